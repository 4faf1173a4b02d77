"""The submitter's API: run, submit, map, remote, peers, device, actors.

Every function uses one process-wide backend, made on first use from the environment: the LAN's
Client (GPULAYER_KEY or the key file, GPULAYER_INTERFACES, GPULAYER_PEERS), or a Ray cluster when
GPULAYER_BACKEND=ray (GPULAYER_RAY_ADDRESS; see gpulayer.backends). `configure()` replaces it.
Task options (accelerator, gpu_memory_gb, frameworks, capabilities, peer, devices, timeout,
retries, python, env) are defined and checked in one table, `gpulayer.options`.
"""

from __future__ import annotations

import atexit
import functools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from .backends.base import Backend, make
from .actor_class import ActorClass
from .options import TaskOptions, no_keep, split_call

_client: Backend | None = None
_client_lock = threading.Lock()


def default_client() -> Backend:
    """The process-wide backend (the LAN's Client unless GPULAYER_BACKEND says otherwise), created on first use."""
    global _client
    with _client_lock:
        if _client is None or _client.closed:
            _client = make()
        return _client


def configure(backend: str | None = None, **options: Any) -> Backend:
    """Replace the process-wide backend: "lan" (key, interfaces, peers, mdns, echo_output, discovery_timeout, leases)
    or "ray" (address, echo_output, init_options); the default is GPULAYER_BACKEND, else "lan"."""
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
        _client = make(backend, **options)
        return _client


@atexit.register
def shutdown() -> None:
    """Close the process-wide Client (saves the peer cache); runs at exit."""
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
            _client = None


def _submit(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: TaskOptions) -> Future[Any]:
    return default_client().submit(fn, args, kwargs, req=options.requirements, timeout=options.timeout,
                                   retries=options.retries, env=options.env, keep=options.keep)


def submit(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
    """Run fn(*args, **kwargs) on a matching peer; returns a concurrent.futures.Future.

    Keyword arguments named like a task option (see `gpulayer.options`) are task options;
    the others go to fn. A future among the arguments (also inside lists and dicts) is replaced by
    its value; with keep=True, the result stays on its peer, and a future of it passed to another
    task travels from peer to peer, not through here (docs/data.md).
    """
    options, kwargs = split_call(kwargs)
    return _submit(fn, args, kwargs, options)


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run fn(*args, **kwargs) on a matching peer and return its result (or raise its exception)."""
    options, kwargs = split_call(kwargs)
    no_keep(options, "gl.run()")
    return _submit(fn, args, kwargs, options).result()


def map(fn: Callable[[Any], Any], iterable: Iterable[Any], *, progress: bool | None = None, **options: Any) -> list[Any]:
    """fn(item) for every item, spread over all matching peers; results in input order.

    At most two tasks per slot of the matching peers are in flight at once, so that faster
    peers take more. The first failure cancels the rest and is raised. A progress bar is
    drawn on a terminal (or when progress=True).
    """
    parsed = TaskOptions.parse(options)
    no_keep(parsed, "gl.map()")
    return default_client().map(fn, list(iterable), req=parsed.requirements, timeout=parsed.timeout,
                                retries=parsed.retries, env=parsed.env, progress=progress)


class RemoteFunction:
    """What @gl.remote returns: call it to run remotely, or use .submit(), .map(), .options()."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]):
        self._parsed = TaskOptions.parse(options)  # validate now, not at the first call
        self.__gpulayer_function__ = fn
        self._options = options
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        no_keep(self._parsed, "calling a remote function (use its .submit())")
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> Future[Any]:
        return _submit(self.__gpulayer_function__, args, kwargs, self._parsed)

    def map(self, iterable: Iterable[Any], progress: bool | None = None) -> list[Any]:
        return map(self.__gpulayer_function__, iterable, progress=progress, **self._options)

    def options(self, **overrides: Any) -> RemoteFunction:
        """A copy with some options replaced, e.g. f.options(accelerator="cuda")."""
        return RemoteFunction(self.__gpulayer_function__, {**self._options, **overrides})

    def local(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function here, in this process."""
        return self.__gpulayer_function__(*args, **kwargs)


def remote(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator: `@gl.remote` or `@gl.remote(accelerator="mps", frameworks={"mlx": ">=0.10"})`.

    On a class it makes an actor class (`gpulayer.actor_class`: also `max_concurrency=` and `restarts=`).
    """
    if fn is None:
        return lambda f: _remote(f, options)
    return _remote(fn, options)


def _remote(obj: Any, options: dict[str, Any]) -> RemoteFunction | ActorClass:
    return ActorClass(obj, options) if isinstance(obj, type) else RemoteFunction(obj, options)


def actors() -> list[dict[str, Any]]:
    """This submitter's live actors (actor id, class, peer, address, slot, calls served, calls pending)."""
    return default_client().live_actors()


def peers(wait: float | None = None, probe: bool = True) -> list[dict[str, Any]]:
    """The discovered peers of this cluster, with their state and load."""
    return default_client().peers(wait=wait, probe=probe)


def device() -> Any:
    """Inside a task, the torch device the peer gave it; elsewhere, the best local one (cuda, mps, cpu).

    Raises `gpulayer.torch.AcceleratorUnavailable`, saying what to install, when the job's torch
    cannot use the device the peer gave the task.
    """
    from .torch.accelerators import resolve

    return resolve().device()
