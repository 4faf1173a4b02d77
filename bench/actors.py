"""Actor calls, side by side with stateless tasks and with Ray 2.60 actors (when ray is installed).

    python bench/actors.py [--quick] [--json bench/results/actors.json] [--plot bench/results/actors.png]

One run on one machine, on loopback: a local peer subprocess (mDNS bound to 127.0.0.1) with 11
slots, and Ray bound to 127.0.0.1. Reported for each: the sync call's p50/p99 (one call at a time;
for GPUlayer both on the direct connection to the actor's worker and through the peer, ADR 0012),
calls/s when many are pipelined (submitted at once, then awaited), repeated for the spread (min and
max of the repeats); and the memory of the peer daemon and of its workers with 10 live actors (each
actor's worker takes the place of its slot's warm worker, so the workers' count stays 11).
Targets (issue 11): p50 <= 0.3 ms and >= 10,000 pipelined calls/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil
from output import PLOT_HELP, draw_beside  # this folder's
from overhead import latencies, machine  # this folder's: the same measurement as for tasks

RESULTS = Path(__file__).resolve().parent / "results"
DIRECT_ENV = "GPULAYER_DIRECT_CALLS"
TARGETS = {"p50_ms": 0.3, "calls_per_s": 10_000}
ACTORS_FOR_MEMORY = 10


class Counter:
    """The actor of every measurement: one counter, one trivial method."""

    def __init__(self):
        self.n = 0

    def bump(self):
        self.n += 1
        return self.n


def trivial():
    return 1


def rates(burst, calls: int, repeats: int) -> dict:
    """Calls/s of `repeats` bursts of `calls` pipelined calls: the best, and the range."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        burst(calls)
        seconds.append(time.perf_counter() - started)
    return {"calls": calls, "calls_per_s": calls / min(seconds),
            "calls_per_s_range": [calls / max(seconds), calls / min(seconds)]}


def repeated_latencies(call, n: int, repeats: int) -> dict:
    """`latencies` run `repeats` times: the run of the median p50, with the range of the runs' p50 and p99."""
    runs = sorted((latencies(call, n, n // 10) for _ in range(repeats)), key=lambda r: r["p50_ms"])
    return {**runs[len(runs) // 2], "p50_ms_range": [runs[0]["p50_ms"], runs[-1]["p50_ms"]],
            "p99_ms_range": [min(r["p99_ms"] for r in runs), max(r["p99_ms"] for r in runs)]}


def rss_mb(pid: int) -> dict:
    """Resident memory of a process and, separately, of all its descendants (MiB)."""
    proc = psutil.Process(pid)
    children = sum(c.memory_info().rss for c in proc.children(recursive=True))
    return {"peer_mb": proc.memory_info().rss / 2**20, "workers_mb": children / 2**20,
            "workers": len(proc.children(recursive=True))}


def burst(counter, k: int) -> None:
    """k calls submitted at once, then awaited."""
    futures = [counter.bump.submit() for _ in range(k)]
    for f in futures:
        f.result()


def measure_gpulayer(n: int, calls: int, repeats: int) -> dict:
    import gpulayer as gl
    from gpulayer.demo import local_peer

    with local_peer(dict(os.environ), name="bench-actors", extra_args=("--concurrency", "11")) as (proc, _):
        gl.configure(interfaces=["127.0.0.1"], echo_output=False)
        remote_counter = gl.remote(Counter)
        task = repeated_latencies(lambda: gl.run(trivial), n, repeats)
        os.environ[DIRECT_ENV] = "0"  # a handle made now calls through the peer: the path before ADR 0012
        relayed = remote_counter()
        os.environ.pop(DIRECT_ENV)
        via_peer = repeated_latencies(relayed.bump, n, repeats)
        via_peer_pipelined = rates(lambda k: burst(relayed, k), calls, repeats)
        relayed.close()
        counter = remote_counter()
        sync = repeated_latencies(counter.bump, n, repeats)
        pipelined = rates(lambda k: burst(counter, k), calls, repeats)
        counter.close()
        time.sleep(1.0)
        before = rss_mb(proc.pid)
        held = [remote_counter() for _ in range(ACTORS_FOR_MEMORY)]
        for actor in held:
            actor.bump()
        with_actors = rss_mb(proc.pid)
        for actor in held:
            actor.close()
        gl.api.shutdown()
    return {"task_latency": task, "latency": sync, "via_peer_latency": via_peer, **pipelined,
            "via_peer_pipelined": via_peer_pipelined,
            "memory": {"no_actors": before, f"{ACTORS_FOR_MEMORY}_actors": with_actors}}


def measure_ray(n: int, calls: int, repeats: int) -> dict | None:
    try:
        import ray
    except ImportError:
        return None
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR",
             _node_ip_address="127.0.0.1")  # a cluster of its own, on loopback, never one already running
    try:
        actor_class = ray.remote(Counter)
        counter = actor_class.remote()
        sync = repeated_latencies(lambda: ray.get(counter.bump.remote()), n, repeats)
        pipelined = rates(lambda k: ray.get([counter.bump.remote() for _ in range(k)]), calls, repeats)
    finally:
        ray.shutdown()
    return {"version": ray.__version__, "latency": sync, **pipelined}


def summarize(glr: dict, ray: dict | None) -> dict:
    summary = {"p50_ms": glr["latency"]["p50_ms"], "p50_ms_range": glr["latency"]["p50_ms_range"],
               "p99_ms": glr["latency"]["p99_ms"], "p99_ms_range": glr["latency"]["p99_ms_range"],
               "task_p50_ms": glr["task_latency"]["p50_ms"], "via_peer_p50_ms": glr["via_peer_latency"]["p50_ms"],
               "via_peer_p50_ms_range": glr["via_peer_latency"]["p50_ms_range"],
               "via_peer_calls_per_s": glr["via_peer_pipelined"]["calls_per_s"],
               "via_peer_calls_per_s_range": glr["via_peer_pipelined"]["calls_per_s_range"], "calls_per_s": glr["calls_per_s"],
               "calls_per_s_range": glr["calls_per_s_range"],
               "peer_mb_with_actors": glr["memory"][f"{ACTORS_FOR_MEMORY}_actors"]["peer_mb"],
               "peer_mb_without": glr["memory"]["no_actors"]["peer_mb"]}
    summary["targets"] = {"p50_ms<=0.3": summary["p50_ms"] <= TARGETS["p50_ms"],
                          "calls_per_s>=10000": summary["calls_per_s"] >= TARGETS["calls_per_s"]}
    if ray:
        summary.update(ray_p50_ms=ray["latency"]["p50_ms"], ray_p50_ms_range=ray["latency"]["p50_ms_range"],
                       ray_p99_ms=ray["latency"]["p99_ms"],
                       ray_calls_per_s=ray["calls_per_s"], ray_calls_per_s_range=ray["calls_per_s_range"],
                       ray_p50_over_gpulayer=ray["latency"]["p50_ms"] / glr["latency"]["p50_ms"],
                       gpulayer_calls_over_ray=glr["calls_per_s"] / ray["calls_per_s"])
    return summary


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    glr, ray = result["gpulayer"], result.get("ray")
    names = ["task", "actor\nvia peer", "actor"] + (["Ray\nactor"] if ray else [])
    lats = [glr["task_latency"], glr["via_peer_latency"], glr["latency"]] + ([ray["latency"]] if ray else [])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [1.6, 1, 1]})
    axes[0].bar([f"{n}\np50" for n in names], [x["p50_ms"] for x in lats], color="tab:blue")
    axes[0].bar([f"{n}\np99" for n in names], [x["p99_ms"] for x in lats], color="tab:orange")
    axes[0].axhline(TARGETS["p50_ms"], color="gray", linestyle="--", label="p50 target")
    axes[0].set_ylabel("ms per sync call (GPUlayer unless Ray)")
    axes[0].tick_params(axis="x", labelsize=8)
    axes[0].legend()
    runs = [("GPUlayer\nvia peer", glr["via_peer_pipelined"]), ("GPUlayer\ndirect", glr)] + ([("Ray", ray)] if ray else [])
    best = [r["calls_per_s"] for _, r in runs]
    low = [r["calls_per_s"] - r["calls_per_s_range"][0] for _, r in runs]
    axes[1].bar([n for n, _ in runs], best, yerr=[low, [0] * len(runs)], color="tab:green", capsize=4)
    axes[1].axhline(TARGETS["calls_per_s"], color="gray", linestyle="--", label="target")
    axes[1].set_title(f"{glr['calls']} pipelined calls (calls/s, best and worst run)")
    axes[1].legend()
    mem = glr["memory"]
    labels = ["no actors", f"{ACTORS_FOR_MEMORY} actors"]
    axes[2].bar(labels, [mem["no_actors"]["peer_mb"], mem[f"{ACTORS_FOR_MEMORY}_actors"]["peer_mb"]],
                label="peer daemon")
    axes[2].bar(labels, [mem["no_actors"]["workers_mb"], mem[f"{ACTORS_FOR_MEMORY}_actors"]["workers_mb"]],
                bottom=[mem["no_actors"]["peer_mb"], mem[f"{ACTORS_FOR_MEMORY}_actors"]["peer_mb"]],
                label="its workers")
    axes[2].set_ylabel("RSS (MiB)")
    axes[2].legend()
    m = result["machine"]
    fig.suptitle(f"Actors on {m['host']} ({m['cpus']} CPUs, load {m['load_average_1_5_15'][0]:.1f}), {m['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    parser.add_argument("--json", type=Path, default=RESULTS / "actors.json")
    parser.add_argument("--plot", default=None, help=PLOT_HELP)
    args = parser.parse_args(argv)
    n, calls, repeats = (200, 500, 2) if args.quick else (2000, 10_000, 5)
    if not os.environ.get("GPULAYER_KEY"):
        import secrets

        os.environ["GPULAYER_KEY"] = "bench-" + secrets.token_hex(16)
    result = {"machine": {**machine(), "load_average_1_5_15": list(os.getloadavg())}, "gpulayer": measure_gpulayer(n, calls, repeats), "ray": measure_ray(n, calls, repeats)}
    result["summary"] = summarize(result["gpulayer"], result["ray"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    draw_beside(plot, result, args.json, args.plot)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
