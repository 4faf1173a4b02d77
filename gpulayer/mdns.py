"""mDNS over zeroconf: a peer's `Advertiser`, a submitter's `Browser` (into discovery's Directory), and
`every_peer` (an invite's look-up), on sockets bound to the mDNS group (`group_sockets`).

Apart from discovery.py so that a process that never browses imports neither zeroconf nor asyncio
(about 25 ms of a submitter's start); the submitter's pool imports it on the thread that starts the
browse. discovery.py's docstring says how peers are advertised and found.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import logging
import secrets
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ifaddr
import zeroconf._core as zeroconf_core
import zeroconf._utils.net as zeroconf_net
from zeroconf import (DNSAddress, DNSIncoming, DNSOutgoing, DNSQuestion, DNSQuestionType, DNSRecord, InterfaceChoice,
                      IPVersion, ServiceBrowser, ServiceInfo, ServiceListener, ServiceStateChange, Zeroconf)

from .discovery import (SERVICE_TYPE, Directory, PeerRecord, advertised_addresses, instance_label, kept_tag,
                        plain_ip)
from .resources.model import Advert

log = logging.getLogger("gpulayer.discovery")

_MDNS_GROUP = "224.0.0.251"
_MDNS_PORT = 5353
_TYPE_PTR, _CLASS_IN = 12, 1
MAX_LOOKUPS = 32  # mDNS service-info look-ups outstanding at once; more names wait for the next announcement
LOOKUP_TIMEOUT_MS = 1500


def _zeroconf(interfaces: list[str] | None) -> Zeroconf:
    """A Zeroconf on its own thread, even when called from inside a running event loop, with its
    sockets bound to the mDNS group where the system allows it (`group_sockets`)."""
    choice = interfaces if interfaces else InterfaceChoice.All
    version = ip_version(interfaces)

    def make() -> Zeroconf:
        if not GROUP_BOUND:
            return Responder(interfaces=choice, ip_version=version)
        with _SOCKETS_LOCK:  # zeroconf looks its socket factory up by name when it starts
            setattr(zeroconf_core, "create_sockets", group_sockets)
            try:
                return Responder(interfaces=choice, ip_version=version)
            finally:
                setattr(zeroconf_core, "create_sockets", zeroconf_net.create_sockets)

    with ThreadPoolExecutor(1) as pool:  # no event loop runs there, so zeroconf starts its own thread
        return pool.submit(make).result()


def ip_version(interfaces: list[str] | None) -> IPVersion:
    """IPv4 and IPv6 on all interfaces where this host has IPv6; else those of the addresses given."""
    if interfaces:
        has_v6 = any(":" in i for i in interfaces)
        return (IPVersion.All if any(":" not in i for i in interfaces) else IPVersion.V6Only) if has_v6 \
            else IPVersion.V4Only
    return IPVersion.All if socket.has_ipv6 else IPVersion.V4Only


LEGACY_UNICAST_TTL = 10  # seconds at most in an answer to a query from a port other than 5353 (RFC 6762 6.7)


class Responder(Zeroconf):
    """zeroconf's Zeroconf, whose answers to legacy unicast queries (sent from a port other than 5353,
    as `dig` and our own `query_now` do) carry TTLs of at most LEGACY_UNICAST_TTL: such a querier is
    no full mDNS resolver, and would keep a record for an hour (RFC 6762 section 6.7)."""

    def async_send(self, out: DNSOutgoing, addr: str | None = None, port: int = _MDNS_PORT,
                   v6_flow_scope: tuple[()] | tuple[int, int] = (),
                   transport: Any = None) -> None:
        if addr is not None and port != _MDNS_PORT:
            out.answers = [(_capped(record), when) for record, when in out.answers]
            out.additionals = [_capped(record) for record in out.additionals]
        if not any(isinstance(r, DNSAddress) for r in [a for a, _ in out.answers] + out.additionals):
            return super().async_send(out, addr, port, v6_flow_scope, transport)
        adapters = list(ifaddr.get_adapters())  # once a message, not once a sender: it reads every interface
        for sender in [transport] if transport is not None else list(self.engine.senders):
            own = _own_addresses(adapters, sender.transport.get_extra_info("socket"), addr, v6_flow_scope)
            super().async_send(_only(out, own), addr, port, v6_flow_scope, sender)


def _own_addresses(adapters: list[ifaddr.Adapter], sock: Any, addr: str | None,
                   scope: tuple[()] | tuple[int, int]) -> set[bytes] | None:
    """The packed addresses of the interface (among `adapters`) a message goes out on: for a reply to
    `addr`, the one toward it (its IPv6 scope, else the subnet that holds it: the socket it came in on
    says nothing); else the one `sock` sends on (its IPv6 scope, its IPv4 multicast interface). None
    when unknown."""
    try:
        if addr is not None:
            target = ipaddress.ip_address(addr.split("%")[0])
            chosen = [a for a in adapters if a.index == scope[1]] if scope and scope[1] else \
                [a for a in adapters for ip in a.ips
                 if target in ipaddress.ip_network(f"{plain_ip(ip.ip)}/{ip.network_prefix}", False)]
        elif len(sock.getsockname()) == 4:  # IPv6: bound to the group at the interface's scope
            chosen = [a for a in adapters if a.index == sock.getsockname()[3]]
        else:
            where = socket.inet_ntoa(sock.getsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, 4))
            chosen = [a for a in adapters if any(ip.ip == where for ip in a.ips)]
    except (OSError, ValueError, TypeError):
        return None
    return {_packed(plain_ip(ip.ip)) for a in chosen[:1] for ip in a.ips} or None


def _packed(address: str) -> bytes:
    return socket.inet_pton(socket.AF_INET6 if ":" in address else socket.AF_INET, address)


def _only(out: DNSOutgoing, own: set[bytes] | None) -> DNSOutgoing:
    """A copy of `out` whose address records are those of `own` only (RFC 6762 section 6.2: each interface
    its own addresses); `out` itself when `own` is None."""
    if own is None:
        return out
    kept = DNSOutgoing(out.flags, out.multicast, out.id)
    kept.questions = list(out.questions)
    kept.answers = [(r, when) for r, when in out.answers if not isinstance(r, DNSAddress) or r.address in own]
    kept.authorities = list(out.authorities)
    kept.additionals = [r for r in out.additionals if not isinstance(r, DNSAddress) or r.address in own]
    return kept


def _capped(record: DNSRecord) -> DNSRecord:
    """The record, or a copy of it with a TTL of LEGACY_UNICAST_TTL when its own is longer."""
    if record.ttl <= LEGACY_UNICAST_TTL:
        return record
    capped = copy.copy(record)  # the registry's record keeps its TTL for multicast answers
    capped.ttl = LEGACY_UNICAST_TTL
    return capped


GROUP_BOUND = sys.platform.startswith(("linux", "darwin"))  # systems that bind a socket to a multicast group
_SOCKETS_LOCK = threading.Lock()
_IP_MULTICAST_ALL = 49  # Linux: deliver to a socket only the groups it joined itself (0)


def group_sockets(interfaces: zeroconf_net.InterfacesType, unicast: bool, ip_version: IPVersion,
                  apple_p2p: bool = False) -> tuple[socket.socket | None, list[socket.socket]]:
    """zeroconf's sockets (`create_sockets`), bound to the mDNS groups (224.0.0.251:5353, [ff02::fb]:5353)
    instead of the wildcard and each interface's address: they receive what is sent to the group and
    nothing sent to this host's own addresses, so that unicast queries to port 5353 (RFC 6762 section
    6.7; `dig -p 5353 @HOST`) reach the system's responder (avahi, mDNSResponder), which binds the
    wildcard. Bound to a group, a socket sends from the address of the interface that IP_MULTICAST_IF
    (IPV6_MULTICAST_IF) picks, from port 5353. IPv4: the listen socket joins the group on every
    interface, and each interface's responder only sends. IPv6: one socket an interface, bound to the
    group at that interface's scope, receives and sends."""
    listen = zeroconf_net.new_socket(bind_addr=(_MDNS_GROUP,), ip_version=IPVersion.V4Only, apple_p2p=apple_p2p)
    if listen is None:
        return zeroconf_net.create_sockets(interfaces, unicast, ip_version, apple_p2p)
    responders = []
    chosen = zeroconf_net.normalize_interface_choice(interfaces, ip_version)
    for interface in [i for i in chosen if isinstance(i, str)] if ip_version != IPVersion.V6Only else []:
        if not zeroconf_net.add_multicast_member(listen, interface):
            continue
        sock = zeroconf_net.new_socket(bind_addr=(_MDNS_GROUP,), ip_version=IPVersion.V4Only, apple_p2p=apple_p2p)
        if sock is None:
            continue
        if sys.platform.startswith("linux"):
            sock.setsockopt(socket.IPPROTO_IP, _IP_MULTICAST_ALL, 0)  # no copy of what the listen socket gets
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(str(interface)))
        zeroconf_net.set_respond_socket_multicast_options(sock, IPVersion.V4Only)
        responders.append(sock)
    indexes = {i[1] for i in chosen if isinstance(i, tuple)} if ip_version != IPVersion.V4Only else set()
    responders += filter(None, (_group_socket_v6(index, apple_p2p) for index in sorted(indexes)))
    return listen, responders


_MDNS_GROUP6 = "ff02::fb"


def _group_socket_v6(index: int, apple_p2p: bool) -> socket.socket | None:
    """A socket bound to [ff02::fb%index]:5353 that joined the group there and sends there; None where
    that interface has no IPv6 multicast."""
    try:
        sock = zeroconf_net.new_socket(bind_addr=(_MDNS_GROUP6, 0, index), ip_version=IPVersion.V6Only,
                                       apple_p2p=apple_p2p)
    except OSError as exc:
        log.debug("no IPv6 mDNS on interface %d: %s", index, exc)
        return None
    if sock is None:
        return None
    if not zeroconf_net.add_multicast_member(sock, (("", 0, 0), index)):
        sock.close()
        return None
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, index)
    zeroconf_net.set_respond_socket_multicast_options(sock, IPVersion.V6Only)
    return sock


ANNOUNCEMENTS = 3  # of a record, and of each update (RFC 6762 section 8.3: at least 2, at most 8)
ANNOUNCE_PAUSE = 1.0  # seconds from the first to the second; each later pause doubles the last gap


class Advertiser:
    """Publishes one peer's advert over mDNS until `close()`, which sends a goodbye.

    The record is announced ANNOUNCEMENTS times, at once, then after 1 s, then after twice the last
    gap (RFC 6762 section 8.3: at least one second apart, the interval doubling), and again so for each
    update; it answers queries from the
    first announcement on. No probing: the name holds the peer id, or a tag that the peer keeps in its
    `state` folder across restarts (`kept_tag`), so that browsers see one service, not a goodbye and a
    new one at each restart."""

    def __init__(self, advert: Advert, port: int, interfaces: list[str] | None = None, state: Path | None = None):
        tag = kept_tag(state) if state is not None else None
        self.zc = _zeroconf(interfaces)
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{instance_label(advert.name, tag or advert.peer_id)}.{SERVICE_TYPE}",
            port=port,
            properties=advert.to_txt(),
            server=f"gpulayer-{advert.peer_id}.local.",
            parsed_addresses=advertised_addresses(interfaces),
        )
        self._announcing: asyncio.Task[None] | None = None
        self._on_loop(self._publish(self.info, new=True))

    def _on_loop(self, coro: Coroutine[Any, Any, None]) -> None:
        assert self.zc.loop is not None
        asyncio.run_coroutine_threadsafe(coro, self.zc.loop).result(LOOKUP_TIMEOUT_MS / 1000)

    async def _publish(self, info: ServiceInfo, new: bool) -> None:
        """Put `info` in the registry (it answers queries), announce it now, and later on the schedule."""
        if new:
            info.set_server_if_missing()
            await self.zc.async_wait_for_start()
            self.zc.registry.async_add(info)
        else:
            self.zc.registry.async_update(info)
        if self._announcing is not None:
            self._announcing.cancel()
        out = self.zc.generate_service_broadcast(info, None)
        self.zc.async_send(out)
        self._announcing = asyncio.ensure_future(self._announce_later(out, time.monotonic()))

    async def _announce_later(self, out: DNSOutgoing, last: float) -> None:
        pause = ANNOUNCE_PAUSE
        for _ in range(ANNOUNCEMENTS - 1):
            await asyncio.sleep(pause)
            now = time.monotonic()
            self.zc.async_send(out)
            pause, last = 2 * (now - last), now  # a late wake-up stretches the next pause too

    async def _stop_announcing(self) -> None:
        if self._announcing is not None:
            self._announcing.cancel()

    def update(self, advert: Advert) -> None:
        """Publish a new TXT record for the same service (what a new probe found)."""
        self.info = ServiceInfo(SERVICE_TYPE, self.info.name, port=self.info.port, properties=advert.to_txt(),
                                server=self.info.server, addresses=self.info.addresses)
        self._on_loop(self._publish(self.info, new=False))

    def close(self) -> None:
        try:
            self._on_loop(self._stop_announcing())
            self.zc.unregister_service(self.info)
        finally:
            self.zc.close()


def every_peer(wait: float, interfaces: list[str] | None = None) -> list[tuple[str, int]]:
    """The addresses of the peers of any cluster heard over mDNS within `wait` seconds (MAX_LOOKUPS names
    at most): where a machine without a key looks for the peer of an invite (invite.py)."""
    names: list[str] = []

    def heard(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Added and name not in names and len(names) < MAX_LOOKUPS:
            names.append(name)

    zc = _zeroconf(interfaces)
    try:
        browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[heard], question_type=DNSQuestionType.QM)
        threading.Event().wait(wait)
        browser.cancel()
        found = []
        for name in list(names):
            info = zc.get_service_info(SERVICE_TYPE, name, timeout=LOOKUP_TIMEOUT_MS)
            if info is not None and info.port:
                found += [(address, info.port) for address in info.parsed_scoped_addresses()]
        return found
    finally:
        zc.close()


class Browser(ServiceListener):
    """An mDNS browse of GPUlayer peers that keeps a Directory up to date.

    Names whose records are in zeroconf's cache (a peer's announcement carries them all) are
    resolved at once; the others are looked up in the background, at most MAX_LOOKUPS at a
    time, so that a flood of bogus names never stalls the honest ones. A goodbye that cannot
    remove a verified or static record is passed to `on_goodbye(record)`, which checks.
    """

    def __init__(self, directory: Directory, interfaces: list[str] | None = None,
                 on_goodbye: Callable[[PeerRecord], None] | None = None):
        self.directory = directory
        self.interfaces = interfaces
        self.on_goodbye = on_goodbye
        self._closed = threading.Event()
        self._names: dict[str, str] = {}  # mDNS name -> peer id
        self._lookups: set[str] = set()
        self._lookups_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="gpulayer-mdns")
        self.zc = _zeroconf(interfaces)
        self.browser = ServiceBrowser(self.zc, SERVICE_TYPE, self, question_type=DNSQuestionType.QM)

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self._guarded(self._heard, zc, type_, name)

    update_service = add_service

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self._guarded(self._gone, name)

    @staticmethod
    def _guarded(handler: Callable[..., None], *args: Any) -> None:
        """Run a handler for one name on zeroconf's browser thread: an error (a name that zeroconf
        refuses, with a control character, say) ends that name's event, never the thread that
        reports all the others."""
        try:
            handler(*args)
        except Exception as exc:
            log.debug("ignoring an mDNS event for %r: %r", args[-1], exc)

    def _heard(self, zc: Zeroconf, type_: str, name: str) -> None:
        info = ServiceInfo(type_, name)
        if info.load_from_cache(zc):
            self._found(name, info)
            return
        with self._lookups_lock:
            if name in self._lookups or len(self._lookups) >= MAX_LOOKUPS or self._closed.is_set():
                log.debug("not looking up %s now (%d look-ups outstanding)", name, len(self._lookups))
                return
            self._lookups.add(name)
        self._pool.submit(self._look_up, zc, type_, name)

    def _look_up(self, zc: Zeroconf, type_: str, name: str) -> None:
        try:
            info = zc.get_service_info(type_, name, timeout=LOOKUP_TIMEOUT_MS)
            if info is not None and not self._closed.is_set():
                self._found(name, info)
        except Exception as exc:  # zeroconf closed meanwhile, or a malformed record
            log.debug("look-up of %s failed: %s", name, exc)
        finally:
            with self._lookups_lock:
                self._lookups.discard(name)

    def _found(self, name: str, info: ServiceInfo) -> None:
        if not info.port:
            return
        addresses = [(a, info.port) for a in info.parsed_scoped_addresses()]  # link-local: with our scope
        try:
            advert = Advert.from_txt(info.properties)
        except ValueError as exc:
            log.debug("ignoring %s: %s", name, exc)
            return
        if advert.cluster != self.directory.cluster:
            self.directory.seen_elsewhere(advert)
            return
        if not addresses:
            return
        if name in self._names or len(self._names) < 4 * self.directory.max_records:
            self._names[name] = advert.peer_id  # also when the directory is full: its goodbye counts
        self.directory.upsert(PeerRecord(advert, addresses, "mdns", name=name))

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
        for ip in [a for a in self.interfaces or advertised_addresses(None) if ":" not in a]:  # IPv4
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
                    try:
                        loop.call_soon_threadsafe(self.zc.record_manager.async_updates_from_response, answer)
                    except RuntimeError:  # the browser closed meanwhile: its loop is gone
                        return
        finally:
            selector.close()
            for sock in sockets.values():
                sock.close()

    def _gone(self, name: str) -> None:
        peer_id = self._names.pop(name, None)
        if peer_id is None:
            return
        unconfirmed = self.directory.withdraw(peer_id, name)
        if unconfirmed is not None and self.on_goodbye is not None:
            self.on_goodbye(unconfirmed)

    def close(self) -> None:
        self._closed.set()
        self.browser.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.zc.close()
