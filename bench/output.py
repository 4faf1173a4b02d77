"""Where a benchmark writes: its plot goes beside its JSON unless `--plot` says otherwise."""

from __future__ import annotations

from pathlib import Path

PLOT_HELP = "default: the --json path with .png ('' for none)"


def plot_beside(json_path: str | Path, plot: str | Path | None) -> Path | None:
    """Where a benchmark draws its plot: `--plot` (None where it is ''), or by default beside its JSON, so that
    a run written elsewhere (a quick check into /tmp) leaves bench/results' plot as it was."""
    if plot is None:
        return Path(json_path).with_suffix(".png")
    return Path(plot) if str(plot) else None
