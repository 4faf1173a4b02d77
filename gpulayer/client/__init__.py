"""The submitter side: `engine` (Client: pool, futures, retries, heartbeat, map), `placement`
(candidates, reasons, ranking) and `connection` (one authenticated connection per peer)."""

from .connection import PeerConnection
from .engine import Client, SubmittedTask, TaskFuture

__all__ = ["Client", "PeerConnection", "SubmittedTask", "TaskFuture"]
