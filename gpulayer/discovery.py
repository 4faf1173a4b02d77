"""Finding peers: mDNS advertise and browse, the peer directory, static peers and the cache.

Every peer registers `<name>-<peer id>._gpulayer._tcp.local.` with its Advert in the TXT
record. Registration skips probing (the name holds a unique peer id), so a new peer is seen
in milliseconds; browsers ask with QM questions, so a late joiner gets multicast answers at
once instead of waiting about a second for unicast ones. zeroconf keeps a peer that died
without a goodbye listed for up to about 19 minutes, so liveness is the client's job.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import ifaddr
from zeroconf import (DNSIncoming, DNSOutgoing, DNSQuestion, DNSQuestionType, InterfaceChoice, IPVersion,
                      ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf)

from .errors import ConfigError
from .resources.model import Advert

log = logging.getLogger("gpulayer.discovery")

SERVICE_TYPE = "_gpulayer._tcp.local."
INTERFACES_ENV = "GPULAYER_INTERFACES"
PEERS_ENV = "GPULAYER_PEERS"
CACHE_ENV = "GPULAYER_CACHE"
_MDNS_GROUP = "224.0.0.251"
_TYPE_PTR, _CLASS_IN = 12, 1


def configured_interfaces(interfaces: list[str] | None = None) -> list[str] | None:
    """The IPv4 addresses to use for mDNS: the argument, else GPULAYER_INTERFACES, else None (all)."""
    if interfaces:
        return list(interfaces)
    env = os.environ.get(INTERFACES_ENV, "").strip()
    return [i.strip() for i in env.split(",") if i.strip()] or None


def _zeroconf(interfaces: list[str] | None) -> Zeroconf:
    """A Zeroconf on its own thread, even when called from inside a running event loop."""
    choice = interfaces if interfaces else InterfaceChoice.All
    with ThreadPoolExecutor(1) as pool:  # no event loop runs there, so zeroconf starts its own thread
        return pool.submit(Zeroconf, interfaces=choice, ip_version=IPVersion.V4Only).result()


def advertised_addresses(interfaces: list[str] | None) -> list[str]:
    """The addresses a peer puts in its mDNS record."""
    if interfaces:
        return [i for i in interfaces if i != "0.0.0.0"]
    found = [ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips
             if isinstance(ip.ip, str) and not ip.ip.startswith("127.")]
    return found or ["127.0.0.1"]


class Advertiser:
    """Publishes one peer's advert over mDNS until `close()`, which sends a goodbye."""

    def __init__(self, advert: Advert, port: int, interfaces: list[str] | None = None):
        self.zc = _zeroconf(interfaces)
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{advert.name}-{advert.peer_id}.{SERVICE_TYPE}",
            port=port,
            properties=advert.to_txt(),
            server=f"gpulayer-{advert.peer_id}.local.",
            parsed_addresses=advertised_addresses(interfaces),
        )
        self.zc.register_service(self.info, cooperating_responders=True)

    def close(self) -> None:
        try:
            self.zc.unregister_service(self.info)
        finally:
            self.zc.close()


@dataclass
class PeerRecord:
    """A known peer: its advert, where to reach it, where we heard of it, and its health."""

    advert: Advert
    addresses: list[tuple[str, int]]
    source: str  # "mdns", "static", "cache"
    seen: float = field(default_factory=time.time)
    down_until: float = 0.0
    error: str = ""

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    @property
    def address(self) -> str:
        return "%s:%d" % self.addresses[0] if self.addresses else "?"


class Directory:
    """The peers of one cluster known from every source; safe to use from any thread."""

    def __init__(self, cluster: str, cache_path: Path | None = None):
        self.cluster = cluster
        self.cache_path = cache_path
        self._records: dict[str, PeerRecord] = {}
        self._changed = threading.Condition()

    def upsert(self, record: PeerRecord) -> bool:
        """Add or refresh a record; records of another cluster are ignored."""
        if record.advert.cluster != self.cluster:
            return False
        with self._changed:
            old = self._records.get(record.advert.peer_id)
            if old is not None:
                record.down_until, record.error = old.down_until, old.error
                if record.source == "cache":
                    return False
            self._records[record.advert.peer_id] = record
            self._changed.notify_all()
        return True

    def remove(self, peer_id: str) -> None:
        with self._changed:
            if self._records.pop(peer_id, None) is not None:
                self._changed.notify_all()

    def get(self, peer_id: str) -> PeerRecord | None:
        return self._records.get(peer_id)

    def records(self) -> list[PeerRecord]:
        with self._changed:
            return list(self._records.values())

    def wait_for(self, predicate: Callable[[list[PeerRecord]], bool], timeout: float) -> bool:
        """Wait until predicate(records) is true or `timeout` passes; returns the last verdict."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(list(self._records.values())):
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
                self.upsert(PeerRecord(Advert.from_txt(entry["txt"]), addresses, "cache"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.debug("ignoring peer cache %s: %s", self.cache_path, exc)

    def save_cache(self) -> None:
        """Remember the peers that are up, for the next submitter process."""
        if self.cache_path is None:
            return
        entries = [{"txt": r.advert.to_txt(), "addresses": r.addresses}
                   for r in self.records() if r.up and r.source != "cache"]
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
            tmp.write_text(json.dumps(data))
            tmp.replace(self.cache_path)
        except OSError as exc:
            log.debug("could not write peer cache %s: %s", self.cache_path, exc)


def default_cache_path() -> Path | None:
    if os.environ.get(CACHE_ENV, "1") == "0":
        return None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpulayer" / "peers.json"


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


class Browser(ServiceListener):
    """An mDNS browse of GPUlayer peers that keeps a Directory up to date."""

    def __init__(self, directory: Directory, interfaces: list[str] | None = None):
        self.directory = directory
        self.interfaces = interfaces
        self._closed = threading.Event()
        self._names: dict[str, str] = {}  # mDNS name -> peer id
        self.zc = _zeroconf(interfaces)
        self.browser = ServiceBrowser(self.zc, SERVICE_TYPE, self, question_type=DNSQuestionType.QM)

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        info = zc.get_service_info(type_, name, timeout=1500)
        if info is None or not info.port:
            return
        addresses = [(a, info.port) for a in info.parsed_addresses(IPVersion.V4Only)]
        try:
            advert = Advert.from_txt(info.properties)
        except ValueError as exc:
            log.debug("ignoring %s: %s", name, exc)
            return
        if addresses and self.directory.upsert(PeerRecord(advert, addresses, "mdns")):
            self._names[name] = advert.peer_id

    update_service = add_service

    def query_now(self, window: float = 0.5) -> None:
        """Ask all peers at once with a one-shot legacy unicast query (RFC 6762, section 6.7).

        Answers to a query sent from a port other than 5353 come back by unicast straight
        away, free of the one-second multicast rate limit that can hold back the answers to a
        browser's first question when a peer announced itself, or answered, just before.
        """
        query = DNSOutgoing(0, multicast=False, id_=secrets.randbelow(65535) + 1)  # zeroconf drops repeats
        query.add_question(DNSQuestion(SERVICE_TYPE, _TYPE_PTR, _CLASS_IN))
        selector = selectors.DefaultSelector()
        sockets: dict[int, socket.socket] = {}
        for ip in self.interfaces or advertised_addresses(None):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(ip))
                sock.bind((ip, 0))
                for packet in query.packets():
                    sock.sendto(packet, (_MDNS_GROUP, 5353))
            except OSError as exc:
                log.debug("no fast query on %s: %s", ip, exc)
                sock.close()
                continue
            selector.register(sock, selectors.EVENT_READ)
            sockets[sock.fileno()] = sock
        deadline = time.monotonic() + window
        loop = self.zc.loop
        try:
            while sockets and loop is not None and not self._closed.is_set() and (left := deadline - time.monotonic()) > 0:
                for key, _ in selector.select(min(left, 0.05)):
                    try:
                        answer = DNSIncoming(sockets[key.fd].recv(9000))
                    except OSError:
                        continue
                    # into zeroconf's cache, as if heard by multicast: the browser then reports
                    # the peer, and later its goodbye
                    loop.call_soon_threadsafe(self.zc.record_manager.async_updates_from_response, answer)
        finally:
            selector.close()
            for sock in sockets.values():
                sock.close()

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        peer_id = self._names.pop(name, None)
        if peer_id is not None:
            self.directory.remove(peer_id)

    def close(self) -> None:
        self._closed.set()
        self.browser.cancel()
        self.zc.close()


def hostname() -> str:
    return socket.gethostname().split(".")[0] or "peer"
