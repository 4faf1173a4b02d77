"""Placement: which known peers can run a task, why the others cannot, and which to try first.

Reads of the Directory and of the live connections' load, and the peers' own refusals (a
peer answers for what its advert cannot carry, such as its other installed distributions);
opening connections and retrying belong to the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from ..discovery import Directory, PeerRecord
from ..matching import Requirements, match, rank_key

# A peer's live load, handshake latency and free GB (None: not reported), when the engine has a connection to it.
LoadOf = Callable[[str], "tuple[int, float, float | None] | None"]


class Placement:
    """Candidates, reasons and ranking over one Directory (plus the static peers' errors)."""

    def __init__(self, directory: Directory, static_errors: dict[str, str], load_of: LoadOf):
        self.directory = directory
        self.static_errors = static_errors
        self._load_of = load_of
        self._refusals: dict[tuple[str, Requirements], str] = {}

    def refused(self, peer_id: str, req: Requirements, reason: str) -> None:
        """A peer refused a task as not matching: it will refuse these requirements again."""
        self._refusals[peer_id, req] = reason

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

    def ranked(self, req: Requirements, excluded: Collection[str] = ()) -> list[PeerRecord]:
        """The candidates, best first."""
        return sorted(self.candidates(req, excluded), key=lambda record: self.rank(req, record))

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
                why = ["already failed this task"]
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
