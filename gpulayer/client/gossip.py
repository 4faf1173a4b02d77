"""A submitter's side of gossip (ADR 0017): it asks the peers it is connected to for their lists of
verified peers, sends them its own, and proves each new one with its own handshake.

Every ASK_EVERY seconds (and at once when its first connection opens) it sends PEERS, with the peers
it holds a live connection to, on one of its connections in turn. An id of the reply that it has not
verified is a hint: the pool connects there (`learn`; addresses where that failed wait AGE_OUT), and
only a handshake that proves the id adds the peer, with source "gossip". A peer learned so that the lists no longer name, and that it holds no
connection to, is dropped (the lists drop a peer AGE_OUT after its last verification anywhere).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .. import discovery
from ..protocol import messages
from ..errors import GPULayerError
from .connection import CONNECT_TIMEOUT, PeerConnection

log = logging.getLogger("gpulayer.client")

ASK_EVERY = 2.0  # seconds between two asks
FIRST_ASK_POLL = 0.05  # seconds between looks for a first connection to ask


class Learner(Protocol):
    """What gossip needs of the pool (client/pool.py)."""

    directory: discovery.Directory

    def pooled(self, peer_id: str) -> PeerConnection | None: ...

    def learn(self, addresses: list[tuple[str, int]]) -> bool: ...


class Gossip:
    """Runs on a thread of its own until `stop` is set."""

    def __init__(self, pool: Learner, stop: threading.Event, run_soon: Callable[..., Any]):
        self.pool = pool
        self.stop = stop
        self.run_soon = run_soon  # runs a handshake on the pool's helpers
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._trying: dict[tuple[tuple[str, int], ...], float] = {}  # addresses -> when they may be tried again

    def run(self) -> None:
        wait = FIRST_ASK_POLL
        while not self.stop.wait(wait):
            if self.ask_once():
                wait = ASK_EVERY

    def connections(self) -> list[PeerConnection]:
        """The live connections to verified peers, by peer id."""
        records = sorted(self.pool.directory.records(), key=lambda r: r.advert.peer_id)
        pooled = [self.pool.pooled(r.advert.peer_id) for r in records if r.verified]
        return [conn for conn in pooled if conn is not None]

    def askable(self, conns: list[PeerConnection]) -> list[PeerConnection]:
        """Those of `conns` whose peer answers PEERS (its HELLO's advert names the feature): an older peer
        would close the connection, and end the tasks on it."""
        return [conn for conn in conns if messages.PEERS in conn.advert.features]

    def ask_once(self) -> bool:
        """Ask one connected peer (in turn) for its list and act on it; False when none is connected."""
        conns = self.connections()
        askable = self.askable(conns)
        if not askable:
            return False
        conn = askable[next(self._turn) % len(askable)]
        now = time.monotonic()
        mine = [messages.peers_entry(c.peer_id, c.addresses, min(now - c.last_heard, messages.AGE_OUT))
                for c in conns]
        try:
            reply = conn.request(messages.peers(None, mine), CONNECT_TIMEOUT)
        except (OSError, GPULayerError, TimeoutError) as exc:
            log.debug("no list from %s: %s", conn.name, exc)
            return True
        self.take(messages.check_peers(reply)[0])
        return True

    def _learn(self, addresses: list[tuple[str, int]]) -> None:
        if self.pool.learn(addresses):
            with self._lock:
                self._trying.pop(tuple(addresses), None)

    def take(self, entries: list[tuple[str, list[tuple[str, int]], float]]) -> None:
        """Prove the peers the list names that this submitter has not verified; drop the learned ones it
        no longer names (unless connected)."""
        named = {peer_id for peer_id, _, _ in entries}
        now = time.monotonic()
        with self._lock:
            self._trying = {addresses: due for addresses, due in self._trying.items() if due > now}
        for peer_id, addresses, _ in entries:
            record = self.pool.directory.get(peer_id)
            if record is None or not record.verified:
                with self._lock:  # one handshake at a time at an address; one that failed waits AGE_OUT
                    if self._trying.get(tuple(addresses), 0.0) > now:
                        continue
                    self._trying[tuple(addresses)] = now + messages.AGE_OUT
                self.run_soon(self._learn, addresses)
        for record in self.pool.directory.records():
            peer_id = record.advert.peer_id
            if record.source == "gossip" and peer_id not in named and self.pool.pooled(peer_id) is None:
                log.info("gossip: peer %s is no longer in the lists: dropped", record.advert.name)
                self.pool.directory.remove(peer_id)
