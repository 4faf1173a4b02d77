"""The pool's one liveness rule (client/pool.py `silent_for`), over every kind of connection: a peer's own,
a lease's and a direct actor connection. The connections here are plain records of the state the rule
reads (tasks in flight, since when they are owed, when the other end was last heard); the rule on real
connections is tested in tests/integration/test_pool_liveness.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpulayer.client.pool import LOST_AFTER, silent_for

NOW = 1000.0
HEARTBEAT = 1.0
LIMIT = LOST_AFTER * HEARTBEAT


@dataclass(eq=False)
class Conn:
    """What the rule reads of a connection."""

    peer_id: str
    last_heard: float
    owing_since: float = 0.0
    pending: dict = field(default_factory=dict)
    beats: bool = True  # False: a direct connection (the actor's worker may hold its GIL)


def owing(conn: Conn, since: float) -> Conn:
    conn.pending, conn.owing_since = {1: object()}, since
    return conn


def test_a_lease_and_a_peers_own_connection_that_stopped_answering_are_measured_alike():
    own = owing(Conn("a", last_heard=NOW - 3.5), since=NOW - 10)
    lease = owing(Conn("b", last_heard=NOW - 3.5), since=NOW - 10)
    silent = silent_for([own, lease], {"a": own}, NOW)
    assert silent == {own: 3.5, lease: 3.5}
    assert all(seconds > LIMIT for seconds in silent.values())  # both past the one bound: both lost


def test_silence_counts_from_when_the_answers_became_owed_not_from_an_idle_spell():
    # a lease is not pinged while idle: its last word may be old when it is given a task
    lease = owing(Conn("b", last_heard=NOW - 60), since=NOW - 1)
    own = owing(Conn("a", last_heard=NOW - 60), since=NOW - 1)
    assert silent_for([lease, own], {"a": own}, NOW) == {lease: 1.0, own: 1.0}


def test_a_connection_that_owes_nothing_is_never_lost_however_long_it_was_silent():
    idle_lease = Conn("b", last_heard=NOW - 600)
    idle_own = Conn("a", last_heard=NOW - 600)
    assert silent_for([idle_lease, idle_own], {"a": idle_own}, NOW) == {}


def test_calls_on_a_direct_connection_are_owed_by_its_peers_own_connection():
    """A direct connection's worker may hold its GIL through a long method: its silence says nothing, and
    its calls make the peer's own connection (pinged every heartbeat) owe answers since the first call."""
    direct = owing(Conn("a", last_heard=NOW - 30, beats=False), since=NOW - 20)
    own = Conn("a", last_heard=NOW - 4)  # idle itself: no answer to the last four PINGs
    other = Conn("c", last_heard=NOW - 4)  # another peer, owed nothing
    assert silent_for([own, direct, other], {"a": own, "c": other}, NOW) == {own: 4.0}


def test_a_peers_own_connection_owes_from_the_earliest_of_its_peers_connections():
    lease = owing(Conn("a", last_heard=NOW - 0.5), since=NOW - 8)  # its worker says it is alive
    own = owing(Conn("a", last_heard=NOW - 5), since=NOW - 2)
    assert silent_for([own, lease], {"a": own}, NOW) == {own: 5.0, lease: 0.5}
