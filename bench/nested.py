"""What a task that runs tasks pays for lending its slot (ADR 0014), on one machine.

    python bench/nested.py [--calls 30] [--json bench/results/nested.json]

A local peer of one CPU slot and one of two (loopback, a fresh cluster key in a key file that their
tasks read): one task on each runs `--calls` trivial tasks one after another with gl.run, pinned to
its own peer, and times each call from inside. On one slot every call needs the slot that the
waiting task lends (the first one also starts the lent slot's worker; the later ones find it kept
as a spare); on two slots the second slot is free anyway. Figures from one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def trivial() -> int:
    return 1


def nested_calls(calls: int) -> list[float]:
    """In a task: seconds of each of `calls` gl.run calls to this task's own peer."""
    import gpulayer as gl

    here = os.environ["GPULAYER_PEER_NAME"]
    took = []
    for _ in range(calls):
        started = time.perf_counter()
        gl.run(trivial, peer=here, accelerator="cpu")
        took.append(time.perf_counter() - started)
    return took


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--json", default=str(RESULTS / "nested.json"))
    args = parser.parse_args(argv)
    import gpulayer as gl
    from gpulayer.demo import local_peer

    key = secrets.token_hex(16)
    result: dict = {"calls": args.calls, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="gpulayer-nested-") as config, ExitStack() as stack:
        (Path(config) / "gpulayer").mkdir()
        key_file = Path(config) / "gpulayer" / "key"
        key_file.write_text(key)
        key_file.chmod(0o600)
        env = {**os.environ, "GPULAYER_KEY": key, "XDG_CONFIG_HOME": config, "GPULAYER_CACHE": "0",
               "GPULAYER_INTERFACES": "127.0.0.1"}
        for slots in (1, 2):
            stack.enter_context(local_peer(env, name=f"nested-{slots}", extra_args=("--concurrency", str(slots))))
        gl.configure(key=key.encode(), interfaces=["127.0.0.1"], echo_output=False)
        for slots in (1, 2):
            took = gl.run(nested_calls, args.calls, peer=f"nested-{slots}", accelerator="cpu")
            result[f"{slots}_slot"] = {"first_ms": round(took[0] * 1e3, 2),
                                       "later_p50_ms": round(statistics.median(took[1:]) * 1e3, 3),
                                       "later_max_ms": round(max(took[1:]) * 1e3, 3)}
        gl.api.shutdown()
    print(json.dumps(result, indent=2))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
