"""What the Ray backend adds over plain Ray, side by side in one run on a local Ray bound to 127.0.0.1.

    python bench/ray_backend.py            # writes bench/results/ray_backend.json and .png
    python bench/ray_backend.py --quick

Interleaved rounds of: sequential latency of a trivial call (`ray.get(f.remote())` against
`gl.run(f)`, and `gl.run(f, timeout=...)`, the streaming path whose start the watcher sees), and
the throughput of a burst (`ray.get([f.remote() ...])` against `gl.map(f, ...)`). Medians over
rounds with their range, and the ratio per round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # a one-host cluster: keep 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

import gpulayer as gl  # noqa: E402
from gpulayer import api  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def trivial(x: int = 0) -> int:
    return x


def latency_ms(call, n: int) -> float:
    """The median of n sequential calls, in ms."""
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def per_s(call, n: int) -> float:
    started = time.perf_counter()
    call()
    return n / (time.perf_counter() - started)


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def measure(rounds: int, calls: int, burst: int) -> dict:
    task = ray.remote(trivial)
    for _ in range(2):  # warm the workers and the function caches of both
        ray.get([task.remote() for _ in range(8)])
        gl.map(trivial, range(8))
    rows: dict[str, list[float]] = {k: [] for k in ("ray_ms", "gl_ms", "gl_timed_ms", "ray_per_s", "gl_per_s")}
    for _ in range(rounds):
        rows["ray_ms"].append(latency_ms(lambda: ray.get(task.remote()), calls))
        rows["gl_ms"].append(latency_ms(lambda: gl.run(trivial), calls))
        rows["gl_timed_ms"].append(latency_ms(lambda: gl.run(trivial, timeout=60), calls // 4))
        rows["ray_per_s"].append(per_s(lambda: ray.get([task.remote(i) for i in range(burst)]), burst))
        rows["gl_per_s"].append(per_s(lambda: gl.map(trivial, range(burst)), burst))
    ratios = {"latency_gl_over_ray": [g / r for g, r in zip(rows["gl_ms"], rows["ray_ms"], strict=True)],
              "throughput_gl_over_ray": [g / r for g, r in zip(rows["gl_per_s"], rows["ray_per_s"], strict=True)]}
    return {name: summary(values) for name, values in {**rows, **ratios}.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for axis, keys, label in ((left, ("ray_ms", "gl_ms", "gl_timed_ms"), "sequential call, ms (median)"),
                              (right, ("ray_per_s", "gl_per_s"), "burst, tasks/s")):
        medians = [result[k]["median"] for k in keys]
        errors = [[m - result[k]["min"] for k, m in zip(keys, medians)],
                  [result[k]["max"] - m for k, m in zip(keys, medians)]]
        axis.bar(keys, medians, yerr=errors, capsize=4, color=["#999999", "#3b7dd8", "#8fb3e8"][:len(keys)])
        axis.set_title(label)
    fig.suptitle(f"Ray backend vs plain Ray {result['ray_version']}, {result['machine']['cpus']} CPUs "
                 f"(bars: range over {result['rounds']} rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and calls")
    args = parser.parse_args()
    rounds, calls, burst = (2, 40, 100) if args.quick else (5, 200, 500)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", _node_ip_address="127.0.0.1")
    try:
        gl.configure(backend="ray", echo_output=False)
        figures = measure(rounds, calls, burst)
        result = {"what": "the Ray backend (gl.run, gl.map) beside plain Ray on one local Ray bound to 127.0.0.1",
                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "summary": {name: round(figures[name]["median"], 3) for name in
                              ("ray_ms", "gl_ms", "gl_timed_ms", "ray_per_s", "gl_per_s", "latency_gl_over_ray",
                               "throughput_gl_over_ray")},
                  "ray_version": ray.__version__, "rounds": rounds, "calls": calls, "burst": burst,
                  "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
                  **figures}
    finally:
        api.shutdown()
        ray.shutdown()
    RESULTS.mkdir(exist_ok=True)
    name = "ray_backend_quick" if args.quick else "ray_backend"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / f"{name}.png")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
