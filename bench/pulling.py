"""The queue without a coordinator (issue 28): jobs queued on one peer, pulled by the others.

    python bench/queue.py [--quick] [--json bench/results/queue.json] [--plot bench/results/queue.png]

(bench/queue.py runs this module's `main`.)

1. Makespan: one peer is up, its only slot held by a gate job, and JOBS jobs of mixed lengths (uniform in
   LENGTHS s, `sleep`) and priorities (0, 1, 2) are queued there; then PEERS - 1 more one-slot peers start
   (each pulls as soon as it is ready), and once each has pulled a job the gate opens. Makespan: from the first
   start (of a pulled job, or the gate's end) to the last job's end; ideal: the jobs' total length over
   PEERS slots. Queue wait by priority: each job's start less that first start. Where
   each job ran, and how many were pulled, come from the peers' own records (`gpulayer jobs`).
2. From a slot freeing to a pulled job starting: on each puller, the gap between one job's end and the
   start of the next (a pulled one), as the peers recorded them; beside it the same gap on the owner,
   whose next job was its own.
3. Preemption turnaround: a preemptible job of priority 0 runs (it ends at once on SIGTERM, writing the
   time); a job of priority 1 is submitted; turnaround is from that SIGTERM to the urgent job's start
   (no grace: the job stopped at once), ROUNDS times.
4. Bytes at rest: three idle peers in network namespaces (tests/lan/lanlab.py; root only), the bytes
   their interfaces carried over a window (after the first announcements and browse questions), with
   pulling on, and with `--no-pull`.

Peers run on loopback (1-3) with real zeroconf bound to 127.0.0.1, each with a state folder of its own;
times are the peers' own records (time.time() of one host).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[1:1] = [str(ROOT / "tests"), str(ROOT / "tests" / "lan")]  # after bench/; no gpulayer in either

from lanlab import Lan, why_unavailable  # noqa: E402
from output import PLOT_HELP  # noqa: E402
from overhead import machine, write_results  # noqa: E402
from support import PeerProcess, wait_until  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"slot_to_pulled_start_ms": 100.0}
FULL = {"peers": 8, "jobs": 1000, "lengths": (0.1, 1.0), "rounds": 5, "settle_s": 60.0, "window_s": 120.0}
QUICK = {"peers": 3, "jobs": 12, "lengths": (0.05, 0.2), "rounds": 1, "settle_s": 2.0, "window_s": 5.0}


def _cpu(peer: str | None = None):
    from gpulayer.matching import Requirements

    return Requirements.build(accelerator="cpu", peer=peer)


class Cluster:
    """One-slot peers of a fresh cluster on loopback, each with its own state folder, and the jobs API."""

    def __init__(self, workdir: Path):
        from gpulayer.client import Client
        from gpulayer.client.jobs import Jobs

        self.workdir, self.key = workdir, secrets.token_hex(16)
        self.env = {"XDG_STATE_HOME": str(workdir / "state"), "XDG_CACHE_HOME": str(workdir / "cache"),
                    "GPULAYER_INTERFACES": "127.0.0.1", "GPULAYER_CACHE": "0"}
        self._saved = {name: os.environ.get(name) for name in self.env}
        os.environ.update(self.env)  # for this process's client, until `close`
        self.client = Client(key=self.key.encode(), echo_output=False)
        self.jobs = Jobs(self.client)
        self.peers: list[PeerProcess] = []

    def start(self, name: str, wait: bool = True, *args: str) -> PeerProcess:
        peer = PeerProcess(self.workdir, self.key, name, "--concurrency", "1", "--state-dir",
                           str(self.workdir / f"{name}-state"), *args, env=self.env)
        self.peers.append(peer)
        return peer.start(wait=wait)

    def close(self) -> None:
        self.client.close()
        for peer in self.peers:
            peer.stop(timeout=10)
            peer.kill()
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def spread(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    # nearest-rank p90: never below the median, even of two values (the floor of 0.9*(n-1) took the smaller)
    return {"median": statistics.median(ordered), "p90": ordered[math.ceil(0.9 * len(ordered)) - 1],
            "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def makespan(workdir: Path, peers: int, count: int, lengths: tuple[float, float]) -> dict:
    cluster = Cluster(workdir)
    try:
        cluster.start("owner")
        gate = workdir / "gate"
        opener = cluster.jobs.submit(["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.01; done"], None,
                                     _cpu(peer="owner"), name="gate")
        wait_until(lambda: opener.refresh().state == "running", 60)
        rng = random.Random(28)
        plan = [(round(rng.uniform(*lengths), 3), rng.choice((0, 1, 2))) for _ in range(count)]
        submit_started = time.time()
        submitted = [cluster.jobs.submit(["sleep", str(length)], None, _cpu(), name=f"p{priority}",
                                         priority=priority) for length, priority in plan]
        submit_s = time.time() - submit_started
        joiners = [cluster.start(f"peer{n}", False) for n in range(1, peers)]
        for peer in joiners:
            peer.wait_ready()
        wait_until(lambda: all("pulled from" in peer.log() for peer in joiners), 120, interval=0.2)
        gate.touch()
        assert opener.wait(60) == "succeeded"
        ids = {j.id for j in submitted}

        def ended() -> list[dict] | None:
            rows = [r for r in cluster.jobs.rows() if r.get("id") in ids]
            return rows if len(rows) == count and all(r["state"] == "succeeded" for r in rows) else None

        rows = wait_until(ended, 3600, interval=1.0)
        gate_end = opener.refresh().info["ended"]
        owner_rows = [r for r in cluster.jobs.rows() if r.get("peer") == "owner"]
    finally:
        cluster.close()
    every = rows + [r for r in owner_rows if r["id"] == opener.id]
    start = min(gate_end, *(r["started"] for r in rows))  # joiners ready early pull before the gate opens
    span = max(r["ended"] for r in rows) - start
    ideal = sum(length for length, _ in plan) / peers
    waits = {str(p): spread([r["started"] - start for r in rows if r["priority"] == p]) for p in (0, 1, 2)}
    gaps: dict[str, list[float]] = {"pulled": [], "own": []}
    for peer in {r["peer"] for r in every}:
        ran = sorted((r for r in every if r["peer"] == peer), key=lambda r: r["started"])
        for before, after in zip(ran, ran[1:]):
            gaps["pulled" if after.get("moved") else "own"].append(1e3 * (after["started"] - before["ended"]))
    return {"peers": peers, "jobs": count, "lengths_s": list(lengths), "submit_s": submit_s,
            "makespan_s": span, "ideal_s": ideal, "makespan_over_ideal": span / ideal,
            "ran_on": {peer: sum(r["peer"] == peer for r in rows) for peer in sorted({r["peer"] for r in rows})},
            "pulled": sum(bool(r.get("moved")) for r in rows),
            "queue_wait_s_by_priority": waits,
            "slot_to_next_start_ms": {kind: spread(values) for kind, values in gaps.items()}}


def preemption(workdir: Path, rounds: int) -> dict:
    cluster = Cluster(workdir)
    turnarounds = []
    try:
        cluster.start("solo", True, "--no-pull")
        for n in range(rounds):
            termed, ready = workdir / f"termed-{n}", workdir / f"ready-{n}"
            script = ("import os, signal, sys, time\n"
                      "if os.environ['GPULAYER_RESTARTS'] != '0':\n    sys.exit(0)\n"
                      f"def term(*_):\n    open({str(termed)!r}, 'w').write(repr(time.time()))\n    sys.exit(0)\n"
                      "signal.signal(signal.SIGTERM, term)\n"
                      f"open({str(ready)!r}, 'w').close()\n"
                      "while True:\n    time.sleep(1)\n")
            low = cluster.jobs.submit(["python", "-c", script], None, _cpu(), preemptible=True, grace=30)
            wait_until(ready.exists, 60)
            high = cluster.jobs.submit(["true"], None, _cpu(), priority=1)
            assert high.wait(60) == "succeeded" and low.wait(60) == "succeeded"
            turnarounds.append(1e3 * (high.info["started"] - float(termed.read_text())))
    finally:
        cluster.close()
    return {"rounds": rounds, "sigterm_to_start_ms": spread(turnarounds)}


def idle_bytes(workdir: Path, settle: float, window: float) -> dict:
    """Bytes three idle peers' interfaces carry over `window` s, `settle` s after they are ready (the mDNS
    browse asks often at first, then ever less often), with pulling on and off (namespaces)."""
    reason = why_unavailable()
    if reason:
        return {"skipped": reason}
    out: dict = {"settle_s": settle, "window_s": window, "peers": 3}
    for label, args in (("pull", ()), ("no_pull", ("--no-pull",))):
        lan = Lan(workdir / f"lan-{label}")
        try:
            key = secrets.token_hex(16)
            hosts = [lan.add_host(f"{label[0]}{i}") for i in range(3)]
            peers = [h.start_peer(h.label, key, 1, args=args) for h in hosts]
            for peer in peers:
                peer.wait_ready()
            settled = time.monotonic() + settle
            wait_until(lambda: time.monotonic() >= settled, settle + 10, interval=0.2)

            def carried() -> int:
                total = 0
                for h in hosts:
                    for way in ("rx_bytes", "tx_bytes"):
                        total += int(h.run(["cat", f"/sys/class/net/eth0/statistics/{way}"]).stdout)
                return total

            before, started = carried(), time.monotonic()
            wait_until(lambda: time.monotonic() - started >= window, window + 10, interval=0.5)
            out[f"{label}_bytes_per_min_per_peer"] = (carried() - before) / 3 / (time.monotonic() - started) * 60
        finally:
            lan.close()
    out["pull_cost_bytes_per_min_per_peer"] = out["pull_bytes_per_min_per_peer"] - out["no_pull_bytes_per_min_per_peer"]
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["makespan"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    ax.bar(["ideal", "makespan"], [m["ideal_s"], m["makespan_s"]], color=["tab:gray", "tab:green"])
    ax.set_ylabel("s")
    ax.set_title(f"{m['jobs']} jobs queued on one peer, {m['peers']} peers\nmakespan / ideal = "
                 f"{m['makespan_over_ideal']:.2f}; {m['pulled']} pulled")
    ax = axes[1]
    waits = m["queue_wait_s_by_priority"]
    prios = [p for p in ("2", "1", "0") if waits[p]]
    values = [waits[p] for p in prios]
    ax.bar([f"priority {p}" for p in prios], [v["median"] for v in values],
           yerr=[[v["median"] - v["min"] for v in values], [v["max"] - v["median"] for v in values]],
           color="tab:blue", capsize=4)
    ax.set_ylabel("s from the first start to its start")
    ax.set_title("Queue wait by priority (median, min-max)")
    ax = axes[2]
    gaps = m["slot_to_next_start_ms"]
    names = [k for k in ("own", "pulled") if gaps.get(k)]
    ax.bar([f"next job: {k}" for k in names], [gaps[k]["median"] for k in names],
           yerr=[[0 for _ in names], [gaps[k]["p90"] - gaps[k]["median"] for k in names]],
           color=["tab:gray", "tab:green"][:len(names)], capsize=4)
    ax.axhline(TARGETS["slot_to_pulled_start_ms"], color="k", linestyle="--", label="target 100 ms")
    p = result["preemption"]["sigterm_to_start_ms"]
    ax.set_ylabel("ms from a job's end to the next one's start")
    ax.set_title(f"Slot freed -> next job started (median, p90)\npreemption: SIGTERM -> start "
                 f"{p.get('median', float('nan')):.0f} ms")
    ax.legend()
    mach = result["machine"]
    fig.suptitle(f"Pulling queued jobs on {mach['host']} ({mach['cpus']} CPUs, load {mach['load_before'][0]:.1f}), "
                 f"{mach['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def summarize(result: dict) -> dict:
    m, p, idle = result["makespan"], result["preemption"], result["idle"]
    pulled = m["slot_to_next_start_ms"].get("pulled", {})
    s = {"peers": m["peers"], "jobs": m["jobs"], "makespan_over_ideal": m["makespan_over_ideal"],
         "pulled": m["pulled"], "ran_on": m["ran_on"],
         "queue_wait_median_s_by_priority": {k: v.get("median") for k, v in m["queue_wait_s_by_priority"].items()},
         "slot_to_pulled_start_ms": pulled.get("median"), "slot_to_pulled_start_ms_p90": pulled.get("p90"),
         "slot_to_own_start_ms": m["slot_to_next_start_ms"].get("own", {}).get("median"),
         "preemption_sigterm_to_start_ms": p["sigterm_to_start_ms"].get("median"),
         "idle_pull_cost_bytes_per_min_per_peer": idle.get("pull_cost_bytes_per_min_per_peer", idle.get("skipped"))}
    s["target_met"] = pulled.get("median") is not None and pulled["median"] <= TARGETS["slot_to_pulled_start_ms"]
    return s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 peers, a dozen jobs, one round (a smoke run)")
    parser.add_argument("--json", default=str(RESULTS / "queue.json"))
    parser.add_argument("--plot", default=None, help=PLOT_HELP)
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    result: dict = {"machine": {**machine(), "load_before": os.getloadavg()},
                    "settings": {"quick": args.quick, **shape}, "targets": TARGETS}
    with tempfile.TemporaryDirectory(prefix="queue-bench-") as tmp:
        work = Path(tmp)
        for part in ("makespan", "preemption", "idle"):
            (work / part).mkdir()
        result["makespan"] = makespan(work / "makespan", shape["peers"], shape["jobs"], shape["lengths"])
        result["preemption"] = preemption(work / "preemption", shape["rounds"])
        result["idle"] = idle_bytes(work / "idle", shape["settle_s"], shape["window_s"])
    result["summary"] = summarize(result)
    write_results(result, args.json, args.plot, plot)
    return 0
