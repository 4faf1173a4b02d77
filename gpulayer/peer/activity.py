"""What a peer has been doing, for its STATUS reply: the tasks running now, a bounded ring of the
tasks that finished, and the recent refusals (REJECTs) with their reasons.

The scheduler calls `started` and `ended`; the server calls `refused`. Times are the peer's
wall clock (time.time()); the STATUS reply carries the peer's `now` so that a submitter can place
them on its own clock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any
from ..protocol.messages import RESULT


FINISHED_KEEP = 300  # finished tasks kept
REFUSALS_KEEP = 50  # refusals kept
TEXT_MAX = 200  # characters kept of a name
MESSAGE_MAX = 1000  # characters kept of a refusal's message


def host_of(address: str) -> str:
    """The host part of "host:port"."""
    return address.rpartition(":")[0] or address


def _text(value: Any, limit: int = TEXT_MAX) -> str:
    return "".join(ch for ch in str(value)[:limit] if ch.isprintable())


def _task(name: str, address: str, device: str, start: float, end: float | None = None,
          outcome: str | None = None) -> dict[str, Any]:
    """A running or finished task as STATUS gives it, from what `Activity` keeps."""
    task = {"name": _text(name), "submitter": host_of(address), "device": device, "start": start}
    return task if end is None else {**task, "end": end, "outcome": _text(outcome)}


class Activity:
    """Running tasks (by key), finished ones and refusals, each bounded.

    A task costs little here: its fields are kept as they came (cut to TEXT_MAX) and made
    printable only when a STATUS asks for them."""

    def __init__(self) -> None:
        self._running: dict[int, tuple[str, str, str, float]] = {}
        self.finished: deque[tuple[str, str, str, float, float, str]] = deque(maxlen=FINISHED_KEEP)
        self.refusals: deque[dict[str, Any]] = deque(maxlen=REFUSALS_KEEP)

    def started(self, key: object, name: Any, address: str, device: str) -> None:
        """A task from the submitter at `address` ("host:port") started on `device`; `key` is the task
        itself (its id() keys it until it ends)."""
        self._running[id(key)] = (str(name or "?")[:TEXT_MAX], address, device, time.time())

    def ended(self, key: object, reply: Mapping[str, object]) -> None:
        """A task is answered with `reply`: if it had started, it is finished, "ok" or with its error code."""
        task = self._running.pop(id(key), None)
        if task is not None:
            outcome = "ok" if reply.get("t") == RESULT else str(reply.get("code", "error"))[:TEXT_MAX]
            self.finished.append((*task, time.time(), outcome))

    def refused(self, address: str, code: str, message: str) -> None:
        """A REJECT sent to the submitter at `address`."""
        self.refusals.append({"submitter": host_of(address), "code": code, "message": _text(message, MESSAGE_MAX),
                              "t": time.time()})

    def snapshot(self) -> dict[str, Any]:
        """The STATUS fields: running, finished (oldest first), refusals (oldest first) and now."""
        return {"running": [_task(*t) for t in self._running.values()], "finished": [_task(*t) for t in self.finished],
                "refusals": list(self.refusals), "now": time.time()}
