"""The results a peer holds for its submitters (`keep=True`), and fetching one from another peer.

A held result is the worker's RESULT pickle and its buffers, kept as they arrived (the peer never
unpickles them) under the id the submitter chose. Its submitter fetches it (`future.result()`),
passes it to another task (used in place here, or fetched by the consuming peer), and releases it
(RELEASE: the future was released or garbage-collected). When the submitter has had no connection
for the grace time (GPULAYER_ACTOR_GRACE, as for actors) its results are freed. The bytes held
are bounded (GPULAYER_HELD_MB): a result that does not fit fails its task with "held-full".
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, GPULayerError, ProtocolError
from ..protocol import framing, handshake, messages
from ..transport import blocking
from .actors import DEFAULT_GRACE

log = logging.getLogger("gpulayer.peer")

LIMIT_ENV = "GPULAYER_HELD_MB"
DEFAULT_LIMIT_MB = 4096
FETCH_IDLE_TIMEOUT = 60.0  # seconds a peer-to-peer fetch may take to receive its answer
FETCH_MAX_MESSAGES = 16


def limit_from_env() -> int:
    """The most bytes of results a peer holds (GPULAYER_HELD_MB, default 4096 MiB)."""
    value = os.environ.get(LIMIT_ENV, str(DEFAULT_LIMIT_MB))
    if not value.isdigit():
        raise ConfigError(f"{LIMIT_ENV} must be a whole number of MiB, not {value!r}")
    return int(value) << 20


@dataclass(eq=False)
class Held:
    submitter_id: str  # the submitter that owns it
    data: bytes
    buffers: list[Any]
    size: int


class HeldFull(GPULayerError):
    """Holding a result would pass the peer's bound on held bytes."""


class HeldResults:
    """The held results of one peer, by id, with the bytes they take."""

    def __init__(self, limit: int, grace: float = DEFAULT_GRACE):
        self.limit = limit
        self.grace = grace
        self.bytes = 0
        self._held: dict[str, Held] = {}
        self._expiry: dict[str, asyncio.TimerHandle] = {}  # submitters without a connection

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, result_id: object) -> bool:
        return result_id in self._held

    def keep(self, result_id: str, submitter_id: str, reply: messages.Outgoing,
             buffers: list[Any]) -> tuple[messages.Outgoing, list[Any]]:
        """Hold a task's RESULT; what goes to the submitter instead: a RESULT with "held" and "size"
        and no value, or an ERROR "held-full" when the bound would be passed."""
        data = reply.get("data")
        if not isinstance(data, bytes):
            return messages.error("protocol", "the worker's RESULT has no pickle", reply.get("id")), []
        size = len(data) + sum(memoryview(b).nbytes for b in buffers)
        if self.bytes + size > self.limit:
            message = (f"the result ({size / 2**20:.1f} MiB) does not fit in what this peer may hold: "
                       f"{self.bytes / 2**20:.1f} of {self.limit / 2**20:.0f} MiB are held ({LIMIT_ENV}); "
                       "release held futures (future.release()) or raise the limit")
            return {**messages.error("held-full", message), "id": reply.get("id")}, []
        self._held[result_id] = Held(submitter_id, data, buffers, size)
        self.bytes += size
        return {"t": messages.RESULT, "id": reply.get("id"), "held": result_id, "size": size}, []

    def get(self, result_id: Any, submitter_id: str) -> Held | None:
        """The result `result_id` held for submitter `submitter_id`, or None (unknown, released, or another's)."""
        held = self._held.get(result_id) if isinstance(result_id, str) else None
        return held if held is not None and held.submitter_id == submitter_id else None

    def release(self, result_id: Any, submitter_id: str) -> None:
        if self.get(result_id, submitter_id) is not None:
            self.bytes -= self._held.pop(result_id).size

    def connected(self, submitter_id: str) -> None:
        """A connection of submitter `submitter_id` authenticated: its results stay."""
        timer = self._expiry.pop(submitter_id, None)
        if timer is not None:
            timer.cancel()

    def disconnected(self, submitter_id: str) -> None:
        """The last connection of submitter `submitter_id` closed: free its results after the grace time."""
        if submitter_id not in self._expiry and any(h.submitter_id == submitter_id for h in self._held.values()):
            self._expiry[submitter_id] = asyncio.get_running_loop().call_later(self.grace, self._expire, submitter_id)

    def _expire(self, submitter_id: str) -> None:
        self._expiry.pop(submitter_id, None)
        gone = [rid for rid, held in self._held.items() if held.submitter_id == submitter_id]
        for rid in gone:
            self.release(rid, submitter_id)
        log.info("freed %d held result(s) of submitter %s, gone for %.0f s", len(gone), submitter_id, self.grace)


def fetch(key: bytes, fetcher_id: str, ref: dict[str, Any], owner: str,
          receiving: Callable[[framing.MessageReader], None]) -> tuple[bytes, list[Any]]:
    """Fetch the held result that a SUBMIT's `ref` entry names from the peer holding it (blocking).

    The connection authenticates with the cluster key exactly as a submitter's does (as `fetcher_id`); the holder
    answers only for the result's own submitter (`owner`). Once authenticated, `receiving` sets how
    big buffers are received (the peer's memory bound, and segments that go on to the worker by
    descriptor). Raises ConnectionError with the reason when the holder is unreachable, is another
    peer now, holds no such result, or the result does not fit in the memory free here.
    """
    errors: list[str] = []
    with closing(blocking.connections([tuple(a) for a in ref["at"]], handshake.HANDSHAKE_TIMEOUT, errors)) as reachable:
        for address, conn in reachable:
            try:
                return _fetch_over(conn, key, fetcher_id, ref, owner, address, receiving)
            except (OSError, GPULayerError) as exc:
                raise ConnectionError(f"peer {messages.printable(ref['peer'], 40)} at {address}: {exc}") from None
    raise ConnectionError(f"peer {messages.printable(ref['peer'], 40)} is unreachable: {'; '.join(errors)}")


def _fetch_over(conn: blocking.BlockingConnection, key: bytes, fetcher_id: str, ref: dict[str, Any], owner: str,
                address: str, receiving: Callable[[framing.MessageReader], None]) -> tuple[bytes, list[Any]]:
    hello = handshake.client_handshake(conn, key, fetcher_id)
    if hello["peer"] != ref["peer"]:
        raise ConnectionError(f"another peer ({messages.printable(hello['peer'], 40)}) answers at {address} now")
    receiving(conn.reader)
    conn.send(messages.fetch(1, ref["ref"], owner))
    for _ in range(FETCH_MAX_MESSAGES):  # the answer, maybe after a PONG or two
        msg, buffers = conn.recv(time.monotonic() + FETCH_IDLE_TIMEOUT)
        if framing.REFUSED in msg:
            raise ConnectionError(f"the result was not received here: {msg[framing.REFUSED]}")
        if msg["t"] == messages.RESULT and msg.get("id") == 1 and isinstance(msg.get("data"), bytes):
            return msg["data"], buffers
        if msg["t"] == messages.ERROR:
            raise ConnectionError(messages.printable(msg.get("message")))
    raise ProtocolError(f"no answer to FETCH among {FETCH_MAX_MESSAGES} messages")


Resolved = tuple[str, bytes, list[Any]]  # a held argument ready for the worker: id, pickle, buffers
Fetcher = Callable[[dict[str, Any]], tuple[bytes, list[Any]]]  # fetch(ref) from another peer, blocking


async def gather(table: HeldResults, refs: list[dict[str, Any]], owner: str, peer_id: str,
                 fetcher: Fetcher) -> list[Resolved]:
    """The held arguments a SUBMIT's `refs` name: from `table` when this peer holds them, else fetched
    from their peers (in threads, at once). Raises ConnectionError saying which one is lost."""
    loop = asyncio.get_running_loop()
    resolved: dict[str, Resolved | asyncio.Future[tuple[bytes, list[Any]]]] = {}
    for ref in refs:
        rid = ref["ref"]
        if rid in resolved:
            continue
        if ref["peer"] == peer_id:
            held = table.get(rid, owner)
            if held is None:
                raise ConnectionError(f"this peer holds no result {rid[:8]}... of submitter {owner}: it was "
                                      "released, or freed after its submitter left")
            resolved[rid] = (rid, held.data, held.buffers)
        else:
            resolved[rid] = loop.run_in_executor(None, fetcher, ref)
    out = []
    for rid, entry in resolved.items():
        out.append(entry if isinstance(entry, tuple) else (rid, *await entry))
    return out


def answer_fetch(table: HeldResults, msg: messages.Message, submitter_id: str) -> tuple[messages.Outgoing, list[Any]]:
    """The answer to a FETCH from a connection of submitter `submitter_id`: the RESULT, or ERROR "no-result".

    A peer fetching for a task names the result's submitter ("for"); the id is the capability,
    and an unknown id, a released one and another submitter's all get the same answer."""
    request_id, owner = msg["id"], msg.get("for", submitter_id)  # checked by messages.check_fetch
    held = table.get(msg.get("ref"), owner)
    if held is None:
        return messages.error("no-result", "no such result is held here for this submitter (never held, "
                                       "released, or freed after its submitter left)", request_id), []
    return {"t": messages.RESULT, "id": request_id, "data": held.data}, held.buffers
