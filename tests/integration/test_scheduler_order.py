"""The peer's scheduler performs its actions in the order its transitions decided them, even when an
action causes an event at once: an answer whose send finds the submitter's connection reset drops that
connection, which cancels the submitter's other tasks (Peer.drop), while the next task's start, decided
with the answer, is still to be performed. Real scheduler, real worker processes, real pickles."""

from __future__ import annotations

import asyncio
import logging

from gpulayer import serialization
from gpulayer.matching import Requirements
from gpulayer.peer.scheduler import Scheduler, plan_slots
from gpulayer.peer.slots import TaskHolder
from gpulayer.protocol import messages
from gpulayer.resources.model import Resources


def nap(seconds):
    import time

    time.sleep(seconds)
    return seconds


class ResetOnAnswer:
    """A submitter's connection, as the scheduler sees one, whose first answer finds it reset: as the
    peer does then (Peer.drop), its other tasks are cancelled, with no answer to send."""

    address, submitter_id = "127.0.0.1:1", "reset"

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.answers: dict[int, dict] = {}
        self.tasks: list[TaskHolder] = []

    def task_done(self, task, reply, buffers):
        self.answers[task.task_id] = dict(reply)
        if len(self.answers) == 1:
            for other in self.tasks:
                self.scheduler.cancel(other, "cancelled", "the submitter disconnected", notify=False)

    def task_output(self, task, msg):
        pass

    def send(self, msg, buffers=()):
        pass


def holder(owner, task_id: int, seconds: float, timeout: float | None = None) -> TaskHolder:
    msg = {"t": messages.SUBMIT, "id": task_id, "fn": serialization.dumps_function(nap),
           "args": serialization.dumps(((seconds,), {}))[0], "name": "nap"}
    return TaskHolder(owner=owner, task_id=task_id, msg=msg, buffers=[], req=Requirements.build(),
                      timeout=timeout)


async def until(condition, seconds: float = 60.0) -> None:
    """Wait on the event loop until condition() holds; asyncio.TimeoutError after `seconds`."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), seconds)


async def scenario() -> tuple[dict, dict]:
    res = Resources("h", "Linux", "x86_64", "cpu", 1, 8.0, "3.11.7", [], [])
    scheduler = Scheduler(plan_slots(res, 1), worker_start_timeout=60)
    await scheduler.start()
    try:
        reset = ResetOnAnswer(scheduler)
        first = holder(reset, 1, 0.0)
        # queued behind the first: it starts when the first is answered, and is cancelled by that answer
        second = holder(reset, 2, 5.0, timeout=0.5)
        reset.tasks = [second]
        scheduler.enqueue(first)
        scheduler.enqueue(second)
        await until(lambda: second.answered and scheduler.state.slots[0].ready)  # a fresh worker replaced its
        later = ResetOnAnswer(scheduler)
        third = holder(later, 3, 1.5)  # runs past the second's timeout: that timer must be gone
        scheduler.enqueue(third)
        await until(lambda: 3 in later.answers)
        return reset.answers, later.answers
    finally:
        scheduler.stopping = True
        await scheduler.stop()


def test_an_answer_that_drops_its_connection_cancels_the_task_started_with_it(caplog):
    caplog.set_level(logging.ERROR, logger="gpulayer.peer")
    reset, later = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert list(reset) == [1] and reset[1]["t"] == messages.RESULT  # the second was cancelled unanswered
    assert later[3]["t"] == messages.RESULT, later[3]  # not killed by the cancelled task's timer
    assert not [r for r in caplog.records if "failed to perform" in r.getMessage()]
