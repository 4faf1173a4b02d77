"""`gpulayer bench`: round-trip latency, transfer bandwidth and matmul TFLOPS of each peer.

Every task is pinned to its peer (peer=ID). Latency: p50/p99 of a trivial task. Bandwidth: a
numpy array sent to a task (upload) and one returned by a task (download, less the time the
peer took to make it), best of five. TFLOPS: float32 square matmuls with each framework the
peer advertises (torch on `gl.device()`, mlx on its GPU and CPU backends), the size doubled
until one product takes 50 ms, then timed for a fixed budget. One run, one machine: the
figures include GPUlayer's own overhead, which is the point.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from .accelerators import CPU, CUDA, MPS
from .errors import GPULayerError

FULL = {"latency_n": 200, "transfer_bytes": 64 << 20, "max_size": 8192, "budget_s": 1.0}
QUICK = {"latency_n": 50, "transfer_bytes": 8 << 20, "max_size": 512, "budget_s": 0.3}


# ---- tasks: these run on the peer (pickled by reference, so they need gpulayer there) --------

def _noop():
    return None


def _nbytes(array) -> int:
    return array.nbytes


def _make(nbytes: int):
    """An array of `nbytes` and the seconds it took to make it."""
    import numpy as np

    started = time.perf_counter()
    array = np.ones(nbytes, np.uint8)
    return array, time.perf_counter() - started


def _matmul_rate(product, max_size: int, budget: float) -> dict:
    """`product(n)` gives a callable that computes one n x n product and waits for it."""
    n = 256
    while True:
        run = product(n)
        run()  # warm-up: kernels, allocations
        started = time.perf_counter()
        run()
        one = time.perf_counter() - started
        if one >= 0.05 or n >= max_size:
            break
        n *= 2
    repeats = max(3, int(budget / one))
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    seconds = (time.perf_counter() - started) / repeats
    return {"size": n, "dtype": "float32", "seconds": seconds, "tflops": 2 * n**3 / seconds / 1e12}


def _torch_matmul(max_size: int, budget: float) -> dict:
    import torch

    import gpulayer as gl

    device = gl.device()
    sync = {CUDA: torch.cuda.synchronize, MPS: torch.mps.synchronize}.get(device.type, lambda: None)

    def product(n):
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        return lambda: (a @ b, sync())

    return {"framework": "torch", "device": str(device), **_matmul_rate(product, max_size, budget)}


def _mlx_matmul(gpu: bool, max_size: int, budget: float) -> dict:
    import mlx.core as mx

    device = mx.gpu if gpu else mx.cpu

    def product(n):
        a, b = (mx.random.normal((n, n), stream=device) for _ in range(2))
        mx.eval(a, b)
        return lambda: mx.eval(mx.matmul(a, b, stream=device))

    return {"framework": "mlx", "device": "gpu" if gpu else "cpu", **_matmul_rate(product, max_size, budget)}


# ---- the submitter's side -------------------------------------------------------------------

def _matmul_plan(row: dict) -> list[tuple[str, str, object, tuple]]:
    """(framework, accelerator to match, task, args) for each framework/device on the peer."""
    plan = []
    caps = set(row["capabilities"])
    if "torch" in row["frameworks"]:
        plan.append(("torch", row["accelerator"], _torch_matmul, ()))
    if "mlx" in row["frameworks"]:
        if caps & {"mlx.metal", "mlx.cuda"}:
            plan.append(("mlx", row["accelerator"], _mlx_matmul, (True,)))
        if "mlx.cpu" in caps:
            plan.append(("mlx", CPU, _mlx_matmul, (False,)))
    return plan


def _latency(run, n: int) -> dict:
    for _ in range(10):
        run(_noop)
    times = []
    for _ in range(n):
        started = time.perf_counter()
        run(_noop)
        times.append(time.perf_counter() - started)
    times.sort()
    return {"n": n, "p50_ms": 1e3 * times[n // 2], "p99_ms": 1e3 * times[int(n * 0.99)],
            "mean_ms": 1e3 * sum(times) / n}


def _bandwidth(run, nbytes: int) -> dict:
    import numpy as np

    payload = np.ones(nbytes, np.uint8)
    upload, download = [], []
    for _ in range(6):  # the first of each is a warm-up
        started = time.perf_counter()
        run(_nbytes, payload)
        upload.append(time.perf_counter() - started)
        started = time.perf_counter()
        _, making = run(_make, nbytes)
        download.append(time.perf_counter() - started - making)
    return {"bytes": nbytes, "upload_gb_per_s": nbytes / min(upload[1:]) / 1e9,
            "download_gb_per_s": nbytes / min(download[1:]) / 1e9}


def _matmuls(run, row: dict, max_size: int, budget: float) -> list[dict]:
    """One figure per framework and device on the peer; a failure is recorded, not raised."""
    results = []
    for framework, accelerator, task, args in _matmul_plan(row):
        try:
            results.append(run(task, *args, max_size, budget, accelerator=accelerator, frameworks=[framework]))
        except Exception as exc:  # one framework failing should not hide the others
            results.append({"framework": framework, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
    return results


def measure_peer(row: dict, settings: dict) -> dict:
    """All the figures for one peer (a `gl.peers()` row)."""
    import gpulayer as gl

    def run(fn, *args, **requirements):
        return gl.run(fn, *args, peer=row["peer_id"], **requirements)

    info = {k: row[k] for k in ("name", "peer_id", "address", "accelerator", "device", "memory_kind",
                                "device_memory_gb", "ram_gb", "frameworks", "capabilities", "slots")}
    return {**info, "latency": _latency(run, settings["latency_n"]),
            "bandwidth": _bandwidth(run, settings["transfer_bytes"]),
            "matmul": _matmuls(run, row, settings["max_size"], settings["budget_s"])}


def _matmul_label(m: dict) -> str:
    return f"{m['framework']}/{m['device']}" if "device" in m else m["framework"]


def format_results(peers: list[dict]) -> str:
    header = ("PEER", "ACCEL", "P50 MS", "P99 MS", "UP GB/S", "DOWN GB/S", "MATMUL FP32 TFLOPS")
    lines = [header]
    for p in peers:
        lat, bw = p["latency"], p["bandwidth"]
        matmul = ", ".join(f"{_matmul_label(m)} " + (f"{m['tflops']:.3g} (n={m['size']})" if "tflops" in m else
                                                        "failed") for m in p["matmul"]) or "-"
        lines.append((p["name"], p["accelerator"], f"{lat['p50_ms']:.2f}", f"{lat['p99_ms']:.2f}",
                      f"{bw['upload_gb_per_s']:.2f}", f"{bw['download_gb_per_s']:.2f}", matmul))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def plot(report: dict, path: str) -> None:
    """Three bar panels: latency, bandwidth each way, matmul TFLOPS (log scale); a group per peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = report["peers"]
    names = [p["name"] for p in peers]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = [
        (axes[0], "round-trip latency (ms)", {"p50": [p["latency"]["p50_ms"] for p in peers],
                                              "p99": [p["latency"]["p99_ms"] for p in peers]}),
        (axes[1], f"transfer of {report['settings']['transfer_bytes'] >> 20} MiB (GB/s)",
         {"upload": [p["bandwidth"]["upload_gb_per_s"] for p in peers],
          "download": [p["bandwidth"]["download_gb_per_s"] for p in peers]}),
    ]
    labels = sorted({_matmul_label(m) for p in peers for m in p["matmul"] if "tflops" in m})
    panels.append((axes[2], "matmul float32 (TFLOPS)",
                   {label: [next((m["tflops"] for m in p["matmul"] if "tflops" in m and _matmul_label(m) == label), 0.0)
                            for p in peers] for label in labels}))
    for ax, title, series in panels:
        width = 0.8 / max(len(series), 1)
        for i, (label, values) in enumerate(series.items()):
            bars = ax.bar([x + i * width for x in range(len(peers))], values, width, label=label)
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(peers))], names)
        ax.set_title(title)
        ax.legend(fontsize=8)
    if labels:  # a GPU and a CPU differ by orders of magnitude
        axes[2].set_yscale("log")
    fig.suptitle(f"gpulayer bench, {report['date'][:16]} UTC, from {report['submitter']['host']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peer", default=None, help="benchmark only this peer (name or id)")
    parser.add_argument("--quick", action="store_true", help="fewer round trips, 8 MiB transfers, small matmuls")
    parser.add_argument("--json", metavar="PATH", default=None, help="write every figure as JSON here")
    parser.add_argument("--plot", metavar="PATH", default=None, help="write a PNG bar chart here (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    import platform
    from datetime import datetime, timezone  # here: every gpulayer command builds this parser

    import gpulayer as gl

    if args.plot and importlib.util.find_spec("matplotlib") is None:  # say so before measuring, not after
        raise GPULayerError("--plot needs matplotlib: pip install matplotlib")
    rows = [r for r in gl.peers() if r.get("state") == "up"]
    chosen = [r for r in rows if args.peer in (None, r["name"], r["peer_id"])]
    if not chosen:
        seen = ", ".join(r["name"] for r in rows)
        print(f"gpulayer bench: no peer named {args.peer!r} is up (peers up: {seen})" if args.peer and rows else
              "gpulayer bench: no peers found. Start one with `gpulayer join`, check that this machine has the "
              "same cluster key, or set GPULAYER_PEERS=host:port where multicast is blocked.", file=sys.stderr)
        return 1
    settings = {"quick": args.quick, **(QUICK if args.quick else FULL)}
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "submitter": {"host": platform.node(), "platform": platform.platform(),
                            "python": platform.python_version(), "gpulayer": gl.__version__,
                            "cpu_count": os.cpu_count(),
                            "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None},
              "settings": settings, "peers": []}
    for row in chosen:
        busy = f", {row['busy']}/{row['slots']} slots busy: tasks queue behind them" if row["busy"] else ""
        print(f"benchmarking {row['name']} ({row['accelerator']}, {row['address']}{busy}) ...", file=sys.stderr,
              flush=True)
        report["peers"].append(measure_peer(row, settings))
    print(format_results(report["peers"]))
    for p in report["peers"]:
        for m in p["matmul"]:
            if "error" in m:
                print(f"{p['name']}: {m['framework']} matmul failed: {m['error']}", file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv=None) -> int:
    """Entry point of bench/lan_bench.py; same as `gpulayer bench`."""
    parser = argparse.ArgumentParser(prog="lan_bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except GPULayerError as exc:
        print(f"gpulayer bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
