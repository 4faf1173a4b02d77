"""`Trainer(profiler="simple")`: wall time per action, reported when a run ends."""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

_NOTHING = contextlib.nullcontext()


class SimpleProfiler:
    """Times the Trainer's actions (epochs, batches, validation, hooks' stages) with a wall clock.
    Device work is asynchronous: a batch's time is its host time, as in Lightning's SimpleProfiler."""

    def __init__(self):
        self.durations: dict[str, list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def profile(self, action: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.durations[action].append(time.perf_counter() - start)

    def summary(self) -> str:
        rows = sorted(((a, sum(d), len(d)) for a, d in self.durations.items()), key=lambda r: -r[1])
        width = max([len("Action")] + [len(a) for a, _, _ in rows])
        lines = ["Profiler report", f"{'Action':<{width}}  {'Mean (s)':>10}  {'Calls':>7}  {'Total (s)':>10}"]
        lines += [f"{a:<{width}}  {t / n:>10.5f}  {n:>7}  {t:>10.4f}" for a, t, n in rows]
        return "\n".join(lines)


class PassThroughProfiler:
    """No profiling: the Trainer's default."""

    def profile(self, action: str):
        return _NOTHING

    def summary(self) -> str:
        return ""


def resolve(profiler) -> SimpleProfiler | PassThroughProfiler:
    if profiler is None:
        return PassThroughProfiler()
    if profiler == "simple":
        return SimpleProfiler()
    if isinstance(profiler, (SimpleProfiler, PassThroughProfiler)):
        return profiler
    raise ValueError(f"profiler={profiler!r} is not supported by glt.Trainer; use None or 'simple'")
