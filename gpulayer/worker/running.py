"""Running one call in a worker process, for every stream and runner of the receiver (receiver.py,
actors.py): the function loaded from its pickle, the arguments unpickled, the call made, and
the RESULT or ERROR message built. Needs only msgpack and cloudpickle, as the worker does.
"""

from __future__ import annotations

import os
import sys
import types

from .. import held, lending, remote_exceptions, serialization, taskenv
from ..protocol import framing, messages
from ..transport import shm

_FN_CACHE_SIZE = 128


class FunctionCache:
    """Unpickled functions by their pickle, so that a repeated function is loaded once.

    A function shipped by value has globals of its own, and a module of the user's shipped by value
    is a module of its own (no import on this side holds either): each task starts with both as
    they were unpickled, so that one task's `global x; x = ...` or `mymodule.x = ...` is not the
    next one's. A mutable value changed in place stays changed (docs/scheduling.md, "Clean workers").
    """

    def __init__(self) -> None:
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
    owner = str(msg.get("owner"))
    if owner != shm.POOL.owner and shm.POOL.serve(owner):  # the same as the last one's: nothing to look at
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
    target = lambda: functions.load(msg["fn"])  # noqa: E731
    if values:
        with held.provided(values):
            reply, out = run_call(msg.get("id"), target, msg["args"], own)
    else:  # most tasks take no held result: nothing to provide
        reply, out = run_call(msg.get("id"), target, msg["args"], own)
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


def invoke(task_id, target, args: bytes, buffers: list) -> tuple[object, dict | None]:
    """target()(*args, **kwargs) from the pickled (args, kwargs): (its result, None), or (None, ERROR)."""
    try:
        fn = target()
        args, kwargs = serialization.loads(args, buffers)
        result = fn(*args, **kwargs)
    except BaseException as exc:  # the task's failure, SystemExit included, goes back to the submitter
        flush_output()
        _explain_missing_file(exc)
        return None, _error(task_id, exc, skip_frames=1)
    flush_output()
    return result, None


def _explain_missing_file(exc: BaseException) -> None:
    """A relative path that a task did not find: say where it was looked for, and that files do not
    travel with a function."""
    filename = getattr(exc, "filename", None)
    if isinstance(exc, FileNotFoundError) and isinstance(filename, str) and not os.path.isabs(filename) \
            and hasattr(exc, "add_note"):
        exc.add_note(f"gpulayer: the task looked for {filename!r} in its own folder on the peer "
                     f"({taskenv.working_folder()}). Files do not travel with a function: pass the data as an "
                     "argument, or use a path that exists on the peer (see docs/scheduling.md, \"A task's folder\")")


def run_call(task_id, target, args: bytes, buffers: list) -> tuple[dict, list]:
    """As `invoke`, with the result pickled: the RESULT or ERROR message and its buffers."""
    result, failed = invoke(task_id, target, args, buffers)
    if failed is not None:
        return failed, []
    try:
        data, out = serialization.dumps(result)
    except Exception as exc:
        return _error(task_id, exc, note=f"the result ({type(result).__name__}) could not be pickled"), []
    try:  # every path of a result (the peer, a lease, an actor) passes here: one the wire refuses fails now
        framing.check_size("the task's result and its buffers", [len(data), *(memoryview(b).nbytes for b in out)])
    except ValueError as exc:
        return _error(task_id, exc), []
    return {"t": messages.RESULT, "id": task_id, "data": data}, out


def _error(task_id, exc: BaseException, *, skip_frames: int = 0, note: str = "") -> dict:
    return {"t": messages.ERROR, "id": task_id, **remote_exceptions.pack(exc, skip_frames=skip_frames, note=note)}


def flush_output() -> None:
    """Flush sys.stdout and sys.stderr, whatever they are now (a task may have replaced them)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
