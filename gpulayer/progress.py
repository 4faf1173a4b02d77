"""Progress bars: tqdm's, on stderr, drawn only on a terminal unless asked for (gl.map's tasks, a job's bytes)."""

from __future__ import annotations

import sys
import threading
from typing import IO, Any

TRANSFER_DELAY_S = 0.5  # a job's upload or fetch shows its bar (on a terminal) only once it has taken this long


class ProgressBar:
    """Work done out of `total`, with its rate and the time left; advanced from any thread. `unit="B"` counts
    bytes, shown scaled (MB, GB). With `enabled` None the bar is drawn only if `stream` is a terminal, and then
    only after `delay` seconds (a quick transfer leaves no bar); True draws it at once, False never. A bar
    not drawn costs nothing (tqdm is not even imported)."""

    def __init__(self, total: int | None, label: str = "", unit: str = "task", enabled: bool | None = None,
                 stream: IO[str] | None = None, delay: float = 0.0):
        stream = stream or sys.stderr
        if enabled is None:
            enabled = stream.isatty()
        else:
            delay = 0.0
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label or None, unit=unit, unit_scale=unit == "B", file=stream,
                             dynamic_ncols=True, mininterval=0.1, delay=delay)
        self._lock = threading.Lock()  # futures complete on several threads

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def reach(self, done: int, total: int | None) -> None:
        """Set how much of how much is done (a fetch learns its total from its first message)."""
        if self._bar is not None:
            with self._lock:
                self._bar.total = total
                self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.close()
