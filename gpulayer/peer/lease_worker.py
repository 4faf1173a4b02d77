"""A warm worker lent to one submitter: it runs the tasks that come on that submitter's own connection.

The peer hands the connection over with its channel's keys and counters, as for an actor's direct
calls (ADR 0012), and the worker runs the tasks sent on it one at a time, in order, answering each
there as it ends, before the next starts: one hop each way instead of two (ADR 0013). The lease ends
when no task came for `idle` seconds, when the peer wants the slot back (a queued task could use it,
or the peer stops: looked at before each task starts), or when the submitter closes the connection.
The worker then says LEASE_END to the submitter (a task it sent and got no answer for did not start:
it places it again), tells its peer, and serves its peer again.

What the tasks write to file descriptors 1 and 2 (C code, `os.write`, child processes) goes to the
submitter too, as LOG of the task that runs (`DescriptorOutput`), as the peer's pipes do for its own
tasks.

A task's timeout, and a cancel of the task that runs, end this worker: it answers the submitter and
asks its peer to kill its process tree and start a fresh worker, as the peer does for its own tasks.
Messages on the local link come to a thread of their own meanwhile (a cancel, the peer's wish to end
the lease), since the main thread runs the tasks.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

from .. import lending
from ..errors import ProtocolError
from ..protocol import messages
from ..taskenv import task_environment
from ..transport import blocking
from .actor_worker import Stream, output_to, route_output, take_connection
from .running import FunctionCache, flush_output, run_task

POLL_S = 0.05  # while idle, how often the lease looks whether the peer wants the slot back
DRAIN_S = 2.0  # after LEASE_END, how long the submitter is given to close its side
KILL_WAIT_S = 10.0  # how long a worker that asked to be killed waits for it before it exits itself


class Lease:
    """One lease: the submitter's connection, and what the peer said with it."""

    def __init__(self, link: blocking.BlockingConnection, conn: blocking.BlockingConnection, msg: dict):
        self.link = link
        self.stream = Stream(conn, direct=True)
        self.env = dict(msg.get("env") or {})  # the slot's device variables, under each task's own
        self.idle = float(msg.get("idle") or 1.0)
        self.beat = float(msg.get("beat") or 1.0)  # seconds between signs of life while a task runs or arrives
        self._done = threading.Event()
        self.served = 0
        self.ending = ""  # why the lease ends, once the peer said so
        self.bye = False  # the peer said BYE (it stops): the worker exits after the lease
        self._lock = threading.Lock()  # guards _running, _started, _cancelled and _stopping
        self._link_lock = threading.Lock()
        self._running = None  # the id of the task that runs now
        self._receiving = False  # a message is being read: a big one takes long over a slow link
        self._started = 0  # the highest task id started (ids rise on a connection)
        self._cancelled: set[int] = set()  # ids cancelled before they started
        self._stopping = False  # a timeout or a cancel ends this worker (`_stop_worker`): no task starts any more
        self._finished = False  # the peer was told that the lease ended

    def serve(self, functions: FunctionCache) -> None:
        self.output = DescriptorOutput(self.stream, lambda: self._running)
        watcher = threading.Thread(target=self._watch_link, name="gpulayer-lease-link", daemon=True)
        watcher.start()
        threading.Thread(target=self._keep_alive, name="gpulayer-lease-beat", daemon=True).start()
        with lending.sending(self._tell_peer):  # on the link under its lock while the lease lasts
            reason = self._run_tasks(functions)
        self._done.set()
        if self._stopping:  # `_stop_worker` answered the task, ended the lease, and ends this worker
            threading.Event().wait()
        self.output.close()
        self._end(reason)
        watcher.join()

    # ---- the submitter's connection (main thread) ----------------------------------------------------

    def _run_tasks(self, functions: FunctionCache) -> str:
        """Run the tasks that come, until the lease ends; returns why it ends."""
        conn = self.stream.conn
        last = time.monotonic()
        try:
            while True:
                if not conn.reader.messages:
                    if self.ending:
                        return self.ending
                    if not select.select([conn.sock], [], [], POLL_S)[0]:
                        if time.monotonic() - last >= self.idle:
                            return f"no task came for {self.idle:g} s"
                        continue
                self._receiving = True
                msg, buffers = conn.recv()
                self._receiving = False
                last = time.monotonic()
                kind = msg["t"]
                if kind == messages.SUBMIT:
                    if not self._run(msg, buffers, functions):
                        return self.ending or "this worker is stopped"
                elif kind == messages.CANCEL:
                    self._cancel(msg.get("id"))
                elif kind == messages.PING:
                    self.stream.send({"t": messages.PONG, "id": msg.get("id")})
                elif kind == messages.BYE:
                    return "the submitter said bye"
                else:
                    self.stream.send(messages.error(
                        "protocol", f"unexpected message type {messages.printable(repr(kind), 40)} on a leased connection"))
                    return "the submitter sent an unexpected message"
                del msg, buffers
        except (ConnectionError, OSError, ProtocolError) as exc:
            return f"the connection ended: {exc}"

    def _run(self, msg: dict, buffers: list, functions: FunctionCache) -> bool:
        """Run one SUBMIT and answer it, or refuse it with an answer; False when the lease ends before it
        (it did not start, and is not answered: LEASE_END tells the submitter so)."""
        task_id = msg.get("id")
        problem = messages.check_submit(msg, leased=True)
        if problem is not None:
            self.stream.send(messages.error("bad-request", problem, task_id if isinstance(task_id, int) else None))
            return True
        with self._lock:
            if self.ending or self._stopping:  # the peer wants the slot back, or stops; or this worker ends
                return False
            refusal = self._refusal(task_id)
            if refusal is None:
                self._cancelled = {i for i in self._cancelled if i > task_id}
                self._running = self._started = task_id
        if refusal is not None:  # every SUBMIT gets one answer: the submitter counts them (client/connection.py)
            self.stream.send(refusal)
            return True
        started = time.monotonic()
        with task_environment({**self.env, **(msg.get("env") or {})}), self._watched(msg), \
                output_to(self.stream, task_id, self.output.drain):
            reply, out = run_task(msg, buffers, functions)
        self.output.drain()  # what it wrote to its descriptors goes before its answer
        with self._lock:
            self._running = None
            if self._stopping:  # `_stop_worker` answered it (timeout, cancelled)
                return False
        del msg, buffers
        reply["ran"] = round(time.monotonic() - started, 6)
        self.served += 1
        # sent now, before the next task starts: a task that ends this worker, or a lost connection, leaves
        # the submitter no answered task unknown (ADR 0013)
        self.stream.send(reply, out)
        return True

    def _refusal(self, task_id: int) -> dict | None:
        """The answer to a SUBMIT that may not start (cancelled, or an id not above the last), or None;
        with the lock held."""
        if task_id in self._cancelled:
            return messages.error("cancelled", "cancelled by the submitter before it started", task_id)
        if task_id <= self._started:
            return messages.error("bad-request", f"task id {task_id} is not above the last one", task_id)
        return None

    def _keep_alive(self) -> None:
        """While a task runs or arrives, say every `beat` seconds that this worker is alive (a PONG without
        id): the submitter ends a lease whose tasks wait in silence (its path or its host is down), and a
        big argument that crosses a slow link is not silence."""
        while not self._done.wait(self.beat):
            if self._running is not None or self._receiving:
                try:
                    self.stream.send({"t": messages.PONG, "id": None})
                except OSError:
                    return

    def _cancel(self, task_id) -> None:
        """A task cancelled before it started does not run (a running one is the peer's to stop)."""
        if isinstance(task_id, int) and not isinstance(task_id, bool):
            with self._lock:
                if task_id > self._started:
                    self._cancelled.add(task_id)

    @contextlib.contextmanager
    def _watched(self, msg: dict) -> Iterator[None]:
        timeout = msg.get("timeout")
        if timeout is None:
            yield
            return
        reason = (f"the task ran past its timeout of {timeout:g} s; its worker was killed and replaced")
        timer = threading.Timer(timeout, self._stop_worker, (msg.get("id"), "timeout", reason))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _end(self, reason: str) -> None:
        """Say LEASE_END to the submitter, let it close its side, and tell the peer."""
        conn = self.stream.conn
        try:
            self.stream.send({"t": messages.LEASE_END, "reason": reason})
            conn.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + DRAIN_S  # what it sent meanwhile is dropped: it places those again
            while (left := deadline - time.monotonic()) > 0 and select.select([conn.sock], [], [], left)[0] and \
                    conn.sock.recv(1 << 16):
                pass  # bounded: a submitter that goes on sending does not keep the slot
        except OSError:
            pass
        conn.close()
        with self._lock:
            self._finished = True
        self._tell_peer({"t": messages.STATUS, "lease_end": messages.printable(reason, 200), "served": self.served})

    # ---- the peer's link (a thread of its own) ---------------------------------------------------------

    def _watch_link(self) -> None:
        """Take the peer's messages while the lease lasts: a cancel, its wish to end the lease, its ack."""
        try:
            while True:
                msg, _ = self.link.recv()
                kind = msg["t"]
                if kind == messages.CANCEL:
                    self._cancel_running(msg.get("id"))
                elif kind == messages.BYE:  # the peer stops: the worker exits after the lease
                    self.bye = True
                    self.ending = self.ending or "the peer is stopping"
                    return
                elif kind == messages.LEASE_END:  # the peer wants the slot back, or acknowledges the end
                    self.ending = self.ending or "the peer needs the slot for another submitter"
                    with self._lock:
                        if self._finished:
                            return
        except (ConnectionError, OSError, ProtocolError):
            self.bye = True
            self.ending = "the peer is gone"

    def _cancel_running(self, task_id) -> None:
        if not self._stop_worker(task_id, "cancelled", "cancelled by the submitter; its worker was killed and "
                                                       "replaced"):
            self._cancel(task_id)

    def _stop_worker(self, task_id, code: str, reason: str) -> bool:
        """End the running task `task_id` with `code`, end the lease, and have the peer kill this worker's
        tree; False if that task does not run (no other starts once this began)."""
        with self._lock:
            if self._stopping or task_id is None or task_id != self._running:
                return False
            self._stopping = True
        try:
            self.output.drain()
            self.stream.send(messages.error(code, reason, task_id))
            self.stream.send({"t": messages.LEASE_END, "reason": reason})
        except OSError:
            pass
        self._tell_peer({"t": messages.BYE, "reason": reason, "kill": True})
        flush_output()
        time.sleep(KILL_WAIT_S)
        os._exit(3)

    def _tell_peer(self, msg: dict) -> None:
        try:
            with self._link_lock:
                self.link.send(msg)
        except OSError:
            pass


class DescriptorOutput:
    """File descriptors 1 and 2 of a leased worker, while the lease lasts: pipes whose bytes go to the
    submitter as LOG of the task that runs (before its answer: `drain`), and on to the peer's pipes
    (where they went before) while none runs, or after the lease, for as long as a child process that
    a task left running holds them."""

    def __init__(self, stream: Stream, running: Callable[[], int | None]):
        self._stream = stream
        self._running = running  # the id of the task that runs now, or None
        self._lock = threading.Lock()  # one passes bytes on at a time, to the task that runs then
        self._originals: dict[int, int] = {}  # descriptor -> a copy of what it was (the peer's pipe)
        self._pipes: dict[int, tuple[str, int]] = {}  # read end -> (stream, descriptor)
        self._given_back = False  # descriptors 1 and 2 are the peer's pipes again (`close`)
        for fd, name in ((1, "out"), (2, "err")):
            read, write = os.pipe()
            os.set_blocking(read, False)
            self._originals[fd] = os.dup(fd)
            os.dup2(write, fd)
            os.close(write)
            self._pipes[read] = (name, fd)
        threading.Thread(target=self._pump, name="gpulayer-lease-output", daemon=True).start()

    def _pump(self) -> None:
        """Pass bytes on as they come, until no one holds the pipes any more."""
        while True:
            ready = select.select(list(self._pipes), [], [])[0]
            with self._lock:
                for read in ready:
                    if not self._pass_on(read):
                        del self._pipes[read]
                        os.close(read)
                if not self._pipes:
                    if self._given_back:
                        self._close_originals()
                    return

    def drain(self) -> None:
        """Pass on what was written so far."""
        with self._lock:
            for read in select.select(list(self._pipes), [], [], 0)[0]:
                self._pass_on(read)

    def _pass_on(self, read: int) -> bool:
        """Pass on what the pipe holds: to the submitter as LOG of the task that runs, or to the peer's
        pipe when none runs (or the submitter's connection is gone). False at the pipe's end."""
        name, fd = self._pipes[read]
        task_id = self._running()
        while True:
            try:
                data = os.read(read, 1 << 16)
            except BlockingIOError:
                return True
            if not data:
                return False
            if task_id is None or not self._to_submitter(task_id, name, data):
                _write_all(self._originals[fd], data)

    def _to_submitter(self, task_id: int, name: str, data: bytes) -> bool:
        try:
            self._stream.send(messages.log(task_id, name, data))
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Give descriptors 1 and 2 back (the pipes end once the children that hold them end)."""
        flush_output()
        with self._lock:
            for fd, original in self._originals.items():
                os.dup2(original, fd)
            self._given_back = True
            if not self._pipes:  # a task closed both descriptors: the pump ended already
                self._close_originals()

    def _close_originals(self) -> None:
        for original in self._originals.values():
            os.close(original)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


def serve_lease(link: blocking.BlockingConnection, msg: dict, functions: FunctionCache) -> bool:
    """Serve the lease that a LEASE message on the link begins; False if the worker should exit after it."""
    conn = take_connection(link, msg)
    if conn is None:
        link.send({"t": messages.STATUS, "lease_end": "the connection did not arrive", "served": 0})
        return True
    route_output()
    lease = Lease(link, conn, msg)
    lease.serve(functions)
    return not lease.bye
