"""Finding peers: the peer directory, static peers and the cache; mDNS itself is mdns.py's.

Every peer registers `<label>-<tag>._gpulayer._tcp.local.` with its Advert in the TXT record, the
label being its name made fit for one DNS label (`instance_label`), the tag one it keeps across
restarts (`kept_tag`) or its peer id. Its IPv4 and IPv6 addresses go out on each interface, that
interface's only. Registration skips probing (the name holds a unique tag), so a new peer is seen in milliseconds;
browsers ask with QM questions, so a late joiner gets multicast answers at once instead of
waiting about a second for unicast ones. zeroconf keeps a peer that died without a goodbye
listed for up to about 19 minutes, so liveness is the client's job.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .security import cache_home
from .resources.model import TXT_VALUE_MAX, Advert

log = logging.getLogger("gpulayer.discovery")

SERVICE_TYPE = "_gpulayer._tcp.local."
INTERFACES_ENV = "GPULAYER_INTERFACES"
PEERS_ENV = "GPULAYER_PEERS"
CACHE_ENV = "GPULAYER_CACHE"
CACHE_KEEP_S = 86400.0  # a cached peer that no process proved for this long is no longer written back
MAX_RECORDS = 1024  # unverified claims a directory holds at most
MAX_CLAIMS = 8  # unverified claims to one peer id at most (each costs a handshake when the peer is needed)
LABEL_MAX = 63  # bytes in one DNS label (RFC 1035): a peer's mDNS instance name is one label
MAX_FOREIGN = 256  # peers of other clusters counted at most (their ids only)
Address = tuple[str, int]


def configured_interfaces(interfaces: list[str] | None = None) -> list[str] | None:
    """The addresses (IPv4 or IPv6) to use for mDNS: the argument, else GPULAYER_INTERFACES, else None (all)."""
    if interfaces:
        return list(interfaces)
    env = os.environ.get(INTERFACES_ENV, "").strip()
    return [i.strip() for i in env.split(",") if i.strip()] or None


def plain_ip(ip: str | tuple[str, int, int]) -> str:
    """An ifaddr address as text, without IPv6's flow and scope."""
    return ip if isinstance(ip, str) else ip[0]


def advertised_addresses(interfaces: list[str] | None) -> list[str]:
    """The addresses a peer puts in its mDNS record: IPv4 and IPv6 (global, and link-local without the
    scope, which each receiver adds: its own interface's), never loopback unless it has nothing else."""
    if interfaces:
        return [i for i in interfaces if i not in ("0.0.0.0", "::")]
    import ifaddr  # here: the peer's start, and `gpulayer join`, need it; a submitter never does

    found = [plain_ip(ip.ip) for adapter in ifaddr.get_adapters() for ip in adapter.ips]
    return [a for a in found if not ipaddress.ip_address(a).is_loopback] or ["127.0.0.1"]


def remote(addr: tuple[Any, ...]) -> Address:
    """(host, port) of an accepted connection's other side: an IPv4-mapped IPv6 address as the IPv4 one."""
    host = ipaddress.ip_address(addr[0].split("%")[0])
    if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped is not None:
        return str(host.ipv4_mapped), addr[1]
    return addr[0], addr[1]


def host_port(address: Address) -> str:
    """HOST:PORT, with an IPv6 host in brackets."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_name(name: str) -> str:
    """A peer name that its TXT record carries whole (printable, at most 253 bytes); else ConfigError."""
    if not name.isprintable():
        raise ConfigError(f"peer name {name!r} has control or other non-printable characters")
    room = TXT_VALUE_MAX - len("n=")
    if len(name.encode()) > room:
        raise ConfigError(f"peer name {name[:40]!r}... is {len(name.encode())} bytes long; at most {room} can "
                          "be advertised")
    return name


def instance_label(name: str, tag: str) -> str:
    """The mDNS instance label of a peer: its name with dots and non-printable characters as '-' (a dot
    would split the label: other browsers would not see the service), cut to fit one DNS label with
    its tag (its peer id, or the tag it keeps: `kept_tag`), which keeps it unique. The whole name travels
    in the TXT record."""
    suffix = f"-{tag}"
    shown = "".join(ch if ch.isprintable() and ch != "." else "-" for ch in name)
    room = LABEL_MAX - len(suffix.encode())
    return shown.encode()[:room].decode("utf-8", "ignore") + suffix


def kept_tag(folder: Path) -> str | None:
    """The instance tag kept in the peer's state folder (made at its first start there), or None where the
    folder cannot keep one. The folder is this peer's alone while it runs (peer/jobs.py holds it)."""
    path = folder / "mdns-instance"
    try:
        tag = path.read_text().strip() if path.exists() else ""
        if len(tag) != TAG_HEX or tag.strip("0123456789abcdef"):
            tag = secrets.token_hex(TAG_HEX // 2)
            path.write_text(tag + "\n")
        return tag
    except (OSError, UnicodeDecodeError) as exc:
        log.debug("no stable instance name (%s): the peer id names the advert", exc)
        return None


TAG_HEX = 12  # hex digits of a kept instance tag, as many as a peer id's
@dataclass(eq=False)  # a claim is itself: two with equal fields are still two
class PeerRecord:
    """One claim of where a peer is: its advert, its addresses, where we heard of it, and its health.

    Several claims may carry one peer id: adverts under other instance names (a copy, or the peer's
    own), the cache, a static address, and the handshake that verified it. Only a handshake says
    which of them is that peer (`verified`: the advert came with its HELLO, the address is the one
    connected to)."""

    advert: Advert
    addresses: list[tuple[str, int]]
    source: str  # "mdns", "static", "cache"
    verified: bool = False  # the advert and addresses came from a handshake with the cluster key
    name: str = ""  # the mDNS name that announced it (unverified mDNS records only)
    proved: float = 0.0  # a cache claim's: when a handshake last proved the peer there (time.time())
    down_until: float = 0.0
    error: str = ""

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    @property
    def address(self) -> str:
        return host_port(self.addresses[0]) if self.addresses else "?"

    @property
    def claim(self) -> tuple[str, str]:
        """What a fresh record of the same origin replaces: the handshake's, or that of its source and name."""
        return ("verified", "") if self.verified else (self.source, self.name)


class Directory:
    """The peers of one cluster known from every source; safe to use from any thread.

    Adverts are hints: each one is kept as a claim beside the others of its peer id (one per
    mDNS instance name, the cache's) and beside the claim that a handshake verified; none
    replaces another's, and a goodbye removes only the claim its own name made. The engine
    tries every claim's addresses and keeps the one whose handshake proves that id. At most
    `max_records` unverified claims in all, and MAX_CLAIMS to one peer id (a new one takes the
    place of one that failed), are held, so that a flood of adverts cannot grow the directory, or
    the handshakes one peer costs, without bound. `on_new`, when set, is called with the first claim
    to each peer id (outside the lock). Adverts of other clusters are only counted (`seen_elsewhere`).
    """

    def __init__(self, cluster: str, cache_path: Path | None = None, max_records: int = MAX_RECORDS):
        self.cluster = cluster
        self.cache_path = cache_path
        self.max_records = max_records
        self._claims: dict[str, list[PeerRecord]] = {}  # peer id -> its claims, oldest first
        self._unverified = 0
        self._changed = threading.Condition()
        self.on_new: Callable[[PeerRecord], None] | None = None  # told of each peer id's first claim
        self._foreign: dict[str, str] = {}  # peer id -> cluster id, of adverts of other clusters (ids only)

    def seen_elsewhere(self, advert: Advert) -> None:
        """Count an advert of another cluster: its peer id and cluster id, nothing else, MAX_FOREIGN at most."""
        with self._changed:
            if advert.peer_id in self._foreign or len(self._foreign) < MAX_FOREIGN:
                self._foreign[advert.peer_id] = advert.cluster

    def foreign(self) -> dict[str, str]:
        """The peers of other clusters seen: peer id -> its cluster id."""
        with self._changed:
            return dict(self._foreign)

    def foreign_note(self) -> str:
        """A sentence on the peers of other clusters seen (a wrong key looks like no peer at all), or ""."""
        seen = self.foreign()
        clusters, count = sorted(set(seen.values())), len(seen)
        if not count:
            return ""
        return (f"{count} peer{'s' if count > 1 else ''} of another cluster (ids {', '.join(clusters)}) "
                f"{'were' if count > 1 else 'was'} seen; this key's cluster id is {self.cluster} (`gpulayer key id`)")

    def prove(self, advert: Advert, addresses: list[tuple[str, int]], source: str) -> bool:
        """A handshake at `addresses` proved the peer of `advert` (its HELLO's): its verified record, heard of
        through `source`; False if it belongs to another cluster."""
        return self.upsert(PeerRecord(advert, addresses, source if source in ("static", "gossip") else "mdns",
                                      verified=True))

    def upsert(self, record: PeerRecord) -> bool:
        """Add or refresh a claim; False when it is ignored (another cluster, or too many claims)."""
        if record.advert.cluster != self.cluster:
            return False
        with self._changed:
            new = record.advert.peer_id not in self._claims
            claims = self._claims.setdefault(record.advert.peer_id, [])
            old = next((c for c in claims if c.claim == record.claim), None)
            if old is not None:
                record.down_until, record.error = old.down_until, old.error
                claims[claims.index(old)] = record
            elif record.verified:
                claims.insert(0, record)
            elif sum(not c.verified for c in claims) >= MAX_CLAIMS:
                failed = next((c for c in claims if not c.verified and not c.up), None)
                if failed is None:
                    log.debug("%d claims to %s already: ignoring one", MAX_CLAIMS, record.advert.peer_id)
                    return False
                claims[claims.index(failed)] = record  # one whose handshake failed makes room
            elif self._unverified >= self.max_records:
                log.debug("directory full (%d claims): ignoring the advert of %s", self.max_records,
                          record.advert.peer_id)
                if not claims:
                    del self._claims[record.advert.peer_id]
                return False
            else:
                claims.append(record)
                self._unverified += 1
            self._changed.notify_all()
        if new and self.on_new is not None:
            self.on_new(record)
        return True

    def remove(self, peer_id: str) -> None:
        """Forget the peer: every claim to its id."""
        with self._changed:
            claims = self._claims.pop(peer_id, None)
            if claims is not None:
                self._unverified -= sum(not c.verified for c in claims)
                self._changed.notify_all()

    def drop(self, record: PeerRecord) -> None:
        """Forget one claim (its endpoint failed the key, or proved another id); the peer with its last."""
        with self._changed:
            claims = self._claims.get(record.advert.peer_id, [])
            if record in claims:
                claims.remove(record)
                self._unverified -= not record.verified
                if not claims:
                    del self._claims[record.advert.peer_id]
                self._changed.notify_all()

    def withdraw(self, peer_id: str, name: str) -> PeerRecord | None:
        """An mDNS goodbye for `name`: remove the unverified claim that name made, and only that.

        Returns the peer's verified or static claim, if it has one, whose owner must check for
        itself whether the peer is gone; None otherwise.
        """
        with self._changed:
            claims = self._claims.get(peer_id, [])
            made = next((c for c in claims if c.claim == ("mdns", name)), None)
            if made is not None:
                self.drop(made)
            return next((c for c in claims if c.verified or c.source == "static"), None)

    def mark_down(self, peer_id: str, reason: str, until: float,
                  addresses: list[tuple[str, int]] | None = None) -> None:
        """Skip the peer's claims at any of `addresses` (all of its claims: None) until `until` (monotonic)."""
        for record in self.claims(peer_id):
            if addresses is None or set(record.addresses) & set(addresses):
                record.down_until, record.error = until, reason

    def claims(self, peer_id: str) -> list[PeerRecord]:
        """Every claim to the peer id: the verified one first, then those that are up, oldest first."""
        with self._changed:
            return sorted(self._claims.get(peer_id, []), key=lambda c: (not c.verified, not c.up))

    def get(self, peer_id: str) -> PeerRecord | None:
        """The peer's claim that stands for it: the verified one, else the first that is up."""
        claims = self.claims(peer_id)
        return claims[0] if claims else None

    def records(self) -> list[PeerRecord]:
        """One record per peer: the claim that stands for it (`get`)."""
        with self._changed:
            ids = list(self._claims)
        return [record for record in map(self.get, ids) if record is not None]

    def wait_for(self, predicate: Callable[[list[PeerRecord]], bool], timeout: float) -> bool:
        """Wait until predicate(records) is true or `timeout` passes; returns the last verdict."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self.records()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.25))  # also when a peer's down back-off runs out
            return True

    def load_cache(self) -> None:
        """Add last-known peers as unverified records (verified on connect)."""
        if self.cache_path is None:
            return
        try:
            entries = json.loads(self.cache_path.read_text()).get(self.cluster, [])
            for entry in entries:
                addresses = [(host, int(port)) for host, port in entry["addresses"]]
                self.upsert(PeerRecord(Advert.from_txt(entry["txt"]), addresses, "cache",
                                       proved=float(entry.get("proved", 0.0))))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.debug("ignoring peer cache %s: %s", self.cache_path, exc)

    def save_cache(self) -> None:
        """Remember the peers that are up, for the next submitter process: those a handshake proved, and the
        cache's own that nothing disproved, proved within CACHE_KEEP_S (a process that used one peer, or
        none, keeps the others)."""
        if self.cache_path is None:
            return
        now = time.time()
        entries = [{"txt": r.advert.to_txt(), "addresses": r.addresses, "proved": now if r.verified else r.proved}
                   for r in self.records()
                   if r.up and (r.verified or (r.source == "cache" and now - r.proved < CACHE_KEEP_S))]
        try:
            data = json.loads(self.cache_path.read_text()) if self.cache_path.exists() else {}
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        data[self.cluster] = entries
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_path.with_suffix(f".{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)  # also when an old temp file was there
                f.write(json.dumps(data))
            tmp.replace(self.cache_path)
        except OSError as exc:
            log.debug("could not write peer cache %s: %s", self.cache_path, exc)


def default_cache_path() -> Path | None:
    if os.environ.get(CACHE_ENV, "1") == "0":
        return None
    return cache_home() / "peers.json"


def static_peers(value: str | None = None) -> list[tuple[str, int]]:
    """Parse GPULAYER_PEERS=host:port,host:port (the fallback where multicast is blocked)."""
    value = os.environ.get(PEERS_ENV, "") if value is None else value
    out = []
    for item in filter(None, (i.strip() for i in value.split(","))):
        out.append(parse_address(item))
    return out


def parse_address(item: str) -> tuple[str, int]:
    host, sep, port = item.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"bad peer address {item!r}: expected host:port")
    return host.strip("[]"), int(port)


def hostname() -> str:
    return socket.gethostname().split(".")[0] or "peer"
