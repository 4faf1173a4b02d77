"""The LAN suite's reliability report: what the tests tried and what survived, with totals.

The `reliability` fixture (conftest.py) fills a `Reliability` during a run and writes that run's
report into pytest's temporary directory, or to `--reliability-json PATH`. bench/reliability.py
runs the suite with that option and merges the run into bench/results/reliability.json, the only
writer of that tracked file: a test run never changes the work tree.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

WHAT = ("GPUlayer across hosts: peers in network namespaces on a bridge, real mDNS multicast, "
        "kills, link cuts, a faulty relay, load, and hostile input (tests/lan)")
_DETECTION_WORDS = ("detect", "discovered", "appeared", "disappeared", "found", "reused")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class Reliability:
    """The sections and test outcomes of one run, filled by the tests that ran."""

    def __init__(self) -> None:
        self.sections: dict[str, dict] = {}
        self.outcomes: dict[str, str] = {}
        self.written: Path | None = None

    def record(self, section: str, **data) -> None:
        self.sections.setdefault(section, {"recorded": _now()}).update(data)

    def write(self, path: Path) -> Path | None:
        """Write this run's report to `path` (nothing when no test recorded a section)."""
        if not self.sections:
            return None
        write_report(path, build_report(self.sections, self.outcomes))
        self.written = path
        return path


def build_report(tests: dict[str, dict], outcomes: dict[str, str]) -> dict:
    """The report of these sections and outcomes: totals, detection times, the machine."""
    totals: dict = {"faults_injected": {}, "faults_injected_total": 0, "tasks_completed": 0, "duplicates": 0,
                    "lost": 0}
    for section in tests.values():
        faults = section.get("faults_injected")
        if isinstance(faults, dict):
            for kind, n in faults.items():
                totals["faults_injected"][kind] = totals["faults_injected"].get(kind, 0) + n
                totals["faults_injected_total"] += n
        for key in ("tasks_completed", "duplicates", "lost"):
            if isinstance(section.get(key), int):
                totals[key] += section[key]
    detection = {}
    for name, section in tests.items():
        for key, value in section.items():
            timed = isinstance(value, (int, float)) and not isinstance(value, bool) and key.endswith("_s")
            if timed and "bound" not in key and any(word in key for word in _DETECTION_WORDS):
                detection[f"{name}.{key}"] = value
    return {
        "what": WHAT,
        "written": _now(),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "totals": totals,
        "detection_times_s": detection,
        "outcomes": dict(sorted(outcomes.items())),
        "tests": tests,
    }


def merge(previous: dict | None, run: dict) -> dict:
    """`run` over `previous`: the sections and outcomes of tests not run this time are kept."""
    def part(report: dict | None, key: str) -> dict:
        value = (report or {}).get(key)
        return value if isinstance(value, dict) else {}

    return build_report({**part(previous, "tests"), **part(run, "tests")},
                        {**part(previous, "outcomes"), **part(run, "outcomes")})


def read_report(path: Path) -> dict | None:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def write_report(path: Path, report: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
