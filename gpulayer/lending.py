"""A task that blocks on a GPUlayer future lends its slot to its peer until it resumes (ADR 0014).

A worker installs a `Lender` (`install`) with a way to tell its peer; the submitter's waits
(`TaskFuture.result`, a map's full window) go through `lent()`, which does nothing outside a worker,
and is not reached for a future that is done. The first of a task's threads to block sends WAIT
`blocked: true` on the worker's link, the last to resume `blocked: false`: one small message each
way, only when a task really waits. This module is a leaf: the worker and the submitter import it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any
from .protocol import messages



class Lender:
    """The worker's side of lending: counts the threads of the running task that wait on a future."""

    def __init__(self, send: Callable[[dict[str, Any]], None]):
        self.send = send  # tells the peer; serialised with the worker's other messages on the link
        self.actor: str | None = None  # the id of the actor this worker is, if it is one
        self.concurrency = 1  # ... and how many of its calls may run at once
        self._lock = threading.Lock()
        self._waiting = 0  # threads of the running task that wait
        self._round = 0  # bumped when a task ends with threads still waiting: their resumption is stale

    def blocked(self) -> int:
        """A thread starts waiting; returns the round to pass to `resumed`."""
        with self._lock:
            self._waiting += 1
            first = self._waiting == 1
            current = self._round
        if first:
            self._tell(True)
        return current

    def resumed(self, round_: int) -> None:
        """A thread that waited since `round_` goes on."""
        with self._lock:
            if round_ != self._round or not self._waiting:
                return
            self._waiting -= 1
            last = not self._waiting
        if last:
            self._tell(False)

    def _tell(self, blocked: bool) -> None:
        try:
            self.send({"t": messages.WAIT, "blocked": blocked})
        except OSError:  # the peer is gone: the worker ends at its next read of the link
            pass

    def task_ended(self) -> None:
        """The task ended (the peer forgets its lending with it): threads it left waiting count no more."""
        if self._waiting:
            with self._lock:
                self._waiting = 0
                self._round += 1

    def waits_on_itself(self, actor_id: str | None) -> bool:
        """Whether waiting on a call to actor `actor_id` could never end: it is this actor, which runs one
        call at a time, and this one waits."""
        return actor_id is not None and actor_id == self.actor and self.concurrency == 1


lender: Lender | None = None  # set in a worker process only


def install(send: Callable[[dict[str, Any]], None]) -> Lender:
    """Make this process a worker that lends its slot while a task waits."""
    global lender
    lender = Lender(send)
    return lender


@contextlib.contextmanager
def lent() -> Iterator[None]:
    """Around a wait on a future: in a worker, the task's slot is lent to the peer meanwhile."""
    current = lender
    if current is None:
        yield
        return
    round_ = current.blocked()
    try:
        yield
    finally:
        current.resumed(round_)
