"""Run the multi-host reliability suite (tests/lan) and print what it wrote to bench/results/reliability.json.

    sudo python bench/reliability.py [extra pytest arguments]

It needs root and iproute2: the suite builds network namespaces joined by a bridge, runs a peer
in each, and injects kills, link cuts, a faulty relay, load and hostile input (see tests/lan/).
Everything stays inside those namespaces; they are removed afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "bench" / "results" / "reliability.json"


def main() -> int:
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/lan", *sys.argv[1:]], cwd=ROOT)
    if REPORT.exists():
        report = json.loads(REPORT.read_text())
        print(json.dumps({k: report.get(k) for k in ("written", "totals", "detection_times_s", "outcomes")},
                         indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
