"""The submitter side: `engine` (Client: pool, retries, heartbeat, map), `tasks` (a call on its way and its
future), `placement`
(candidates, reasons, ranking) and `connection` (one authenticated connection per peer)."""

from .connection import PeerConnection
from .engine import Client
from .tasks import SubmittedTask, TaskFuture

__all__ = ["Client", "PeerConnection", "SubmittedTask", "TaskFuture"]
