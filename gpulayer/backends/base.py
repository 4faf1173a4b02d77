"""The backend boundary: what `gpulayer.api` asks of whatever runs the tasks.

The LAN backend is `gpulayer.client.Client`; `gpulayer.backends.ray.RayBackend` runs the same
calls on a Ray cluster. Both take validated Requirements and execution options and return
concurrent.futures.Future objects with `stdout`, `stderr` and `peer`; an actor is created from
its ActorSpec, and its handle answers `handle.method(...)`, `.submit`, `.options(timeout=)` and
`close()` on either.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError
from ..matching import Requirements

if TYPE_CHECKING:
    from ..client.actors import ActorSpec

LAN, RAY = "lan", "ray"
BACKENDS = (LAN, RAY)


class Backend(Protocol):
    """What the API functions call: submit one task, map over calls, list the machines, close."""

    @property
    def closed(self) -> bool: ...

    def submit(self, fn: Callable[..., Any], args: Iterable[Any] = (), kwargs: dict[str, Any] | None = None, *,
               req: Requirements, timeout: float | None = None, retries: int = 0,
               env: dict[str, str] | None = None, keep: bool = False, priority: int = 0) -> Future[Any]: ...

    def map(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]], *, req: Requirements, timeout: float | None = None,
            retries: int = 0, env: dict[str, str] | None = None, progress: bool | None = None,
            priority: int = 0) -> list[Any]: ...

    def create_actor(self, spec: ActorSpec) -> Future[Any]: ...

    def live_actors(self) -> list[dict[str, Any]]: ...

    def peers(self, wait: float | None = None, probe: bool = True) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


def make(backend: str | None = None, **options: Any) -> Backend:
    """A backend by name ("lan" or "ray"; default GPULAYER_BACKEND, else "lan") with its own options."""
    name = backend or os.environ.get("GPULAYER_BACKEND") or LAN
    if name == LAN:
        from ..client import Client

        return Client(**options)
    if name == RAY:
        from .ray import RayBackend

        return RayBackend(**options)
    raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, not {name!r} (GPULAYER_BACKEND)")
