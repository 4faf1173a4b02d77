"""The examples of examples/lightning_port run under Lightning and under gpulayer.torch, side by side in
one process, with the same seed: the metrics they end with and their training curves (metrics.csv).

    python bench/lightning_parity.py                      # CPU; writes bench/results/lightning_parity.json/.png
    python bench/lightning_parity.py --accelerator cuda --json bench/results/lightning_parity_cuda.json

Needs lightning (pip install lightning); it is not a test dependency.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import platform
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "lightning_port"))
from frameworks import EXAMPLES, load  # noqa: E402

FRAMEWORKS = ("lightning", "glt")


def floats(out: dict, prefix: str = "") -> dict[str, float]:
    """The float results of an example's main(), flattened: {"fit/val_loss": ..., "test/test_acc": ...}."""
    flat = {}
    for key, value in out.items():
        if isinstance(value, dict):
            flat.update(floats(value, f"{prefix}{key}/"))
        elif isinstance(value, float):
            flat[prefix + key] = value
    return flat


def curves(log_dir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv, or the TensorBoard events where the default logger was TensorBoard, as
    {metric: [(step, value), ...]}."""
    if not (log_dir / "metrics.csv").exists():
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(log_dir))
        events.Reload()
        return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
                if tag not in ("epoch", "hp_metric")}  # hp_metric: Lightning's placeholder, not a metric
    with open(log_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("epoch", "step") and value:
                out.setdefault(key, []).append((int(row["step"]), float(value)))
    return out


def run(name: str, framework: str, accelerator: str, tmp: pathlib.Path) -> dict:
    root = tmp / f"{pathlib.Path(name).stem}-{framework}"
    start = time.perf_counter()
    out = load(name, framework).main(str(root), accelerator=accelerator)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "metrics": floats(out),
            "other": {k: v for k, v in out.items() if not isinstance(v, (dict, float))},
            "curves": curves(root / out["log_dir"])}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4))
    for ax, (name, runs) in zip(axes, results.items()):
        metric = next(k for k in ("train_loss", "train_loss_step") if k in runs["glt"]["curves"])
        for framework, style in (("lightning", "-"), ("glt", "--")):
            steps, values = zip(*runs[framework]["curves"][metric])
            ax.plot(steps, values, style, label=f"{framework} {metric}")
            val = runs[framework]["curves"].get("val_loss")
            if val:
                ax.plot(*zip(*val), style, marker="o", label=f"{framework} val_loss")
        ax.set_title(f"{name}: max relative difference {runs['max_rel_diff']:.1e}")
        ax.set_xlabel("step (as logged)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "lightning_parity.json"))
    args = parser.parse_args()
    import lightning

    results = {}
    with tempfile.TemporaryDirectory(prefix="lightning-parity-") as tmp:
        for name in EXAMPLES:
            runs = {fw: run(name, fw, args.accelerator, pathlib.Path(tmp)) for fw in FRAMEWORKS}
            ours, theirs = runs["glt"]["metrics"], runs["lightning"]["metrics"]
            diffs = {k: rel_diff(ours[k], theirs[k]) for k in theirs if k in ours}
            curve_diffs = [rel_diff(a[1], b[1]) for key, points in runs["lightning"]["curves"].items()
                           for a, b in zip(runs["glt"]["curves"].get(key, []), points)]
            runs.update({"same_metric_names": sorted(ours) == sorted(theirs),
                         "same_other_results": runs["glt"]["other"] == runs["lightning"]["other"],
                         "rel_diff": diffs, "max_rel_diff": max([*diffs.values(), *curve_diffs]),
                         "curve_points": len(curve_diffs)})
            results[pathlib.Path(name).stem] = runs
            print(f"{name}: {len(diffs)} metrics, {len(curve_diffs)} logged points, max relative difference "
                  f"{runs['max_rel_diff']:.2e}; same names {runs['same_metric_names']}, same other results "
                  f"{runs['same_other_results']}; lightning {runs['lightning']['seconds']:.1f} s, "
                  f"glt {runs['glt']['seconds']:.1f} s")
    report = {"accelerator": args.accelerator, "lightning": lightning.__version__, "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.platform(),
              "date": time.strftime("%Y-%m-%d"), "examples": results}
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    if not all(math.isfinite(r["max_rel_diff"]) and r["max_rel_diff"] < 1e-4 for r in results.values()):
        sys.exit("the metrics differ by more than 1e-4 (relative)")


if __name__ == "__main__":
    main()
