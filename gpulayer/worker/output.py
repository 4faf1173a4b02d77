"""Where what a task prints goes, chosen in one place (`OutputRouter`) by the kind of its stream.

A task that came on the peer's link writes to the worker's stdout and stderr: pipes that the peer
streams back to its submitter. A call on an actor's direct connection sends what its thread writes
to sys.stdout and sys.stderr to its submitter, as LOG (`RoutedOutput`: other threads still write to
the peer's pipes). A leased task does too, and what it writes to file descriptors 1 and 2 (C code,
`os.write`, child processes) goes to its submitter as well (`DescriptorOutput`): a lease runs one
task at a time, so what comes there is that task's.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..protocol import messages
from .running import flush_output
from .streams import LEASE, Stream

_output = threading.local()  # .sink: where the current thread's stdout and stderr go, while it runs for a submitter
_NOWHERE = contextlib.nullcontext()


class OutputRouter:
    """The output path of each kind of stream (see the module's docstring)."""

    def __init__(self) -> None:
        self._descriptors: DescriptorOutput | None = None  # a lease's, while it lasts

    def open(self, stream: Stream) -> None:
        """A submitter's connection begins: from now on its tasks' output can go to it."""
        if not isinstance(sys.stdout, RoutedOutput):
            sys.stdout, sys.stderr = RoutedOutput(sys.stdout, "out"), RoutedOutput(sys.stderr, "err")
        if stream.kind == LEASE:
            self._descriptors = DescriptorOutput(stream, lambda: min(stream.running, default=None))

    def close(self) -> None:
        """A lease ends: descriptors 1 and 2 are the peer's pipes again."""
        if self._descriptors is not None:
            self._descriptors.close()
            self._descriptors = None

    def to(self, stream: Stream, task_id: Any) -> contextlib.AbstractContextManager[None]:
        """While task `task_id` of `stream` runs, what its thread prints goes where its stream says."""
        return self._to_submitter(stream, task_id) if stream.handed_over else _NOWHERE

    @contextlib.contextmanager
    def _to_submitter(self, stream: Stream, task_id: Any) -> Iterator[None]:
        before = self._descriptors.drain if self._descriptors is not None else None

        def send(name: str, text: str) -> None:
            if before is not None:  # what came to the descriptors first goes first
                before()
            stream.send(messages.log(task_id, name, text.encode("utf-8", "replace")))

        _output.sink = send
        try:
            yield
        finally:
            _output.sink = None

    def drain(self) -> None:
        """Pass on what a leased task wrote to its descriptors so far (before its answer)."""
        if self._descriptors is not None:
            self._descriptors.drain()


class RoutedOutput:
    """sys.stdout or sys.stderr of a worker with submitters' connections: what a thread running one of
    their tasks writes goes to that task's submitter as LOG; anything else to the original stream (the
    peer's pipe)."""

    def __init__(self, original: Any, name: str):
        self._original = original
        self._name = name

    def write(self, text: str) -> int:
        sink = getattr(_output, "sink", None)
        if sink is None:
            return int(self._original.write(text))
        sink(self._name, text)
        return len(text)

    def flush(self) -> None:
        self._original.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


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


