"""GPUlayer with many peers on one LAN: discovery, mDNS traffic, map throughput, the submitter's
footprint, and fairness among submitters without a coordinator.

    python bench/scale.py [--sizes 8,16,32,64] [--quick] [--json bench/results/scale.json]
                          [--plot bench/results/scale.png] [--replot]

Needs root and iproute2. Every peer is a real `python -m gpulayer.peer` in a network namespace on
one bridge, found over real mDNS multicast (tests/lan/scalelab.py); several peers share a
namespace at the larger sizes (`per_host` in the JSON), to keep the namespaces few. For each N:
- a fresh submitter process: seconds until it lists all N peers, and until its first result;
- the mDNS packets and bytes per minute that a silent observer on the bridge sees with N idle
  peers, and above that rate while one peer joins and while it leaves;
- gl.map throughput over the N peers (1 slot each) for trivial and for 10 ms tasks, interleaved
  rounds, and the submitter's threads, descriptors and memory afterwards.
Then fairness: 4 submitters at once, each a gl.map of the same 10 ms-1 s tasks (in its own order)
over heterogeneous peers (slots 1-4, speeds 1-3x), repeated: makespan against the ideal (the
total work over the total capacity), slot time left idle while tasks waited, and the spread of
the submitters' shares (ADR 0011). Everything stays inside the namespaces, which are removed
afterwards. The 2 vCPUs of this machine run every peer, so throughput is that of this box.
"""

from __future__ import annotations

import argparse
import json
import os
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

from lanlab import why_unavailable  # noqa: E402
from output import PLOT_HELP, draw_beside  # noqa: E402  this folder's
from scalelab import PeerSpec, ScaleLan, discovery, fairness, mdns_traffic, throughput  # noqa: E402

# The heterogeneous cluster of the fairness runs: (name, slots, slowdown). 11 slots, whose capacity is
# 8.8 task-seconds (at unit speed) a second.
FAIR_PEERS = [("f-a", 4, 1.0), ("f-b", 2, 1.0), ("f-c", 1, 1.0), ("f-d", 2, 2.0), ("f-e", 1, 2.0), ("f-f", 1, 3.0)]
TARGETS = {"makespan_over_ideal": 1.15, "share_spread": 1.2}


def per_host(n: int) -> int:
    """Peers per namespace: one up to 16 peers, then enough to keep about 16 namespaces."""
    return 1 if n <= 16 else n // 16


def measure_size(n: int, quick: bool) -> dict:
    """Discovery, mDNS traffic, throughput and footprint with `n` one-slot peers."""
    workdir = Path(tempfile.mkdtemp(prefix=f"gpulayer-scale-{n}-"))
    started = time.monotonic()
    lan = ScaleLan(workdir, [PeerSpec(f"s{i:02d}") for i in range(n)], per_host(n))
    try:
        up = time.monotonic() - started
        agent, seen = discovery(lan, "fresh")
        traffic = mdns_traffic(lan, idle_s=10.0 if quick else 40.0, change_s=5.0 if quick else 10.0)
        rates = throughput(agent, tasks=max(100, (10 if quick else 20) * n), rounds=1 if quick else 3)
        usage = agent.call("usage")
        agent.close()
    finally:
        lan.close()
    print(f"N={n}: seen {seen['seen_s']:.2f} s, first result {seen['first_result_s']:.2f} s, "
          f"idle mDNS {traffic['idle']['packets_per_min']:.1f} packets/min, "
          f"{rates['trivial']['tasks_per_s']:.0f} trivial and {rates['10ms']['tasks_per_s']:.0f} 10 ms tasks/s, "
          f"{usage['threads']} threads, {usage['fds']} fds", flush=True)
    return {"peers": n, "per_host": per_host(n), "peers_up_s": up, "discovery": seen, "mdns": traffic,
            "throughput": rates, "submitter": usage}


def measure_fairness(repeats: int, tasks_each: int) -> dict:
    """`repeats` fairness runs of 4 submitters on the heterogeneous cluster: each run, and the medians."""
    workdir = Path(tempfile.mkdtemp(prefix="gpulayer-fair-"))
    lan = ScaleLan(workdir, [PeerSpec(*spec) for spec in FAIR_PEERS])
    try:
        runs = []
        for i in range(repeats):
            runs.append(fairness(lan, submitters=4, tasks_each=tasks_each, label=f"fair{i}-"))
            r = runs[-1]
            print(f"fairness run {i + 1}: makespan {r['makespan_over_ideal']:.3f}x ideal, idle while waiting "
                  f"{100 * r['idle_while_waiting']:.1f}%, share spread {r['share_spread']:.3f}", flush=True)
    finally:
        lan.close()
    summary = {}
    for key in ("makespan_over_ideal", "idle_while_waiting", "share_spread"):
        values = [r[key] for r in runs]
        summary[key] = {"median": statistics.median(values), "range": [min(values), max(values)]}
    middle = sorted(range(len(runs)), key=lambda i: runs[i]["makespan_over_ideal"])[len(runs) // 2]
    return {"peers": [{"name": n, "slots": s, "slowdown": d} for n, s, d in FAIR_PEERS], "submitters": 4,
            "tasks_each": tasks_each, "targets": TARGETS, "summary": summary,
            "runs": [{k: v for k, v in r.items() if k != "timeline"} for r in runs],
            "timeline_run": middle + 1, "timeline": runs[middle]["timeline"]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    ns = [s["peers"] for s in sizes]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    ax = axes[0][0]
    ax.plot(ns, [s["discovery"]["seen_s"] for s in sizes], "o-", label="lists every peer")
    ax.plot(ns, [s["discovery"]["first_result_s"] for s in sizes], "s-", label="first result")
    ax.set(title="fresh submitter process", xlabel="peers", ylabel="seconds from spawn")
    ax.legend()
    ax = axes[0][1]
    ax.plot(ns, [s["mdns"]["idle"]["packets_per_min"] for s in sizes], "o-", label="idle, per minute")
    ax.plot(ns, [s["mdns"]["join"]["above_idle"] for s in sizes], "s-", label="one peer joins (above idle)")
    ax.plot(ns, [s["mdns"]["leave"]["above_idle"] for s in sizes], "^-", label="one peer leaves (above idle)")
    ax.set(title="mDNS packets on the bridge", xlabel="peers", ylabel="packets")
    ax.legend()
    ax = axes[0][2]
    for kind, marker in (("trivial", "o-"), ("10ms", "s-")):
        ax.plot(ns, [s["throughput"][kind]["tasks_per_s"] for s in sizes], marker, label=f"{kind} tasks")
    ax.set(title="gl.map throughput (one submitter, 2 vCPUs run everything)", xlabel="peers", ylabel="tasks/s")
    ax.legend()
    ax = axes[1][0]
    ax.plot(ns, [s["submitter"]["threads"] for s in sizes], "o-", label="threads")
    ax.plot(ns, [s["submitter"]["fds"] for s in sizes], "s-", label="file descriptors")
    ax.plot(ns, [s["submitter"]["rss"] / 2**20 for s in sizes], "^-", label="RSS (MiB)")
    ax.plot(ns, [s["submitter"]["connections"] for s in sizes], "x--", label="peers it connected to")
    ax.set(title="the submitter after the map", xlabel="peers")
    ax.legend()
    fair = result["fairness"]
    ax = axes[1][1]
    runs = fair["runs"]
    x = range(1, len(runs) + 1)
    ax.plot(x, [r["makespan_over_ideal"] for r in runs], "o-", label="makespan / ideal")
    ax.plot(x, [r["share_spread"] for r in runs], "s-", label="largest share / smallest")
    ax.plot(x, [1 + r["idle_while_waiting"] for r in runs], "^-", label="1 + idle share while tasks waited")
    for target in TARGETS.values():
        ax.axhline(target, color="grey", linestyle=":")
    ax.set(title=f"4 submitters over {len(fair['peers'])} unequal peers", xlabel="run", ylim=(0.95, None),
           xticks=list(x))
    ax.legend()
    ax = axes[1][2]
    names = [p["name"] for p in fair["peers"]]
    slots = {p["name"]: p["slots"] for p in fair["peers"]}
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    lanes: dict[str, list[float]] = {name: [] for name in names}  # per peer: when each slot's last task ended
    for peer, submitter, t0, t1 in sorted(fair["timeline"], key=lambda run: run[2]):
        ends = lanes[peer]
        lane = next((i for i, end in enumerate(ends) if end <= t0 + 1e-3), len(ends))
        ends[lane:lane + 1] = [t1]
        height = 0.8 / slots[peer]
        ax.barh(names.index(peer) - 0.4 + (lane + 0.5) * height, t1 - t0, left=t0, height=height * 0.9,
                color=colors[submitter % 4])
    ax.set_yticks(range(len(names)), [f"{p['name']} ({p['slots']} slots, {p['slowdown']:g}x)" for p in fair["peers"]])
    ax.invert_yaxis()
    which = f"run {fair['timeline_run']}" if "timeline_run" in fair else "one run"
    ax.set(title=f"{which}: tasks by peer, coloured by submitter", xlabel="seconds")
    fig.suptitle(f"GPUlayer at scale, {result['when'][:10]} ({result['machine']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,16,32,64")
    parser.add_argument("--quick", action="store_true", help="shorter windows and one fairness run (a smoke run)")
    parser.add_argument("--json", default=str(RESULTS / "scale.json"))
    parser.add_argument("--plot", default=None, help=PLOT_HELP)
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from the JSON")
    args = parser.parse_args(argv)
    if args.replot:
        draw_beside(plot, json.loads(Path(args.json).read_text()), args.json, args.plot)
        return 0
    reason = why_unavailable()
    if reason:
        print(f"scale: {reason}", file=sys.stderr)
        return 2
    sizes = [measure_size(int(n), args.quick) for n in args.sizes.split(",")]
    fair = measure_fairness(1 if args.quick else 5, 20 if args.quick else 60)
    result = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} vCPUs, Python {platform.python_version()}",
              "sizes": sizes, "fairness": fair}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    where = draw_beside(plot, result, args.json, args.plot)
    print(f"wrote {args.json}" + (f" and {where}" if where is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
