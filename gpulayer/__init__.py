"""GPUlayer: a peer-to-peer, zero-config scheduler for the GPUs on a LAN.

    import gpulayer as gl
    gl.run(fn, *args, accelerator="mps")

The API is loaded on first use, so that workers and `gpulayer.torch` import this package
without the discovery stack.
"""

from . import distributed  # gl.distributed.init() inside a gang's rank (torch and MLX load only then)
from .errors import (ActorDied, AuthError, ConfigError, GangFailed, GPULayerError, NoMatchingPeer, PeerLost,
                     ProtocolError, RemoteError, TaskRejected, TaskTimeout, WaitCycle, WorkerDied)
from .taskenv import task_folder

__version__ = "0.1.0"
_API = ("run", "submit", "map", "options", "remote", "peers", "device", "actors", "configure", "default_client",
        "RemoteFunction", "ActorClass", "Options", "submit_job", "job", "jobs")

__all__ = [*_API, "ActorDied", "AuthError", "ConfigError", "GangFailed", "GPULayerError", "NoMatchingPeer", "PeerLost",
           "ProtocolError", "RemoteError", "TaskRejected", "TaskTimeout", "WaitCycle", "WorkerDied", "task_folder"]


def __getattr__(name: str):
    if name in _API:
        from . import api

        value = globals()[name] = getattr(api, name)  # later lookups skip this function
        return value
    raise AttributeError(f"module 'gpulayer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})  # tab completion offers the API before its first use
