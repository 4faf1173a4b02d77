"""Gangs (ADR 0018): one function as N ranks on N distinct peers, started together, stopped together.

Each rank's slot is held by a `distributed.Rank` actor. The submitter asks for them in the order of
the peers' ids, each waiting in its peer's queue when the peer is busy, and asks for the next once
the peer said that this one took its slot: a gang holds slots only of peers before the one it waits
for, so two gangs never wait on each other in a cycle (resource ordering), while the ranks' workers
start side by side. Once every rank's actor lives, each reports free ports of its host, and every
rank's function starts with the rendezvous variables (`distributed.rendezvous`). The first rank that
fails, dies or whose peer is lost ends the others at once (a CLOSE kills the actor's worker), and
the gang fails with the rank, its peer and the cause; `retries` runs the whole gang again.
Cancelling the gang's future ends every rank the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, wait
from typing import TYPE_CHECKING, Any

from .. import distributed
from ..errors import ActorDied, GangFailed, GPULayerError, NoMatchingPeer, PeerLost, WorkerDied
from ..matching import Requirements
from .actors import CLOSE_TIMEOUT, ActorHandle, ActorSpec, create

if TYPE_CHECKING:
    from .engine import Client

log = logging.getLogger("gpulayer.client")

CLOSED_BY_US = "the actor was closed by its submitter"  # the peer's reason when a CLOSE ended an actor
RETRYABLE = (ActorDied, PeerLost, WorkerDied)  # a rank that died or whose peer was lost: retries= runs it again
WAIT_NOTE = 5.0  # seconds a rank waits for its peer's slot before the log says why


class GangFuture(Future[list[Any]]):
    """A gang's future. `cancel()` stops the gang while it runs: a rank's creation still waiting is
    taken back, and every rank's actor is closed (its peer kills the worker and all it started)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._creations: list[Future[ActorHandle]] = []
        self._stopping = False

    def created(self, creation: Future[ActorHandle]) -> None:
        """A rank's actor is on its way: a cancel ends it (at once, if the cancel came first)."""
        with self._lock:
            if not self._stopping:
                self._creations.append(creation)
                return
        _end(creation)

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        with self._lock:
            self._stopping, creations = True, self._creations
        for creation in creations:
            _end(creation)
        return True

    def settle(self, outcome: list[Any] | BaseException) -> None:
        """The gang's results, or its error, unless it was cancelled."""
        if not self.set_running_or_notify_cancel():
            return
        if isinstance(outcome, BaseException):
            self.set_exception(outcome)
        else:
            self.set_result(outcome)


def submit_gang(client: Client, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                req: Requirements, nodes: int, timeout: float | None, retries: int,
                env: dict[str, str]) -> GangFuture:
    """`run_gang` on a thread of its own; the future's result is the ranks' results in rank order."""
    gang = GangFuture()

    def run() -> None:
        try:
            gang.settle(run_gang(client, fn, args, kwargs, req=req, nodes=nodes, timeout=timeout,
                                 retries=retries, env=env, gang=gang))
        except BaseException as exc:  # the future carries it to the caller
            gang.settle(exc)

    threading.Thread(target=run, name=f"gpulayer-gang-{nodes}", daemon=True).start()
    return gang


def run_gang(client: Client, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
             req: Requirements, nodes: int, timeout: float | None, retries: int,
             env: dict[str, str], gang: GangFuture) -> list[Any]:
    """fn(*args, **kwargs) as `nodes` ranks on as many distinct matching peers; their results in rank order."""
    while True:
        try:
            return _run_once(client, fn, args, kwargs, req, nodes, timeout, env, gang)
        except GangFailed as exc:
            if retries <= 0 or not isinstance(exc.cause, RETRYABLE) or client.closed or gang.cancelled():
                raise
            retries -= 1
            log.warning("gang of %d: %s; running the whole gang again (%d retries left)", nodes, exc, retries)


def _run_once(client: Client, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              req: Requirements, nodes: int, timeout: float | None, env: dict[str, str],
              gang: GangFuture) -> list[Any]:
    creations: list[Future[ActorHandle]] = []
    ranks: list[ActorHandle] = []
    try:
        for index, peer_id in enumerate(sorted(choose(client, req, nodes))):  # in peer-id order: no deadlock
            if gang.cancelled():
                raise CancelledError("the gang was cancelled")
            taken = threading.Event()
            spec = ActorSpec(distributed.Rank, (), {}, dataclasses.replace(req, peer=peer_id), env=env)
            creations.append(create(client, spec, taken=taken))
            gang.created(creations[-1])
            record = client.directory.get(peer_id)
            _until_taken(creations[-1], taken, index, record.advert.name if record is not None else peer_id)
        for created in creations:
            ranks.append(created.result())
        ports = [rank.call("ports", (), {}, None) for rank in ranks]
        addresses = distributed.rank_addresses([_reached(client, rank) for rank in ranks])
        rendezvous = [tuple(p.result(CLOSE_TIMEOUT)) for p in ports]
        calls = [rank.call("run", (fn, args, kwargs, distributed.rendezvous(i, addresses, rendezvous)), {}, timeout)
                 for i, rank in enumerate(ranks)]
        wait(calls, return_when=FIRST_EXCEPTION)
        failed = _failed(calls)  # before the stop: those that failed by themselves
        if not failed:
            return [call.result() for call in calls]
        _stop(ranks)
        raise _failure(ranks, calls, failed)
    finally:
        for creation in creations[len(ranks):]:  # not waited for: taken back, or closed once created
            _end(creation)
        _stop(ranks)


def choose(client: Client, req: Requirements, nodes: int, feature: str | None = None) -> list[str]:
    """The ids of `nodes` distinct matching peers, the best first, leaving out those whose slots this
    submitter's own actors hold (and those whose adverts do not name `feature`, when given: a part of the
    protocol the gang needs); NoMatchingPeer when fewer are known after discovery's wait."""
    client.discover()
    client.directory.wait_for(lambda _: len(client.placement.candidates(req)) >= nodes, client.discovery_timeout)
    held = _held_by_own_actors(client)
    ranked = client.placement.ranked(req)
    older = {r.advert.peer_id: r.advert.name for r in ranked if feature is not None and feature not in r.advert.features}
    chosen = [record.advert.peer_id for record in ranked
              if record.advert.peer_id not in held and record.advert.peer_id not in older][:nodes]
    if len(chosen) < nodes:
        reasons = client.placement.reasons(req)
        reasons[f"the gang of {nodes}"] = [f"needs {nodes} distinct matching peers; {len(chosen)} match and are free"] \
            + [f"peer {name} runs a GPUlayer without {feature}" for name in older.values()] \
            + [f"every slot of peer {peer} holds an actor of this submitter ({', '.join(names)}): a rank would wait "
               "for it to be closed, which this gang cannot do; close it first" for peer, names in held.values()]
        raise NoMatchingPeer(req, reasons, client.directory.foreign_note())
    return chosen


def _held_by_own_actors(client: Client) -> dict[str, tuple[str, list[str]]]:
    """The peers whose every slot holds a live actor of this submitter other than a gang's rank (id ->
    name, the actors' classes): a rank placed there would wait for the caller itself."""
    classes: dict[str, list[str]] = {}
    for handle in list(client.actors.values()):
        if handle.alive and handle.class_name != distributed.Rank.__qualname__:
            classes.setdefault(handle.peer_id, []).append(handle.class_name)
    return {peer: (record.advert.name, names) for peer, names in classes.items()
            if (record := client.directory.get(peer)) is not None and len(names) >= record.advert.slots}


def _reached(client: Client, rank: ActorHandle) -> list[str]:
    """The addresses of a rank's peer, the one that this submitter's connection reached first."""
    advertised = [host for host, _ in rank.addresses]
    conn = client.pool.pooled(rank.peer_id)
    if conn is None:
        return advertised
    used = conn.address.rsplit(":", 1)[0]
    return [used, *(host for host in advertised if host != used)]


def _until_taken(creation: Future[ActorHandle], taken: threading.Event, rank: int, peer: str) -> None:
    """Wait until the rank's peer says that it took its slot, or its creation ended (a peer of an
    earlier build only says that); a long wait says why in the log. The next rank's creation goes out
    then, and its worker starts beside this one's."""
    creation.add_done_callback(lambda _: taken.set())
    if not taken.wait(WAIT_NOTE):
        log.warning("gang: rank %d waits for a slot of peer %s, busy with queued tasks or held by actors (another "
                    "gang's ranks, say); it starts when one is free (a wait on actors fails after about ten "
                    "minutes with TaskRejected)", rank, peer)
        taken.wait()


def _end(creation: Future[ActorHandle]) -> None:
    """Take back a rank's creation, or close the actor that it created."""
    if not creation.cancel():
        creation.add_done_callback(_close_created)


def _close_created(creation: Future[ActorHandle]) -> None:
    if not creation.cancelled() and creation.exception() is None:
        creation.result().close_soon()


def _stop(ranks: list[ActorHandle]) -> None:
    """Close every rank's actor (its peer kills the worker and all it started) and wait for the word."""
    closing = [rank for rank in ranks if rank.alive]
    for rank in closing:
        rank.close_soon()
    for rank in closing:
        rank.death_reason(CLOSE_TIMEOUT)


def _failed(calls: Sequence[Future[Any]]) -> list[tuple[int, BaseException]]:
    """The ranks whose call failed, with why."""
    return [(i, exc) for i, call in enumerate(calls) if call.done() and (exc := call.exception()) is not None]


def _failure(ranks: list[ActorHandle], calls: Sequence[Future[Any]],
             first: list[tuple[int, BaseException]]) -> GangFailed:
    """The error of a failed gang: a rank that died or lost its peer before we stopped it (its word may
    come after another rank's error caused by its death), else the first that failed."""
    wait(calls, CLOSE_TIMEOUT)
    died = [(i, exc) for i, exc in _failed(calls) if isinstance(exc, RETRYABLE) and CLOSED_BY_US not in str(exc)]
    rank, cause = (died or first)[0]
    return GangFailed(rank, ranks[rank].peer, cause)
