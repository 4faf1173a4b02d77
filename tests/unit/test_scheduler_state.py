"""The peer scheduler's decisions, as pure transitions: each event on a `SchedulerState` (a task arrived,
a worker replied, a timeout, a cancel, a worker died, a wait, a lease) changes its state and returns
the actions that follow, in order. No event loop, no process: the slots' workers are what the state
reads of them (whether one is up, whether it takes a handed-over connection)."""

from __future__ import annotations

from dataclasses import dataclass

from gpulayer.protocol import messages
from gpulayer.matching import Requirements
from gpulayer.peer.scheduler_state import (
    IDLE_NOTICE_GAP_S, SPARE_IDLE_S, EndActor, Replace, RunAlone, SchedulerState, StartJob, StopWorker, TellIdle,
    ToWorker)
from gpulayer.peer.slots import ActorHolder, JobHolder, LeaseHolder, Slot, TaskHolder


@dataclass(eq=False)
class Up:
    """What the state reads of a worker process: whether it is up, and whether it takes connections."""
    ready: bool = True
    direct: bool = True
    last_words: str = ""


@dataclass(eq=False)
class Owner:
    """A submitter's connection, as the state sees one: its address and id (sending is the shell's)."""
    address: str
    submitter_id: str

    def task_done(self, task, reply, buffers):
        raise AssertionError("the state sends nothing itself")

    task_output = send = task_done


ALICE, BOB = Owner("10.0.0.1:5000", "alice"), Owner("10.0.0.2:5000", "bob")


def slots(count=1, device="cpu", memory_gb=None):
    made = [Slot(i, device if count == 1 else f"{device}:{i}", memory_gb, {"GPULAYER_DEVICE": device})
            for i in range(count)]
    for slot in made:
        slot.worker = Up()  # type: ignore[assignment]
    return made


def task(task_id=1, owner=ALICE, timeout=None, env=None, **req):
    msg = {"t": messages.SUBMIT, "id": task_id, "fn": b"fn", "args": b"args", "name": f"f{task_id}"}
    if env:
        msg["env"] = env
    return TaskHolder(owner=owner, task_id=task_id, msg=msg, buffers=[b"buffer"],
                      req=Requirements.build(**req), timeout=timeout)


def actor(task_id=7):
    msg = {"t": messages.ACTOR, "id": task_id, "cls": b"cls", "args": b"args", "name": "Counter", "conc": 1}
    return ActorHolder(owner=ALICE, task_id=task_id, msg=msg, buffers=[], req=Requirements.build(),
                       timeout=None, class_name="Counter")


def kinds(actions):
    return [type(a).__name__ for a in actions]


def test_a_task_on_a_free_slot_starts_at_once_on_its_warm_worker():
    state = SchedulerState(slots())
    first = task()
    actions = state.task_arrived(first, now=10.0)
    assert kinds(actions) == ["Started", "Run"]
    started, run = actions
    assert (started.holder, started.name, started.device) == (first, "f1", "cpu")
    assert run.worker is state.slots[0].worker and run.buffers == [b"buffer"]
    assert run.msg == {"t": messages.SUBMIT, "id": 1, "fn": b"fn", "args": b"args", "owner": "alice"}
    assert state.slots[0].task is first and first.msg is None  # the SUBMIT is not kept once sent
    assert (state.busy, state.queued, state.load()) == (1, 0, [1, 0])


def test_a_result_answers_once_frees_the_slot_and_starts_the_next_in_line():
    state = SchedulerState(slots())
    first, second = task(1), task(2)
    state.task_arrived(first, now=10.0)
    assert state.task_arrived(second, now=10.5) == [] and state.queued == 1
    actions = state.task_replied(first, {"t": messages.RESULT, "id": 1}, [b"result"], now=12.25)
    assert kinds(actions) == ["StopTimer", "Answer", "Started", "Run"]
    answer = actions[1]
    assert answer.task is first and answer.buffers == [b"result"]
    assert answer.reply == {"t": messages.RESULT, "id": 1, "ran": 2.25}
    assert actions[3].task is second and state.slots[0].task is second and state.tasks_done == 1
    # a second outcome of the same task (a late one) is not sent again
    assert state.cancel(first, "cancelled", "too late", notify=True, now=13.0) == []


def test_output_and_other_messages_of_a_worker_decide_nothing():
    state = SchedulerState(slots())
    first = task()
    state.task_arrived(first, now=0.0)
    assert state.task_replied(first, {"t": messages.STATUS, "served": 3}, [], now=1.0) == []
    assert state.slots[0].task is first


def test_a_timeout_answers_the_task_and_replaces_its_worker_before_anything_else_starts_there():
    state = SchedulerState(slots())
    late, waiting = task(1, timeout=5.0), task(2)
    state.task_arrived(late, now=0.0)
    state.task_arrived(waiting, now=0.0)
    old = state.slots[0].worker
    actions = state.timed_out(late, now=5.0)
    assert kinds(actions) == ["Answer", "StopTimer", "Replace"]
    assert actions[0].reply["code"] == "timeout" and actions[0].reply["ran"] == 5.0
    replace = actions[2]
    assert (replace.slot, replace.old) == (state.slots[0], old) and "timeout of 5 s" in replace.why
    assert state.slots[0].worker is None and not state.slots[0].ready and waiting.slot is None
    state.slots[0].worker = Up()  # the shell's fresh worker, once it started
    assert kinds(state.worker_ready(now=6.0)) == ["Started", "Run"] and waiting.slot is state.slots[0]


def test_a_cancel_drops_a_queued_task_and_stops_a_running_one():
    state = SchedulerState(slots())
    running, queued = task(1), task(2)
    state.task_arrived(running, now=0.0)
    state.task_arrived(queued, now=0.0)
    actions = state.cancel(queued, "cancelled", "cancelled by the submitter", notify=True, now=1.0)
    assert kinds(actions) == ["Answer"] and actions[0].reply["code"] == "cancelled" and state.queued == 0
    actions = state.cancel(running, "cancelled", "the submitter disconnected", notify=False, now=1.0)
    assert kinds(actions) == ["StopTimer", "Replace"] and running.answered  # no answer: nobody to send it to
    assert "its task was stopped: the submitter disconnected" == actions[1].why


def test_a_withdrawn_task_leaves_the_queue_only_before_it_starts():
    state = SchedulerState(slots())
    running, queued = task(1), task(2)
    state.task_arrived(running, now=0.0)
    state.task_arrived(queued, now=0.0)
    assert not state.withdraw(running)
    assert state.withdraw(queued) and state.queued == 0 and state.withdrawn == 1 and queued.answered
    assert not state.withdraw(queued)


def test_a_bad_env_is_answered_and_never_queued():
    state = SchedulerState(slots())
    bad = task(env={"GPULAYER_DEVICE": "cuda:0"})  # the slot's own variable
    actions = state.task_arrived(bad, now=0.0)
    assert kinds(actions) == ["Answer"] and actions[0].reply["code"] == "bad-request" and state.queued == 0


def test_a_variable_read_at_load_gets_a_bare_worker_of_its_own():
    state = SchedulerState(slots())
    fresh = task(env={"OMP_NUM_THREADS": "3"})
    warm = state.slots[0].worker
    started, alone = state.task_arrived(fresh, now=0.0)
    assert isinstance(alone, RunAlone) and alone.bare and alone.env == {"OMP_NUM_THREADS": "3"}
    assert fresh.one_off and alone.old is warm and state.slots[0].worker is None  # until the shell makes one
    state.slots[0].worker = Up()
    # its answer gives the slot a warm worker again
    actions = state.task_replied(fresh, {"t": messages.RESULT, "id": 1}, [], now=1.0)
    assert kinds(actions) == ["StopTimer", "Replace", "Answer"]
    assert actions[1].why == "its task needed a worker of its own"


def test_a_task_on_several_devices_sees_all_of_them_in_a_worker_of_its_own():
    gpus = slots(3, "cuda", 80.0)
    for slot in gpus:
        slot.env["CUDA_VISIBLE_DEVICES"] = str(slot.index)
    state = SchedulerState(gpus)
    wide = task(accelerator="cuda", devices=2)
    started, alone = state.task_arrived(wide, now=0.0)
    assert isinstance(alone, RunAlone) and not alone.bare and alone.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert wide.group == gpus[:2] and state.busy == 2


def test_a_task_that_does_not_fit_the_free_memory_lets_the_next_one_go_first():
    gpus = slots(2, "cuda", 24.0)
    state = SchedulerState(gpus)
    state.task_arrived(task(1, accelerator="cuda", gpu_memory_gb=20), now=0.0)
    big, small = task(2, accelerator="cuda", gpu_memory_gb=30), task(3, accelerator="cuda", gpu_memory_gb=4)
    assert state.task_arrived(big, now=0.0) == []  # no device has 30 GB
    assert kinds(state.task_arrived(small, now=0.0)) == ["Started", "Run"] and small.slot is gpus[1]
    assert list(state.queue) == [big] and state.free_memory() == {"cuda:0": 4.0, "cuda:1": 20.0}


def test_an_actor_holds_its_slot_once_its_constructor_returned():
    state = SchedulerState(slots())
    creation = actor()
    started, alone = state.task_arrived(creation, now=0.0)
    assert isinstance(alone, RunAlone) and alone.msg["t"] == messages.ACTOR and alone.msg["actor"] == creation.actor_id
    state.slots[0].worker = own = Up()
    reply = {"t": messages.RESULT, "id": 7}
    actions = state.task_replied(creation, reply, [], now=1.0)
    assert kinds(actions) == ["StopTimer", "GoLive", "Answer"]
    assert (actions[1].worker, actions[1].reply) == (own, reply)
    assert state.slots[0].task is creation
    creation.actor = object()  # the shell's live actor (GoLive)
    assert (state.held_by_actors, state.actors_hold_all(Requirements.build())) == (1, True)


def test_an_actor_whose_constructor_failed_leaves_the_slot_to_a_warm_worker():
    state = SchedulerState(slots())
    creation = actor()
    state.task_arrived(creation, now=0.0)
    state.slots[0].worker = own = Up()
    actions = state.task_replied(creation, {"t": messages.ERROR, "id": 7, "code": "exception"}, [], now=1.0)
    assert kinds(actions) == ["StopTimer", "Replace", "Answer"] and state.slots[0].task is None
    assert actions[1].old is own


def test_a_worker_that_dies_fails_its_task_or_ends_its_actor():
    state = SchedulerState(slots(2))
    victim = task()
    state.task_arrived(victim, now=0.0)
    actions = state.worker_died(state.slots[0], 4321, "killed by SIGKILL", now=1.0)
    assert kinds(actions) == ["StopTimer", "Replace", "Answer"] and actions[1].why is None
    assert actions[2].reply["message"] == "the worker process 4321 died while running the task (killed by SIGKILL)"
    creation = actor()
    state.task_arrived(creation, now=2.0)
    creation.slot.worker = Up()
    state.task_replied(creation, {"t": messages.RESULT, "id": 7}, [], now=3.0)
    creation.actor = live = object()
    slot = creation.slot
    assert [(type(a), a.actor, a.reason) for a in state.worker_died(slot, 99, "exit code 1", now=4.0)] == [
        (EndActor, live, "its worker process 99 died (exit code 1)")]
    # the actor table ends it, then gives the slot back through `actor_ended`
    assert kinds(state.actor_ended(slot, slot.worker, "its actor ended", now=4.0)) == ["StopTimer", "Replace"]


def test_a_lease_takes_a_slot_only_when_nothing_waits_and_yields_it_to_the_queue():
    state = SchedulerState(slots())
    lease = LeaseHolder(req=Requirements.build(), lease_id="ab", submitter=BOB.address, submitter_id="bob")
    assert state.lease(lease, now=0.0) is None and state.slots[0].task is lease and state.leases == {"ab": lease}
    worker = state.slots[0].worker
    waiting = task(1)
    actions = state.task_arrived(waiting, now=1.0)  # its slot would let a queued task start: asked to end
    assert [(type(a), a.worker, a.msg) for a in actions] == [(ToWorker, worker, {"t": messages.LEASE_END})]
    assert state.task_arrived(task(2), now=1.0) == []  # asked once
    other = LeaseHolder(req=Requirements.build(), lease_id="cd", submitter=BOB.address, submitter_id="bob")
    assert state.lease(other, now=1.0) == "tasks wait in the queue"
    actions = state.lease_reported(lease, {"t": messages.STATUS, "lease_end": True, "served": 5}, now=2.0)
    assert kinds(actions) == ["ToWorker", "Ended", "Started", "Run"] and actions[2].holder is waiting
    assert state.tasks_done == 5 and state.leases == {} and lease.answered


def test_only_the_lease_holder_cancels_a_task_on_its_lease():
    state = SchedulerState(slots())
    lease = LeaseHolder(req=Requirements.build(), lease_id="ab", submitter=BOB.address, submitter_id="bob")
    state.lease(lease, now=0.0)
    assert state.cancel_leased("ab", "mallory", 3) == [] and state.cancel_leased("zz", "bob", 3) == []
    [cancel] = state.cancel_leased("ab", "bob", 3)
    assert cancel.msg == messages.cancel(3)
    [replace] = [a for a in state.lease_reported(lease, {"t": messages.BYE, "kill": True, "reason": "timeout"}, now=1.0)
                 if isinstance(a, Replace)]
    assert replace.why == "its leased task was stopped: timeout" and state.leases == {}


def test_a_blocked_task_lends_its_slot_to_the_queue_but_never_to_an_actor():
    state = SchedulerState(slots())
    waiter, creation, helper = task(1), actor(), task(2)
    state.task_arrived(waiter, now=0.0)
    state.task_arrived(creation, now=0.0)
    state.task_arrived(helper, now=0.0)
    actions = state.wait_changed(waiter, True, now=1.0)
    assert kinds(actions) == ["OpenBorrowed"]
    borrowed = actions[0].slot
    assert borrowed.lent_by is waiter and borrowed.device == "cpu" and state.load() == [0, 2]
    borrowed.worker = Up()  # the shell started its worker
    actions = state.worker_ready(now=2.0)
    assert kinds(actions) == ["Started", "Run"] and actions[1].task is helper and helper.slot is borrowed
    assert list(state.queue) == [creation]  # the actor waits for a slot of its own
    assert state.wait_changed(waiter, False, now=3.0) == [] and borrowed.lent_by is None


def test_a_spare_borrowed_worker_is_stopped_after_it_idled_long_enough():
    state = SchedulerState(slots())
    waiter = task(1)
    state.task_arrived(waiter, now=0.0)
    [opened] = state.wait_changed(waiter, True, now=0.0)
    opened.slot.worker = spare = Up()
    state.wait_changed(waiter, False, now=1.0)
    assert state.spares_due(now=2.0) == []
    assert state.spares_due(now=2.0 + SPARE_IDLE_S / 2) == []
    [stop] = state.spares_due(now=2.0 + SPARE_IDLE_S)
    assert isinstance(stop, StopWorker) and stop.worker is spare and state.borrowed == []


def test_other_contenders_hear_that_a_slot_is_free_at_most_once_a_gap():
    state = SchedulerState(slots(2))
    mine, theirs = task(1, owner=ALICE), task(2, owner=BOB)
    state.task_arrived(mine, now=0.0)
    state.task_arrived(theirs, now=0.0)
    assert state.submitters(now=0.0) == 2
    actions = state.task_replied(mine, {"t": messages.RESULT, "id": 1}, [], now=1.0)
    [tell] = [a for a in actions if isinstance(a, TellIdle)]
    assert tell.owners == frozenset({BOB})  # ALICE knows from her answer
    again = task(3, owner=ALICE)
    state.task_arrived(again, now=1.0)
    actions = state.task_replied(again, {"t": messages.RESULT, "id": 3}, [], now=1.0 + IDLE_NOTICE_GAP_S / 2)
    assert not any(isinstance(a, TellIdle) for a in actions)


def test_a_lease_counts_as_a_contending_submitter():
    state = SchedulerState(slots(2))
    lease = LeaseHolder(req=Requirements.build(), lease_id="ab", submitter=BOB.address, submitter_id="bob")
    state.lease(lease, now=0.0)
    state.task_arrived(task(1), now=0.0)
    assert state.submitters(now=0.5) == 2
    assert state.report({"t": messages.PONG}, now=0.5) == {"t": messages.PONG, "load": [2, 0], "submitters": 2}


def test_a_job_runs_its_own_process_on_its_slots_until_it_ends():
    gpus = slots(2, "cuda", 80.0)
    for slot in gpus:
        slot.env["CUDA_VISIBLE_DEVICES"] = str(slot.index)
    state = SchedulerState(gpus)
    job = JobHolder(req=Requirements.build(accelerator="cuda", devices=2), job_id="j1", name="train",
                    start=lambda group, env: None)
    started, start = state.task_arrived(job, now=0.0)
    assert (started.name, started.holder.address) == ("train", "job j1")
    assert isinstance(start, StartJob) and start.group == gpus and start.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert state.held_by_jobs == 2 and state.submitters(now=100.0) == 2
    waiting = task(1)
    assert state.task_arrived(waiting, now=1.0) == []
    # the idle warm worker of a job's slot dies: replaced, and the job keeps its slots
    assert kinds(state.worker_died(gpus[0], 77, "exit code 1", now=2.0)) == ["Replace"]
    assert gpus[0].task is job and not job.answered
    gpus[0].worker = Up()
    actions = state.job_ended(job, "failed", now=3.0)
    assert kinds(actions) == ["Ended", "Started", "Run"] and actions[0].reply == {"code": "failed"}
    assert job.answered and state.tasks_done == 1 and waiting.slot in gpus


def test_the_queue_starts_by_priority_then_the_submitters_in_turn():
    state = SchedulerState(slots())
    running = task(1)
    state.task_arrived(running, now=0.0)

    def job(job_id, priority=0, share="ann@10.0.0.3"):
        return JobHolder(req=Requirements.build(), job_id=job_id, name=job_id, priority=priority, share=share,
                         start=lambda group, env: None)

    low, ann1, ann2, urgent = job("low", priority=-1), job("ann1"), job("ann2"), job("urgent", priority=5)
    later = task(2, owner=BOB)  # tasks have priority 0 and one turn between them all
    for waiting in (low, ann1, ann2, later, urgent):
        assert state.task_arrived(waiting, now=1.0) == []
    order = []
    holder = running
    for step in range(5):
        actions = (state.task_replied(holder, {"t": messages.RESULT, "id": holder.task_id}, [], now=2.0 + step)
                   if isinstance(holder, TaskHolder) else state.job_ended(holder, "ok", now=2.0 + step))
        holder = next(a.holder for a in actions if type(a).__name__ == "Started")
        order.append(holder)
    assert order == [urgent, ann1, later, ann2, low] and state.queued == 0


def test_a_user_at_its_quota_waits_while_another_users_work_starts_on_the_free_slot():
    """--max-slots-per-user 1 on two slots: alice's second task waits although a slot is free, bob's task
    and job take it; when alice's first ends her next starts. A job counts in its user's quota too."""
    state = SchedulerState(slots(2), max_slots_per_user=1)
    a1, a2, b1 = task(1), task(2), task(3, owner=BOB)
    for holder, user in ((a1, "alice@10.0.0.1"), (a2, "alice@10.0.0.1"), (b1, "bob@10.0.0.2")):
        holder.user = user
    assert kinds(state.task_arrived(a1, now=0.0)) == ["Started", "Run"]
    assert state.task_arrived(a2, now=0.1) == [] and state.queued == 1 and state.busy == 1
    assert kinds(state.task_arrived(b1, now=0.2)) == ["Started", "Run"] and state.slots[1].task is b1
    bobs_job = JobHolder(req=Requirements.build(), job_id="j1", name="j1", share="bob@10.0.0.2",
                         user="bob@10.0.0.2", start=lambda group, env: None)
    assert state.task_arrived(bobs_job, now=0.3) == []
    actions = state.task_replied(a1, {"t": messages.RESULT, "id": 1}, [], now=1.0)
    assert kinds(actions) == ["StopTimer", "Answer", "Started", "Run"] and actions[3].task is a2  # not bob's job
    assert state.within_quota(bobs_job) is False and state.within_quota(bobs_job, freed=b1) is True


def test_work_that_needs_more_slots_than_the_quota_starts_while_its_user_holds_none():
    gpus = slots(2, "cuda", 80.0)
    for slot in gpus:
        slot.env["CUDA_VISIBLE_DEVICES"] = str(slot.index)
    state = SchedulerState(gpus, max_slots_per_user=1)
    wide, again = task(1, accelerator="cuda", devices=2), task(2, accelerator="cuda", devices=2)
    wide.user = again.user = "alice@10.0.0.1"
    assert kinds(state.task_arrived(wide, now=0.0))[0] == "Started" and state.busy == 2
    assert not state.within_quota(again) and state.within_quota(again, freed=wide)
