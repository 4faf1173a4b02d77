"""Seeds and gossip (ADR 0017): how peers learn each other beyond one multicast domain.

Each peer keeps the members it has verified itself: peers whose handshake it ran (their HELLO named
the id, at the address it connected to), with the time of the freshest verification it knows of.
Once a round (GOSSIP_ROUND) it runs its exchanges, MAX_EXCHANGES side by side at most: with the oldest
hints (addresses it heard of and has not verified) and the members about to age out (DUE), else with
one seed it has no member at, else with one random member (of those half way to ageing out, when
there are some); each proves the key
both ways, sends its list and its port in a PEERS message and merges the list that comes back.
Lists travel only over the secure channel, between key holders; an entry is a peer id, its
addresses and the age of its last verification, never an advert. An id that is not a member yet
is only a hint: it becomes one after this peer's own handshake there. A member's age is refreshed
by the lists of others (the freshest wins), so a peer that died ages out of every list within
AGE_OUT of its last handshake. Lists hold MAX_LIST entries, hints MAX_HINTS.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from ..protocol import handshake, messages
from ..protocol.messages import AGE_OUT, MAX_LIST, peers_entry
from ..transport.blocking import connections
from ..discovery import Address
from ..resources.model import features_of
from ..errors import GPULayerError

log = logging.getLogger("gpulayer.peer")

GOSSIP_ROUND = 2.0  # seconds between a peer's exchanges
MAX_HINTS = 64  # addresses heard of and not verified yet
MAX_EXCHANGES = 8  # exchanges side by side in one round, at most (a join of N peers takes N / 8 rounds)
DUE = AGE_OUT - 2 * GOSSIP_ROUND  # a member not verified for so long is verified this round
EXCHANGE_TIMEOUT = 3.0


@dataclass
class Member:
    addresses: list[Address]
    verified: float  # monotonic: the freshest verification known, here or by another key holder


class Gossip:
    """One peer's members, hints and seeds; used on its event loop, but for `exchange` (blocking), which
    runs on a helper thread and touches nothing here."""

    def __init__(self, key: bytes, peer_id: str, addresses: list[Address], seeds: list[Address],
                 clock: Callable[[], float] = time.monotonic):
        self.key = key
        self.peer_id = peer_id
        self.addresses = addresses  # this peer's own, for its entry in its lists
        self.seeds = dict.fromkeys(seeds, 0.0)  # seed -> when it may be tried again (monotonic)
        self.clock = clock
        self.members: dict[str, Member] = {}
        self.hints: dict[tuple[Address, ...], None] = {}  # oldest first

    def listing(self) -> list[dict[str, Any]]:
        """This peer's list: itself, then its members not aged out, freshest first."""
        self.age_out()
        now = self.clock()
        members = sorted(self.members.items(), key=lambda item: -item[1].verified)[:MAX_LIST - 1]
        return [peers_entry(self.peer_id, self.addresses, 0.0)] + [
            peers_entry(peer_id, m.addresses, now - m.verified) for peer_id, m in members]

    def merge(self, entries: list[messages.PeerEntry]) -> None:
        """Take a received list (`messages.check_peers`): fresher ages for members, hints for the ids not
        verified here."""
        now = self.clock()
        for peer_id, addresses, age in entries:
            member = self.members.get(peer_id)
            if member is not None:
                member.verified = max(member.verified, now - age)
            elif peer_id != self.peer_id:
                self.hint(addresses)

    def hint(self, addresses: list[Address]) -> None:
        """An address to verify in a coming round (MAX_HINTS at most: the newest are dropped)."""
        known = {tuple(m.addresses) for m in self.members.values()} | {tuple(self.addresses)}
        if tuple(addresses) not in known and len(self.hints) < MAX_HINTS:
            self.hints[tuple(addresses)] = None

    def heard_from(self, host: str, msg: messages.Message) -> None:
        """A PEERS request from a key holder: its list, and its own port at the address it came from."""
        entries, port = messages.check_peers(msg)
        self.merge(entries)
        if port is not None:
            self.hint([(host, port)])

    def verified(self, peer_id: str, addresses: list[Address]) -> None:
        """This peer's own handshake proved `peer_id` at `addresses` (itself: that is no seed to try)."""
        self.hints.pop(tuple(addresses), None)
        if peer_id == self.peer_id:
            for address in addresses:
                self.seeds.pop(address, None)
            return
        self.members[peer_id] = Member(addresses, self.clock())

    def failed(self, addresses: list[Address]) -> None:
        """No exchange at `addresses`: a hint is dropped, a seed waits AGE_OUT, a member is not refreshed."""
        self.hints.pop(tuple(addresses), None)
        for address in addresses:
            if address in self.seeds:
                self.seeds[address] = self.clock() + AGE_OUT

    def age_out(self) -> None:
        limit = self.clock() - AGE_OUT
        for peer_id in [p for p, m in self.members.items() if m.verified < limit]:
            log.info("gossip: peer %s not verified for %.0f s: dropped", peer_id, AGE_OUT)
            del self.members[peer_id]

    def next_target(self) -> list[Address] | None:
        """Whom to verify this round: the oldest hint, else a seed due with no member there, else a random
        member of those not verified for half of AGE_OUT (the others, when none is), so that the members
        aging out get the rounds; None when there is nobody."""
        self.age_out()
        if self.hints:
            return list(next(iter(self.hints)))
        now = self.clock()
        at_members = {a for m in self.members.values() for a in m.addresses}
        seeds = [seed for seed, due in self.seeds.items() if due <= now and seed not in at_members]
        if seeds:
            return [random.choice(seeds)]
        stale = [m.addresses for m in self.members.values() if now - m.verified >= AGE_OUT / 2]
        return random.choice(stale or [m.addresses for m in self.members.values()]) if self.members else None

    def next_targets(self) -> list[list[Address]]:
        """Whom to verify this round, side by side (MAX_EXCHANGES at most): the oldest hints, then the members
        about to age out (DUE of AGE_OUT gone: verifying them beats dropping and learning them again), else
        `next_target`'s one seed or member (none when there is nobody)."""
        self.age_out()
        now = self.clock()
        due = sorted((m for m in self.members.values() if now - m.verified >= DUE), key=lambda m: m.verified)
        targets = [list(hint) for hint in itertools.islice(self.hints, MAX_EXCHANGES)] + [m.addresses for m in due]
        if targets:
            return targets[:MAX_EXCHANGES]
        target = self.next_target()
        return [] if target is None else [target]

    def exchange(self, addresses: list[Address], port: int,
                 listing: list[dict[str, Any]]) -> tuple[str, list[messages.PeerEntry]]:
        """Connect to the first of `addresses` that answers, prove the key both ways, send `listing` and
        this peer's `port`; return (the id its HELLO named, the list it sent back). A peer whose HELLO
        does not name PEERS among its features (an older one) is verified and asked nothing. Raises
        OSError or GPULayerError."""
        errors: list[str] = []
        with closing(connections(addresses, EXCHANGE_TIMEOUT, errors)) as reachable:
            for _, conn in reachable:  # the first that answers: its failure is the exchange's
                deadline = time.monotonic() + EXCHANGE_TIMEOUT
                hello = handshake.client_handshake(conn, self.key, f"peer-{self.peer_id}", EXCHANGE_TIMEOUT)
                if messages.PEERS not in features_of(hello["advert"]):
                    return hello["peer"], []
                conn.send(messages.peers(1, listing, port))
                reply, _ = conn.recv(deadline)
                if reply["t"] != messages.PEERS:
                    raise ConnectionError(f"expected PEERS, got {messages.printable(reply['t'], 20)}")
                return hello["peer"], messages.check_peers(reply)[0]
        raise ConnectionError("; ".join(errors) or "no address")


async def rounds(gossip: Gossip, port: int) -> None:
    """Run a round's exchanges every GOSSIP_ROUND while the peer lives (their blocking parts on helper
    threads, side by side)."""
    while True:
        await asyncio.sleep(GOSSIP_ROUND)
        await asyncio.gather(*(visit(gossip, target, port) for target in gossip.next_targets()))


async def visit(gossip: Gossip, target: list[Address], port: int) -> None:
    """One exchange: a hint that fails is dropped, a member that fails is not refreshed (it ages out)."""
    try:
        peer_id, entries = await asyncio.get_running_loop().run_in_executor(
            None, gossip.exchange, target, port, gossip.listing())
    except (OSError, GPULayerError) as exc:
        log.debug("gossip with %s failed: %s", target, exc)
        gossip.failed(target)
        return
    gossip.verified(peer_id, target)
    gossip.merge(entries)
