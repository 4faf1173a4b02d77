"""Latency, transfer bandwidth and matmul TFLOPS of every peer on the LAN; the same as `gpulayer bench`.

    python bench/lan_bench.py [--peer NAME] [--quick] [--json bench/results/lan_bench.json] [--plot lan_bench.png]
"""

import sys

from gpulayer.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
