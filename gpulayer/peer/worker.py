"""The warm worker: a process of the job interpreter that runs tasks one at a time.

Started by the peer as `python -m gpulayer.peer.worker FD [--preload torch,mlx] [--link FD2]`, it
talks frames over the inherited socket FD; big buffers come and go as shared-memory descriptors
on the local link FD2 (shm.py). It needs only msgpack and cloudpickle (and cryptography, where it
has it, to take an actor's direct connections: actor_worker.py), and it is the only place where
task data is ever unpickled. Its stdout and stderr are pipes that the peer
streams back to the submitter.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import socket
import sys
import threading
import time
import types

from .. import held, lending, remote_exceptions, serialization, shm, taskenv, wire
from . import spawning

_FN_CACHE_SIZE = 128


class FunctionCache:
    """Unpickled functions by their pickle, so that a repeated function is loaded once.

    A function shipped by value has globals of its own, and a module of the user's shipped by value
    is a module of its own (no import on this side holds either): each task starts with both as
    they were unpickled, so that one task's `global x; x = ...` or `mymodule.x = ...` is not the
    next one's. A mutable value changed in place stays changed (docs/scheduling.md, "Clean workers").
    """

    def __init__(self):
        self._fns: dict[bytes, tuple[object, list[tuple[dict, dict]]]] = {}

    def load(self, data: bytes):
        cached = self._fns.get(data)
        if cached is None:
            fn = serialization.loads(data)
            fn = getattr(fn, "__gpulayer_function__", fn)  # a @gl.remote object pickled by reference
            if not callable(fn):
                raise TypeError(f"the task's function is a {type(fn).__name__}, not a callable")
            if len(self._fns) >= _FN_CACHE_SIZE:
                self._fns.pop(next(iter(self._fns)))
            cached = self._fns[data] = (fn, _shipped_namespaces(fn))
        fn, namespaces = cached
        for namespace, unpickled in namespaces:
            namespace.clear()
            namespace.update(unpickled)
        return fn

    def clear(self) -> None:
        self._fns.clear()


def serve_owner(msg: dict, functions: FunctionCache) -> None:
    """Before a task or a lease of the submitter that the peer names in `msg` ("owner"): when it is another
    than the last, nothing that this worker keeps of the others is left for its code to read (pooled
    segments are zeroed or let go of, cached functions forgotten). What their tasks left in the
    process itself is not wiped: tasks on one peer are not isolated (docs/security.md)."""
    if shm.POOL.serve(str(msg.get("owner"))):
        functions.clear()


def _shipped_namespaces(fn) -> list[tuple[dict, dict]]:
    """(namespace, a copy of it) for the globals of a function shipped by value and the modules shipped
    by value among them; none for a function of an imported module."""
    namespace = getattr(fn, "__globals__", None)
    if namespace is None or namespace is getattr(sys.modules.get(getattr(fn, "__module__", "")), "__dict__", None):
        return []
    modules = [vars(value) for value in namespace.values()
               if isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is not value]
    return [(ns, dict(ns)) for ns in (namespace, *modules)]


def run_task(msg: dict, buffers: list, functions: FunctionCache) -> tuple[dict, list]:
    """Run one SUBMIT; return the RESULT or ERROR message and its buffers. A result buffer that is the
    whole of one of the task's own argument segments goes back in it, with no copy (a task keeps
    nothing after it ends; an actor may, so its results are always copies)."""
    own, values = held_arguments(msg, buffers)
    with held.provided(values):
        reply, out = _run(msg.get("id"), lambda: functions.load(msg["fn"]), msg["args"], own)
    if lending.lender is not None:
        lending.lender.task_ended()
    return reply, shm.reuse(out, own)


def held_arguments(msg: dict, buffers: list) -> tuple[list, dict]:
    """The task's own buffers, and the held results among its arguments by id: (pickle, buffers).

    The peer sends a held result's buffers after the task's own ("ab" of them), in the order of "refs".
    They are read-only here: on one host they may be the held result's own memory, which a task must
    not change under the tasks after it (arrays rebuilt on them are read-only, as Ray's are)."""
    start = msg.get("ab", len(buffers))
    values = {}
    for result_id, data, count in msg.get("refs") or ():
        values[result_id] = (data, [memoryview(b).toreadonly() for b in buffers[start:start + count]])
        start += count
    return buffers[:msg.get("ab", len(buffers))], values


def _invoke(task_id, target, args: bytes, buffers: list) -> tuple[object, dict | None]:
    """target()(*args, **kwargs) from the pickled (args, kwargs): (its result, None), or (None, ERROR)."""
    try:
        fn = target()
        args, kwargs = serialization.loads(args, buffers)
        result = fn(*args, **kwargs)
    except BaseException as exc:  # the task's failure, SystemExit included, goes back to the submitter
        _flush()
        _explain_missing_file(exc)
        return None, _error(task_id, exc, skip_frames=1)
    _flush()
    return result, None


def _explain_missing_file(exc: BaseException) -> None:
    """A relative path that a task did not find: say where it was looked for, and that files do not
    travel with a function."""
    filename = getattr(exc, "filename", None)
    if isinstance(exc, FileNotFoundError) and isinstance(filename, str) and not os.path.isabs(filename) \
            and hasattr(exc, "add_note"):
        exc.add_note(f"gpulayer: the task looked for {filename!r} in its own folder on the peer ({taskenv.working_folder()}). Files do "
                     "not travel with a function: pass the data as an argument, or use a path that exists on the "
                     "peer (see docs/scheduling.md, \"A task's folder\")")


def _run(task_id, target, args: bytes, buffers: list) -> tuple[dict, list]:
    """As `_invoke`, with the result pickled: the RESULT or ERROR message and its buffers."""
    result, failed = _invoke(task_id, target, args, buffers)
    if failed is not None:
        return failed, []
    try:
        data, out = serialization.dumps(result)
    except Exception as exc:
        return _error(task_id, exc, note=f"the result ({type(result).__name__}) could not be pickled"), []
    try:  # every path of a result (the peer, a lease, an actor) passes here: one the wire refuses fails now
        wire.check_size("the task's result and its buffers", [len(data), *(memoryview(b).nbytes for b in out)])
    except ValueError as exc:
        return _error(task_id, exc), []
    return {"t": wire.RESULT, "id": task_id, "data": data}, out


@contextlib.contextmanager
def task_environment(env: dict | None):
    """A task's environment variables (the SUBMIT's "env") set while it runs; after it, everything the
    task changed of the worker's state is put back (CleanRoom)."""
    os.environ.update(env or {})
    try:
        yield
    finally:
        taskenv.restore_clean_room()


def _error(task_id, exc: BaseException, *, skip_frames: int = 0, note: str = "") -> dict:
    return {"t": wire.ERROR, "id": task_id, **remote_exceptions.pack(exc, skip_frames=skip_frames, note=note)}


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


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
    conn = wire.BlockingConnection(socket.socket(fileno=args.fd), wire.max_message_bytes(), link, populate=True)
    reaper = OrphanReaper() if become_subreaper() else None
    spawning.install()
    loaded = preload([n for n in args.preload.split(",") if n])
    taskenv.open_clean_room(os.getcwd(), keep=args.keep_task_folders)
    conn.send({"t": wire.STATUS, "pid": os.getpid(), "preloaded": loaded, "fds": link is not None,
               "direct": link is not None and importlib.util.find_spec("cryptography") is not None})
    functions = FunctionCache()
    link_lock = threading.Lock()  # a thread of a task that waits on a future tells the peer (lending.py)

    def tell_peer(msg: dict) -> None:
        with link_lock:
            conn.send(msg)

    lending.install(tell_peer)
    while True:
        try:
            msg, buffers = conn.recv()
        except (ConnectionError, OSError):
            return
        if msg["t"] == wire.BYE:
            return
        if msg["t"] == wire.ACTOR:  # its environment was set when the peer started this worker for it
            from .actor_worker import become_actor

            become_actor(conn, msg, buffers)
        if msg["t"] == wire.LEASE:  # the peer lent this worker to a submitter's connection
            from .lease_worker import serve_lease

            serve_owner(msg, functions)
            if not serve_lease(conn, msg, functions):
                return
            continue
        if msg["t"] != wire.SUBMIT:  # the peer's acknowledgement of a lease's end, or a cancel that came late
            continue
        serve_owner(msg, functions)
        with task_environment(msg.get("env")):
            reply, out = run_task(msg, buffers, functions)
        del msg, buffers
        with link_lock:
            conn.send(reply, out)
        del reply, out  # a result may be a view of an argument's segment: let the mapping go now
        if reaper is not None:
            reaper.maybe_reap()


if __name__ == "__main__":
    main()
