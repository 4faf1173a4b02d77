"""The warm worker: a process of the job interpreter that runs tasks (receiver.py).

Started by the peer as `python -m gpulayer.worker FD [--preload torch,mlx] [--link FD2]`, it talks
frames over the inherited socket FD; big buffers come and go as shared-memory descriptors on the
local link FD2 (shm.py). It needs only msgpack and cloudpickle (and cryptography, where it has it,
to take the connections handed over for a lease or an actor's direct calls), and it is the only
place where task data is ever unpickled. Its stdout and stderr are pipes that the peer streams back
to the submitter.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import socket
import sys
import time

from .. import lending, taskenv
from ..protocol import framing, messages
from ..transport import blocking, shm
from . import spawning
from .receiver import Receiver


def preload(names: list[str]) -> list[str]:
    """Import frameworks now so that tasks find them warm; returns those that imported."""
    done = []
    for name in names:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as exc:
            print(f"gpulayer worker: preloading {name} failed: {exc}", file=sys.stderr)
    return done


_PR_SET_CHILD_SUBREAPER = 36
_REAP_INTERVAL_S = 1.0


def become_subreaper() -> bool:
    """On Linux, make orphaned descendants of tasks re-parent to this worker (not to init), so that
    the peer's kill of the worker's tree finds them. False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class OrphanReaper:
    """Collects the exited orphans a subreaper adopts, which would otherwise stay zombies here.

    Between tasks, at most once a second, it reaps each zombie child that was already a zombie at
    the previous look: a zombie that a task's own code still means to wait for (a Popen it polls)
    is given a full interval, and a task boundary, first.
    """

    def __init__(self):
        self._path = f"/proc/{os.getpid()}/task/{os.getpid()}/children"  # orphans go to the main thread
        self._last = 0.0
        self._zombies: set[int] = set()

    def maybe_reap(self) -> None:
        now = time.monotonic()
        if now - self._last < _REAP_INTERVAL_S:
            return
        self._last = now
        try:
            with open(self._path) as f:
                children = [int(pid) for pid in f.read().split()]
        except (OSError, ValueError):
            return
        zombies = {pid for pid in children if _is_zombie(pid)}
        for pid in zombies & self._zombies:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        self._zombies = zombies


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("fd", type=int)
    parser.add_argument("--preload", default="")
    parser.add_argument("--link", type=int, default=-1)  # the local link for shared memory (shm.py)
    parser.add_argument("--keep-task-folders", action="store_true")  # the peer was given --workdir
    args = parser.parse_args(argv)
    link = socket.socket(fileno=args.link) if args.link >= 0 and shm.enabled() else None
    conn = blocking.BlockingConnection(socket.socket(fileno=args.fd), framing.max_message_bytes(), link, populate=True)
    reaper = OrphanReaper() if become_subreaper() else None
    spawning.install()
    loaded = preload([n for n in args.preload.split(",") if n])
    taskenv.open_clean_room(os.getcwd(), keep=args.keep_task_folders)
    conn.send({"t": messages.STATUS, "pid": os.getpid(), "preloaded": loaded, "fds": link is not None,
               "direct": link is not None and importlib.util.find_spec("cryptography") is not None})
    receiver = Receiver(conn, reaper.maybe_reap if reaper is not None else None)
    lending.install(receiver.peer.send)  # a thread of a task that waits on a future tells the peer
    receiver.serve_peer()


if __name__ == "__main__":
    main()
