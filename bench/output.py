"""Where a benchmark writes: its plot goes beside its JSON unless `--plot` says otherwise."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

PLOT_HELP = "default: the --json path with .png ('' for none)"


def draw_beside(draw: Callable[[Any, Path], object], result: Any, json_path: str | Path,
                plot: str | Path | None) -> Path | None:
    """Draw a benchmark's plot (`draw(result, path)`) where `--plot` says, none where it is '', or by default
    beside its JSON, so that a run written elsewhere (a quick check into /tmp) leaves bench/results' plot as it
    was; the path drawn, or None."""
    where = Path(json_path).with_suffix(".png") if plot is None else Path(plot) if str(plot) else None
    if where is not None:
        draw(result, where)
    return where
