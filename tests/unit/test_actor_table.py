"""The peer's actor table as pure transitions (peer/actors.py): each event (a CALL, a cancel, a CLOSE, a
connection come or gone, a worker's reply or output, a timer that fired) changes the table and returns
the actions that follow, in order. No event loop, no process, no socket: a connection is what the table
reads of one (its submitter's id and its calls in flight), a worker what it names in its actions."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpulayer.peer.actors import (
    ArmCall, ArmGrace, Actor, Actors, Gone, StopCall, StopGrace, ToSubmitter)
from gpulayer.peer.scheduler_state import ToWorker
from gpulayer.peer.slots import Slot
from gpulayer.protocol import messages

ACTOR_ID = "a1" * 16


@dataclass(eq=False)
class Worker:
    pid: int = 4242


@dataclass(eq=False)
class Conn:
    """A submitter's connection as the table sees one (sending is the scheduler's)."""
    submitter_id: str
    calls: dict = field(default_factory=dict)

    def send(self, msg, buffers=()):
        raise AssertionError("the table sends nothing itself")


def table(grace=10.0):
    actors = Actors(grace)
    creator = Conn("alice")
    actor = Actor(ACTOR_ID, "Counter", "alice", creator, Slot(0, "cpu"), Worker())  # type: ignore[arg-type]
    actors.add(actor)
    return actors, actor, creator


def call(call_id, method="add", timeout=None, actor_id=ACTOR_ID):
    msg = {"t": messages.CALL, "id": call_id, "actor": actor_id, "method": method, "args": b"args"}
    if timeout is not None:
        msg["timeout"] = timeout
    return msg


def kinds(actions):
    return [type(a).__name__ for a in actions]


def test_a_call_goes_to_the_worker_under_the_peers_own_id_and_its_result_back_under_the_submitters():
    actors, actor, alice = table()
    other = Conn("alice")  # a second connection of the same submitter: ids are per connection
    [first] = actors.call(alice, call(7), [b"buf"])
    [second] = actors.call(other, call(7), [])
    assert isinstance(first, ToWorker) and first.worker is actor.worker and first.buffers == [b"buf"]
    assert first.msg == {"t": messages.CALL, "id": 1, "method": "add", "args": b"args"}
    assert second.msg["id"] == 2 and alice.calls == {7: (actor, 1)} and other.calls == {7: (actor, 2)}
    [answer] = actors.reply(actor, {"t": messages.RESULT, "id": 2, "data": b"x"}, [b"r"])  # no timer to stop
    assert isinstance(answer, ToSubmitter)
    assert answer.owner is other and answer.msg == {"t": messages.RESULT, "id": 7, "data": b"x"}
    assert answer.buffers == [b"r"] and other.calls == {} and alice.calls == {7: (actor, 1)}
    assert actors.rows() == [{"actor": ACTOR_ID[:8], "class": "Counter", "slot": 0, "served": 1, "pending": 1,
                              "pid": 4242}]


def test_a_call_id_in_use_or_an_actor_not_here_is_answered_at_once():
    actors, actor, alice = table()
    actors.call(alice, call(1), [])
    [again] = actors.call(alice, call(1), [])
    assert again.owner is alice and again.msg["code"] == "bad-request" and again.msg["id"] == 1
    [unknown] = actors.call(alice, call(2, actor_id="b2" * 16), [])
    assert unknown.msg["code"] == "no-actor" and unknown.msg["id"] == 2
    assert len(actor.calls) == 1 and list(alice.calls) == [1]


def test_a_timeout_arms_a_timer_and_when_it_fires_the_call_gets_timeout_and_the_actor_ends():
    actors, actor, alice = table()
    send, arm = actors.call(alice, call(3, method="slow", timeout=2.5), [])
    assert isinstance(arm, ArmCall) and (arm.actor, arm.worker_call_id, arm.call.timeout) == (actor, 1, 2.5)
    waiting = actors.call(alice, call(4), [])  # queued behind it on the worker
    assert kinds(waiting) == ["ToWorker"]
    actions = actors.call_timed_out(actor, 1)
    assert kinds(actions) == ["ToSubmitter", "ToSubmitter", "ToSubmitter", "Gone"]
    timeout, died, end, gone = actions
    assert timeout.msg["code"] == "timeout" and timeout.msg["id"] == 3 and "slow" in timeout.msg["message"]
    assert died.msg["code"] == "actor-died" and died.msg["id"] == 4
    assert end.owner is alice and end.msg["t"] == messages.ACTOR_END and end.msg["code"] == "died"
    assert isinstance(gone, Gone) and gone.actor is actor and "timeout of 2.5 s" in gone.why
    assert actors.live == {} and alice.calls == {}
    # a call after its end learns why, and a late timer or reply decides nothing
    [late] = actors.call(alice, call(5), [])
    assert late.msg["code"] == "actor-died" and "timeout of 2.5 s" in late.msg["message"]
    assert actors.call_timed_out(actor, 1) == [] and actors.reply(actor, {"t": messages.RESULT, "id": 2}, []) == []


def test_a_cancel_answers_the_call_and_tells_the_worker_and_its_late_result_is_dropped():
    actors, actor, alice = table()
    actors.call(alice, call(9, timeout=5.0), [])
    stop, cancel, answer = actors.cancel(alice, 9)
    assert isinstance(stop, StopCall) and cancel.msg == messages.cancel(1) and cancel.worker is actor.worker
    assert answer.msg["code"] == "cancelled" and answer.msg["id"] == 9 and alice.calls == {}
    assert actors.reply(actor, {"t": messages.RESULT, "id": 1}, []) == [] and actor.served_here == 1


def test_only_the_creator_closes_an_actor_and_the_close_is_answered_on_the_connection_that_asked():
    actors, actor, alice = table()
    [refused] = actors.close(Conn("mallory"), {"t": messages.CLOSE, "id": 4, "actor": ACTOR_ID})
    assert refused.msg["code"] == "not-owner" and ACTOR_ID in actors.live
    other = Conn("alice")
    end, gone = actors.close(other, {"t": messages.CLOSE, "id": 5, "actor": ACTOR_ID})
    assert end.owner is other and end.msg["t"] == messages.ACTOR_END
    assert (end.msg["code"], end.msg["id"]) == ("closed", 5) and isinstance(gone, Gone)
    [again] = actors.close(other, {"t": messages.CLOSE, "id": 6, "actor": ACTOR_ID})
    assert again.msg["code"] == "actor-died" and again.msg["id"] == 6


def test_an_actor_outlives_its_creators_last_connection_by_the_grace_time_unless_it_comes_back():
    actors, actor, alice = table(grace=3.0)
    actors.call(alice, call(1), [])
    assert actors.disconnected(alice, last=False) == [] and actor.owner is None  # another connection is left
    assert list(actor.calls.values())[0].owner is None and alice.calls == {}  # its outcome is dropped
    [arm] = actors.disconnected(Conn("alice"), last=True)
    assert isinstance(arm, ArmGrace) and (arm.actor, arm.seconds) == (actor, 3.0)
    assert actors.disconnected(Conn("alice"), last=True) == []  # armed once
    back = Conn("alice")
    [stop] = actors.connected(back)
    assert isinstance(stop, StopGrace) and actor.owner is back
    assert actors.grace_ended(actor) == []  # a timer that fired as it was cancelled
    actors.disconnected(back, last=True)
    actions = actors.grace_ended(actor)  # the call whose connection went has no one to answer, nor has the end
    assert kinds(actions) == ["StopGrace", "Gone"]
    gone = actions[-1]
    assert "its submitter alice was gone for 3 s" in gone.why and actors.live == {}


def test_output_goes_to_the_oldest_call_in_flight_and_a_status_counts_the_direct_calls():
    actors, actor, alice = table()
    assert actors.output(actor, "stdout", b"idle\n") == []
    actors.call(alice, call(1), [])
    actors.call(alice, call(2), [])
    [log] = actors.output(actor, "stderr", b"hi\n")
    assert log.msg == messages.log(1, "stderr", b"hi\n")
    assert actors.reply(actor, {"t": messages.STATUS, "served": 5}, []) == [] and actor.served == 5
    assert actors.reply(actor, {"t": messages.STATUS, "served": True}, []) == [] and actor.served == 5


def test_ending_every_actor_answers_each_call_and_frees_each_slot():
    actors, actor, alice = table()
    second = Actor("c3" * 16, "Other", "bob", None, Slot(1, "cpu"), Worker(4343))  # type: ignore[arg-type]
    actors.add(second)
    actors.call(alice, call(1, timeout=9.0), [])
    actors.call(alice, call(2), [])
    actions = actors.end_all("the peer shut down")
    assert kinds(actions) == ["StopCall", "ToSubmitter", "ToSubmitter", "ToSubmitter", "Gone", "Gone"]
    assert [a.msg["id"] for a in actions if isinstance(a, ToSubmitter)][:2] == [1, 2]
    assert [a.actor for a in actions if isinstance(a, Gone)] == [actor, second]
    assert actors.live == {} and actors.ended == {ACTOR_ID: "the peer shut down", "c3" * 16: "the peer shut down"}
