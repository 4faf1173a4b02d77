"""The cost of a peer's utilisation sampling (gpulayer/resources/utilisation.py), against its budget of
1% of one core at 1 Hz (10 ms of CPU per second).

    python bench/sampling.py [--quick] [--json bench/results/sampling.json] [--plot bench/results/sampling.png]

Measured side by side in one run, each in rounds (medians, quartiles and ranges over the rounds):
1. `Sampler.sample()` as this machine runs it (psutil's CPU and memory, plus the GPU source found
   here: NVML, ioreg, or none), CPU seconds per sample (process_time: user + system of this process);
2. its parts: `read_host` (psutil), `parse_ioreg` of the recorded M2 Max output, and, as a stand-in
   for running ioreg where there is none, spawning `true` (the fork and exec that reading ioreg pays;
   the child's CPU time counted too);
3. the Sampler's own thread at 1 Hz for a while, its CPU time per second read from its thread CPU
   clock (pthread_getcpuclockid), i.e. the share of one core it takes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from gpulayer.resources import utilisation
from output import PLOT_HELP, draw_beside  # this folder's

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
IOREG_FACT = HERE.parent / "tests" / "resources" / "facts" / "utilisation" / "mac_m2_max_ioreg.txt"
BUDGET_PERCENT = 1.0  # of one core, at 1 Hz


def cpu_per_call(fn: Callable[[], object], calls: int, children: bool = False) -> float:
    """CPU seconds per call of `fn`: this process's (process_time), and its children's when `children`."""
    def now() -> float:
        own = time.process_time()
        if not children:
            return own
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own + usage.ru_utime + usage.ru_stime

    start = now()
    for _ in range(calls):
        fn()
    return (now() - start) / calls


def rounds(fn: Callable[[], object], calls: int, count: int, children: bool = False) -> dict[str, float | int]:
    values = [cpu_per_call(fn, calls, children) for _ in range(count)]
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return {"median_s": median, "q1_s": q1, "q3_s": q3, "min_s": min(values), "max_s": max(values),
            "rounds": count, "calls_per_round": calls,
            "percent_of_a_core_at_1hz": 100 * median}


def sampler_thread_share(seconds: float, interval: float = 1.0) -> dict[str, float]:
    """Run a Sampler at `interval` for `seconds`: its thread's CPU seconds per wall second."""
    sampler = utilisation.Sampler(interval)
    sampler.start()
    assert sampler._thread is not None
    time.sleep(0.2)
    clock = time.pthread_getcpuclockid(sampler._thread.ident)  # type: ignore[arg-type]

    def thread_cpu() -> float:
        return time.clock_gettime(clock)

    cpu0, wall0 = thread_cpu(), time.monotonic()
    time.sleep(seconds)
    cpu, wall = thread_cpu() - cpu0, time.monotonic() - wall0
    sampler.stop()
    return {"seconds": wall, "cpu_s": cpu, "percent_of_a_core": 100 * cpu / wall, "interval_s": interval,
            "source": sampler.source or "none"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a check, not a measurement)")
    parser.add_argument("--json", type=Path, default=RESULTS / "sampling.json")
    parser.add_argument("--plot", default=None, help=PLOT_HELP)
    args = parser.parse_args()
    count, calls, thread_s = (3, 20, 3.0) if args.quick else (15, 200, 30.0)

    ioreg_text = IOREG_FACT.read_text()
    sampler = utilisation.Sampler()
    utilisation.read_host()  # psutil's first cpu_percent call only primes it
    parts = {
        "sample (this machine)": rounds(sampler.sample, calls, count),
        "read_host (psutil)": rounds(utilisation.read_host, calls, count),
        "parse_ioreg (recorded M2 Max)": rounds(lambda: utilisation.parse_ioreg(ioreg_text), calls, count),
        "spawn `true` (stand-in for ioreg)": rounds(lambda: subprocess.run(["true"], check=True),
                                                    max(calls // 10, 2), count, children=True),
    }
    thread = sampler_thread_share(thread_s)
    report = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                    "gpu_source": sampler.source or "none"},
        "quick": args.quick, "budget_percent_of_a_core": BUDGET_PERCENT,
        "per_sample": parts, "sampler_thread_at_1hz": thread,
        "within_budget": thread["percent_of_a_core"] <= BUDGET_PERCENT,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    where = draw_beside(plot, report, args.json, args.plot)
    for name, part in parts.items():
        print(f"{name:38s} {1e6 * part['median_s']:9.1f} µs CPU per sample "
              f"(quartiles {1e6 * part['q1_s']:.1f}-{1e6 * part['q3_s']:.1f}) = "
              f"{part['percent_of_a_core_at_1hz']:.3f}% of a core at 1 Hz")
    print(f"Sampler thread at 1 Hz over {thread['seconds']:.0f} s: {thread['percent_of_a_core']:.3f}% of a core "
          f"(budget {BUDGET_PERCENT}%); wrote {args.json}" + (f" and {where}" if where is not None else ""))
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = report["per_sample"]
    names = [*parts, "Sampler thread, measured"]
    values = [p["percent_of_a_core_at_1hz"] for p in parts.values()] + \
        [report["sampler_thread_at_1hz"]["percent_of_a_core"]]
    lows = [100 * p["q1_s"] for p in parts.values()] + [values[-1]]
    highs = [100 * p["q3_s"] for p in parts.values()] + [values[-1]]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.barh(names, values, xerr=[[v - lo for v, lo in zip(values, lows)], [hi - v for v, hi in zip(values, highs)]],
            color="#2f81f7")
    ax.axvline(report["budget_percent_of_a_core"], color="#cf222e", linestyle="--", label="budget: 1% of a core")
    ax.set_xscale("log")
    ax.set_xlabel("% of one core at 1 Hz (median, quartiles)")
    ax.set_title(f"Utilisation sampling cost ({report['machine']['platform'][:40]})", fontsize=9)
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
