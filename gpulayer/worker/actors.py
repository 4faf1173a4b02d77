"""A worker that became an actor: its instance, and what runs the calls that come for it.

Calls come on the worker's link from its peer, and on direct connections: submitters' connections
that the peer handed over to this worker (ADR 0012), so that a call goes from the submitter to here
and its answer straight back. The receiver (receiver.py) reads each of them in a thread of its own;
calls start in the order they arrive on it, at most `max_concurrency` at a time over all of them
(with one, in the thread that read it, so no hand-over to another thread).
"""

from __future__ import annotations

import threading
from typing import Any

from .. import lending, serialization
from ..protocol import messages
from .running import invoke, run_call
from .streams import DIRECT, Stream


class ActorRunner:
    """The actor's instance, how many of its calls may run at once, and its count of direct calls."""

    def __init__(self, instance: object, conc: int):
        self.instance = instance
        self.turns = threading.Semaphore(conc)
        self.pool = None
        if conc > 1:  # imported here: a function worker, and an actor of one call at a time, need no pool
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(conc, thread_name_prefix="gpulayer-actor")
        self._lock = threading.Lock()
        self._served_direct = 0  # calls answered on direct connections
        self._reported = 0  # ... as the peer was last told

    @classmethod
    def create(cls, msg: messages.Message, buffers: list[Any]) -> tuple[ActorRunner | None, messages.Message]:
        """The actor that an ACTOR message describes, and the answer to it (its ERROR: no actor)."""
        def construct() -> Any:
            made = serialization.loads(msg["cls"])
            return getattr(made, "__gpulayer_class__", made)  # an @gl.remote class pickled by reference

        instance, failed = invoke(msg.get("id"), construct, msg["args"], buffers)
        if failed is not None:
            return None, failed
        conc = msg.get("conc", 1)
        if lending.lender is not None:  # a call that waits on a future lends the actor's slot (ADR 0014)
            lending.lender.actor, lending.lender.concurrency = msg.get("actor"), conc
        return cls(instance, conc), {"t": messages.RESULT, "id": msg.get("id"), "data": serialization.dumps(None)[0]}

    def check(self, stream: Stream, msg: messages.Message) -> str | None:
        """What is wrong with a CALL on a direct connection (the peer checked those it sends), or None."""
        return messages.check_call(msg) if stream.kind == DIRECT else None

    def run(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> tuple[messages.Message, list[Any]]:
        name: str = msg["method"]
        return run_call(msg.get("id"), lambda: self._method(name), msg["args"], buffers)

    def _method(self, name: str) -> Any:
        method = getattr(self.instance, name)
        if not callable(method):
            raise TypeError(f"{type(self.instance).__qualname__}.{name} is a {type(method).__name__}, not a method")
        return method

    def timeout_reason(self, msg: messages.Message, timeout: float) -> str:
        return (f"its call of {msg.get('method')} ran past its timeout of {timeout:g} s; its worker was killed "
                "(a running method cannot be stopped otherwise)")

    def served_direct(self) -> None:
        """A call was answered on a direct connection."""
        with self._lock:
            self._served_direct += 1

    def report(self, peer: Stream) -> None:
        """Tell the peer how many calls were answered on direct connections (for its STATUS), if that
        changed since the last time: once no other call waits here."""
        with self._lock:
            served = self._served_direct
            if served == self._reported:
                return
            self._reported = served
        peer.send({"t": messages.STATUS, "served": served})
