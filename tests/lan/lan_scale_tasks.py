"""The functions the scale measurements run on peers (shipped by value: not installed on them).

A peer's speed is set, for these tests only, by LAN_SCALE_SLOWDOWN in its environment (a
worker inherits it): `work(seconds)` sleeps `seconds` times that factor, so a peer with 2
runs each task in twice the time. Sleeping, not spinning: many peers share two cores here.
Times are time.monotonic(), one clock for every namespace of this machine.
"""

from __future__ import annotations

import os
import time

SLOWDOWN_ENV = "LAN_SCALE_SLOWDOWN"


def trivial(x: int) -> int:
    return x


def pause(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def work(seconds: float) -> list:
    """[peer, worker pid, start, end] of `seconds` of work at this peer's speed."""
    start = time.monotonic()
    time.sleep(seconds * float(os.environ.get(SLOWDOWN_ENV, "1")))
    return [os.environ["GPULAYER_PEER_NAME"], os.getpid(), start, time.monotonic()]
