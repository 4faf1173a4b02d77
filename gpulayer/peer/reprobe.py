"""Looking again in the job interpreter (issue 26, item 5): a task that asks for a framework, a
distribution or a capability that the last probe did not find makes the peer probe again, so that
a `pip install` into the job interpreter needs no restart of the peer.

Bounded, so that a stream of tasks asking for what is not there cannot keep the peer probing: one
probe at a time (tasks that ask meanwhile wait for it), and a name is looked for again only when
the interpreter's sys.path changed since the last probe (a few stat calls tell: an install
changes its site folder) or REPROBE_GAP_S after it was last looked for. A probe of distributions
imports nothing (a fraction of a second); one for torch, mlx or a capability imports them (seconds).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Collection

from ..resources import detect
from ..resources.model import PROBED_FRAMEWORKS, Resources

log = logging.getLogger("gpulayer.peer")

REPROBE_GAP_S = 5.0  # a missing name is looked for again at most this often, sys.path unchanged
MAX_NAMES = 1024  # names remembered at most


def fingerprint(paths: Collection[str]) -> tuple[int | None, ...]:
    """The modification times of `paths` (None for one that is missing): an install changes one."""
    times: list[int | None] = []
    for path in paths:
        try:
            times.append(os.stat(path).st_mtime_ns)
        except OSError:
            times.append(None)
    return tuple(times)


class Reprobe:
    """When to probe the job interpreter again, and the probe; used on the peer's event loop."""

    def __init__(self, python: str):
        self.python = python
        self._looked: dict[str, float] = {}  # name -> when a probe last looked for it (monotonic)
        self._paths: list[str] = []  # the interpreter's sys.path at the last probe
        self._stamp: tuple[int | None, ...] | None = None  # their fingerprint then; None: no probe yet
        self._lock = asyncio.Lock()

    def due(self, missing: Collection[str]) -> bool:
        """Whether a probe may find something of `missing`: none ran since sys.path changed, or one of
        them was not looked for in the last REPROBE_GAP_S."""
        if self._stamp is None or fingerprint(self._paths) != self._stamp:
            return True
        now = time.monotonic()
        return any(now - self._looked.get(name, -REPROBE_GAP_S) >= REPROBE_GAP_S for name in missing)

    async def look(self, resources: Resources, missing: Collection[str]) -> Resources | None:
        """`resources` as a new probe finds them, if one is still due once the running one ended; else
        None. Frameworks are probed (imported) only when `missing` has one of them or a capability."""
        async with self._lock:
            if not self.due(missing):
                return None
            if len(self._looked) + len(missing) > MAX_NAMES:
                self._looked.clear()  # forgotten names are only looked for again sooner
            self._looked.update(dict.fromkeys(list(missing)[:MAX_NAMES], time.monotonic()))
            frameworks = any(name.split(".")[0] in PROBED_FRAMEWORKS for name in missing)  # torch, torch.cuda
            log.info("probing the job interpreter %s again for %s", self.python, ", ".join(sorted(missing)[:8]))
            found, paths = await asyncio.get_running_loop().run_in_executor(
                None, detect.look_again, resources, self.python, frameworks)
            if paths:
                self._paths, self._stamp = paths, fingerprint(paths)
            return found
