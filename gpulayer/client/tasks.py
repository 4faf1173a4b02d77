"""A call on its way from the submitter, and its future: SubmittedTask (what the engine places,
retries and resolves), TaskFuture (what the caller holds), HeldResult (a result kept on its peer).
"""

from __future__ import annotations

import codecs
import sys
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import held, lending, serialization
from ..checks import login_user
from ..errors import GPULayerError, PeerLost, WaitCycle
from ..matching import Requirements
from ..protocol import messages
from .connection import PeerConnection, send_quietly

if TYPE_CHECKING:
    from .engine import Client

OUTPUT_KEEP = 1 << 20  # bytes of a task's stdout/stderr kept on its future


class TaskFuture(Future[Any]):
    """A task's future. `cancel()` also stops the task on its peer; `stdout`/`stderr` hold its output.

    Passed as an argument of another task, it stands for its value. With keep=True its result
    stays on the peer: `result()` fetches it (once), another task gets it from that peer, and
    `release()` (or dropping the future) frees it there (docs/data.md).
    """

    def __init__(self, task: SubmittedTask):
        super().__init__()
        self._task: SubmittedTask | None = task  # until it ends (then dropped: a result is freed with its future)
        self._keep = task.keep
        self._peer: str | None = None
        self.stdout = ""
        self.stderr = ""

    def _ended(self) -> None:
        """The task is over: keep what the future still shows of it, and let it go (no cycle holds the result)."""
        task, self._task = self._task, None
        if task is not None:
            self._peer = task.peer_name

    def result(self, timeout: float | None = None) -> Any:
        if lending.lender is not None and not self.done():  # in a task, on a peer: it waits (ADR 0014)
            value = self._wait_lent(timeout)
        else:
            value = super().result(timeout)
        return value.fetch(timeout) if isinstance(value, HeldResult) else value

    def _wait_lent(self, timeout: float | None) -> Any:
        """Wait with the slot of the task that waits lent to its peer; a wait that could never end raises."""
        task = self._task
        assert lending.lender is not None
        if task is not None and lending.lender.waits_on_itself(task.actor):
            raise WaitCycle(f"this actor ({task.actor}) runs one call at a time and would wait on a call to "
                            "itself, which can only start after this one ends: give it max_concurrency=2 or "
                            "more, or do not wait for the call's result here")
        with lending.lent():
            return super().result(timeout)

    @property
    def held(self) -> HeldResult | None:
        """Where the result is held (keep=True, once the task succeeded), else None."""
        if not self.done() or self.cancelled() or self.exception() is not None:
            return None
        value = super().result()
        return value if isinstance(value, HeldResult) else None

    def release(self) -> None:
        """Free the result held on the peer (keep=True); a value fetched already stays here."""
        where = self.held
        if where is not None:
            where.release()

    def __reduce__(self) -> tuple[Any, ...]:
        """As another task's argument (`held.collecting`): a held result by id, else the value. A
        pending value is a placeholder until the submitter pickles the arguments again."""
        if held.met(self):
            if self._keep is not None:
                return held.resolve, (self._keep,)
            ok = self.done() and not self.cancelled() and self.exception() is None
            return held.passthrough, (self.result() if ok else None,)
        return held.passthrough, (self.result(),)

    @property
    def peer(self) -> str | None:
        """The name of the peer that ran (or runs) the task."""
        task = self._task
        return task.peer_name if task is not None else self._peer

    def cancel(self) -> bool:
        task = self._task
        if not super().cancel():
            return False
        if task is not None:
            task.abandon()
            self._ended()
        return True


_MISSING = object()


class HeldResult:
    """A result held on its peer: fetched when asked for (once), released when its future goes."""

    def __init__(self, client: Client, conn: PeerConnection, result_id: str, size: int, future: TaskFuture):
        self.client = client
        self.peer_id, self.peer_name, self.addresses = conn.peer_id, conn.name, conn.addresses
        self.result_id = result_id
        self.size = size  # bytes held on the peer
        self.released = False
        self._value: Any = _MISSING
        self._lock = threading.Lock()
        # dropping the future releases it; the heartbeat sends the RELEASE (never from the collector's thread)
        self._finalizer = weakref.finalize(future, client.release_later, self.peer_id, result_id)

    def ref(self) -> dict[str, Any]:
        return messages.ref(self.result_id, self.peer_id, self.addresses)

    def fetch(self, timeout: float | None = None) -> Any:
        """The value, fetched from the peer the first time."""
        with self._lock:
            if self._value is _MISSING:
                if self.released:
                    raise GPULayerError("the result was released (future.release()) before it was fetched")
                try:
                    conn = self.client.connection_to(self.peer_id, self.addresses)
                except (OSError, GPULayerError) as exc:
                    raise PeerLost(f"the result is held on peer {self.peer_name}, which is lost: {exc}") from None
                task = FetchRequest(None, None, None, Requirements(), None, 0, "fetch", False,
                                    result_id=self.result_id)
                task.conn = conn
                conn.submit(task)
                self._value = task.future.result(timeout)
            return self._value

    def release(self) -> None:
        """Free it on its peer now."""
        with self._lock:
            if self.released:
                return
            self.released = True
        self._finalizer.detach()
        conn = self.client.pool.pooled(self.peer_id)
        if conn is not None:  # else the peer frees it when this submitter's connections are gone
            send_quietly(conn, messages.release(self.result_id))


@dataclass(eq=False)
class SubmittedTask:
    """One call on its way: where it is placed now, what failed before, how to resolve its future."""

    fn: bytes | None
    args: bytes | None
    buffers: list[Any] | None
    req: Requirements
    timeout: float | None
    retries: int
    name: str
    echo_output: bool
    env: dict[str, str] = field(default_factory=dict)
    keep: str | None = None  # the id its result is held under on its peer (keep=True)
    priority: int = 0  # its place in its peer's queue, higher first
    user: str = field(default_factory=login_user)  # whose quota of its peer's slots it counts in
    deps: list[TaskFuture] = field(default_factory=list)  # the futures among its arguments, kept until it ends
    future: TaskFuture = field(init=False)
    conn: PeerConnection | None = None
    task_id: int = 0
    excluded: dict[str, str] = field(default_factory=dict)  # peers it failed on, and why
    busy_delay: float = 0.0
    busy_rejections: int = 0
    queued: bool = False  # waiting in its peer's queue, which lets it be withdrawn (ADR 0011)
    withdrawing: str = ""  # the id of the free peer that a WITHDRAW took it back for
    decoders: dict[str, codecs.IncrementalDecoder] = field(default_factory=dict)
    done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.future = TaskFuture(self)

    @property
    def peer_name(self) -> str | None:
        return self.conn.name if self.conn is not None else None

    @property
    def actor(self) -> str | None:
        """The id of the actor that runs it (an actor's call), else None."""
        return None

    def message(self) -> tuple[messages.Outgoing, list[Any]]:
        assert self.fn is not None and self.args is not None
        return messages.submit(self.task_id, self.fn, self.args, self.req.to_wire(), self.timeout, self.name,
                               self.env, self.keep, [where.ref() for where in self.held_args()], self.priority,
                               self.user), \
            self.buffers or []

    def held_args(self) -> list[HeldResult]:
        """The held results among its arguments, each once, the largest first."""
        found = {where.result_id: where for f in self.deps if (where := f.held) is not None}
        return sorted(found.values(), key=lambda where: -where.size)

    def result_from(self, msg: dict[str, Any], buffers: list[Any]) -> Any:
        """The result that a RESULT carries: the task's return value."""
        return serialization.loads(msg["data"], buffers)

    def complete(self, result: Any = None, exc: BaseException | None = None) -> None:
        """Resolve the future exactly once; later outcomes are dropped."""
        with self._lock:
            if self.done:
                return
            self.done = True
        self.fn = self.args = self.buffers = None
        self.deps = []
        self.future._ended()
        if not self.future.set_running_or_notify_cancel():
            return
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)

    def accepted(self, queued: bool, started: bool) -> None:
        """The peer's ACCEPT: it waits in the peer's queue and may be withdrawn (`queued`), or (an actor's
        creation) it took its slot and its worker starts (`started`)."""
        self.queued = queued

    def abandon(self) -> None:
        """The future was cancelled: tell the peer and forget the task."""
        with self._lock:
            self.done = True
        if self.conn is not None:
            self.conn.cancel(self)

    def on_output(self, stream: str, data: bytes) -> None:
        decoder = self.decoders.setdefault(stream, codecs.getincrementaldecoder("utf-8")("replace"))
        text = decoder.decode(data)  # a character split across two LOG frames stays whole
        attr = "stdout" if stream == "out" else "stderr"
        setattr(self.future, attr, (getattr(self.future, attr) + text)[-OUTPUT_KEEP:])
        if self.echo_output:
            out = sys.stdout if stream == "out" else sys.stderr
            out.write(text)
            out.flush()


@dataclass(eq=False)
class FetchRequest(SubmittedTask):
    """A FETCH of a held result on its way; the RESULT resolves it with the value."""

    result_id: str = ""

    def message(self) -> tuple[messages.Outgoing, list[Any]]:
        return messages.fetch(self.task_id, self.result_id), []
