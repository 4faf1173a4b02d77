"""The Ray backend against a real three-node Ray cluster on loopback (ray.cluster_utils.Cluster).

The nodes declare what `gpulayer ray-node` would declare for a CPU box, a two-GPU CUDA box and
a Mac (`node_settings` of synthetic Resources): Ray's GPU resource, the custom `mps` and
`gpu_memory_gb` resources and the gpulayer.io/ labels. Tasks run for real in Ray workers (this
box has no GPU: the "cuda" and "mps" tasks only read the environment Ray and GPUlayer gave them).
Everything is bound to 127.0.0.1, the dashboard is off, and one cluster serves the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import CancelledError
from pathlib import Path

import pytest

# Ray resolves 127.0.0.1 to the host's outward address unless told that this is a one-host cluster.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason='the Ray backend needs ray: pip install "gpulayer[ray]"')
from ray.cluster_utils import Cluster  # noqa: E402

import gpulayer as gl  # noqa: E402
from gpulayer import security  # noqa: E402
from gpulayer.backends.ray import (  # noqa: E402
    AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV, ray_start_command, use_cluster_token)
from gpulayer.errors import RemoteTraceback  # noqa: E402
from gpulayer.resources.model import Device, Framework, Resources  # noqa: E402
from support import new_key  # noqa: E402
from test_examples_and_bench import sweep_cells  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TORCH = "2.13.0+cpu"
pytestmark = pytest.mark.timeout(120)


def resources(accelerator: str, devices: list[Device], frameworks: list[Framework]) -> Resources:
    return Resources(host="box", system="Linux", machine="x86_64", cpu_name="cpu", cpu_count=1, memory_gb=8.0,
                     python="%d.%d.%d" % sys.version_info[:3], devices=devices, frameworks=frameworks)


NODES = {
    "ray-cpu": resources("cpu", [], [Framework("torch", TORCH, ("torch.cpu",))]),
    "ray-cuda": resources("cuda", [Device(i, "cuda", "NVIDIA L4", 24.0, "dedicated", distributed="nccl")
                                   for i in range(2)],
                          [Framework("torch", TORCH, ("torch.cpu", "torch.cuda"))]),
    "ray-mps": resources("mps", [Device(0, "mps", "Apple M3 Max", 64.0, "unified")],
                         [Framework("torch", TORCH, ("torch.cpu", "torch.mps")),
                          Framework("mlx", "0.32.4", ("mlx.cpu", "mlx.metal"))]),
}


def node_args(name: str) -> dict:
    """Cluster.add_node arguments from the same `ray start` options `gpulayer ray-node` passes."""
    args = ray_start_command(NODES[name], name=name, head=True)
    options = dict(zip(args[5::2], args[6::2], strict=True))
    labels = dict(item.split("=", 1) for item in options["--labels"].split(","))
    return {"num_cpus": 1, "num_gpus": int(options["--num-gpus"]), "resources": json.loads(options["--resources"]),
            "labels": labels, "node_ip_address": "127.0.0.1", "include_dashboard": False,
            "object_store_memory": 80 << 20}


@pytest.fixture(scope="module")
def cluster():
    """The three nodes with Ray's token authentication on, the token derived from a cluster key
    (as `gpulayer ray-node` starts them; the nodes and the subprocesses inherit the environment)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GPULAYER_KEY", new_key())
        for name in (AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV):
            env.delenv(name, raising=False)
        assert use_cluster_token()
        cluster = Cluster(initialize_head=True, head_node_args=node_args("ray-cpu"))
        try:
            for name in ("ray-cuda", "ray-mps"):
                cluster.add_node(**node_args(name))
            backend = gl.configure(backend="ray", address=cluster.address, echo_output=False)
            yield cluster
            backend.close()
        finally:
            cluster.shutdown()


def where() -> tuple[str, str, str]:
    return os.environ["GPULAYER_PEER_NAME"], os.environ["GPULAYER_DEVICE"], os.environ.get("CUDA_VISIBLE_DEVICES", "")


def square(x: int) -> int:
    return x * x


def test_run_submit_map_and_remote_run_unchanged(cluster):
    assert gl.run(square, 7) == 49
    future = gl.submit(divmod, 17, 5)
    assert future.result(timeout=60) == (3, 2) and future.peer in NODES
    assert gl.map(square, range(8)) == [x * x for x in range(8)]

    @gl.remote(accelerator="cpu")
    def shifted(x, by=1):
        return x + by

    assert shifted(1, by=10) == 11
    assert shifted.map([1, 2, 3]) == [2, 3, 4]
    assert shifted.options(accelerator="mps")(0) == 1


def test_requirements_become_ray_resources_and_labels(cluster):
    name, device, visible = gl.run(where, accelerator="cuda")
    assert (name, device) == ("ray-cuda", "cuda:0") and visible in ("0", "1")
    assert gl.run(where, accelerator="cuda", devices=2)[2] in ("0,1", "1,0")
    assert gl.run(where, accelerator="mps")[:2] == ("ray-mps", "mps")
    assert gl.run(where, accelerator="gpu")[0] == "ray-cuda"  # cuda first, as a LAN peer reports
    assert gl.run(where, gpu_memory_gb=40)[:2] == ("ray-mps", "mps")  # only the Mac's 64 GB unified fit
    assert gl.run(where, frameworks={"mlx": ">=0.30"})[:2] == ("ray-mps", "cpu")
    assert gl.run(where, accelerator="cpu", capabilities="torch.cuda")[:2] == ("ray-cuda", "cpu")


def test_a_cluster_without_what_the_task_needs_raises_no_matching_peer_with_reasons(cluster):
    with pytest.raises(gl.NoMatchingPeer) as e:
        gl.run(where, accelerator="cuda", gpu_memory_gb=100)
    assert e.value.reasons["ray-cuda (ray node %s)" % _node_id("ray-cuda")[:8]] == \
        ["needs 100 GB of GPU memory; peer has 24 GB dedicated"]
    assert "task needs cuda; peer offers mps" in str(e.value)
    with pytest.raises(gl.NoMatchingPeer, match="devices=4; peer has 2"):
        gl.run(where, accelerator="cuda", devices=4)
    with pytest.raises(gl.NoMatchingPeer, match=r"torch 2.13.0 does not satisfy >=99"):
        gl.submit(where, frameworks={"torch": ">=99"})
    # a distribution no label lists: the worker refuses it, as a LAN peer does at admission
    with pytest.raises(gl.NoMatchingPeer, match="refused the task: coremltools is not installed"):
        gl.run(where, frameworks={"coremltools": ""})


def _node_id(name: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Labels"].get("gpulayer.io/name") == name)


def fail(message: str) -> None:
    print("about to fail")
    raise ValueError(message)


def test_errors_keep_their_type_and_remote_traceback_and_output_is_kept(cluster):
    future = gl.submit(fail, "bad input")
    with pytest.raises(ValueError, match="bad input") as e:
        future.result(timeout=60)
    assert isinstance(e.value.__cause__, RemoteTraceback)
    assert "in fail" in e.value.__cause__.traceback and 'raise ValueError(message)' in e.value.__cause__.traceback
    assert future.stdout == "about to fail\n"


def chatty(n: int) -> int:
    print(f"out {n}")
    print(f"err {n}", file=sys.stderr)
    return n


def test_stdout_and_stderr_are_on_the_future_and_echoed(cluster, capsys):
    future = gl.submit(chatty, 3)
    assert future.result(timeout=60) == 3
    assert (future.stdout, future.stderr) == ("out 3\n", "err 3\n")
    backend = gl.default_client()
    backend.echo_output = True
    try:
        gl.run(chatty, 4)
    finally:
        backend.echo_output = False
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("out 4\n", "err 4\n")


def test_timeout_counts_from_the_start_and_kills_the_task(cluster):
    with pytest.raises(gl.TaskTimeout, match="timeout of 1 s"):
        gl.run(time.sleep, 600, timeout=1)  # not killed, it would outlast the test's timeout
    # the Mac node's one mps slot is busy for 2.5 s: the queued task's 1 s start only when it runs
    busy = gl.submit(time.sleep, 2.5, accelerator="mps")
    assert gl.run(square, 3, accelerator="mps", timeout=1) == 9
    assert busy.done()


def nap(seconds: float) -> float:
    if not seconds:
        raise ZeroDivisionError("no nap")
    time.sleep(seconds)
    return seconds


def test_map_raises_the_first_failure_and_cancels_the_rest(cluster):
    with pytest.raises(ZeroDivisionError, match="no nap"):
        gl.map(nap, [0, 600, 600], accelerator="mps")
    assert gl.run(square, 2, accelerator="mps") == 4  # the naps would hold the one mps slot past the test's timeout


def test_cancel_stops_the_ray_task(cluster, tmp_path):
    future = gl.submit(time.sleep, 60, accelerator="mps")
    assert future.cancel()
    with pytest.raises(CancelledError):
        future.result(timeout=1)
    assert gl.run(square, 5, accelerator="mps", timeout=60) == 25  # the mps slot is free again


def die_once(marker: str) -> str:
    path = Path(marker)
    if not path.exists():
        path.write_text("died")
        os._exit(1)
    return "second try"


def test_a_dead_worker_is_retried_as_asked_else_worker_died(cluster, tmp_path):
    assert gl.run(die_once, str(tmp_path / "a"), retries=1) == "second try"
    with pytest.raises(gl.WorkerDied):
        gl.run(die_once, str(tmp_path / "b"))


def env_var(name: str) -> str | None:
    return os.environ.get(name)


def test_env_reaches_the_task_only(cluster):
    assert gl.run(env_var, "GL_RAY_TEST", env={"GL_RAY_TEST": "yes"}) == "yes"
    assert gl.run(env_var, "GL_RAY_TEST") is None


def test_peers_lists_the_nodes(cluster):
    rows = {r["name"]: r for r in gl.peers()}
    assert {n: (r["accelerator"], r["device_memory_gb"], r["state"]) for n, r in rows.items()} == {
        "ray-cpu": ("cpu", [], "up"), "ray-cuda": ("cuda", [24.0, 24.0], "up"), "ray-mps": ("mps", [64.0], "up")}
    assert rows["ray-mps"]["frameworks"] == {"torch": "2.13.0", "mlx": "0.32.4"}


def test_ray_node_dry_run_prints_a_valid_ray_start_with_the_cluster_token(tmp_path):
    from ray._private.label_utils import parse_node_labels_string

    key = new_key()
    env = {**os.environ, "GPULAYER_KEY": key, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    out = subprocess.run([sys.executable, "-m", "gpulayer", "ray-node", "--dry-run", "--address", "127.0.0.1:1",
                          "--name", "box 1", "--", "--num-cpus", "1"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    args = out.stdout.split()
    token_file = tmp_path / "config" / "gpulayer" / "key.ray-token"
    assert args[:2] == ["RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN_PATH={token_file}"]
    assert token_file.read_text() == security.ray_token(key.encode()) and token_file.stat().st_mode & 0o777 == 0o600
    assert args[5:8] == ["start", "--address", "127.0.0.1:1"] and args[-2:] == ["--num-cpus", "1"]
    labels = parse_node_labels_string(args[args.index("--labels") + 1])  # Ray's own syntax check
    assert labels["gpulayer.io/name"] == "box-1" and labels["gpulayer.io/python"] == "%d.%d.%d" % sys.version_info[:3]
    missing = subprocess.run([sys.executable, "-m", "gpulayer", "ray-node"], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path, env=env)
    assert missing.returncode == 1 and "--address" in missing.stderr


def test_ray_node_refuses_a_node_without_the_cluster_key_unless_insecure(tmp_path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    env.pop("GPULAYER_KEY", None)  # no key anywhere
    command = [sys.executable, "-m", "gpulayer", "ray-node", "--head"]
    refused = subprocess.run([*command, "--", "--bogus-option"], capture_output=True, text=True, timeout=60,
                             cwd=tmp_path, env=env)
    assert refused.returncode == 1 and refused.stdout == ""  # nothing ran: ray start would fail on --bogus-option
    assert "no cluster key" in refused.stderr and "Pass --insecure" in refused.stderr
    insecure = subprocess.run([*command, "--insecure", "--dry-run"], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path, env=env)
    assert insecure.returncode == 0 and insecure.stdout.startswith("RAY_AUTH_MODE=disabled ")
    assert "token authentication is off" in insecure.stderr


LOOPBACK6 = ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")  # ::1, ::ffff:127.0.0.1


def _loopback(address: str) -> bool:
    """Whether an address of /proc/net/tcp[6] ("0100007F:1F90", little-endian) is on loopback."""
    host = address.split(":")[0]
    return host.endswith("7F") if len(host) == 8 else host in LOOPBACK6


def _unconnected(address: str) -> bool:
    return set(address.replace(":", "")) == {"0"}


def test_every_ray_process_listens_and_talks_on_loopback_only(cluster):
    session = Path(cluster.head_node.get_session_dir_path()).name
    pids = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, session)]
    assert len(pids) >= 3
    pids.append(str(os.getpid()))  # the driver: this process
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    rows = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        rows += [(table, *line.split()[1:3]) for line in lines if line.split()[9] in inodes]
    assert rows, "the Ray processes hold no IP sockets"
    assert not [r for r in rows if not _loopback(r[1]) or not (_loopback(r[2]) or _unconnected(r[2]))], rows


def _cmdline_has(proc: Path, text: str) -> bool:
    try:
        return text in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_sweep_example_gives_the_same_table_on_ray(cluster):
    out = subprocess.run([sys.executable, "examples/remote_sweep/sweep.py", "--backend", "ray", "--ray-address",
                          cluster.address, "--accelerator", "cpu", "--epochs", "2"], cwd=REPO, capture_output=True,
                         text=True, timeout=110, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    cells = sweep_cells(out)
    assert {(c[4], c[5]) for c in cells} == {("2", "cpu")} and {c[6] for c in cells} <= set(NODES)


def test_the_environment_picks_the_ray_backend(cluster, tmp_path):
    env = {**os.environ, "GPULAYER_BACKEND": "ray", "GPULAYER_RAY_ADDRESS": cluster.address}
    out = subprocess.run([sys.executable, "-m", "gpulayer", "peers", "--json"], capture_output=True, text=True,
                         timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert sorted(row["name"] for row in json.loads(out.stdout)) == sorted(NODES)
    bad = subprocess.run([sys.executable, "-m", "gpulayer", "peers"], capture_output=True, text=True, timeout=60,
                         env={**env, "GPULAYER_BACKEND": "dask"}, cwd=tmp_path)
    assert bad.returncode == 1 and "backend must be one of lan, ray, not 'dask'" in bad.stderr


@gl.remote(accelerator="mps")
class Counter:
    def __init__(self, start: int):
        self.n = start

    def add(self, k: int = 1) -> int:
        self.n += k
        print(f"now {self.n}")
        return self.n

    def where(self) -> tuple[str, str, str]:
        return where()

    def fail(self) -> None:
        raise KeyError("nope")

    def nap(self, seconds: float) -> None:
        time.sleep(seconds)


def test_actors_are_ray_actors_with_the_lan_handle(cluster):
    with Counter(10) as counter:
        assert counter.add() == 11 and counter.add(5) == 16  # state kept, calls in order
        future = counter.add.submit(1)
        assert future.result(timeout=60) == 17 and future.stdout == "now 17\n"
        assert counter.where()[:2] == ("ray-mps", "mps") and counter.peer == "ray-mps"
        with pytest.raises(KeyError, match="nope"):
            counter.fail()
        assert [(row["class"], row["peer"]) for row in gl.actors()] == [("Counter", "ray-mps")]
    assert not counter.alive and gl.actors() == []
    with pytest.raises(gl.ActorDied):
        counter.add()


def test_an_actor_call_past_its_timeout_ends_the_actor(cluster):
    counter = Counter(0)
    with pytest.raises(gl.TaskTimeout):
        counter.nap.options(timeout=1)(600)
    assert not counter.alive
    with pytest.raises(gl.ActorDied):
        counter.add()


def test_an_actor_that_fits_no_node_or_fails_to_start_holds_nothing(cluster):
    with pytest.raises(gl.NoMatchingPeer, match="needs 100 GB of GPU memory"):
        Counter.options(accelerator="cuda", gpu_memory_gb=100)(0)
    with pytest.raises(TypeError, match="start"):
        Counter()  # the constructor raises in the actor
    assert gl.run(square, 2, accelerator="mps") == 4  # the failed actor let go of the Mac node


def test_without_ray_the_backend_says_what_to_install(tmp_path):
    code = "import sys; sys.modules['ray'] = None; import gpulayer as gl; gl.configure(backend='ray')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 1 and 'the ray backend needs Ray: pip install "gpulayer[ray]"' in out.stderr
