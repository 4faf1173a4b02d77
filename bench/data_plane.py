"""The data plane (issue 12), side by side in one run: big arrays on one host, across hosts, chained
between peers, and the small-task latency before and after it.

    python bench/data_plane.py [--quick] [--json bench/results/data_plane.json] [--plot bench/results/data_plane.png]

1. Same host (loopback): a 256 MiB numpy round trip (a task that returns its argument) through
   GPUlayer with shared memory (the default), through GPUlayer over TCP and the secure channel (a
   peer with GPULAYER_SHM=0), through bench/overhead.py's raw msgpack socket, and through Ray on
   one node bound to 127.0.0.1 (`ray.get(echo.remote(array))`).
2. Across network namespaces on a bridge (tests/lan/lanlab.py; root only): the same round trip
   from a submitter in one namespace to a peer in another (secure channel on, no shared memory
   across hosts), against the raw socket echo between the same two namespaces; and AES-256-GCM
   alone (bench/aead.py) and the channel's record layer alone (bench/overhead.py) on the buffer.
3. A chain A->B with a 256 MiB intermediate, peers A and B and the submitter in three namespaces:
   with keep=True (the value goes peer to peer) and without (through the submitter), time and the
   bytes through the submitter (Client.received_bytes() and its veth's counters); against Ray
   doing the same on a two-node ray.cluster_utils.Cluster bound to 127.0.0.1 (tasks pinned to
   each node by custom resources, the ObjectRef passed).
4. Small tasks: the p50 of trivial gl.run calls through a loopback peer and submitter of this tree
   and of commit 2018100 (before the data plane; a git worktree in /tmp), in interleaved rounds.

Measurements of one part alternate between the ways compared, round by round; medians are given
with their min and max over rounds. Transfer rates count the bytes both ways (2 x size / time).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[1:1] = [str(ROOT / "tests"), str(ROOT / "tests" / "lan")]  # after bench/; no gpulayer in either

from lanlab import Agent, Lan, start_peers, why_unavailable  # noqa: E402
from output import PLOT_HELP  # noqa: E402  this folder's
from overhead import RawClient, latencies, machine, raw_server, write_results  # noqa: E402  this folder's
from support import PeerProcess  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
BEFORE = "2018100"  # the last commit before the data plane (issue 12)
WORKTREE = Path("/tmp/gpulayer-before")
ROLE = "GPULAYER_DATA_PLANE_ROLE"  # set in the environment of the processes this script drives
TARGETS = {"same_host_over_ray": 1.0, "namespaces_over_raw": 0.8, "p50_now_over_before": 1.05}
TASK_TIMEOUT = 300.0


def echo(array):
    return array


def trivial():
    return 1


def make(nbytes: int):
    return np.ones(nbytes, dtype=np.uint8)


def consume(array) -> int:
    return int(array.nbytes)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def rate(nbytes: int, seconds: float) -> float:
    """GB/s of a round trip: the bytes both ways."""
    return 2 * nbytes / seconds / 1e9


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Deadline:
    """Rounds stop early (after the first) once the run has taken `minutes`."""

    def __init__(self, minutes: float):
        self.end = time.monotonic() + 60 * minutes

    def rounds(self, n: int):
        for i in range(n):
            if i and time.monotonic() > self.end:
                print(f"deadline: {i} of {n} rounds", file=sys.stderr)
                return
            yield i


# ---- the processes this script drives (lanlab.Agent: JSON lines on stdin and stdout) ----------------

class Role:
    """A submitter in another process (another namespace, or another tree's gpulayer)."""

    def __init__(self):
        self.client = None
        self.raw = None
        self.big = None

    def op_configure(self, key: str, peers: str):
        import gpulayer as gl

        self.client = gl.configure(key=key.encode(), peers=peers, mdns=False, echo_output=False)
        return {"gpulayer": gl.__file__}

    def op_latency(self, n: int):
        import gpulayer as gl

        return latencies(lambda: gl.run(trivial), n, n // 10)

    def op_alloc(self, nbytes: int):
        self.big = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
        return {}

    def op_echo(self, peer: str, check: bool = False):
        import gpulayer as gl

        started = time.perf_counter()
        back = gl.run(echo, self.big, peer=peer, timeout=TASK_TIMEOUT)
        seconds = time.perf_counter() - started
        assert not check or np.array_equal(back, self.big), "the echo came back different"
        return {"seconds": seconds}

    def op_raw(self, host: str, port: int):
        self.raw = RawClient((host, port))
        return {}

    def op_raw_echo(self):
        view = memoryview(self.big).cast("B")
        return {"seconds": timed(lambda: self.raw.bulk(view))}

    def op_chain(self, nbytes: int, keep: bool):
        import gpulayer as gl

        received = self.client.received_bytes()
        started = time.perf_counter()
        a = gl.submit(make, nbytes, keep=keep, peer="A", timeout=TASK_TIMEOUT)
        b = gl.submit(consume, a, peer="B", timeout=TASK_TIMEOUT)
        assert b.result(TASK_TIMEOUT) == nbytes
        seconds = time.perf_counter() - started
        if keep:
            a.release()
        return {"seconds": seconds, "received_bytes": self.client.received_bytes() - received}

    def op_exit(self):
        import gpulayer as gl

        if self.raw is not None:
            self.raw.close()
        gl.api.shutdown()
        return {}


class Loopback:
    """Stands in for lanlab.Host, so that lanlab.Agent drives a process here, started in `cwd`."""

    def __init__(self, workdir: Path, cwd: Path):
        from types import SimpleNamespace

        self.lan = SimpleNamespace(workdir=workdir)
        self.cwd = cwd

    def popen(self, argv: list[str], env: dict, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(argv, env=env, cwd=self.cwd, start_new_session=True, **kwargs)


def role(host, name: str, key: str, env: dict | None = None):
    """This script as a driven submitter on `host` (lanlab.Host or Loopback)."""
    return Agent(host, name, key, {ROLE: "1", **(env or {})}, script=Path(__file__))


# ---- 1. same host ---------------------------------------------------------------------------------------

def same_host(workdir: Path, nbytes: int, rounds: int, deadline: Deadline) -> dict:
    import gpulayer as gl

    key = secrets.token_hex(16)
    peers = [PeerProcess(workdir, key, "shm", "--concurrency", "1"),
             PeerProcess(workdir, key, "tcp", "--concurrency", "1", env={"GPULAYER_SHM": "0"})]
    big = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
    view = memoryview(big).cast("B")
    raw = RawClient()
    ray = start_ray(dict(num_cpus=2, object_store_memory=max(4 * nbytes, 256 * MIB)))
    try:
        for peer in peers:
            peer.start()
        gl.configure(key=key.encode(), peers=",".join(p.address for p in peers), mdns=False, echo_output=False)
        ray_echo = ray.remote(echo)
        ways = {"raw": lambda: raw.bulk(view),
                "gpulayer_shm": lambda: gl.run(echo, big, peer="shm", timeout=TASK_TIMEOUT),
                "gpulayer_tcp": lambda: gl.run(echo, big, peer="tcp", timeout=TASK_TIMEOUT),
                "ray": lambda: ray.get(ray_echo.remote(big))}
        for name in ("gpulayer_shm", "gpulayer_tcp", "ray"):  # warm, and check the bytes
            assert np.array_equal(ways[name](), big), name
        seconds = {name: [] for name in ways}
        for i in deadline.rounds(rounds):
            for name in rotated(list(ways), i):
                seconds[name].append(timed(ways[name]))
    finally:
        gl.api.shutdown()
        ray.shutdown()
        raw.close()
        for peer in peers:
            peer.stop(10)
    return {name: {**spread([rate(nbytes, s) for s in values]), "seconds": values} for name, values in seconds.items()}


def rotated(items: list, i: int) -> list:
    """The order of round i: each way goes first in turn."""
    return items[i % len(items):] + items[:i % len(items)]


def start_ray(init: dict):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # a one-host cluster: keep 127.0.0.1
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ray.init(include_dashboard=False, logging_level="ERROR", _node_ip_address="127.0.0.1", **init)
    return ray


# ---- 2 and 3. across namespaces ------------------------------------------------------------------------

def across_namespaces(workdir: Path, nbytes: int, rounds: int, deadline: Deadline) -> dict:
    key = secrets.token_hex(16)
    lan = Lan(workdir / "lan")
    try:
        host_a, host_b, submitter = lan.add_host("a"), lan.add_host("b"), lan.add_host("s")
        peers = start_peers([(host_a, "A"), (host_b, "B")], key, concurrency=1)
        port_file = workdir / "raw.port"
        host_a.popen([sys.executable, __file__, "--raw-server", str(port_file), "--bind", host_a.ip], os.environ)
        wait_for_file(port_file, 30)
        agent = role(submitter, "submitter", key)
        agent.call("configure", key=key, peers=",".join(p.address for p in peers))
        agent.call("alloc", nbytes=nbytes)
        agent.call("raw", host=host_a.ip, port=int(port_file.read_text()))
        agent.call("echo", peer="A", check=True, reply_timeout=TASK_TIMEOUT)
        echo_s = {"raw": [], "gpulayer": []}
        for i in deadline.rounds(rounds):
            for name in rotated(list(echo_s), i):
                op = ("raw_echo", {}) if name == "raw" else ("echo", {"peer": "A"})
                echo_s[name].append(agent.call(op[0], reply_timeout=TASK_TIMEOUT, **op[1])["seconds"])
        echo = {name: {**spread([rate(nbytes, s) for s in values]), "seconds": values}
                for name, values in echo_s.items()}
        chain = chains(agent, submitter.veth, nbytes, rounds, deadline)
        agent.close()
    finally:
        lan.close()
    return {"echo": echo, "channel_alone": channel_alone(nbytes), "chain": chain}


def wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} not written in {timeout} s")
        time.sleep(0.02)


def veth_bytes(veth: str) -> int:
    """Bytes through the submitter's cable, both ways (the bridge's side of its veth)."""
    stats = Path(f"/sys/class/net/{veth}/statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


def chains(agent, veth: str, nbytes: int, rounds: int, deadline: Deadline) -> dict:
    """A -> B, kept on A and fetched by B, or through the submitter; Ray's two-node chain beside them."""
    cluster, ray = start_ray_cluster(nbytes)
    try:
        ray_make = ray.remote(make).options(resources={"A": 1})
        ray_consume = ray.remote(consume).options(resources={"B": 1})

        def ray_chain():
            assert ray.get(ray_consume.remote(ray_make.remote(nbytes)), timeout=TASK_TIMEOUT) == nbytes

        def gl_chain(keep: bool):
            def run():
                through = veth_bytes(veth)
                out = agent.call("chain", nbytes=nbytes, keep=keep, reply_timeout=TASK_TIMEOUT)
                return {**out, "veth_bytes": veth_bytes(veth) - through}
            return run

        ways = {"gpulayer_keep": gl_chain(True), "gpulayer_through_submitter": gl_chain(False),
                "ray": lambda: {"seconds": timed(ray_chain)}}
        for way in ways.values():  # warm
            way()
        out: dict[str, list[dict]] = {name: [] for name in ways}
        for i in deadline.rounds(rounds):
            for name in rotated(list(ways), i):
                out[name].append(ways[name]())
    finally:
        ray.shutdown()
        cluster.shutdown()
    result = {}
    for name, runs in out.items():
        result[name] = {"seconds": spread([r["seconds"] for r in runs])}
        for counted in ("received_bytes", "veth_bytes"):
            if counted in runs[0]:
                result[name][counted] = spread([r[counted] for r in runs])
    return result


def start_ray_cluster(nbytes: int):
    """Two Ray nodes on 127.0.0.1, with custom resources A and B; this process its driver."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False,
            "object_store_memory": max(3 * nbytes, 256 * MIB)}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "resources": {"A": 1}})
    try:
        cluster.add_node(**node, resources={"B": 1})
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", logging_level="ERROR")
    except BaseException:
        cluster.shutdown()
        raise
    return cluster, ray


def channel_alone(nbytes: int) -> dict:
    """Where a round trip's time goes on a channel: AES-256-GCM alone on 1 MiB records (bench/aead.py),
    and the record layer sealing and opening the buffer both ways (bench/overhead.py)."""
    from aead import measure_primitive
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from overhead import measure_aead

    gcm = measure_primitive(AESGCM, MIB, max(1, nbytes // MIB), 3)
    big = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
    records = measure_aead(100, big, 3)
    return {"aes_gcm_seal_gb_per_s": gcm["seal_gb_per_s"], "aes_gcm_open_gb_per_s": gcm["open_gb_per_s"],
            "records_round_trip_seconds": records["bulk_seconds"],
            "records_round_trip_gb_per_s": rate(nbytes, records["bulk_seconds"])}


# ---- 4. small tasks, this tree against the one before the data plane ----------------------------------

def worktree() -> Path:
    """Commit BEFORE checked out in /tmp (made if missing, left there for the next run)."""
    want = subprocess.run(["git", "-C", str(ROOT), "rev-parse", BEFORE], capture_output=True, text=True,
                          check=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(WORKTREE), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0 or head.stdout.strip() != want:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(WORKTREE), want],
                       capture_output=True, text=True, check=True)
    return WORKTREE


class TreePeer(PeerProcess):
    """A loopback peer of one tree's gpulayer: run from that tree, with it on PYTHONPATH."""

    def __init__(self, tree: Path, workdir: Path, key: str, name: str):
        super().__init__(workdir, key, name, "--concurrency", "1", env={"PYTHONPATH": str(tree)})
        self.tree = tree

    def _popen(self, log) -> subprocess.Popen:
        return subprocess.Popen(self.argv, env=self.env, cwd=self.tree, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def small_tasks(workdir: Path, calls: int, rounds: int, deadline: Deadline) -> dict:
    trees = {"now": ROOT, "before": worktree()}
    peers, agents = [], {}
    try:
        for label, tree in trees.items():
            key = secrets.token_hex(16)
            peer = TreePeer(tree, workdir, key, f"lat-{label}")
            peers.append(peer.start())
            agents[label] = role(Loopback(workdir, tree), f"latency-{label}", key,
                                 {"PYTHONPATH": str(tree), "GPULAYER_INTERFACES": "127.0.0.1"})
            where = agents[label].call("configure", key=key, peers=peer.address)["gpulayer"]
            assert where.startswith(str(tree)), f"{label}: gpulayer from {where}, not {tree}"
            agents[label].call("latency", n=calls // 4, reply_timeout=TASK_TIMEOUT)  # warm
        p50 = {label: [] for label in trees}
        for i in deadline.rounds(rounds):
            for label in rotated(list(trees), i):
                p50[label].append(agents[label].call("latency", n=calls, reply_timeout=TASK_TIMEOUT)["p50_ms"])
    finally:
        for agent in agents.values():
            agent.close()
        for peer in peers:
            peer.stop(10)
    ratios = [now / before for now, before in zip(p50["now"], p50["before"], strict=True)]
    return {"calls_per_round": calls, "before": subprocess.run(["git", "-C", str(ROOT), "rev-parse", BEFORE],
                                                               capture_output=True, text=True).stdout.strip(),
            "p50_ms": {label: spread(values) for label, values in p50.items()},
            "now_over_before": spread(ratios)}


# ---- summary and plot -----------------------------------------------------------------------------------

def summarize(result: dict) -> dict:
    same = result["same_host"]
    s = {f"same_host_{name}_gb_per_s": [v["median"], v["min"], v["max"]] for name, v in same.items()}
    s["same_host_shm_over_ray"] = same["gpulayer_shm"]["median"] / same["ray"]["median"]
    s["same_host_shm_over_raw"] = same["gpulayer_shm"]["median"] / same["raw"]["median"]
    s["same_host_tcp_over_raw"] = same["gpulayer_tcp"]["median"] / same["raw"]["median"]
    targets = {"same_host: gpulayer_shm >= ray": s["same_host_shm_over_ray"] >= TARGETS["same_host_over_ray"]}
    lan = result["namespaces"]
    if "skipped" not in lan:
        echo = lan["echo"]
        s["namespaces_gb_per_s"] = {n: [v["median"], v["min"], v["max"]] for n, v in echo.items()}
        s["namespaces_over_raw"] = echo["gpulayer"]["median"] / echo["raw"]["median"]
        s["namespaces_over_raw_per_round"] = [w / g for g, w in zip(echo["gpulayer"]["seconds"],
                                                                    echo["raw"]["seconds"], strict=True)]
        targets["namespaces: gpulayer >= 0.8 x raw"] = s["namespaces_over_raw"] >= TARGETS["namespaces_over_raw"]
        s["chain_seconds"] = {n: v["seconds"]["median"] for n, v in lan["chain"].items()}
        s["chain_received_mib"] = {n: v["received_bytes"]["median"] / MIB for n, v in lan["chain"].items()
                                   if "received_bytes" in v}
    small = result["small_tasks"]
    if "skipped" not in small:
        s["p50_ms_now"] = small["p50_ms"]["now"]["median"]
        s["p50_ms_before"] = small["p50_ms"]["before"]["median"]
        s["p50_now_over_before"] = small["now_over_before"]["median"]
        targets["small tasks: p50 within 5% of before"] = s["p50_now_over_before"] <= TARGETS["p50_now_over_before"]
    s["targets"] = targets
    return s


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = f"{result['settings']['mib']} MiB"
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))

    def bars(ax, rows: list[tuple[str, dict, str]], unit: str, fmt: str = "{:.2f}"):
        medians = [r["median"] for _, r, _ in rows]
        errors = [[m - r["min"] for m, (_, r, _) in zip(medians, rows)], [r["max"] - m for m, (_, r, _) in
                                                                          zip(medians, rows)]]
        ax.barh([label for label, _, _ in rows], medians, xerr=errors, color=[c for _, _, c in rows], capsize=4)
        for y, (m, (_, r, _)) in enumerate(zip(medians, rows)):
            ax.text(r["max"], y, "  " + fmt.format(m) + unit, va="center", ha="left")
        ax.invert_yaxis()
        ax.set_xlim(0, max(r["max"] for _, r, _ in rows) * 1.35)

    same = result["same_host"]
    bars(axes[0, 0], [("raw msgpack socket", same["raw"], "tab:gray"),
                      ("GPUlayer, shared memory", same["gpulayer_shm"], "tab:green"),
                      ("GPUlayer, TCP + channel", same["gpulayer_tcp"], "tab:olive"),
                      ("Ray 2.60, one node", same["ray"], "tab:blue")], " GB/s")
    axes[0, 0].axvline(same["ray"]["median"], color="k", linestyle="--", label="target: at least Ray")
    axes[0, 0].legend(loc="lower right")
    axes[0, 0].set_title(f"Same host: {size} round trip (GB/s, higher is better)")

    lan = result["namespaces"]
    if "skipped" in lan:
        for ax in (axes[0, 1], axes[1, 0]):
            ax.text(0.5, 0.5, f"across namespaces skipped:\n{lan['skipped']}", ha="center", va="center", wrap=True)
            ax.axis("off")
    else:
        echo, alone = lan["echo"], lan["channel_alone"]
        channel = alone["records_round_trip_gb_per_s"]
        bars(axes[0, 1], [("raw socket over the veth", echo["raw"], "tab:gray"),
                          ("GPUlayer (secure channel)", echo["gpulayer"], "tab:green"),
                          ("channel's records alone\n(one core, no network)",
                           {"median": channel, "min": channel, "max": channel}, "tab:red")], " GB/s")
        axes[0, 1].axvline(TARGETS["namespaces_over_raw"] * echo["raw"]["median"], color="k", linestyle="--",
                           label="target: 0.8 x raw")
        axes[0, 1].legend(loc="lower right")
        axes[0, 1].set_title(f"Across namespaces: {size} round trip (GB/s)")
        chain = lan["chain"]
        def through(key: str) -> str:
            got, wire = (chain[key][k]["median"] / MIB for k in ("received_bytes", "veth_bytes"))
            return f"\nsubmitter received {got:,.1f} MiB,\nits cable carried {wire:,.0f} MiB"

        rows = [("GPUlayer keep=True (peer to peer)" + through("gpulayer_keep"), "gpulayer_keep", "tab:green"),
                ("GPUlayer without keep" + through("gpulayer_through_submitter"), "gpulayer_through_submitter",
                 "tab:olive"),
                ("Ray 2.60, two nodes\n(ObjectRef passed)", "ray", "tab:blue")]
        bars(axes[1, 0], [(label, chain[key]["seconds"], c) for label, key, c in rows], " s")
        axes[1, 0].set_title(f"Chain A -> B, {size} intermediate (seconds, lower is better)")

    small = result["small_tasks"]
    ax = axes[1, 1]
    if "skipped" in small:
        ax.text(0.5, 0.5, f"small tasks skipped:\n{small['skipped']}", ha="center", va="center")
        ax.axis("off")
    else:
        for x, (label, color) in enumerate((("before", "tab:gray"), ("now", "tab:green"))):
            values = small["p50_ms"][label]["rounds"]
            ax.bar(x, small["p50_ms"][label]["median"], color=color, alpha=0.6)
            ax.plot([x] * len(values), values, "o", color="k", markersize=4)
        ax.axhline(small["p50_ms"]["before"]["median"] * TARGETS["p50_now_over_before"], color="k",
                   linestyle="--", label="target: before + 5%")
        ax.legend(loc="lower right")
        ax.set_xticks([0, 1], [f"before ({small['before'][:7]})", "now"])
        ax.set_ylabel("p50 ms per trivial gl.run (dots: rounds)")
        ax.set_title(f"Small tasks: now / before = {small['now_over_before']['median']:.3f} "
                     f"({small['now_over_before']['min']:.3f}-{small['now_over_before']['max']:.3f})")
    m = result["machine"]
    fig.suptitle(f"GPUlayer data plane on {m['host']} ({m['cpus']} CPUs, load {m['load_before'][0]:.1f}), "
                 f"{m['date'][:10]}; bars: median of rounds, whiskers: min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    if os.environ.get(ROLE):
        from lanserve import serve

        serve(Role)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds (a smoke run)")
    parser.add_argument("--json", default=str(RESULTS / "data_plane.json"))
    parser.add_argument("--plot", default=None, help=PLOT_HELP)
    parser.add_argument("--max-minutes", type=float, default=40.0, help="rounds stop early past this")
    parser.add_argument("--raw-server", help=argparse.SUPPRESS)
    parser.add_argument("--bind", default="127.0.0.1", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_server:
        raw_server(args.raw_server, args.bind)
        return 0
    os.environ.update(GPULAYER_INTERFACES="127.0.0.1", GPULAYER_CACHE="0")
    nbytes, rounds, calls = (4 * MIB, 2, 200) if args.quick else (256 * MIB, 7, 2000)
    deadline = Deadline(args.max_minutes)
    result = {"machine": {**machine(), "load_before": os.getloadavg()},
              "settings": {"quick": args.quick, "mib": nbytes // MIB, "rounds": rounds, "calls": calls},
              "targets": TARGETS}
    with tempfile.TemporaryDirectory(prefix="data-plane-") as tmp:
        workdir = Path(tmp)
        result["same_host"] = same_host(workdir, nbytes, rounds, deadline)
        reason = why_unavailable()
        result["namespaces"] = ({"skipped": reason} if reason else
                                across_namespaces(workdir, nbytes, rounds, deadline))
        try:
            result["small_tasks"] = small_tasks(workdir, calls, rounds + 3, deadline)
        except (subprocess.CalledProcessError, FileNotFoundError) as exc:  # not a git checkout
            result["small_tasks"] = {"skipped": f"no worktree of {BEFORE}: {exc}"}
    result["machine"]["load_after"] = os.getloadavg()
    result["summary"] = summarize(result)
    write_results(result, args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
