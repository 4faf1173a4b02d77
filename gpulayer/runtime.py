"""The process-wide backend: made on first use from the environment, replaced by `configure()`, closed
at exit; and the LAN client through which an actor handle unpickled in this process calls its actor.

Above the client and the backends (it makes either), below the public API (`gpulayer.api`), which
re-exports `default_client`, `configure` and `shutdown`.
"""

from __future__ import annotations

import atexit
import threading
from typing import TYPE_CHECKING, Any

from .backends.base import Backend, make
from .client.engine import Client
from .errors import ConfigError
from .matching import Requirements

if TYPE_CHECKING:
    from .client.actors import ActorHandle

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


def lan_client() -> Client:
    """The process-wide client, which must be the LAN's: actors live on GPUlayer peers."""
    client = default_client()
    if not isinstance(client, Client):
        raise ConfigError("actors run on GPUlayer peers: they need the LAN backend (GPULAYER_BACKEND=lan)")
    return client


def actor_handle(actor_id: str, peer_id: str, peer_name: str, addresses: list[tuple[str, int]],
                 slot: int | None, class_name: str, req: Requirements) -> ActorHandle:
    """A handle unpickled in another process (a task, another actor): it calls through that process's client."""
    from .client.actors import ActorHandle  # here: a process that has no actor never loads it

    return ActorHandle(lan_client(), actor_id, peer_id, peer_name, [(str(h), int(p)) for h, p in addresses],
                              slot, class_name, req)


Client.rebuild_handle = actor_handle  # a handle pickles as a reference to this function
