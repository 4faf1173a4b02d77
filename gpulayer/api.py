"""The submitter's API: run, submit, map, remote, peers, device.

Every function uses one process-wide Client, made on first use from the environment
(GPULAYER_KEY or the key file, GPULAYER_INTERFACES, GPULAYER_PEERS); `configure()` replaces it.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading

from . import serialization
from .client import Client, TaskFuture
from .matching import Requirements
from .progress import Progress

_client: Client | None = None
_client_lock = threading.Lock()
_OPTION_NAMES = ("accelerator", "gpu_memory_gb", "frameworks", "capabilities", "peer", "devices", "timeout", "retries")


def default_client() -> Client:
    """The process-wide Client, created on first use."""
    global _client
    with _client_lock:
        if _client is None or _client._closed.is_set():
            _client = Client()
        return _client


def configure(**client_options) -> Client:
    """Replace the process-wide Client (key, interfaces, peers, mdns, echo_output, discovery_timeout)."""
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
        _client = Client(**client_options)
        return _client


@atexit.register
def shutdown() -> None:
    """Close the process-wide Client (saves the peer cache); runs at exit."""
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
            _client = None


def _split(options: dict) -> tuple[Requirements, float | None, int]:
    req = Requirements.build(options.get("accelerator"), options.get("gpu_memory_gb"), options.get("frameworks"),
                             options.get("capabilities"), options.get("peer"), options.get("devices", 1))
    return req, options.get("timeout"), options.get("retries", 0)


def submit(fn, *args, accelerator=None, gpu_memory_gb=None, frameworks=None, capabilities=None, peer=None,
           devices=1, timeout=None, retries=0, **kwargs) -> TaskFuture:
    """Run fn(*args, **kwargs) on a matching peer; returns a concurrent.futures.Future."""
    req = Requirements.build(accelerator, gpu_memory_gb, frameworks, capabilities, peer, devices)
    return default_client().submit(fn, args, kwargs, req=req, timeout=timeout, retries=retries)


def run(fn, *args, accelerator=None, gpu_memory_gb=None, frameworks=None, capabilities=None, peer=None,
        devices=1, timeout=None, retries=0, **kwargs):
    """Run fn(*args, **kwargs) on a matching peer and return its result (or raise its exception)."""
    return submit(fn, *args, accelerator=accelerator, gpu_memory_gb=gpu_memory_gb, frameworks=frameworks,
                  capabilities=capabilities, peer=peer, devices=devices, timeout=timeout, retries=retries,
                  **kwargs).result()


def map(fn, iterable, *, accelerator=None, gpu_memory_gb=None, frameworks=None, capabilities=None, peer=None,
        devices=1, timeout=None, retries=0, progress: bool | None = None) -> list:
    """fn(item) for every item, spread over all matching peers; results in input order.

    At most two tasks per slot of the matching peers are in flight at once, so that faster
    peers take more. The first failure cancels the rest and is raised. A progress bar is
    drawn on a terminal (or when progress=True).
    """
    req = Requirements.build(accelerator, gpu_memory_gb, frameworks, capabilities, peer, devices)
    items = list(iterable)
    engine = default_client()
    fn_bytes = serialization.dumps(fn)[0]
    bar = Progress(len(items), label=f"{getattr(fn, '__name__', 'map')} ", enabled=progress)
    futures: list[TaskFuture] = []
    window = None
    try:
        for item in items:
            if window is not None:
                window.acquire()
            future = engine.submit(fn, (item,), req=req, timeout=timeout, retries=retries, fn_bytes=fn_bytes)
            if window is None:
                window = threading.BoundedSemaphore(max(4, 2 * engine.total_slots(req)))
                window.acquire()
            future.add_done_callback(lambda _f, w=window: (w.release(), bar.advance()))
            futures.append(future)
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise
    finally:
        bar.close()


class RemoteFunction:
    """What @gl.remote returns: call it to run remotely, or use .submit(), .map(), .options()."""

    def __init__(self, fn, options: dict):
        unknown = set(options) - set(_OPTION_NAMES)
        if unknown:
            raise TypeError(f"unknown remote option(s): {', '.join(sorted(unknown))}")
        _split(options)  # validate now, not at the first call
        self.__gpulayer_function__ = fn
        self._options = options
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self.submit(*args, **kwargs).result()

    def submit(self, *args, **kwargs) -> TaskFuture:
        req, timeout, retries = _split(self._options)
        return default_client().submit(self.__gpulayer_function__, args, kwargs, req=req, timeout=timeout, retries=retries)

    def map(self, iterable, progress: bool | None = None) -> list:
        return map(self.__gpulayer_function__, iterable, progress=progress, **self._options)

    def options(self, **overrides) -> RemoteFunction:
        """A copy with some requirements replaced, e.g. f.options(accelerator="cuda")."""
        return RemoteFunction(self.__gpulayer_function__, {**self._options, **overrides})

    def local(self, *args, **kwargs):
        """Call the function here, in this process."""
        return self.__gpulayer_function__(*args, **kwargs)


def remote(fn=None, **options):
    """Decorator: `@gl.remote` or `@gl.remote(accelerator="mps", frameworks={"mlx": ">=0.10"})`."""
    if fn is None:
        return lambda f: RemoteFunction(f, options)
    return RemoteFunction(fn, options)


def peers(wait: float | None = None, probe: bool = True) -> list[dict]:
    """The discovered peers of this cluster, with their state and load."""
    return default_client().peers(wait=wait, probe=probe)


def device():
    """Inside a task, the torch device the peer gave it; elsewhere, the best local one."""
    import torch

    name = os.environ.get("GPULAYER_DEVICE")
    if name:
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
