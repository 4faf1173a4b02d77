"""Reach (issue 30): a fresh submitter across subnets with one seed, what gossip costs, the invite exchange.

    python bench/reach.py [--subnets 4] [--per-subnet 4] [--window 30] [--json bench/results/reach.json]

Needs root and iproute2. SUBNETS LANs of PER_SUBNET peers each (network namespaces, tests/lan/lanlab.py),
every other LAN joined to the first by a router host that forwards unicast and no multicast. Every peer
runs with --no-mdns and one seed, the first peer of the first LAN: all they know of each other comes
from gossip (ADR 0017). Measured:
- seconds from the last peer ready until a submitter given the one seed lists every peer (converged_s);
- a fresh submitter process in the first LAN given that one seed (mDNS off): seconds from its
  configure until it lists every peer, and until a task ran on a peer of the last LAN;
- the bytes each peer's interface sent and received per minute at rest (the cluster converged, no
  submitter), and above that in the WINDOW seconds after one more peer joined;
- the invite exchange's wall time (`invite.request` then `invite.receive_key`, in one process on a
  host of the first LAN, the median of 8).
Everything stays inside the namespaces, which are removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "lan"))

from lanlab import Lan, lan_env, why_unavailable  # noqa: E402
from support import new_key  # noqa: E402

INVITES = """
import json, statistics, sys, time
from gpulayer import invite
key, host, port = sys.argv[1].encode(), sys.argv[2], int(sys.argv[3])
times = []
for _ in range(8):  # a peer starts 8 exchanges a second at most
    started = time.perf_counter()
    code = invite.request(key, (host, port), 60, 1)["code"]
    made = time.perf_counter()
    got, _ = invite.receive_key(code, [(host, port)])
    times.append((made - started, time.perf_counter() - made))
    assert got == key
print(json.dumps({"request_ms": 1000 * statistics.median(t[0] for t in times),
                  "exchange_ms": 1000 * statistics.median(t[1] for t in times)}))
"""


def interface_bytes(host) -> int:
    """Bytes eth0 of `host` sent and received so far."""
    for line in host.run(["cat", "/proc/net/dev"]).stdout.splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "eth0":
            fields = counters.split()
            return int(fields[0]) + int(fields[8])
    raise RuntimeError(f"no eth0 in {host}")


def per_peer_minute(hosts, seconds: float) -> float:
    """Bytes a peer's interface carries per minute, the mean over `hosts`, over `seconds` from now."""
    before = [interface_bytes(h) for h in hosts]
    time.sleep(seconds)
    after = [interface_bytes(h) for h in hosts]
    return statistics.mean(b - a for a, b in zip(before, after, strict=True)) * 60 / seconds


def measure(subnets: int, per_subnet: int, window: float) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="gpulayer-reach-"))
    key = new_key()
    lans = [Lan(workdir / f"lan{i}", subnet=f"10.77.{i + 1}.", prefix_len=24) for i in range(subnets)]
    try:
        for other in lans[1:]:
            lans[0].add_router(other)
        first = lans[0].add_host("s0p0").start_peer("s0p0", key, 1, args=("--no-mdns",)).wait_ready()
        seed = ("--no-mdns", "--seed", first.address)
        peers = [first] + [lan.add_host(f"s{i}p{k}").start_peer(f"s{i}p{k}", key, 1, args=seed)
                           for i, lan in enumerate(lans) for k in range(per_subnet) if (i, k) != (0, 0)]
        for peer in peers:
            peer.wait_ready()
        ready = time.monotonic()
        names = [p.name for p in peers]
        submitter = lans[0].add_host("submitter").agent(key, name="submitter")
        submitter.call("configure", peers=first.address, mdns=False)
        if not submitter.call("wait_names", present=names, timeout=120)["ok"]:
            raise RuntimeError("the cluster did not converge in 120 s")
        converged = time.monotonic() - ready
        submitter.close()  # the cluster has converged: now a fresh submitter
        fresh = lans[0].add_host("fresh").agent(key, name="fresh")
        started = time.monotonic()
        fresh.call("configure", peers=first.address, mdns=False)
        configured = time.monotonic()
        seen = fresh.call("wait_names", present=names, timeout=30)
        ran = fresh.call("run", fn="where", peer=peers[-1].name)
        first_result = time.monotonic() - started
        fresh.close()
        hosts = [p.host for p in peers]
        rest = per_peer_minute(hosts, window)
        joined = lans[-1].add_host("joiner").start_peer("joiner", key, 1, args=seed)
        after_join = per_peer_minute(hosts, window)
        joined.wait_ready()
        invite = lans[0].add_host("invitee").run([sys.executable, "-c", INVITES, key, first.host.ip, str(first.port)],
                                                 env=lan_env(None), timeout=120)
        if invite.returncode != 0:
            raise RuntimeError(invite.stderr)
    finally:
        for lan in lans:  # the first (it holds the routers) first
            lan.close()
    result = {"subnets": subnets, "per_subnet": per_subnet, "peers": subnets * per_subnet, "converged_s": converged,
              "fresh_submitter": {"lists_all_s": configured - started + seen["elapsed"],
                                  "listed": seen["ok"],
                                  "first_result_on_last_subnet_s": first_result, "ran": ran["ok"]},
              "gossip_bytes_per_peer_per_min": {"at_rest": rest, "window_after_a_join": after_join,
                                                "above_rest_after_a_join": after_join - rest, "window_s": window},
              "invite": json.loads(invite.stdout)}
    print(json.dumps(result, indent=2), flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subnets", type=int, default=4)
    parser.add_argument("--per-subnet", type=int, default=4)
    parser.add_argument("--window", type=float, default=30.0, help="seconds of each byte count")
    parser.add_argument("--json", default=None, help="write the figures here (e.g. bench/results/reach.json)")
    args = parser.parse_args()
    reason = why_unavailable()
    if reason:
        print(f"bench/reach.py: {reason}", file=sys.stderr)
        return 2
    result = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
              "cpus": __import__("os").cpu_count(), **measure(args.subnets, args.per_subnet, args.window)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
