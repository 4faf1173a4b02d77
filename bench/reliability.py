"""GPUlayer across hosts: run the LAN reliability suite (tests/lan) and write what it tried and what survived.

    python bench/reliability.py [--json bench/results/reliability.json] [--plot bench/results/reliability.png]
                                [--replot] [extra pytest arguments, e.g. -k faults]

It needs root and iproute2: the suite builds network namespaces joined by a bridge, runs a peer
in each, and injects kills, link cuts, a faulty relay, load and hostile input (see tests/lan/).
Everything stays inside those namespaces; they are removed afterwards.

The suite writes the report of its run to a temporary file (`--reliability-json`); this script
merges it into the JSON (the sections of tests not run this time are kept from the previous
file) and draws the plot. It is the only writer of bench/results/reliability.json: `pytest
tests/lan` alone leaves bench/results as it was. `--replot` only redraws the plot from the JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "tests" / "lan"))

from lanreport import merge, read_report, write_report  # noqa: E402
from output import PLOT_HELP, draw_beside  # noqa: E402  this folder's


def run_suite(pytest_args: list[str], report: Path) -> int:
    """The LAN suite in a pytest of its own, writing the report of this run to `report`."""
    argv = [sys.executable, "-m", "pytest", "-q", "tests/lan", f"--reliability-json={report}", *pytest_args]
    return subprocess.call(argv, cwd=ROOT)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    totals = report["totals"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    detection = report["detection_times_s"]
    bars = axes[0].barh(list(detection), list(detection.values()), color="tab:blue")
    axes[0].bar_label(bars, fmt="%.3g", padding=2, fontsize=8)
    axes[0].margins(x=0.15)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("seconds")
    axes[0].set_title("time to notice (lower is better)")
    faults = totals["faults_injected"]
    bars = axes[1].barh(list(faults), list(faults.values()), color="tab:orange")
    axes[1].bar_label(bars, padding=2, fontsize=8)
    axes[1].margins(x=0.25)
    axes[1].invert_yaxis()
    axes[1].set_xscale("log")
    axes[1].set_title(f"faults injected ({totals['faults_injected_total']} in all)")
    modules: dict[str, dict[str, int]] = {}
    for test, outcome in report["outcomes"].items():
        counts = modules.setdefault(test.split("::")[0].removeprefix("test_lan_").removesuffix(".py"), {})
        kind = outcome if outcome in ("passed", "failed") else "other"
        counts[kind] = counts.get(kind, 0) + 1
    names = list(modules)
    left = [0] * len(names)
    for kind, color in (("passed", "tab:green"), ("failed", "tab:red"), ("other", "tab:gray")):
        widths = [modules[name].get(kind, 0) for name in names]
        if not any(widths):
            continue
        axes[2].barh(names, widths, left=left, color=color, label=kind)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    axes[2].invert_yaxis()
    axes[2].set_xlabel("tests")
    axes[2].set_title("outcomes by module")
    axes[2].legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    fig.suptitle(f"GPUlayer across namespaced hosts, {report['written'][:10]}: {totals['tasks_completed']} tasks "
                 f"completed, {totals['duplicates']} run twice, {totals['lost']} lost "
                 f"({report['machine']['cpus']} CPUs, kernel {report['machine']['kernel']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(RESULTS / "reliability.json"))
    parser.add_argument("--plot", default=None, help=PLOT_HELP)
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from --json")
    args, pytest_args = parser.parse_known_args(argv)
    target = Path(args.json)
    code = 0
    if args.replot:
        report = read_report(target)
        if report is None:
            print(f"bench/reliability.py: no report at {target}", file=sys.stderr)
            return 1
    else:
        with tempfile.TemporaryDirectory(prefix="gpulayer-reliability-") as tmp:
            code = run_suite(pytest_args, Path(tmp) / "reliability.json")
            run = read_report(Path(tmp) / "reliability.json")
        if run is None:
            print("bench/reliability.py: the suite recorded nothing (skipped? it needs root and iproute2); "
                  f"{target} is unchanged", file=sys.stderr)
            return code or 1
        report = merge(read_report(target), run)
        write_report(target, report)
    where = draw_beside(plot, report, target, args.plot)
    print(json.dumps({k: report.get(k) for k in ("written", "totals", "detection_times_s", "outcomes")}, indent=2))
    written = ([] if args.replot else [str(target)]) + ([str(where)] if where is not None else [])
    if written:
        print("wrote " + " and ".join(written))
    return code


if __name__ == "__main__":
    sys.exit(main())
