"""The exceptions GPUlayer raises to its users."""

from __future__ import annotations


class GPULayerError(Exception):
    """Base class of every GPUlayer error."""


class ConfigError(GPULayerError):
    """A missing or malformed setting: the cluster key, a static peer address, an override file."""


class NoMatchingPeer(GPULayerError):
    """No discovered peer fits the task. `reasons` maps each peer seen to why it does not fit."""

    def __init__(self, requirements: object, reasons: dict[str, list[str]], note: str = ""):
        """`note`: what else was seen, such as peers of another cluster (discovery.Directory.foreign_note)."""
        self.requirements = requirements
        self.reasons = reasons
        if reasons:
            lines = [f"  {peer}: {'; '.join(why)}" for peer, why in sorted(reasons.items())]
            detail = "peers seen:\n" + "\n".join(lines)
        else:
            detail = (
                "no peers were discovered. Start one with `gpulayer join`, check that both sides "
                "share the cluster key, or set GPULAYER_PEERS=host:port where multicast is blocked."
            )
        super().__init__(f"no peer matches {requirements}; {detail}" + (f"\n{note}" if note else ""))


class PeerLost(GPULayerError):
    """The connection to the peer running a task was lost before the task completed."""


class AuthError(GPULayerError):
    """The other side did not prove knowledge of the cluster key."""


class ProtocolError(GPULayerError):
    """Malformed, oversized or unexpected data on the wire."""

    code = "protocol"


class FrameTooLarge(ProtocolError):
    code = "too-large"


class VersionMismatch(ProtocolError):
    code = "version"


class WaitCycle(GPULayerError):
    """A wait on a future that could never end: an actor of max_concurrency=1 waiting on a call to itself."""


class TaskRejected(GPULayerError):
    """The peer refused the task (busy, no match, bad request)."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(f"{code}: {message}")


class TaskTimeout(GPULayerError, TimeoutError):
    """The task ran past its timeout; its worker was killed."""


class WorkerDied(GPULayerError):
    """The worker process running the task died (a crash, a kill, out of memory)."""


class ActorDied(GPULayerError):
    """The actor is gone (closed, its worker died, its peer was lost or its submitter went away);
    the message says why. Every call in flight and every later call raises it, unless the actor
    was created with `restarts=N` (then a later call re-creates it)."""


class GangFailed(GPULayerError):
    """A rank of a gang failed, died or lost its peer; the other ranks were stopped (docs/gangs.md).
    `rank`, `peer` (its peer's name) and `cause` (the rank's own error) say which and why."""

    def __init__(self, rank: int, peer: str, cause: BaseException):
        self.rank, self.peer, self.cause = rank, peer, cause
        super().__init__(f"rank {rank} of the gang, on peer {peer}, failed: {type(cause).__name__}: {cause}; "
                         "the other ranks were stopped")


class RemoteError(GPULayerError):
    """A remote exception that could not be rebuilt here; carries its type name and traceback."""

    def __init__(self, type_name: str, message: str, traceback: str):
        self.type_name = type_name
        self.remote_traceback = traceback
        super().__init__(f"{type_name}: {message}\n\nRemote traceback:\n{traceback}")


class RemoteTraceback(Exception):
    """Attached as __cause__ of a re-raised remote exception, so the remote traceback prints."""

    def __init__(self, traceback: str):
        self.traceback = traceback
        super().__init__(traceback)

    def __str__(self) -> str:
        return f"\n\nRemote traceback:\n{self.traceback}"
