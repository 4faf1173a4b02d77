"""The progress bar of `gl.map`: one line on stderr, drawn only on a terminal."""

from __future__ import annotations

import sys
import threading
import time


class MapProgressBar:
    """Tasks done out of `total` and their rate, redrawn at most every 0.1 s (and at the last one)."""

    def __init__(self, total: int, label: str = "", enabled: bool | None = None, stream=None):
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0
        self._started = time.monotonic()
        self._drawn = 0.0
        self._lock = threading.Lock()

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self.enabled and (now - self._drawn > 0.1 or self.done == self.total):
                self._drawn = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        rate = self.done / max(now - self._started, 1e-9)
        self.stream.write(f"\r{self.label}[{'#' * filled}{'.' * (width - filled)}] "
                          f"{self.done}/{self.total} {rate:.1f}/s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
