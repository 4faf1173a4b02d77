"""The one receiver of a worker process: every stream that tasks come on, served the same way.

A stream is the worker's link to its peer, or a submitter's connection that the peer handed over
with its channel's keys and counters: a lease's (ADR 0013) on a function worker, a direct one
(ADR 0012) on an actor's worker. Every stream is read by one thread (the main thread serves the
peer's link, and a lease, whose tasks run there as the peer's own do); what it reads goes through
one dispatch table, and its tasks through one queue: before a task starts, every message that has
already arrived is read, so that a CANCEL sent while an earlier task ran is known before the task
it names. One watchdog ends a task that runs past its timeout, and one output router sends what a
task prints where its stream's kind says (output.py). What runs a task is the worker's runner: a
function worker's (`FunctionRunner`) or, once it became one, an actor's (actors.py).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .. import taskenv
from ..errors import ProtocolError
from ..protocol import messages
from ..transport import blocking
from .actors import ActorRunner
from .leases import Lease
from .output import OutputRouter
from .running import FunctionCache, flush_output, run_task, serve_owner
from .streams import DIRECT, LEASE, PEER, Stream, take_connection

# What each kind of stream serves: anything else on a submitter's connection ends it with an ERROR
# (on the peer's link it is ignored: a late acknowledgement or cancel).
SERVES = {
    PEER: frozenset({messages.SUBMIT, messages.CALL, messages.CANCEL, messages.BYE, messages.ACTOR, messages.LEASE, messages.DIRECT,
                     messages.LEASE_END}),
    LEASE: frozenset({messages.SUBMIT, messages.CANCEL, messages.PING, messages.BYE}),
    DIRECT: frozenset({messages.CALL, messages.CANCEL, messages.PING, messages.BYE}),
}


KILL_WAIT_S = 10.0  # how long a function worker that asked to be killed waits for it before it exits itself


class Runner(Protocol):
    """What runs the tasks of a worker: a function worker's (`FunctionRunner`), or an actor's."""

    @property
    def turns(self) -> threading.Semaphore | None:
        """How many tasks may run at once over all streams (None: one stream runs them)."""

    @property
    def pool(self) -> Any:
        """An executor that runs them off their stream's thread, or None."""

    def check(self, stream: Stream, msg: messages.Message) -> str | None:
        """What keeps a task that came on `stream` from running (answered bad-request), or None."""

    def run(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> tuple[messages.Message, list[Any]]:
        """Run one task: its RESULT or ERROR message and the buffers that go with it."""

    def timeout_reason(self, msg: messages.Message, timeout: float) -> str:
        """Why the task ended when it ran past its timeout (what its submitter reads)."""


class FunctionRunner:
    """A function worker's: one SUBMIT at a time, in the task's environment (taskenv.CleanRoom)."""

    turns = None
    pool = None

    def __init__(self, receiver: Receiver):
        self.functions = FunctionCache()
        self._receiver = receiver

    def check(self, stream: Stream, msg: messages.Message) -> str | None:
        return messages.check_submit(msg, leased=True) if stream.kind == LEASE else None

    def run(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> tuple[messages.Message, list[Any]]:
        lease = self._receiver.lease
        if lease is None:  # the peer's: the submitter it names may be another than the last
            serve_owner(msg, self.functions)
            env = msg.get("env")
        else:  # the slot's device variables, under the task's own
            env = {**lease.env, **(msg.get("env") or {})}
        if env:
            os.environ.update(env)
        try:
            return run_task(msg, buffers, self.functions)
        finally:  # what the task changed of the worker's state is put back (taskenv.CleanRoom)
            taskenv.restore_clean_room()

    def timeout_reason(self, msg: messages.Message, timeout: float) -> str:
        return f"the task ran past its timeout of {timeout:g} s; its worker was killed and replaced"


class Watchdog:
    """The one timer of a worker: a task on a submitter's connection that runs past its timeout is
    stopped (`expire`), as the peer stops the tasks it sends (their timeouts are the peer's). One
    thread, started with the first timeout, for every stream."""

    def __init__(self, expire: Callable[[Stream, Any, str, str], bool]):
        self._expire = expire
        self._cond = threading.Condition()
        self._due: dict[int, tuple[float, Stream, Any, str]] = {}  # key -> (deadline, stream, task id, reason)
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, stream: Stream, msg: messages.Message, runner: Runner) -> int | None:
        """Watch the task `msg` of `stream` if it has a timeout; the key to `disarm` it with, or None."""
        timeout = msg.get("timeout")
        if timeout is None:
            return None
        key = next(self._keys)
        with self._cond:
            self._due[key] = (time.monotonic() + timeout, stream, msg.get("id"), runner.timeout_reason(msg, timeout))
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="gpulayer-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        return key

    def disarm(self, key: int | None) -> None:
        if key is not None:
            with self._cond:
                self._due.pop(key, None)

    def _watch(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    soonest = min(self._due.items(), key=lambda item: item[1][0], default=None)
                    if soonest is not None and soonest[1][0] <= now:
                        del self._due[soonest[0]]
                        break
                    self._cond.wait(None if soonest is None else soonest[1][0] - now)
            _, stream, task_id, reason = soonest[1]
            self._expire(stream, task_id, "timeout", reason)


ACKNOWLEDGED = "the peer acknowledged the lease's end"
BYE = {PEER: "the peer said bye", LEASE: "the submitter said bye", DIRECT: "the submitter said bye"}
UNEXPECTED_ON = {LEASE: "a leased connection", DIRECT: "a direct connection to an actor"}


class Receiver:
    """The streams of one worker process, their one dispatch table, watchdog and output router.

    It starts as a function worker on the peer's link. A LEASE makes it serve a submitter's
    connection for a while (a handed-over stream plus the lease's idle policy, leases.py), on the
    main thread, while a thread of its own takes the peer's messages; an ACTOR makes it an actor's
    worker for good (actors.py), and each DIRECT after that a stream read by a thread of its own.
    """

    def __init__(self, conn: blocking.BlockingConnection, between_tasks: Callable[[], None] | None = None):
        self.peer = Stream(conn, PEER)
        self.tasks = FunctionRunner(self)
        self.runner: Runner = self.tasks
        self.lease: Lease | None = None
        self.actor: ActorRunner | None = None
        self.direct: list[Stream] = []  # an actor's direct connections
        self.output = OutputRouter()
        self.watchdog = Watchdog(self.stop)
        self._between_tasks = between_tasks  # on the peer's link of a function worker, while it waits
        self._lock = threading.Lock()  # guards the streams' cancelled, started and running, `direct`, `_stopping`
        self._stopping = False  # a task is being stopped (`stop`): this worker ends, no task starts any more
        self._became_actor = False
        self._handlers: dict[str, Callable[[Stream, messages.Message, list[Any]], str | None]] = {
            messages.SUBMIT: self._on_task, messages.CALL: self._on_task, messages.CANCEL: self._on_cancel,
            messages.PING: self._on_ping, messages.BYE: self._on_bye, messages.ACTOR: self._on_actor, messages.LEASE: self._on_lease,
            messages.DIRECT: self._on_direct, messages.LEASE_END: self._on_lease_end,
        }

    def serve_peer(self) -> None:
        """Serve the peer's link until it says BYE or closes. An actor's worker then exits at once,
        without waiting for calls still running in threads: the peer ends this process anyway."""
        self.serve(self.peer)
        if self._became_actor:
            flush_output()
            os._exit(0)

    def serve(self, stream: Stream) -> str:
        """Take what comes on `stream` and run its tasks, until its end; returns why it ended."""
        try:
            while True:
                if not stream.queue:  # nothing waits: the replies kept back go now
                    stream.flush()
                    reason = self._idle(stream) or self._take(stream, *stream.recv())
                else:
                    reason = self._start_next(stream)
                if reason is not None:
                    return reason
        except (ConnectionError, OSError, ProtocolError) as exc:
            return f"the connection ended: {exc}"

    def _idle(self, stream: Stream) -> str | None:
        """Before a wait for the next message: a lease's idle policy, an actor's count of direct calls,
        a function worker's orphans reaped; why the stream ends, or None."""
        if stream.kind == LEASE:
            assert self.lease is not None
            return self.lease.wait()
        if stream.kind == DIRECT:
            assert self.actor is not None
            self.actor.report(self.peer)
        elif self._between_tasks is not None and self.lease is None and self.actor is None:
            self._between_tasks()
        return None

    def _take(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> str | None:
        """One message, through the dispatch table; why the stream ends, or None."""
        kind = msg["t"]
        if kind in SERVES[stream.kind]:
            return self._handlers[kind](stream, msg, buffers)
        if not stream.handed_over:
            return None
        stream.send(messages.error("protocol", f"unexpected message type {messages.printable(repr(kind), 40)} "
                                           f"on {UNEXPECTED_ON[stream.kind]}"))
        return "the submitter sent an unexpected message"

    def _start_next(self, stream: Stream) -> str | None:
        """Start the first task of the queue once a turn is free (an actor's max_concurrency), the messages
        that arrived meanwhile read first."""
        turns = self.runner.turns
        if turns is not None:
            turns.acquire()
        try:
            while stream.arrived():
                reason = self._take(stream, *stream.recv())
                if reason is not None:
                    return reason
            if not stream.queue:
                return None
            msg, buffers = stream.queue.popleft()
            if self.runner.pool is None:
                return self._run(stream, msg, buffers)
            self.runner.pool.submit(self._run_in_turn, stream, msg, buffers)
            turns = None  # the pool's thread gives it back
            return None
        finally:
            if turns is not None:
                turns.release()

    def _run_in_turn(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> None:
        try:
            self._run(stream, msg, buffers)
        finally:
            assert self.runner.turns is not None
            self.runner.turns.release()

    def _run(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> str | None:
        """Run one task of `stream` and answer it there, or answer why it may not start. When the stream
        ends before it (this worker stops; a lease's peer wants the slot back) it does not start and is
        not answered (LEASE_END tells a lease's submitter so); returns why."""
        task_id: Any = msg.get("id")
        with self._lock:
            if self._stopping:
                return "this worker is stopped"
            if self.lease is not None and stream is self.lease.stream and self.lease.ending:
                return self.lease.ending
            refusal = self._refusal(stream, task_id) if stream.cancelled or stream.kind == LEASE else None
            if refusal is None:
                if stream.cancelled:
                    stream.cancelled = {i for i in stream.cancelled if i > task_id}
                stream.started = task_id
                stream.running.add(task_id)
        if refusal is not None:  # every task on a submitter's connection gets one answer: it counts them
            if stream.handed_over:
                stream.send(refusal)
            return None
        if not stream.handed_over:  # the peer's: it times its tasks, and their output is its pipes'
            reply, out = self.runner.run(stream, msg, buffers)
        else:
            began = time.monotonic()
            watched = self.watchdog.arm(stream, msg, self.runner)
            try:
                with self.output.to(stream, task_id):
                    reply, out = self.runner.run(stream, msg, buffers)
            finally:
                self.watchdog.disarm(watched)
            self.output.drain()  # what it wrote to its descriptors goes before its answer
            if stream.kind == LEASE:  # how long it ran: the submitter paces its leases by it
                reply["ran"] = round(time.monotonic() - began, 6)
        with self._lock:
            stream.running.discard(task_id)
            if self._stopping:  # `stop` answered it
                return "this worker is stopped"
        del msg, buffers
        self._answer(stream, reply, out)
        return None

    def _refusal(self, stream: Stream, task_id: Any) -> messages.Outgoing | None:
        """The answer to a task that may not start (cancelled; on a lease, an id not above the last), or
        None; with the lock held."""
        if task_id in stream.cancelled:
            stream.cancelled.discard(task_id)
            return messages.error("cancelled", "cancelled by the submitter before it started", task_id)
        if stream.kind == LEASE and task_id <= stream.started:
            return messages.error("bad-request", f"task id {task_id} is not above the last one", task_id)
        return None

    def _answer(self, stream: Stream, reply: messages.Message, out: list[Any]) -> None:
        """Send a task's answer on its stream: a lease's now, before its next task starts, so that a task
        that ends this worker, or a lost connection, leaves its submitter no answered task unknown (ADR
        0013); a direct call's held back while calls that came with it run (one write for all of them)."""
        if stream.kind == LEASE:
            assert self.lease is not None
            self.lease.served += 1
            stream.send(reply, out)
        elif stream.kind == DIRECT:
            assert self.actor is not None
            more = self.runner.pool is None and stream.arrived()
            stream.send(reply, out, hold=more)
            self.actor.served_direct()
            if not more:
                self.actor.report(self.peer)  # after the reply: its caller waits for nothing else
        else:
            stream.send(reply, out)

    def stop(self, stream: Stream, task_id: Any, code: str, reason: str) -> bool:
        """End the running task `task_id` of `stream` with `code` (a timeout; a cancel of a leased task):
        answer it, tell the other submitters' connections and the peer, and end this worker (a function
        worker waits for its peer to kill its process tree, as the peer does for its own tasks); False
        if that task does not run. No other task starts once this began."""
        with self._lock:
            if self._stopping or task_id is None or task_id not in stream.running:
                return False
            self._stopping = True
            others = [s for s in self.direct if s is not stream]
        self.output.drain()
        stream.tell({**messages.error(code, reason, task_id), "ends": True})  # nothing more is sent to it
        if self.lease is not None:
            self.lease.stream.tell({"t": messages.LEASE_END, "reason": reason})
        for other in others:  # no id: the connection is about to close, and this is why
            other.tell(messages.error("actor-died", f"the actor was stopped: {reason}"))
        self.peer.tell({"t": messages.BYE, "reason": reason, **({} if self._became_actor else {"kill": True})})
        flush_output()
        if not self._became_actor:
            time.sleep(KILL_WAIT_S)
        os._exit(3)

    # ---- the dispatch table ----------------------------------------------------------------------------

    def _on_task(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> str | None:
        """A SUBMIT or a CALL: queued, or answered bad-request."""
        problem = self.runner.check(stream, msg)
        if problem is None:
            stream.queue.append((msg, buffers))
        else:
            task_id = msg.get("id")
            stream.send(messages.error("bad-request", problem, task_id if isinstance(task_id, int) else None))
        return None

    def _on_cancel(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> str | None:
        """A task cancelled before it starts does not run. A leased task that runs, cancelled through its
        peer, ends this worker (`stop`); any other that runs is the peer's to stop. On a function worker's
        link the peer cancels only a lease's tasks: one that comes after the lease is nothing (the ids of
        the peer's own tasks are their submitters', and another's may be the same)."""
        task_id = msg.get("id")
        if stream is self.peer and self.actor is None:
            if self.lease is None:
                return None
            stream = self.lease.stream
            if self.stop(stream, task_id, "cancelled", "cancelled by the submitter; its worker was killed and "
                                                       "replaced"):
                return None
        with self._lock:
            stream.cancel(task_id)
        return None

    def _on_ping(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> str | None:
        stream.send({"t": messages.PONG, "id": msg.get("id")})
        return None

    def _on_bye(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> str | None:
        return BYE[stream.kind]

    def _on_actor(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> str | None:
        """This worker becomes the actor (its environment was set when the peer started it for it) and
        runs no task after it: the peer starts a fresh worker for the slot when the actor ends."""
        self._became_actor = True
        actor, reply = ActorRunner.create(msg, buffers)
        del buffers
        self.peer.send(reply)
        if actor is None:
            return "the actor could not be made"
        self.actor = self.runner = actor
        self.peer.peeks = True  # calls come behind calls: a CANCEL among them is read before the call it names
        return None

    def _on_direct(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> str | None:
        """An actor's: a submitter's connection that the peer handed over, read by a thread of its own."""
        conn = take_connection(self.peer.conn, msg) if self.actor is not None else None
        if conn is None:
            return None
        direct = Stream(conn, DIRECT)
        with self._lock:
            self.output.open(direct)
            self.direct.append(direct)
        threading.Thread(target=self._serve_direct, args=(direct,), name="gpulayer-direct", daemon=True).start()
        return None

    def _serve_direct(self, stream: Stream) -> None:
        try:
            self.serve(stream)
        finally:
            with self._lock:
                self.direct.remove(stream)
            stream.conn.close()

    def _on_lease(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> str | None:
        """The peer lent this function worker to a submitter's connection: serve it (on this, the main
        thread) while a thread takes the peer's messages, until the lease ends; then tell both."""
        serve_owner(msg, self.tasks.functions)
        conn = take_connection(self.peer.conn, msg)
        if conn is None:
            self.peer.tell({"t": messages.STATUS, "lease_end": "the connection did not arrive", "served": 0})
            return None
        lease = self.lease = Lease(Stream(conn, LEASE), msg)
        self.output.open(lease.stream)
        watcher = threading.Thread(target=self._watch_peer, args=(lease,), name="gpulayer-lease-link", daemon=True)
        watcher.start()
        lease.keep_alive()
        reason = self.serve(lease.stream)
        lease.done.set()
        if self._stopping:  # `stop` answered its task, ended the lease, and ends this worker
            threading.Event().wait()
        self.output.close()
        lease.end(reason)
        with self._lock:
            lease.finished = True
        self.peer.tell({"t": messages.STATUS, "lease_end": messages.printable(reason, 200), "served": lease.served})
        watcher.join()
        self.lease = None
        return BYE[PEER] if lease.bye else None

    def _watch_peer(self, lease: Lease) -> None:
        """The peer's messages while a lease lasts (a cancel, its wish for the slot, its acknowledgement
        of the lease's end), read by a thread of their own: the main thread runs the lease's tasks."""
        reason = self.serve(self.peer)
        if reason != ACKNOWLEDGED:  # the peer stops, or is gone: the worker exits after the lease
            lease.bye = True
            lease.ending = lease.ending or ("the peer is stopping" if reason == BYE[PEER] else "the peer is gone")

    def _on_lease_end(self, stream: Stream, msg: messages.Message, buffers: list[Any]) -> str | None:
        """From the peer: it wants the lent slot back (the lease ends before its next task), or it
        acknowledges the lease's end (a late one, once no lease lasts, is nothing)."""
        lease = self.lease
        if lease is None:
            return None
        with self._lock:
            if lease.finished:
                return ACKNOWLEDGED
        lease.ending = lease.ending or "the peer needs the slot for another submitter"
        return None
