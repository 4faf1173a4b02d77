"""A Ray head started by `gpulayer ray-node --head`, as docs/ray.md says, and hosts of the LAN that
try to run code on it (issue 24, item 1).

The head runs in a namespace of its own, reached at its LAN address (Ray's GCS on 6379, the Ray
Client server on 10001, the raylet and the agents on ports of their own). A host that holds no
cluster key, hence no Ray token, tries the two doors a Ray user would: `ray.init("ray://HEAD:10001")`
and `ray.init("HEAD:6379")`; a key holder goes through the same two with GPUlayer's Ray backend.
The function they send creates a marker file, so the test sees whether any code ran at all.
Ray starts once for the module (about 10 s of CPU); every process of the namespaces is killed
at the end, passed or not (lanlab), and `ray stop` is never called: it stops every Ray of the machine.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from lanlab import HERE, lan_env
from support import wait_until

pytest.importorskip("ray", reason='the Ray tests need ray: pip install "gpulayer[ray]"')

LAN_PEERS = 0  # no GPUlayer peers: the hosts of this LAN run Ray
CLIENT = HERE / "lan_ray_client.py"
CLIENT_TIMEOUT = 90.0  # a refused ray:// client gives up after 3 attempts, about 20 s
pytestmark = pytest.mark.timeout(300)


def ray_env(lan, key: str | None, home: str) -> dict:
    """A host's environment: the key or none, a config folder of its own, no Ray settings of ours."""
    env = {k: v for k, v in lan_env(key).items() if not k.startswith("RAY_")}
    env.update(XDG_CONFIG_HOME=str(lan.workdir / home), RAY_USAGE_STATS_ENABLED="0",
               RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S="1")  # a refused client gives up sooner
    return env


@pytest.fixture(scope="module")
def head(lan):
    """`gpulayer ray-node --head -- --port 6379` on a host of the LAN; its host once Ray listens."""
    host = lan.add_host("ray-head")
    started = host.run([sys.executable, "-m", "gpulayer", "ray-node", "--head", "--name", "head", "--",
                        "--port", "6379", "--node-ip-address", host.ip, "--num-cpus", "1",
                        "--include-dashboard", "false", "--object-store-memory", str(80 << 20),
                        "--temp-dir", str(lan.workdir / "ray")], timeout=180, env=ray_env(lan, lan.key, "head"))
    assert started.returncode == 0, started.stdout + started.stderr
    wait_until(lambda: ":10001 " in host.run(["ss", "-ltn"]).stdout, timeout=60)  # the Ray Client server
    return host


# Ray's own failures to start its per-client server, not a refusal: its message, and its proxier's traceback
# (under load its psutil met the new server as a zombie: ZombieProcess in start_specific_server)
RAY_SERVER_FAILED = ("Starting Ray client server failed", "in start_specific_server")


def attempts(lan, key: str | None, via: str, addresses: list[str]) -> dict[str, tuple[dict, bool]]:
    """Run lan_ray_client.py from a fresh host for each address at once: {address: (its report, marker made)}."""
    host = lan.add_host(f"{via}-{'key' if key else 'nokey'}")

    def attempt(address: str) -> tuple[dict, bool]:
        marker = lan.workdir / f"ran-{host.label}-{address.split(':')[0]}"
        for _ in range(2):  # once more where Ray's head failed to start its per-client server (it did under load)
            out = host.run([sys.executable, str(CLIENT), json.dumps({"address": address, "marker": str(marker),
                                                                     "via": via})],
                           timeout=CLIENT_TIMEOUT, env=ray_env(lan, key, host.label))
            assert out.returncode == 0 and out.stdout.strip(), out.stdout + out.stderr
            report = json.loads(out.stdout.strip().splitlines()[-1])
            if not any(failed in line for line in report.get("error", []) for failed in RAY_SERVER_FAILED):
                break
        return report, marker.exists()

    with ThreadPoolExecutor(len(addresses)) as pool:
        return dict(zip(addresses, pool.map(attempt, addresses), strict=True))


def test_a_host_without_the_cluster_key_runs_nothing_on_the_head(lan, head):
    client, gcs = f"ray://{head.ip}:10001", f"{head.ip}:6379"
    tried = attempts(lan, None, "ray", [client, gcs])
    (client_report, client_ran), (gcs_report, gcs_ran) = tried[client], tried[gcs]
    assert "ran" not in client_report and not client_ran, client_report
    assert "Invalid or missing authentication token" in " ".join(client_report["rpc"]), client_report
    assert "ran" not in gcs_report and not gcs_ran, gcs_report
    assert "token" in " ".join(gcs_report["error"]), gcs_report


def test_a_key_holder_runs_code_on_the_head_through_gpulayer(lan, head):
    tried = attempts(lan, lan.key, "gpulayer", [f"ray://{head.ip}:10001", f"{head.ip}:6379"])
    assert tried == {address: ({"ran": head.ip}, True) for address in tried}


def test_only_a_key_holder_joins_the_head_as_a_node(lan, head):
    member, stranger = lan.add_host("ray-member"), lan.add_host("ray-stranger")
    address, options = ["--address", f"{head.ip}:6379"], ["--num-cpus", "1", "--object-store-memory", str(80 << 20)]
    joined = member.run([sys.executable, "-m", "gpulayer", "ray-node", *address, "--name", "member", "--", *options,
                         "--node-ip-address", member.ip], timeout=180, env=ray_env(lan, lan.key, "member"))
    assert joined.returncode == 0, joined.stdout + joined.stderr
    refused = stranger.run([sys.executable, "-m", "ray.scripts.scripts", "start", *address, *options,
                            "--node-ip-address", stranger.ip], timeout=180, env=ray_env(lan, None, "stranger"))
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stdout + refused.stderr
    env = {**ray_env(lan, lan.key, "member"), "GPULAYER_BACKEND": "ray", "GPULAYER_RAY_ADDRESS": f"{head.ip}:6379"}
    listed = member.run([sys.executable, "-m", "gpulayer", "peers", "--json"], timeout=CLIENT_TIMEOUT, env=env)
    assert listed.returncode == 0, listed.stderr
    assert sorted((row["name"], row["state"]) for row in json.loads(listed.stdout)) == [("head", "up"), ("member", "up")]
