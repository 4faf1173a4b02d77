"""The peer's scheduler, the asyncio side: it turns what happens (a task admitted, a worker's reply, its
exit, a timeout, a wait on a future; an actor's call, its outcome, its creator's connection come or gone)
into events of `SchedulerState` (scheduler_state.py) and of the actor table (actors.py), which decide,
and performs the actions that come back, in one queue: it starts and replaces worker processes, sends
them work, arms timers, and answers each task once through its connection's `TaskOwner` methods. It
runs on the peer's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .. import accelerators
from .activity import Activity
from ..errors import WorkerDied
from ..matching import Requirements
from ..protocol import messages
from ..resources.model import Resources
from ..resources.utilisation import Sample
from .actors import (
    Actor, ActorAction, Actors, ArmCall, ArmGrace, CallOwner, Gone, StopCall, StopGrace, ToSubmitter, grace_from_env)
from .scheduler_state import (
    LEASE_IDLE_S, SPARE_IDLE_S, Action, Answer, EndActor, Ended, GoLive, OpenBorrowed, Replace, Run,
    RunAlone, SchedulerState, Started, StartJob, StopTimer, StopWorker, TellIdle, ToWorker, device_env)
from .slots import ActorHolder, JobHolder, LeaseHolder, Queued, Slot, Submission
from .worker_processes import Worker, describe_exit, job_pythonpath

log = logging.getLogger("gpulayer.peer")

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def plan_slots(res: Resources, concurrency: int | None) -> list[Slot]:
    """One slot per GPU (or `concurrency` per GPU); CPU-only peers get one per core by default.

    CPU slots share the cores: each worker's math libraries get cores / slots threads (unless
    the operator set those variables), so that concurrent tasks do not fight over every core.
    """
    gpus = [d for d in res.devices if d.kind == res.accelerator]
    if not gpus:
        count = concurrency or res.cpu_count or 1
        threads = str(max(1, (res.cpu_count or 1) // count))
        env = {accelerators.ENV_DEVICE: accelerators.CPU, **{v: threads for v in _THREAD_VARS if v not in os.environ}}
        return [Slot(i, accelerators.CPU, env=dict(env)) for i in range(count)]
    slots: list[Slot] = []
    inherited = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    for gpu in gpus:
        if gpu.kind == accelerators.CUDA:  # the peer's own CUDA_VISIBLE_DEVICES numbers what it detected
            visible = inherited[gpu.index] if gpu.index < len(inherited) else str(gpu.index)
            env = {accelerators.ENV_DEVICE: "cuda:0", "CUDA_VISIBLE_DEVICES": visible}
        else:
            env = {accelerators.ENV_DEVICE: accelerators.MPS}
        env[accelerators.ENV_DEVICE_INDEX] = str(gpu.index)
        slots += [Slot(len(slots) + i, f"{gpu.kind}:{gpu.index}", gpu.memory_gb, env,
                       unified=gpu.memory_kind == accelerators.UNIFIED) for i in range(concurrency or 1)]
    return slots


def default_preload(res: Resources) -> list[str]:
    """Keep the frameworks that GPU tasks use warm in every worker."""
    if res.accelerator == accelerators.CPU:
        return []
    wanted = ["torch", "mlx"] if res.accelerator == accelerators.MPS else ["torch"]
    return [name for name in wanted if res.framework(name)]


class Scheduler:
    """Runs admitted tasks in warm workers as `state` decides: by priority, then first come first served,
    honouring device memory."""

    def __init__(self, slots: list[Slot], python: str = sys.executable, preload: list[str] | None = None,
                 worker_start_timeout: float = 120.0, workdir: str | None = None,
                 max_slots_per_user: int | None = None):
        self.slots = slots
        self.state = SchedulerState(slots, max_slots_per_user)
        self.python = python
        self.preload = preload or []
        self.worker_start_timeout = worker_start_timeout
        # where tasks start: the operator's folder, or a scratch folder of this peer's, removed at stop
        self.workdir = workdir or tempfile.mkdtemp(prefix="gpulayer-work-")
        self._own_workdir = workdir is None
        self.activity = Activity()  # running and finished tasks, for STATUS
        self.stopping = False
        self.actors = Actors(grace_from_env())  # the live actors' table (actors.py), whose actions are performed here
        self._retiring: asyncio.Task[Any] | None = None  # `_retire_spares`, while borrowed slots exist
        self._background: set[asyncio.Task[Any]] = set()
        self._pythonpath = job_pythonpath(python)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: deque[Action | ActorAction] = deque()  # actions decided, not yet performed
        self.on_acted: Callable[[], None] | None = None  # told after the actions of each event (peer/pull.py)
        self._performers: dict[type[Any], Callable[[Any], None]] = {
            Started: self._started, Run: self._run, RunAlone: self._run_alone, StartJob: self._start_job,
            Answer: self._answer,
            Ended: self._ended, Replace: self._replace, StopTimer: self._stop_timer, ToWorker: self._to_worker,
            TellIdle: self._tell_idle, GoLive: self._go_live, EndActor: self._end_actor,
            OpenBorrowed: self._open_borrowed, StopWorker: self._stop_worker,
            ToSubmitter: self._to_submitter, ArmCall: self._arm_call, StopCall: self._stop_call,
            ArmGrace: self._arm_grace, StopGrace: self._stop_grace, Gone: self._gone}

    # ---- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start one warm worker per slot. Raises WorkerDied when workers cannot start."""
        self._loop = asyncio.get_running_loop()
        for slot in self.slots:
            slot.worker = self._new_worker(slot)
        await asyncio.gather(*(self._worker(s).start(self.worker_start_timeout) for s in self.slots))

    async def stop(self) -> None:
        """Stop the workers and the background jobs (tasks must have been answered or cancelled)."""
        self.stopping = True
        await asyncio.gather(*(self._worker(s).stop() for s in [*self.slots, *self.state.borrowed]),
                             return_exceptions=True)
        for job in list(self._background):
            job.cancel()
        if self._pythonpath:
            shutil.rmtree(self._pythonpath, ignore_errors=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run a coroutine in the background; it is cancelled at stop."""
        assert self._loop is not None
        job = self._loop.create_task(coro)
        self._background.add(job)
        job.add_done_callback(self._background.discard)
        return job

    def report(self, msg: messages.Outgoing) -> messages.Outgoing:
        """Add what a reply tells the submitter about this peer (`SchedulerState.report`)."""
        return self.state.report(msg, time.monotonic())

    # ---- events: the state decides, then its actions are performed ------------------------------------

    def enqueue(self, task: Queued) -> bool:
        """Queue an admitted task (or a job) and start what can start; True if it started at once."""
        self._perform(self.state.task_arrived(task, time.monotonic()))
        return task.slot is not None

    def cancel(self, task: Submission, code: str, message: str, notify: bool = True) -> None:
        """Drop a queued task, or stop a running one (its worker is killed and replaced)."""
        self._perform(self.state.cancel(task, code, message, notify, time.monotonic()))

    def withdraw(self, task: Queued) -> bool:
        """Take a task out of the queue for its submitter to place elsewhere; False once it started (or ended)."""
        return self.state.withdraw(task)

    def lease(self, address: str, submitter_id: str, req: Requirements) -> LeaseHolder | str:
        """Lend a ready warm worker that fits `req` to the connection of submitter `submitter_id` at `address`
        (ADR 0013); or why not."""
        lease = LeaseHolder(req=req, lease_id=os.urandom(8).hex(), submitter=address, submitter_id=submitter_id)
        refusal = self.state.lease(lease, time.monotonic())
        if refusal is not None:
            return refusal
        assert lease.slot is not None
        self._started(Started(lease, "(lease)", lease.slot.device))
        return lease

    def lease_message(self, lease: LeaseHolder) -> messages.Message:
        """What the leased worker is told with the connection: its device variables and idle limit."""
        assert lease.slot is not None
        return {"t": messages.LEASE, "env": device_env(lease.req, lease.slot), "idle": LEASE_IDLE_S,
                "owner": lease.submitter_id}

    def lease_failed(self, lease: LeaseHolder) -> None:
        """The connection did not reach the leased worker: the slot is free again."""
        self._perform(self.state.lease_failed(lease, time.monotonic()))

    def cancel_leased(self, lease_id: Any, submitter_id: str, task_id: int) -> None:
        """Stop a task on a lease of submitter `submitter_id` if it runs now, or keep it from starting."""
        self._perform(self.state.cancel_leased(lease_id, submitter_id, task_id))

    def end_leases(self) -> None:
        """Ask every leased worker to end its lease after the task it runs (the peer stops)."""
        self._perform(self.state.end_leases())

    def job_ended(self, job: JobHolder, outcome: str) -> None:
        """A job's process ended with `outcome` ("ok" or its state): its slots are free again."""
        self._perform(self.state.job_ended(job, outcome, time.monotonic()))

    def measure(self, sample: Sample) -> None:
        """Take a new measurement of the devices' memory, and start what it lets start."""
        self._perform(self.state.measure(sample, time.monotonic()))

    # ---- events of the actor table (actors.py) ------------------------------------------------------

    def call_actor(self, owner: CallOwner, msg: messages.Message, buffers: list[Any]) -> None:
        """A CALL: on to its actor's worker, or answered with why not."""
        self._perform(self.actors.call(owner, msg, buffers))

    def cancel_call(self, owner: CallOwner, call_id: int) -> None:
        """Cancel a call in flight of this connection."""
        self._perform(self.actors.cancel(owner, call_id))

    def close_actor(self, owner: CallOwner, msg: messages.Message) -> None:
        """A CLOSE: end the actor if its creator asks."""
        self._perform(self.actors.close(owner, msg))

    def submitter_connected(self, owner: CallOwner) -> None:
        """A submitter (re)connected: it owns its actors again."""
        self._perform(self.actors.connected(owner))

    def submitter_disconnected(self, owner: CallOwner, last: bool) -> None:
        """A connection closed (its submitter's `last`): its calls' outcomes are dropped, its actors orphaned."""
        self._perform(self.actors.disconnected(owner, last))

    def end_actors(self, reason: str) -> None:
        """End every live actor (the peer stops)."""
        self._perform(self.actors.end_all(reason))

    def _on_reply(self, worker: Worker, reply: messages.Message, buffers: list[Any]) -> None:
        holder = worker.slot.task
        if holder is None or worker.slot.worker is not worker:
            return
        if isinstance(holder, LeaseHolder):
            self._perform(self.state.lease_reported(holder, reply, time.monotonic()))
        elif isinstance(holder, ActorHolder) and holder.actor is not None:
            self._perform(self.actors.reply(holder.actor, reply, buffers))
        elif isinstance(holder, Submission):
            self._perform(self.state.task_replied(holder, reply, buffers, time.monotonic()))

    def _on_timeout(self, task: Submission) -> None:
        self._perform(self.state.timed_out(task, time.monotonic()))

    def _on_wait(self, worker: Worker, blocked: bool) -> None:
        """The worker's task blocks on a future (lend its slots) or goes on (take them back) (ADR 0014)."""
        if worker.slot.worker is worker and worker.slot.task is not None:
            self._perform(self.state.wait_changed(worker.slot.task, blocked, time.monotonic()))

    def _on_worker_exit(self, worker: Worker, code: int | None) -> None:
        slot = worker.slot
        if slot.worker is not worker:
            return
        log.warning("worker %s of slot %d died (%s)", worker.pid, slot.index, describe_exit(code))
        self._perform(self.state.worker_died(slot, worker.pid, describe_exit(code), time.monotonic()))

    def _on_output(self, worker: Worker, stream: str, data: bytes) -> None:
        """A piece of a worker's stdout or stderr: to the live actor's call, the task's submitter, or the log."""
        holder = worker.slot.task if worker.slot.worker is worker else None
        if isinstance(holder, ActorHolder) and holder.actor is not None:
            to_call = self.actors.output(holder.actor, stream, data)
            if to_call:
                return self._perform(to_call)
        if isinstance(holder, LeaseHolder):
            log.info("leased worker of %s, %s: %s", holder.address, stream, data.decode("utf-8", "replace").rstrip())
        elif isinstance(holder, Submission) and not holder.answered:
            holder.owner.task_output(holder, messages.log(holder.task_id, stream, data))
        else:
            log.info("worker %s %s: %s", worker.pid, stream, data.decode("utf-8", "replace").rstrip())

    # ---- actions ----------------------------------------------------------------------------------

    def _perform(self, actions: Sequence[Action | ActorAction]) -> None:
        """Perform actions in the order the transitions decided them. An event that an action causes at
        once (a send that finds its connection reset drops that connection, which cancels its tasks) is
        decided then, and its actions wait for those decided before it."""
        performing = bool(self._pending)
        self._pending.extend(actions)
        if performing:
            return
        while self._pending:
            action = self._pending[0]
            try:
                self._performers[type(action)](action)
            except Exception:  # a bug of ours costs this action, never the actions decided after it
                log.exception("failed to perform %s", type(action).__name__)
            self._pending.popleft()
        if self.on_acted is not None:
            self.on_acted()

    def _started(self, action: Started) -> None:
        self.activity.started(action.holder, action.name, action.holder.address, action.device)

    def _run(self, action: Run) -> None:
        action.worker.send(action.msg, action.buffers)
        self._arm_timeout(action.task)

    def _start_job(self, action: StartJob) -> None:
        action.job.start(action.group, action.env)

    def _run_alone(self, action: RunAlone) -> None:
        action.slot.worker = self._new_worker(action.slot, action.env, [] if action.bare else None)
        self.spawn(self._start_one_off(action, action.slot.worker))

    async def _start_one_off(self, action: RunAlone, worker: Worker) -> None:
        if action.old is not None:
            await action.old.kill()
        try:
            await worker.start(self.worker_start_timeout)
        except (WorkerDied, OSError) as exc:
            if worker.slot.worker is worker:
                self._perform(self.state.one_off_failed(action.task, worker.slot, str(exc), time.monotonic()))
            return
        if worker.slot.worker is not worker or worker.slot.task is not action.task:  # cancelled while it started
            await worker.kill()
            return
        worker.send(action.msg, action.buffers)
        self._arm_timeout(action.task)

    def _arm_timeout(self, task: Submission) -> None:
        if task.timeout:
            assert self._loop is not None
            task.timer = self._loop.call_later(task.timeout, self._on_timeout, task)

    def _stop_timer(self, action: StopTimer) -> None:
        if action.task.timer is not None:
            action.task.timer.cancel()
            action.task.timer = None

    def _answer(self, action: Answer) -> None:
        self.activity.ended(action.task, action.reply)
        action.task.owner.task_done(action.task, self.report(action.reply), action.buffers)

    def _ended(self, action: Ended) -> None:
        self.activity.ended(action.holder, action.reply)

    def _to_worker(self, action: ToWorker) -> None:
        action.worker.send(action.msg, action.buffers)

    def _tell_idle(self, action: TellIdle) -> None:
        news = self.report({"t": messages.PONG, "id": None})
        for owner in action.owners:
            owner.send(news)

    def _go_live(self, action: GoLive) -> None:
        """The actor's constructor returned: the live actor holds the slot, and the answer carries its id."""
        task, slot = action.task, action.task.slot
        assert isinstance(task, ActorHolder) and slot is not None
        owner: CallOwner = task.owner  # type: ignore[assignment]  # a connection is both
        task.actor = Actor(task.actor_id, task.class_name, owner.submitter_id, owner, slot, action.worker)
        self.actors.add(task.actor)
        log.info("actor %s (%s) of submitter %s lives on slot %d, worker %s", task.actor.short_id, task.actor.name,
                 owner.submitter_id, slot.index, action.worker.pid)
        action.reply["actor"], action.reply["slot"] = task.actor_id, slot.index

    def _end_actor(self, action: EndActor) -> None:
        self._perform(self.actors.end(action.actor, "died", action.reason))

    def _to_submitter(self, action: ToSubmitter) -> None:
        action.owner.send(action.msg, action.buffers)

    def _arm_call(self, action: ArmCall) -> None:
        assert self._loop is not None and action.call.timeout is not None
        action.call.timer = self._loop.call_later(action.call.timeout, self._on_call_timeout, action)

    def _on_call_timeout(self, armed: ArmCall) -> None:
        armed.call.timer = None
        self._perform(self.actors.call_timed_out(armed.actor, armed.worker_call_id))

    def _stop_call(self, action: StopCall) -> None:
        if action.call.timer is not None:
            action.call.timer.cancel()
            action.call.timer = None

    def _arm_grace(self, action: ArmGrace) -> None:
        assert self._loop is not None
        action.actor.grace = self._loop.call_later(action.seconds, self._on_grace_end, action.actor)

    def _on_grace_end(self, actor: Actor) -> None:
        actor.grace = None
        self._perform(self.actors.grace_ended(actor))

    def _stop_grace(self, action: StopGrace) -> None:
        if action.actor.grace is not None:
            action.actor.grace.cancel()
            action.actor.grace = None

    def _gone(self, action: Gone) -> None:
        """An actor ended: kill its worker (unless it is gone already) and give the slot a warm one."""
        actor = action.actor
        log.info("actor %s (%s) ended after %d call(s): %s", actor.short_id, actor.name, actor.served, action.why)
        self._perform(self.state.actor_ended(actor.slot, actor.worker, f"its actor {actor.short_id} ended: {action.why}",
                                             time.monotonic()))

    def _replace(self, action: Replace) -> None:
        """Kill the slot's old worker and start a fresh one (retried with back-off until the peer stops)."""
        action.slot.worker = self._new_worker(action.slot)
        self.spawn(self._restart(action.old, action.slot, action.why))

    async def _restart(self, old: Worker | None, slot: Slot, why: str | None) -> None:
        if old is not None:  # else a one-off worker was about to take the slot: it sees it lost it, and ends
            code = await old.kill()
            ended = f"stopped by the peer: {why}" if why else describe_exit(code)  # a kill of ours is no crash
            log.info("worker %s of slot %d ended (%s); starting a new one", old.pid, slot.index, ended)
        delay = 0.5
        while not self.stopping:
            try:
                await self._worker(slot).start(self.worker_start_timeout)
            except (WorkerDied, OSError) as exc:
                log.error("%s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                slot.worker = self._new_worker(slot)
                continue
            self._perform(self.state.worker_ready(time.monotonic()))
            return

    def _open_borrowed(self, action: OpenBorrowed) -> None:
        action.slot.worker = self._new_worker(action.slot)
        if self._retiring is None or self._retiring.done():
            self._retiring = self.spawn(self._retire_spares())
        self.spawn(self._start_borrowed(action.slot))

    async def _start_borrowed(self, slot: Slot) -> None:
        try:
            await self._worker(slot).start(self.worker_start_timeout)
        except (WorkerDied, OSError) as exc:
            log.error("no worker for a lent slot: %s", exc)
            self.state.borrowed_failed(slot)
            return
        self._perform(self.state.worker_ready(time.monotonic()))

    async def _retire_spares(self) -> None:
        """Stop the workers of borrowed slots that no wait needed for SPARE_IDLE_S; ends when none is left."""
        while self.state.borrowed:
            await asyncio.sleep(SPARE_IDLE_S / 2)
            self._perform(self.state.spares_due(time.monotonic()))

    def _stop_worker(self, action: StopWorker) -> None:
        self.spawn(action.worker.stop())

    # ---- workers ------------------------------------------------------------------------------

    @staticmethod
    def _worker(slot: Slot) -> Worker:
        assert slot.worker is not None
        return slot.worker

    def _new_worker(self, slot: Slot, env: dict[str, str] | None = None, preload: list[str] | None = None) -> Worker:
        """A worker for `slot`, not started: a warm one, or one with `env` on top of the slot's and other preloads."""
        return Worker(slot, self.python, self.preload if preload is None else preload, self._on_reply,
                      self._on_output, self._on_worker_exit, self._on_wait, self._pythonpath, env, self.workdir,
                      keep_folders=not self._own_workdir)
