"""Placement: which known peers can run a task, why the others cannot, and which to try first.

Reads of the Directory and of the live connections' load, and the peers' own refusals (a
peer answers for what its advert cannot carry, such as its other installed distributions);
opening connections and retrying belong to the engine.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..accelerators import CPU
from ..discovery import Directory, PeerRecord
from ..matching import Requirements, match, missing_software, rank_key

# A peer's live load, handshake latency and free GB (None: not reported), when the engine has a connection to it.
LoadOf = Callable[[str], "tuple[float, float, float | None] | None"]
CONTENTION_MAX_AGE_S = 5.0  # a peer's count of contending submitters is forgotten after this
MAX_SUBMITTERS = 1024  # a larger count from a peer is ignored
MAX_RAN_S = 30 * 86400.0  # a longer run time reported by a peer is ignored
MIN_RAN_S = 1e-3  # run times shorter than this count as this (overheads dominate)
RAN_WEIGHT = 0.1  # of each new run time in a peer's moving average
_RANDOM = random.Random()


class Contention:
    """What the peers' outcomes say of the competition: how many submitters share each peer, and
    how long its tasks run (ADR 0011). Both are untrusted: implausible values are ignored."""

    def __init__(self) -> None:
        self._heard: dict[str, tuple[int, float]] = {}  # peer id -> (submitters, when heard)
        self._ran: dict[str, float] = {}  # peer id -> moving average of its tasks' run time, in seconds

    def heard(self, peer_id: str, msg: dict[str, Any]) -> None:
        """An outcome's "submitters" (how many submitters contend for the peer) and "ran" (seconds)."""
        count, ran = msg.get("submitters"), msg.get("ran")
        if isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= MAX_SUBMITTERS:
            self._heard[peer_id] = (count, time.monotonic())
        if isinstance(ran, float | int) and not isinstance(ran, bool) and 0 <= ran <= MAX_RAN_S:
            last = self._ran.get(peer_id)
            self._ran[peer_id] = ran if last is None else last + RAN_WEIGHT * (ran - last)

    def load(self, peer_id: str, ours: int, estimated: int, age: float) -> float:
        """A peer's load: our tasks there, and the others' at its last report (`age` seconds ago),
        fading as their tasks would end (over the peer's run time), so that a peer that freed a slot
        for another submitter does not look busy until it next writes to us."""
        others = max(0, estimated - ours)
        return ours + others * math.exp(-max(0.0, age) / max(self.typical(peer_id), MIN_RAN_S))

    def typical(self, peer_id: str) -> float:
        """The peer's moving average of run time; a peer not heard from yet: the median of the others."""
        ran = self._ran.get(peer_id)
        if ran is not None:
            return ran
        known = sorted(self._ran.values())
        return known[len(known) // 2] if known else 1.0

    def capacity(self, record: PeerRecord) -> float:
        """The peer's slots per second of its tasks' run time, so that two random choices draw peers
        by what they get through."""
        return max(1, record.advert.slots) / max(self.typical(record.advert.peer_id), MIN_RAN_S)

    def submitters(self) -> int:
        """The most submitters that any peer reported lately; 1 (this one alone) when none did."""
        cutoff = time.monotonic() - CONTENTION_MAX_AGE_S
        return max((n for n, at in list(self._heard.values()) if at >= cutoff), default=1)

    def window(self, slots: int) -> int:
        """How many of one map's tasks may be in flight: two per slot of the matching peers (at least
        four), shared among the submitters, so that together they queue about one task per slot."""
        return max(2, math.ceil(max(4, 2 * slots) / self.submitters()))


class Placement:
    """Candidates, reasons and ranking over one Directory (plus the static peers' errors)."""

    def __init__(self, directory: Directory, static_errors: dict[str, str], load_of: LoadOf):
        self.directory = directory
        self.static_errors = static_errors
        self._load_of = load_of
        self._refusals: dict[tuple[str, Requirements], str] = {}
        self.contention = Contention()

    def refused(self, peer_id: str, req: Requirements, reason: str) -> None:
        """A peer refused a task as not matching: it will refuse these requirements again."""
        self._refusals[peer_id, req] = reason

    def forget_refusals(self, peer_id: str) -> None:
        """The peer advertises something else now: it may run what it refused."""
        for key in [key for key in list(self._refusals) if key[0] == peer_id]:
            self._refusals.pop(key, None)

    def to_ask(self, req: Requirements, excluded: Collection[str] = ()) -> list[PeerRecord]:
        """The peers that are up and may run the task after a new probe of their job interpreter (a pip
        install since): those that refused it, and those whose advert lacks only the software it asks
        for. Asked when no peer fits (issue 26, item 5); the peer answers at once when no probe is due."""
        return [r for r in self.directory.records() if r.up and r.advert.peer_id not in excluded and
                ((r.advert.peer_id, req) in self._refusals or missing_software(req, r.advert))]

    def refusal_reasons(self) -> list[dict[str, str]]:
        """The peers' no-match refusals remembered (for the dashboard): which peer, and why."""
        return [{"peer_id": peer_id, "reason": reason} for (peer_id, _), reason in list(self._refusals.items())]

    def _why_not(self, req: Requirements, record: PeerRecord) -> list[str]:
        """Why the peer does not fit: its advert says so, or the peer itself said so."""
        refusal = self._refusals.get((record.advert.peer_id, req))
        return [f"refused the task: {refusal}"] if refusal is not None else list(match(req, record.advert))

    def candidates(self, req: Requirements, excluded: Collection[str] = ()) -> list[PeerRecord]:
        """The matching peers that are up."""
        return [r for r in self.directory.records()
                if r.up and r.advert.peer_id not in excluded and not self._why_not(req, r)]

    def ranked(self, req: Requirements, excluded: Collection[str] = (), holders: Collection[str] = ()) -> list[PeerRecord]:
        """The candidates, best first; among equals (see `local_first`), the peers holding the task's arguments.

        Without holders, the two first are the better and the worse of two peers of the best kind
        drawn at random (`two_choices`)."""
        order = sorted(self.candidates(req, excluded),
                       key=lambda record: local_first(req, self.rank(req, record), record.advert.peer_id in holders))
        return order if holders else self.two_choices(req, order)

    def two_choices(self, req: Requirements, order: list[PeerRecord]) -> list[PeerRecord]:
        """`order` as it is when its first has a free slot as far as we know; else with two peers first:
        drawn at random, by capacity, among those of the first's kind (its rank without load or
        latency), the less loaded first (ADR 0011).

        Always taking the least loaded peer by one submitter's view keeps a submitter on the peers
        where its own tasks just ended (it hears of those first): shares then follow the speed of
        the peers each one happened to start on. Two random choices mix the tasks over the peers.
        """
        if len(order) < 3 or self._free(order[0]):
            return order
        kind = self._kind(req, order[0])
        same = [r for r in order if self._kind(req, r) == kind]
        if len(same) < 3:
            return order
        first = _RANDOM.choices(same, [self.contention.capacity(r) for r in same])[0]
        rest = [r for r in same if r is not first]
        second = _RANDOM.choices(rest, [self.contention.capacity(r) for r in rest])[0]
        two = sorted((first, second), key=lambda record: self.rank(req, record))
        return two + [r for r in order if r is not first and r is not second]

    def _free(self, record: PeerRecord) -> bool:
        """Whether the peer has a free slot, as far as we know."""
        live = self._load_of(record.advert.peer_id)
        return live is None or live[0] < record.advert.slots

    def _kind(self, req: Requirements, record: PeerRecord) -> tuple[Any, ...]:
        return rank_key(req, record.advert, 0, 0.0, record.verified)

    def rank(self, req: Requirements, record: PeerRecord) -> tuple[Any, ...]:
        live = self._load_of(record.advert.peer_id)
        load, latency, free = live if live is not None else (0, 1.0, None)
        return rank_key(req, record.advert, load, latency, record.verified, free)

    def reasons(self, req: Requirements, excluded: Collection[str] = ()) -> dict[str, list[str]]:
        """Why each known peer is not a candidate, for NoMatchingPeer."""
        reasons = {}
        for record in self.directory.records():
            why = self._why_not(req, record)
            if not why and record.advert.peer_id in excluded:
                why = [f"already failed this task: {excluded[record.advert.peer_id]}" if isinstance(excluded, Mapping)
                       else "already failed this task"]
            elif not why and not record.up:
                why = [f"down: {record.error}"]
            reasons[f"{record.advert.name} ({record.address})"] = why
        for label, error in self.static_errors.items():
            reasons[label] = [f"static peer unreachable: {error}"]
        return reasons

    def total_slots(self, req: Requirements) -> int:
        """Slots of all the matching peers that are up."""
        return sum(r.advert.slots for r in self.candidates(req))

    def wait_for_match(self, req: Requirements, excluded: Collection[str], timeout: float) -> bool:
        """Wait up to `timeout` until some peer is a candidate."""
        return self.directory.wait_for(lambda _: bool(self.candidates(req, excluded)), timeout)


def local_first(req: Requirements, key: tuple[Any, ...], local: bool) -> tuple[Any, ...]:
    """`key` (matching.rank_key) with locality inserted: for a GPU task right after the load, for the
    others after "has a free slot" and "has no GPU", so that a held argument never moves a CPU task
    onto a GPU's slot, nor any task onto a busier peer."""
    cut = 1 if req.accelerator not in (None, CPU) else 2
    return (*key[:cut], not local, *key[cut:])
