"""The progress bar of `gl.map`: tqdm's, on stderr, drawn only on a terminal unless asked for."""

from __future__ import annotations

import sys
import threading
from typing import IO


class MapProgressBar:
    """Tasks done out of `total`, with their rate and the time left; advanced from the futures' threads."""

    def __init__(self, total: int, label: str = "", enabled: bool | None = None, stream: IO[str] | None = None):
        from tqdm import tqdm  # here, not at import: only gl.map draws a bar

        stream = stream or sys.stderr
        enabled = stream.isatty() if enabled is None else enabled
        self._bar = tqdm(total=total, desc=label or None, unit="task", file=stream, disable=not enabled,
                         dynamic_ncols=True, mininterval=0.1)
        self._lock = threading.Lock()  # futures complete on several threads

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self._bar.update(n)

    def close(self) -> None:
        with self._lock:
            self._bar.close()
