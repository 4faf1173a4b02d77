"""The functions the LAN tests run on peers (shipped by value: this file is not installed on them).

Times are time.monotonic(), one clock for every namespace of this machine, so that intervals
measured in workers, agents and the test compare directly.
"""

from __future__ import annotations

import os
import time
import uuid


def where(_item=None) -> str:
    return os.environ["GPULAYER_PEER_NAME"]


def square(x: int) -> int:
    return x * x


def echo(x):
    return x


def length(blob) -> int:
    return len(blob)


def blob(mb: float) -> bytes:
    return bytes(int(mb * (1 << 20)))


def blob_size(mb: float) -> int:
    """Through a result of `mb` MiB (see op_run's `measure`)."""
    return int(mb * (1 << 20))


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return os.environ["GPULAYER_PEER_NAME"]


def square_where(x: int, pause: float = 0.0) -> list:
    """[x, x*x, peer, worker pid, start, end]: enough to check results, spread and slot use."""
    start = time.monotonic()
    if pause:
        time.sleep(pause)
    return [x, x * x, os.environ["GPULAYER_PEER_NAME"], os.getpid(), start, time.monotonic()]


def marked(x: int, seconds: float, folder: str) -> list:
    """Sleep, leaving a start and an end marker per run: which runs began, and which completed.

    Returns [x, x*x, peer, run token]; the token names this run's markers.
    """
    token = uuid.uuid4().hex[:10]
    peer = os.environ["GPULAYER_PEER_NAME"]
    base = os.path.join(folder, f"{x}.{peer}.{token}")
    open(base + ".start", "w").close()
    time.sleep(seconds)
    open(base + ".end", "w").close()
    return [x, x * x, peer, token]
