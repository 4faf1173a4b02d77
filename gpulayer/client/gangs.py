"""Gangs (ADR 0018): one function as N ranks on N distinct peers, started together, stopped together.

Each rank's slot is held by a `distributed.Rank` actor. The submitter creates them one at a time in
the order of the peers' ids, each waiting in its peer's queue when the peer is busy: a gang holds
slots only of peers before the one it waits for, so two gangs never wait on each other in a cycle
(resource ordering). Once every rank's actor lives, each reports free ports of its host, and every
rank's function starts with the rendezvous variables (`distributed.rendezvous`). The first rank that
fails, dies or whose peer is lost ends the others at once (a CLOSE kills the actor's worker), and
the gang fails with the rank, its peer and the cause; `retries` runs the whole gang again.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import TYPE_CHECKING, Any

from .. import distributed
from ..errors import ActorDied, GangFailed, GPULayerError, NoMatchingPeer, PeerLost, WorkerDied
from ..matching import Requirements
from .actors import CLOSE_TIMEOUT, ActorHandle, ActorSpec

if TYPE_CHECKING:
    from .engine import Client

log = logging.getLogger("gpulayer.client")

CLOSED_BY_US = "the actor was closed by its submitter"  # the peer's reason when a CLOSE ended an actor
RETRYABLE = (ActorDied, PeerLost, WorkerDied)  # a rank that died or whose peer was lost: retries= runs it again


def submit_gang(client: Client, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                req: Requirements, nodes: int, timeout: float | None, retries: int,
                env: dict[str, str]) -> Future[list[Any]]:
    """`run_gang` on a thread of its own; the future's result is the ranks' results in rank order."""
    future: Future[list[Any]] = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(run_gang(client, fn, args, kwargs, req=req, nodes=nodes, timeout=timeout,
                                           retries=retries, env=env))
            except BaseException as exc:  # the future carries it to the caller
                future.set_exception(exc)

    threading.Thread(target=run, name=f"gpulayer-gang-{nodes}", daemon=True).start()
    return future


def run_gang(client: Client, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
             req: Requirements, nodes: int, timeout: float | None, retries: int,
             env: dict[str, str]) -> list[Any]:
    """fn(*args, **kwargs) as `nodes` ranks on as many distinct matching peers; their results in rank order."""
    while True:
        try:
            return _run_once(client, fn, args, kwargs, req, nodes, timeout, env)
        except GangFailed as exc:
            if retries <= 0 or not isinstance(exc.cause, RETRYABLE) or client.closed:
                raise
            retries -= 1
            log.warning("gang of %d: %s; running the whole gang again (%d retries left)", nodes, exc, retries)


def _run_once(client: Client, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              req: Requirements, nodes: int, timeout: float | None, env: dict[str, str]) -> list[Any]:
    ranks: list[ActorHandle] = []
    try:
        for peer_id in sorted(_choose(client, req, nodes)):  # in the order of the peers' ids: no deadlock
            spec = ActorSpec(distributed.Rank, (), {}, dataclasses.replace(req, peer=peer_id), env=env)
            ranks.append(client.create_actor(spec).result())
        ports = [rank.call("ports", (), {}, None) for rank in ranks]
        addresses = rank_addresses([_reached(client, rank) for rank in ranks])
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
        _stop(ranks)


def _choose(client: Client, req: Requirements, nodes: int) -> list[str]:
    """The ids of `nodes` distinct matching peers, the best first; NoMatchingPeer when fewer are known
    after discovery's wait."""
    client.start()
    client.directory.wait_for(lambda _: len(client.placement.candidates(req)) >= nodes, client.discovery_timeout)
    chosen = [record.advert.peer_id for record in client.placement.ranked(req)][:nodes]
    if len(chosen) < nodes:
        reasons = client.placement.reasons(req)
        reasons[f"the gang of {nodes}"] = [f"needs {nodes} distinct matching peers; {len(chosen)} match"]
        raise NoMatchingPeer(req, reasons, client.directory.foreign_note())
    return chosen


def _reached(client: Client, rank: ActorHandle) -> list[str]:
    """The addresses of a rank's peer, the one that this submitter's connection reached first."""
    advertised = [host for host, _ in rank.addresses]
    conn = client.pool.pooled(rank.peer_id)
    if conn is None:
        return advertised
    used = conn.address.rsplit(":", 1)[0]
    return [used, *(host for host in advertised if host != used)]


def rank_addresses(per_peer: list[list[str]]) -> list[str]:
    """Each rank's peer address as the other ranks reach it: the one this submitter reached it at,
    unless that is a loopback address and some rank lives on another host (then its first other one)."""
    first = [hosts[0] for hosts in per_peer]
    if all(_loopback(host) for host in first) or not any(_loopback(host) for host in first):
        return first
    return [next((host for host in hosts if not _loopback(host)), hosts[0]) for hosts in per_peer]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


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
