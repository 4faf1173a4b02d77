"""The peer's handle on its worker processes (the warm ones, one per slot, and those started for one task
or an actor), driven from its event loop: start, send, hand a connection over, kill the whole tree."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from ..errors import ProtocolError, WorkerDied
from ..protocol import framing, messages
from ..security import KEY_ENV
from ..transport import shm
from ..transport.channel import AsyncChannel

if TYPE_CHECKING:
    from .slots import Slot

log = logging.getLogger("gpulayer.peer")
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def job_pythonpath(python: str) -> str | None:
    """PYTHONPATH that lets another job interpreter import gpulayer without the peer's site-packages.

    None when `python` is this interpreter's own environment: its `sys.prefix` is the peer's. A venv
    made with symlinks resolves to the same executable as its base, and is still another
    environment, so the executables are not compared. A private folder holds one link to this
    gpulayer package; the job interpreter still needs msgpack and cloudpickle of its own.
    """
    if python == sys.executable or _prefix(python) == sys.prefix:
        return None
    folder = Path(tempfile.mkdtemp(prefix="gpulayer-path-"))
    (folder / "gpulayer").symlink_to(_PACKAGE_DIR, target_is_directory=True)
    return str(folder)


def _prefix(python: str) -> str | None:
    """The `sys.prefix` of interpreter `python` (what a venv changes), or None where it does not run."""
    try:
        found = subprocess.run([python, "-I", "-c", "import sys; print(sys.prefix)"], capture_output=True,
                               text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found.stdout.strip() if found.returncode == 0 else None


def tcp_socketpair() -> tuple[socket.socket, socket.socket]:
    """Two connected loopback TCP sockets.

    Used in place of socket.socketpair(): on Linux, loopback TCP carries large buffers about
    five times faster than a Unix socket pair (measured 2.6 against 0.5 GB/s here).
    """
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname())
        while True:  # ours is already connected, so it is first in the queue or soon there
            theirs, address = listener.accept()
            if address == ours.getsockname():
                break
            theirs.close()  # someone else's connection
    for sock in (ours, theirs):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ours, theirs


# What a worker reports, on the peer's event loop.
OnReply = Callable[["Worker", dict[str, Any], list[Any]], None]  # the task's RESULT or ERROR
OnOutput = Callable[["Worker", str, bytes], None]  # a piece of its stdout ("out") or stderr ("err")
OnExit = Callable[["Worker", "int | None"], None]  # it died unexpectedly, with this exit code
OnWait = Callable[["Worker", bool], None]  # its task blocks on a future (True), or goes on (False)


class Worker:
    """One worker process bound to a slot: its warm worker, or one started for one task (`extra_env`
    on top of the slot's environment, its own preloads).

    `send` hands it a task; its reply arrives through `on_reply(worker, msg, buffers)`, its
    output through `on_output(worker, stream, data)`, an unexpected death through
    `on_exit(worker, exit_code)`, and its task's waits on futures through `on_wait(worker, blocked)`.
    """

    def __init__(self, slot: Slot, python: str, preload: list[str], on_reply: OnReply, on_output: OnOutput,
                 on_exit: OnExit, on_wait: OnWait, pythonpath: str | None = None,
                 extra_env: dict[str, str] | None = None, cwd: str | None = None, keep_folders: bool = False):
        self.slot = slot
        self.python = python
        self.preload = preload
        self.on_reply, self.on_output, self.on_exit, self.on_wait = on_reply, on_output, on_exit, on_wait
        self.pythonpath = pythonpath
        self.extra_env = extra_env or {}
        self.cwd = cwd
        self.keep_folders = keep_folders  # task folders stay when their task ends (the peer was given --workdir)
        self.ready = False
        self.pid: int | None = None
        self._retired = False
        self._proc: asyncio.subprocess.Process | None = None
        self._channel: AsyncChannel | None = None
        self._pipes: dict[int, str] = {}
        self._loop = asyncio.get_running_loop()
        self._started: asyncio.Future[messages.Message] = self._loop.create_future()
        self._link: socket.socket | None = None  # the local link for shared memory (shm.py)
        self._fds = False  # whether the worker takes segments on it
        self.direct = False  # whether it takes connections handed over to it (an actor's; ADR 0012)
        self.last_words = ""  # why it is about to exit, when it said so (an actor's call past its timeout)

    async def start(self, timeout: float) -> None:
        """Spawn the process and wait for its ready message (after its preloads)."""
        parent, child = tcp_socketpair()
        self._link, link = shm.link_pair() if shm.enabled() else (None, None)
        if self._link is not None:
            self._link.setblocking(False)  # the event loop's end: a full link sends inline instead
        passed = (child.fileno(),) if link is None else (child.fileno(), link.fileno())
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        env = worker_env({**os.environ, **self.slot.env, **self.extra_env, "PYTHONUNBUFFERED": "1"})
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self.pythonpath, env.get("PYTHONPATH")) if p)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                self.python, "-m", "gpulayer.worker", str(child.fileno()), "--preload", ",".join(self.preload),
                *(["--link", str(link.fileno())] if link is not None else []),
                *(["--keep-task-folders"] if self.keep_folders else []),
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, pass_fds=passed,
                env=env, cwd=self.cwd, start_new_session=True,
            )
        except OSError:
            for fd in (out_r, err_r):
                os.close(fd)
            parent.close()
            raise
        finally:
            child.close()
            if link is not None:
                link.close()
            os.close(out_w)
            os.close(err_w)
        self.pid = self._proc.pid
        self._channel = AsyncChannel(parent, framing.max_message_bytes(), self._on_message, self._on_channel_closed)
        for fd, stream in ((out_r, "out"), (err_r, "err")):
            os.set_blocking(fd, False)
            self._pipes[fd] = stream
            self._loop.add_reader(fd, self._read_output, fd)
        try:
            await asyncio.wait_for(asyncio.shield(self._started), timeout)
        except (ConnectionError, asyncio.TimeoutError) as exc:
            code = await self.kill()
            raise WorkerDied(f"worker for slot {self.slot.index} did not start ({type(exc).__name__}, "
                             f"{describe_exit(code)}); does {self.python} have msgpack and cloudpickle?") from None
        self.ready = True
        log.debug("worker %s ready on %s", self.pid, self.slot.device)

    def send(self, msg: messages.Outgoing, buffers: messages.Buffers = ()) -> None:
        """Hand the worker a message; segments among `buffers` go by descriptor when it takes them."""
        assert self._channel is not None, "the worker has not started"
        self._channel.write(msg, shm.send_over(self._link if self._fds else None, msg, buffers, copy=False))

    def hand_over(self, sock: socket.socket, keys: tuple[bytes, bytes], counters: tuple[int, int],
                  msg: messages.Message) -> bool:
        """Give the worker a submitter's connection with its channel's state (ADR 0012, 0013): the
        descriptor on the local link, then `msg` (a DIRECT or a LEASE) with the keys and counters."""
        assert self._channel is not None and self._link is not None
        try:
            shm.send_socket(self._link, sock)
        except OSError as exc:  # the connection closes with our copy: its submitter goes through the peer
            log.warning("could not hand a connection to worker %s: %s", self.pid, exc)
            return False
        self._channel.write({**msg, "keys": list(keys), "counters": list(counters)})
        return True

    def _on_message(self, msg: messages.Message, buffers: list[Any]) -> None:
        if not self._started.done():
            self._fds = self._link is not None and msg.get("fds") is True
            self.direct = self._fds and msg.get("direct") is True
            self._started.set_result(msg)
        elif msg["t"] == messages.BYE:
            self.last_words = messages.printable(msg.get("reason"), 500)
            if msg.get("kill") is True:  # a leased worker ended its task (timeout, cancel): kill its tree
                self.on_reply(self, msg, buffers)
        elif msg["t"] == messages.STATUS:  # an actor's count of its direct calls, or a lease's end
            self.on_reply(self, msg, buffers)
        elif msg["t"] in (messages.RESULT, messages.ERROR):
            self.drain_output()
            try:
                buffers = shm.receive_with(self._link, msg, buffers)
            except shm.ShmError as exc:
                failed = messages.error("worker-died", f"the worker's reply did not arrive whole: {exc}", msg.get("id"))
                msg, buffers = dict(failed), []
            self.on_reply(self, msg, buffers)
        elif msg["t"] == messages.WAIT:
            self.on_wait(self, msg.get("blocked") is True)

    def _on_channel_closed(self, reason: str, error: ProtocolError | None) -> None:
        self.ready = False
        if not self._started.done():
            self._started.set_exception(ConnectionError(reason))
        elif not self._retired:
            self._retired = True
            asyncio.ensure_future(self._report_exit())

    async def _report_exit(self) -> None:
        code = await self.wait_exit(5.0)
        if code is not None and self.pid is not None:
            _signal_group(self.pid, signal.SIGKILL)  # what its task left in its process group
        self.close()
        self.on_exit(self, code)

    def drain_output(self) -> None:
        """Forward what the process has written so far (call before sending its result)."""
        for fd in list(self._pipes):
            self._read_output(fd, until_empty=True)

    def _read_output(self, fd: int, until_empty: bool = False) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._close_pipe(fd)
                return
            self.on_output(self, self._pipes[fd], data)
            if not until_empty:
                return

    def _close_pipe(self, fd: int) -> None:
        if self._pipes.pop(fd, None) is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    async def wait_exit(self, timeout: float) -> int | None:
        if self._proc is None:
            return None
        try:
            return await asyncio.wait_for(self._proc.wait(), timeout)
        except asyncio.TimeoutError:
            return None

    async def kill(self) -> int | None:
        """Kill the process and every descendant of it; return its exit code. No on_exit follows.

        Descendants that left the worker's process group (setsid, start_new_session) are found
        through the process tree: see `kill_tree`.
        """
        self._retired = True
        self.ready = False
        if self._proc is not None and self._proc.returncode is None:
            await kill_tree(self._proc.pid)
        code = await self.wait_exit(10.0)
        self.close()
        return code

    async def stop(self) -> None:
        """Ask the process to exit; kill it if it lingers."""
        self._retired = True
        if self._channel is not None and not self._channel.closed:
            self._channel.write({"t": messages.BYE})
        if await self.wait_exit(2.0) is None:
            await self.kill()
        self.close()

    def close(self) -> None:
        self.ready = False
        self.drain_output()
        if self._channel is not None:
            self._channel.close()
        if self._link is not None:
            self._link.close()


def worker_env(env: dict[str, str]) -> dict[str, str]:
    """`env` without the cluster key: GPULAYER_KEY, and any other variable that holds the same value."""
    key = env.pop(KEY_ENV, "").strip()
    return {name: value for name, value in env.items() if not key or value.strip() != key}


_FREEZE_ROUNDS = 5


async def kill_tree(pid: int) -> None:
    """SIGKILL process `pid`, its process group and all its descendants, wherever their group.

    Everything is stopped (SIGSTOP) first, the tree walked again until no new process shows up,
    and only then killed, so that nothing forks or is re-parented between the walk and the kill.
    A descendant whose parent exited before this is re-parented away (to init) and escapes,
    unless the worker made itself a child subreaper (Linux; gpulayer.worker does).
    """
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    _signal_group(pid, signal.SIGSTOP)
    seen: dict[int, psutil.Process] = {}
    try:
        for _ in range(_FREEZE_ROUNDS):
            try:
                found = [p for p in root.children(recursive=True) if p.pid not in seen]
            except psutil.NoSuchProcess:
                break
            if not found:
                break
            for proc in found:
                seen[proc.pid] = proc
                _signal(proc, signal.SIGSTOP)
            await asyncio.sleep(0.005)  # let a fork under way finish, so that the next walk sees its child
    finally:  # even if this is cancelled: nothing stays stopped
        for proc in seen.values():
            _signal(proc, signal.SIGKILL)
        _signal_group(pid, signal.SIGKILL)


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)  # psutil refuses a pid that was reused since the walk
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = " (killed: out of memory?)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"
