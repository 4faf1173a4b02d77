"""Warnings that anyone can cause, logged a line a kind per interval, with a count of the rest.

A connection refused before authentication or a local link of another user costs whoever causes
it nothing, so one line each would let any host of the LAN, or any account of this machine, fill
the peer's log and disk. Each kind (a short description, from a fixed set) is logged in full the
first time; what comes within the next interval is only counted, and `flush()` (the peer's
watchdog) logs that count once the interval is over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

QUIET_INTERVAL = 10.0  # seconds: at most one line a kind per interval


@dataclass
class _Window:
    start: float
    held_back: int = 0


class QuietLog:
    """At most one warning a kind per `interval`: the first in full, then the count of the rest."""

    def __init__(self, logger: logging.Logger, interval: float = QUIET_INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        self._log = logger
        self.interval = interval
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        """Log `msg % args` unless `kind` was logged within the interval; count it then."""
        window = self._windows.get(kind)
        if window is None:
            self._windows[kind] = _Window(self._clock())
            self._log.warning(msg, *args)
        else:
            window.held_back += 1

    def flush(self, final: bool = False) -> None:
        """Log the count of each kind whose interval is over (all of them if `final`), and forget quiet kinds."""
        now = self._clock()
        for kind, window in list(self._windows.items()):
            if now - window.start < self.interval and not final:
                continue
            if window.held_back:
                self._log.warning("%s: %d more in the last %.0f s (logged once per %.0f s)",
                                  kind, window.held_back, now - window.start, self.interval)
                self._windows[kind] = _Window(now)
            else:
                del self._windows[kind]
