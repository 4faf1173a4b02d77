"""The submitter's connection pool: where peers are found (mDNS, static peers, gossip), one authenticated
connection to each peer, the connections that peers handed to workers (leases, direct actor calls),
the peers table, and one heartbeat with one liveness rule for every connection (ADR 0005).

The rule (`silent_for`): a connection that owes answers (tasks or calls in flight) is lost when nothing
came on it for `LOST_AFTER` heartbeats since it began to owe them, or since it was last heard, whichever
is later. A peer's own connection owes every answer owed on any connection to that peer, and gets a
PING every heartbeat; a leased worker says it is alive while it runs (ADR 0013); an actor's worker may
hold its GIL through a long method (its connection's `beats` is False), so a direct connection is
watched through its peer's (ADR 0012). A peer's own connection lost to silence ends every connection to
that peer, which is skipped for `DOWN_BACKOFF` seconds: its host, most likely, is cut off or frozen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING, Any

from .. import discovery
from ..errors import AuthError, GPULayerError
from ..protocol import messages
from ..resources.utilisation import clean_sample
from .connection import CONNECT_TIMEOUT, Listener, PeerConnection
from .gossip import Gossip

if TYPE_CHECKING:
    from .. import mdns
    from .actors import DirectConnection
    from .leases import LeaseConnection

log = logging.getLogger("gpulayer.client")

DOWN_BACKOFF = 5.0  # seconds a peer that failed is skipped before it is tried again
LOST_AFTER = 3  # heartbeats without a word from a connection that owes answers
DEFER_DISCOVERY_S = 0.25  # discovery waits this long when cached peers can be tried first (`Pool.start`)


class Pool:
    """The connections of one submitter: each peer's own (`own`, reporting to `listener`), the leases
    (`leases`, by peer id) and direct actor connections (`directs`, by actor id) that their managers
    open and keep here, and the heartbeat that watches them all."""

    def __init__(self, key: bytes, submitter_id: str, directory: discovery.Directory, listener: Listener,
                 heartbeat: float, static: list[tuple[str, int]]):
        self.key = key
        self.submitter_id = submitter_id
        self.directory = directory
        self.listener = listener
        self.heartbeat = heartbeat
        self.static = static
        self.static_errors: dict[str, str] = {}
        self.own: dict[str, PeerConnection] = {}
        self.leases: dict[str, LeaseConnection] = {}  # by peer id (client/leases.py)
        self.directs: dict[str, DirectConnection] = {}  # by actor id (client/actors.py)
        self.closed = threading.Event()
        self._lock = threading.Lock()  # guards `own` and `_connecting`
        self._connecting: dict[str, threading.Lock] = {}
        self._received_before = 0  # bytes read on the peers' own connections closed since
        self._browser: mdns.Browser | None = None
        self._browsing = threading.Lock()  # the browser is set, or closed at once when the pool closed first
        self._mdns, self._discovering = False, False  # what `start` was given; whether `discover` ran
        self._interfaces: list[str] | None = None
        self._helpers = ThreadPoolExecutor(16, thread_name_prefix="gpulayer-pool")
        # the handshakes at the claims of a peer's id (`_verify`): several peers' at once
        self._handshakes = ThreadPoolExecutor(4 * discovery.MAX_CLAIMS, thread_name_prefix="gpulayer-verify")
        self.gossip = Gossip(self, self.closed, self._helpers.submit)  # lists of verified peers (ADR 0017)

    def start(self, mdns: bool, interfaces: list[str] | None, on_beat: Callable[[], None]) -> None:
        """Start the heartbeat, which calls `on_beat` first on each round, and discovery (`discover`): at
        once, or after DEFER_DISCOVERY_S when the directory already holds peers (the cache's) to try first.
        Their handshake is then the only CPU spent before a first placement: the browse (zeroconf's import
        and start, about 25 ms of CPU) and the static probes would hold the GIL and the cores it needs."""
        self._mdns, self._interfaces = mdns, interfaces
        threading.Thread(target=self._heartbeat, args=(on_beat,), name="gpulayer-heartbeat", daemon=True).start()
        threading.Thread(target=self.gossip.run, name="gpulayer-gossip", daemon=True).start()
        if not self.directory.records():
            self.discover()
        else:
            threading.Thread(target=self._discover_later, name="gpulayer-discover", daemon=True).start()

    def _discover_later(self) -> None:
        if not self.closed.wait(DEFER_DISCOVERY_S):
            self.discover()

    def discover(self) -> None:
        """Browse mDNS (on the interfaces given to `start`, None: discovery's default) if asked to, and
        probe the static peers; once, whoever calls first (a placement that finds no candidate does)."""
        with self._lock:
            if self._discovering:
                return
            self._discovering = True
        if self._mdns:
            threading.Thread(target=self._browse, args=(self._interfaces,), name="gpulayer-query", daemon=True).start()
        for address in self.static:
            self._helpers.submit(self.probe_static, address)

    def _browse(self, interfaces: list[str] | None) -> None:
        """Browse mDNS and ask at once, on a thread of its own: zeroconf's import and start overlap with the
        static peers' handshakes instead of coming before them."""
        from .. import mdns

        try:
            browser = mdns.Browser(self.directory, interfaces, self._on_goodbye)
        except OSError as exc:
            log.warning("no mDNS browse (the static and cached peers only): %s", exc)
            return
        with self._browsing:
            if not self.closed.is_set():
                self._browser = browser
        if self._browser is not browser:
            return browser.close()
        browser.query_now()

    def probe_static(self, address: tuple[str, int]) -> None:
        label = "%s:%d" % address
        try:
            self.open([address], "static")
            self.static_errors.pop(label, None)
        except (OSError, GPULayerError) as exc:
            self.static_errors[label] = str(exc)

    def learn(self, addresses: list[tuple[str, int]]) -> bool:
        """A peer that a key holder's list named (client/gossip.py): a hint until a handshake there proves
        it; then its record has source "gossip". False when none did."""
        try:
            self.open(addresses, "gossip")
        except (OSError, GPULayerError) as exc:
            log.debug("no peer proved at %s: %s", addresses, exc)
            return False
        return True

    # ---- connections ------------------------------------------------------------------------------

    def all(self) -> list[PeerConnection]:
        """Every open connection: the peers' own, the leases and the direct ones."""
        return [*self.own.values(), *self.leases.values(), *self.directs.values()]

    def pooled(self, peer_id: str) -> PeerConnection | None:
        """The open connection to a peer, if there is one."""
        conn = self.own.get(peer_id)
        return None if conn is None or conn.closed else conn

    def connection(self, record: discovery.PeerRecord) -> PeerConnection:
        """The live connection to the record's peer, else one opened where a handshake proves that peer."""
        peer_id = record.advert.peer_id
        conn = self.pooled(peer_id)
        if conn is not None:
            return conn
        with self._lock:
            gate = self._connecting.setdefault(peer_id, threading.Lock())
        with gate:
            return self.pooled(peer_id) or self._verify(record)

    def connection_to(self, peer_id: str, addresses: list[tuple[str, int]]) -> PeerConnection:
        """The connection to one known peer (an actor's), opened at `addresses` when there is none.

        Raises ConnectionError when another peer answers there (the actor's peer is gone).
        """
        conn = self.pooled(peer_id)
        if conn is not None:
            return conn
        conn = self.open(addresses, "mdns")
        if conn.peer_id != peer_id:
            raise ConnectionError(f"peer {conn.name} ({conn.peer_id}) answers at {conn.address} now")
        return conn

    def _verify(self, record: discovery.PeerRecord) -> PeerConnection:
        """Handshake at the addresses of every claim to the record's peer id, at once; the first
        connection that proves that id is the peer's. Raises when none does."""
        peer_id = record.advert.peer_id
        groups: dict[tuple[tuple[str, int], ...], list[discovery.PeerRecord]] = {}
        for claim in self.directory.claims(peer_id) or [record]:
            groups.setdefault(tuple(claim.addresses), []).append(claim)
        if len(groups) == 1:
            return self._prove(peer_id, *groups.values())
        errors = []
        for future in as_completed([self._handshakes.submit(self._prove, peer_id, g) for g in groups.values()]):
            try:
                return future.result()
            except (OSError, GPULayerError) as exc:
                errors.append(str(exc))
        raise ConnectionError("; ".join(errors))

    def _prove(self, peer_id: str, claims: list[discovery.PeerRecord]) -> PeerConnection:
        """A connection at the claims' addresses (they share them) that proves `peer_id`.

        An endpoint that fails is skipped for a while. One that fails the key or proves another
        peer's id loses its claims, and a cached address that fails its own: none of them stands
        for this peer, nor changes its row or status."""
        try:
            conn = self.open(claims[0].addresses, claims[0].source)
        except (OSError, GPULayerError) as exc:
            for claim in claims:
                if isinstance(exc, AuthError) or claim.source == "cache":
                    self.directory.drop(claim)
            self.mark_down(peer_id, str(exc), claims[0].addresses)
            raise
        if conn.peer_id != peer_id:  # a copied advert, or a stale one: another peer answers there
            for claim in claims:
                self.directory.drop(claim)
            raise ConnectionError(f"{conn.address} is another peer, {conn.name} ({conn.peer_id})")
        return conn

    def open(self, addresses: list[tuple[str, int]], source: str) -> PeerConnection:
        """Connect and authenticate; the peer's HELLO refreshes (or creates) its directory record."""
        conn = PeerConnection(self.listener, addresses, self.key, self.submitter_id)
        if not self.directory.prove(conn.advert, addresses, source):
            conn.fail("the peer belongs to another cluster")
            raise AuthError(f"{conn.address} belongs to another cluster")
        with self._lock:  # the first live connection to a peer wins: tasks may be running on it
            old = self.own.get(conn.peer_id)
            if old is None or old.closed:
                self.own[conn.peer_id] = conn
                return conn
        conn.fail("a connection to this peer is already open")  # it holds no task yet
        return old

    def mark_down(self, peer_id: str, reason: str, addresses: list[tuple[str, int]] | None = None) -> None:
        """Skip the peer (its claims at `addresses`, or all of them) for DOWN_BACKOFF seconds."""
        self.directory.mark_down(peer_id, reason, time.monotonic() + DOWN_BACKOFF, addresses)

    def lost(self, conn: PeerConnection, reason: str) -> None:
        """A peer's own connection closed: out of the pool. Lost to silence, its peer is skipped for a
        while and every connection to it ends (a reset or a close means its host answered; if the peer
        is dead, the next connect is refused at once)."""
        with self._lock:
            if self.own.get(conn.peer_id) is conn:
                del self.own[conn.peer_id]
                self._received_before += conn.received
        if conn.silent and not self.closed.is_set():
            self.mark_down(conn.peer_id, reason, conn.addresses)
            for other in self.all():
                if other.peer_id == conn.peer_id:
                    other.fail(f"its peer {conn.name} went silent: {reason}", silent=True)

    def received_bytes(self) -> int:
        """Bytes read so far from the peers' connections (on the socket: records and all)."""
        return self._received_before + sum(conn.received for conn in self.all())

    # ---- liveness ---------------------------------------------------------------------------------

    def _heartbeat(self, on_beat: Callable[[], None]) -> None:
        while not self.closed.wait(self.heartbeat):
            on_beat()
            self.check()

    def check(self) -> None:
        """One round of the heartbeat: the liveness rule over every connection, then a PING on each peer's
        own connection that is still open."""
        limit = LOST_AFTER * self.heartbeat
        for conn, silence in silent_for(self.all(), dict(self.own), time.monotonic()).items():
            if silence > limit:
                conn.fail(f"no answer for {silence:.1f} s ({LOST_AFTER} heartbeats of {self.heartbeat:g} s)",
                          silent=True)
        for conn in list(self.own.values()):
            if not conn.closed:
                try:
                    conn.ping()
                except OSError as exc:
                    conn.fail(f"ping failed: {exc}")

    # ---- goodbyes and the peers table ---------------------------------------------------------------

    def _on_goodbye(self, record: discovery.PeerRecord) -> None:
        """An mDNS goodbye for a verified or static peer is a hint: ask the peer itself."""
        if not self.closed.is_set():
            self._helpers.submit(self._check_leaving, record)

    def _check_leaving(self, record: discovery.PeerRecord) -> None:
        try:
            status = self.status(record)
        except (OSError, GPULayerError) as exc:
            self.forget(record.advert.peer_id, f"gone after its goodbye: {exc}")
            return
        if status.get("draining"):
            self.forget(record.advert.peer_id, "the peer is shutting down")

    def forget(self, peer_id: str, reason: str) -> None:
        """The peer is gone: drop its record, or mark a static one down."""
        record = self.directory.get(peer_id)
        if record is not None and record.source == "static":
            self.mark_down(peer_id, reason)
        else:
            self.directory.remove(peer_id)

    def status(self, record: discovery.PeerRecord) -> dict[str, Any]:
        """The peer's STATUS reply, over its authenticated connection (opened if need be); untrusted."""
        return self.connection(record).request(messages.status_request(), CONNECT_TIMEOUT)

    def peers(self, probe: bool) -> list[dict[str, Any]]:
        """The known peers with their state; `probe` asks each for its load (a silent one shows as down)."""
        rows = list(self._helpers.map(lambda record: self._describe(record, probe), self.directory.records()))
        rows += [{"name": label, "address": label, "state": "down", "error": err, "source": "static", "verified": False}
                 for label, err in self.static_errors.items()]
        return sorted(rows, key=lambda r: r["name"])

    def _describe(self, record: discovery.PeerRecord, probe: bool) -> dict[str, Any]:
        """The peer's row; with `probe`, its STATUS from a connection that proved its id, and then the
        claim that the handshake verified (its advert and address)."""
        status: dict[str, Any] | None = None
        error = ""
        if probe:
            try:
                status = self.status(record)
            except (OSError, GPULayerError) as exc:
                error = str(exc)
                self.mark_down(record.advert.peer_id, error)
            record = self.directory.get(record.advert.peer_id) or record
        a = record.advert
        row = {"name": a.name, "peer_id": a.peer_id, "address": record.address, "accelerator": a.accelerator,
               "device": a.device_name, "memory_kind": a.memory_kind, "device_memory_gb": list(a.device_memory_gb),
               "ram_gb": a.ram_gb, "frameworks": dict(a.frameworks), "capabilities": sorted(a.capabilities),
               "slots": a.slots, "busy": None, "queued": None, "util": None, "source": record.source,
               "verified": record.verified, "state": "up" if record.up else "down", "error": record.error,
               "job_isolation": None, "job_isolation_reason": ""}
        if status is not None:
            row["busy"], row["queued"] = status["load"][:2]
            row["actors"] = len(status.get("actors") or [])  # slots that actors hold
            row["util"] = clean_sample(status.get("util"))
            held_bytes = status.get("held_bytes")  # untrusted: a whole number of bytes, or unknown
            row["held_bytes"] = held_bytes if type(held_bytes) is int and held_bytes >= 0 else None
            row.update(job_isolation(status))
            row["state"], row["error"] = "up", ""
        elif error:
            row["state"], row["error"] = "down", error
        return row

    def close(self) -> None:
        """Close every connection and stop browsing (once)."""
        if self.closed.is_set():
            return
        self.closed.set()
        for conn in self.all():
            conn.fail("the client closed")
        with self._browsing:
            browser = self._browser
        if browser is not None:
            browser.close()
        self._helpers.shutdown(wait=False, cancel_futures=True)
        self._handshakes.shutdown(wait=False, cancel_futures=True)


def silent_for(conns: list[PeerConnection], own: dict[str, PeerConnection], now: float) -> dict[PeerConnection, float]:
    """The liveness rule's measure: for each connection that owes answers and says something while it
    does (`beats`), the seconds since it began to owe them or was last heard, whichever is later. A
    peer's own connection (in `own`, by peer id) owes from the earliest moment any connection to that
    peer does."""
    owing: dict[str, float] = {}  # peer id -> since when some connection to it owes answers
    for conn in conns:
        if conn.pending:
            owing[conn.peer_id] = min(owing.get(conn.peer_id, now), conn.owing_since)
    silent = {}
    for conn in conns:
        since = owing.get(conn.peer_id) if own.get(conn.peer_id) is conn else \
            conn.owing_since if conn.pending else None
        if since is not None and conn.beats:
            silent[conn] = now - max(conn.last_heard, since)
    return silent


def job_isolation(status: dict[str, Any]) -> dict[str, Any]:
    """How a peer's STATUS says it holds a job's processes (untrusted): "cgroup", or "process-group" with
    why it has no cgroups for jobs; None from a peer that does not say."""
    isolation = status.get("job_isolation")
    reason = status.get("job_isolation_reason")
    return {"job_isolation": isolation if isolation in ("cgroup", "process-group") else None,
            "job_isolation_reason": messages.printable(reason) if isinstance(reason, str) else ""}
