"""The submitter side: `engine` (Client: placing, retries, stealing, map's window), `pool` (discovery, the
connections, one heartbeat and liveness rule), `connection` (one authenticated connection, its routing
table and the listener base), `placement` (candidates, reasons, ranking), `tasks` (a call on its way and
its future), `leases` and `actors` (the connections handed to workers)."""

from .connection import PeerConnection
from .engine import Client
from .tasks import SubmittedTask, TaskFuture

__all__ = ["Client", "PeerConnection", "SubmittedTask", "TaskFuture"]
