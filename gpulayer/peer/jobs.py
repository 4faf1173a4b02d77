"""The peer's jobs (ADR 0016): received with their folder, recorded in the store, run on a slot, watched.

A job is one more holder of the scheduler's slots (`slots.JobHolder`): queued like a task, and once
started it runs a supervisor (jobs/shim.py) in a session of its own, in the job's folder, and gives
the slots back when the supervisor exits. Nothing here depends on the connection that submitted it:
a job goes on when its submitter goes. Every request is answered from the store, so a peer restarted
on the same state folder answers for the jobs of its earlier life.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import marshal
import os
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import psutil

from ..jobs import folder, local_fetch, shim, transfer
from ..jobs.cgroup import Cgroups
from ..jobs.store import (ENDED, FAILED, LOST, MOVED, MOVING, PREEMPTED, QUEUED, RETENTION_DAYS, RETENTION_GB, RUNNING,
                          STOPPED, SUCCEEDED, JobRow, JobSpec, JobStore, StateDirInUse, default_state_dir, holder_of,
                          kill_point, pause_point)
from ..matching import Requirements, match
from ..protocol import framing, jobs as job_protocol, messages
from ..resources.model import Advert
from ..transport.channel import AsyncChannel
from .gangs import Gangs, JobSteps
from .janitor import Janitor
from .pull import Owner
from .scheduler import Scheduler
from .slots import JobHolder, Slot
from .worker_processes import job_pythonpath, worker_env

log = logging.getLogger("gpulayer.peer")

LOG_FILE, STATUS_FILE, GRACE_FILE, WORK_DIR, MANIFEST_FILE = "log", "exit.json", "grace", "work", "manifest.json"
DATA_CHUNK = 4 << 20  # bytes of a log a JOB_LOG carries
FOLLOW_POLL_S = 0.02  # how often a followed log is looked at again while its job runs (a stat when it did not grow)
FOLLOW_FAST_S, FOLLOW_FAST_FOR_S = 0.005, 1.0  # more often in the first second of a follow: a job's first line
SUPERVISOR = (sys.executable, "-I", "-S", shim.__file__)  # a job's supervisor: the peer's interpreter, isolated
STATUS_ENDED, STATUS_TAIL_LINES, STATUS_TAIL_BYTES = 20, 5, 2000  # what STATUS says of the jobs (the dashboard)  # the defaults of --job-retention-days and --job-retention-gb


def claim_state_dir(path: str | None) -> tuple[Path, int]:
    """The state folder and an open lock on it (held for the peer's life): `path`, or the first of
    <user state dir>/peer, peer-2, peer-3 ... that no other live peer holds. Raises StateDirInUse
    when `path` is held."""
    candidates = [Path(path)] if path else [default_state_dir() / (f"peer-{n}" if n > 1 else "peer")
                                            for n in range(1, 1000)]
    for candidate in candidates:
        candidate.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(candidate / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return candidate, fd
    raise StateDirInUse(f"the state folder {candidates[0]} is in use by another peer")


class JobConnection(Protocol):
    """What a job request needs of the connection it came on (peer/server.py's Connection)."""

    channel: AsyncChannel
    submitter_id: str
    address: str
    link: socket.socket | None  # its local link (transport/shm.py), if it has one


@dataclass
class Upload:
    """A job being received: its spec, its manifest, the blobs the peer still waits for, and its folders
    (one per job of an array), built from the blobs as they are stored."""

    spec: JobSpec
    manifest: folder.Manifest
    receiver: transfer.BlobReceiver
    builder: folder.Builder  # its folders are made in folders reserved in the store (`incoming`)
    disk: transfer.DiskThread | None  # the receiver's, which also places each blob's files: while it is full,
    # the connection is not read
    array: tuple[range, int] | None = None  # an array's indices and limit (`--array 0-99%8`)
    building: bool = False  # the folders are being finished off the event loop: that thread owns them

    @property
    def incoming(self) -> list[Path]:
        """The folders reserved for its jobs (none before the first is built)."""
        return [path.parent for path in self.builder.dests]

    def drop(self) -> list[Path]:
        """Nothing of it is recorded: stop receiving; its folders, to remove (none while their builder is busy)."""
        self.receiver.abort()  # its disk thread, which places files, has ended
        if self.building:
            return []
        self.builder.close()
        return self.incoming


@dataclass
class Run:
    """A running job's supervisor, and why it is being stopped (if it is)."""

    task: JobHolder
    proc: asyncio.subprocess.Process | None = None
    stopping: str = ""  # "stopped", "timeout", "preempted", or "lost" (the peer stops)
    timer: asyncio.TimerHandle | None = None
    runner: asyncio.Task[None] | None = None  # `Jobs._run`, which records how it ended


@dataclass
class Standby:
    """A supervisor started ahead (jobs/shim.py --standby), waiting on its pipe for the next job to start."""

    proc: asyncio.subprocess.Process
    pipe: int  # the pipe's end the job is written to (closed after; its end alone makes the standby exit)
    started: float | None  # its start time (psutil's), recorded with its pid

    async def hand_over(self, cwd: str, env: dict[str, str], argv: list[str]) -> bool:
        """Give it its job (shim.py's handover: marshal of (cwd, env, argv)) and close the pipe; False if it was
        gone (it then runs nothing). What does not fit the pipe's buffer at once is written on a thread."""
        data = memoryview(marshal.dumps((cwd, env, argv)))
        gone = self.proc.returncode is not None
        if not gone:
            try:
                data = data[os.write(self.pipe, data):]  # at once, as a rule: it fits the pipe's buffer
            except BlockingIOError:
                pass
            except BrokenPipeError:
                gone = True
        if gone or not data:
            os.close(self.pipe)
            return not gone
        os.set_blocking(self.pipe, True)
        return await asyncio.get_running_loop().run_in_executor(None, _write_and_close, self.pipe, data)


class Jobs:
    """This peer's jobs: the store, the blob cache, the runs, and the answers to the job requests."""

    def __init__(self, scheduler: Scheduler, python: str, state_dir: str | None, advert: Callable[[], Advert],
                 retention_days: float = RETENTION_DAYS, retention_gb: float = RETENTION_GB, key: bytes = b""):
        self.dir, self._lock = claim_state_dir(state_dir)
        self.store = JobStore(self.dir)
        self.blobs = folder.BlobStore(self.dir / "blobs")
        self.janitor = Janitor(self.store.trash_dir, self.blobs)  # deletes off the event loop
        self.scheduler = scheduler
        self.python = python
        self.advert = advert
        self.retention = (retention_days * 86400.0, int(retention_gb * (1 << 30)))
        self.bin = self._interpreter_bin()
        self._pythonpath = job_pythonpath(python)
        self.runs: dict[str, Run] = {}
        self.queued: dict[str, JobHolder] = {}
        self._limited: dict[str, str] = {}  # the queued or running jobs of arrays with a limit: id -> array
        self._parked: dict[str, list[str]] = {}  # array -> its jobs held back by its limit, in order
        self._uploads: dict[tuple[object, int], Upload] = {}
        self._ended: dict[str, list[asyncio.Future[None]]] = {}
        self._standby: asyncio.Task[Standby | None] | None = None  # the next job's supervisor, started ahead
        self._closing = False
        self.owner = Owner(self)  # the owner's side of peers pulling its queued jobs (pull.py)
        self.pulling: dict[str, folder.Manifest] = {}  # jobs this peer is pulling: their blobs are in use
        self.gangs = Gangs(self, JobSteps(self._info, self._enqueue, self._end, self._append_log), key)  # gang jobs
        for stray in self.store.sweep():  # a receipt or a recording cut by a crash: never recorded
            log.info("removed %s from the jobs' folder: no recorded job's", stray)
        self.janitor.empty_trash()  # and what a crash left in the trash
        self.blobs.recover()  # the partial uploads a crash left, and the blobs jobs wrote into
        found = Cgroups.find(self.holder)
        self.cgroups = found if isinstance(found, Cgroups) else None  # None: why was logged
        # how a job's process tree is held, for STATUS (`gpulayer peers`, the dashboard)
        self.isolation: dict[str, str] = {"job_isolation": "cgroup"} if self.cgroups else {
            "job_isolation": "process-group", "job_isolation_reason": str(found)}
        if self.cgroups is None:
            log.info("jobs run without a cgroup each (%s): a process group and a child subreaper", found)
        else:
            log.info("jobs run in a cgroup each, under %s", self.cgroups.base)

    @property
    def holder(self) -> str:
        return self.store.holder

    def _interpreter_bin(self) -> Path:
        """A folder whose `python` and `python3` run the job interpreter: first on a job's PATH."""
        folder_ = self.dir / "bin"
        folder_.mkdir(mode=0o700, exist_ok=True)
        for name in ("python", "python3"):
            path = folder_ / name
            path.write_text(f"#!/bin/sh\nexec {shlex.quote(self.python)} \"$@\"\n")
            path.chmod(0o700)
        return folder_

    # ---- life cycle -------------------------------------------------------------------------

    def recover(self) -> None:
        """After a start: a job that was running when the peer died is lost (its supervisor, if it
        lives on, is stopped); the queued ones are queued again, oldest first."""
        now = time.time()
        for row in self.store.rows([RUNNING]):
            _stop_leftover(row)
            self._append_log(row.id, "gpulayer: the peer stopped or died while this job ran: it is lost\n")
            self.store.update(row.id, state=LOST, ended=now, pid=None, peak_memory_bytes=None, peak_memory_source="",
                              reason="its peer stopped or died while it ran (the log holds its output until then)")
        for row in self.store.rows([PREEMPTED]):  # it was being preempted: it asked for that, so queue it again
            _stop_leftover(row)
            self.store.update(row.id, state=QUEUED, restarts=row.restarts + 1, pid=None)
        if self.cgroups is not None:
            for job_id in self.cgroups.sweep():  # what the jobs of its earlier life left running
                log.info("job %s: killed what was left in its cgroup, and removed it", job_id)
        for row in self.store.rows([MOVING]):  # offered to a peer that had not committed: it stays here
            self.store.update(row.id, state=QUEUED, moved="")
        for row in self.store.rows([QUEUED]):
            if "ranks" in row.spec.gang:  # a gang's record: its watcher did not survive
                self._end(row.id, LOST, "its peer stopped or died before its gang started (a gang starts whole "
                                        "or not at all)", None)
            elif row.spec.gang:  # a rank waits for a claim again: a retried submit's gang claims it, and a
                self.gangs.recorded(row)  # watcher whose claim broke has failed its gang: it fails in CLAIM_S
            else:
                self._enqueue(row)
        self._retain()

    async def shutdown(self) -> None:
        """The peer stops: running jobs are stopped and recorded lost; queued ones stay queued."""
        self.gangs.shutdown()
        self._closing = True
        standby = await self._take_standby()
        if standby is not None:  # idle: its pipe's end, and it goes
            os.close(standby.pipe)
            await standby.proc.wait()
        runs = list(self.runs.values())
        for run in runs:
            run.stopping = LOST
            _signal(run, signal.SIGTERM)
        await asyncio.gather(*(r.runner for r in runs if r.runner is not None), return_exceptions=True)
        if self._pythonpath:
            shutil.rmtree(self._pythonpath, ignore_errors=True)
        if self.cgroups is not None:
            self.cgroups.close()
        await self.janitor.close()
        self.store.close()
        self.blobs.close()
        os.close(self._lock)

    def forget(self, conn: JobConnection) -> None:
        """A connection went: its unfinished uploads are dropped (nothing of them is recorded)."""
        for key in [k for k in self._uploads if k[0] is conn]:
            self.discard(*self._uploads.pop(key).drop())
        self.owner.forget(conn)
        self.gangs.forget(conn)

    # ---- requests ---------------------------------------------------------------------------

    def handle(self, conn: JobConnection, msg: messages.Message, buffers: list[Any], draining: bool) -> None:
        """Answer one job request of an authenticated connection (`conn.channel`, `conn.submitter_id`)."""
        kind = msg["t"]
        problem = job_protocol.check_request(msg) if kind not in (messages.JOB_SUBMIT, messages.BLOB) else None
        if problem is not None:
            return conn.channel.write(messages.error("bad-request", problem, msg.get("id")))
        if kind == messages.JOB_SUBMIT:
            return self._submit(conn, msg, draining)
        if kind == messages.BLOB:
            return self._blob(conn, msg, buffers)
        if kind == messages.JOB_LIST:
            rows = self.store.rows() if msg.get("all") else self._recent()
            return conn.channel.write({"t": messages.JOB_INFO, "id": msg["id"], "holder": self.holder,
                                       "jobs": [r.public() for r in rows if r.state != MOVED]})
        if kind == messages.JOB_PULL:
            return self.owner.pull(conn, msg)
        if kind == messages.JOB_TAKE:
            return self.owner.take(conn, msg)
        row = self._row(conn, msg)
        if row is None:
            return
        if row.state == MOVED:  # a forwarding record: the answer names the peer that holds the job now
            return self._info(conn, msg)
        if kind == messages.JOB_STOP:
            members = self._members(row)
            for member in members:
                self.stop(member, msg.get("grace", job_protocol.DEFAULT_GRACE_S))
            return self._answer_when(conn, msg, [m.id for m in members])
        if kind == messages.JOB_WAIT:
            return self._answer_when(conn, msg, [m.id for m in self._members(row)], msg.get("timeout"))
        if kind == messages.JOB_RM:
            return self._remove(conn, msg, row)
        if kind == messages.JOB_GANG:
            return self.gangs.request(conn, msg, row)
        if kind == messages.JOB_LOGS:
            self.scheduler.spawn(self._send_log(conn, msg, row))
        elif kind == messages.JOB_FETCH:
            self.scheduler.spawn(self._send_files(conn, msg, row))

    def _row(self, conn: JobConnection, msg: messages.Message) -> JobRow | None:
        """The job a request names, or None after answering that this peer holds no such job."""
        job_id = msg["job"]
        row = self.store.get(job_id)
        if row is None:
            elsewhere = holder_of(job_id) != self.holder
            reason = (f"job {job_id} is not this peer's (this peer holds the jobs {self.holder}-*)" if elsewhere
                      else f"job {job_id} is not known here (removed, or never submitted)")
            conn.channel.write(messages.error("no-job", reason, msg["id"]))
        return row

    def _recent(self) -> list[JobRow]:
        """The jobs `gpulayer jobs` shows without --all: every one not ended, and those ended in the last day."""
        cutoff = time.time() - 86400.0
        return [r for r in self.store.rows() if r.state not in ENDED or (r.ended or 0.0) >= cutoff]

    def summary(self) -> list[dict[str, Any]]:
        """For STATUS (the dashboard): the jobs not ended and the last ended ones, each with its log's last lines."""
        rows = self.store.rows()
        shown = [r for r in rows if r.state not in ENDED and r.state != MOVED] + [
            r for r in rows if r.state in ENDED][-STATUS_ENDED:]
        return [{**r.public(), "tail": self._tail(r.id)} for r in shown]

    def _tail(self, job_id: str) -> str:
        path = self.store.folder(job_id) / LOG_FILE
        try:
            with open(path, "rb") as f:
                f.seek(max(_tail_offset(path, STATUS_TAIL_LINES), f.seek(0, os.SEEK_END) - STATUS_TAIL_BYTES))
                return f.read(STATUS_TAIL_BYTES).decode("utf-8", "replace")
        except OSError:
            return ""

    def _row_ended(self, job_id: str) -> bool:
        row = self.store.get(job_id)
        return row is None or row.state in ENDED or row.state == MOVED

    def _members(self, row: JobRow) -> list[JobRow]:
        """The jobs a request for `row` acts on: the whole array when `row` names one (its first job),
        those its limit holds back first (so that stopping the others starts none of them); else `row`."""
        if row.spec.array != row.id:
            return [row]
        parked = set(self._parked.get(row.id, ()))
        members = [r for r in self.store.rows() if r.spec.array == row.id]
        return sorted(members, key=lambda r: r.id not in parked)

    def _answer_when(self, conn: JobConnection, msg: messages.Message, job_ids: list[str],
                     timeout: float | None = None) -> None:
        """Answer with the JOB_INFO of the request's job once all of `job_ids` ended (or after `timeout` s)."""
        async def answer() -> None:
            try:
                await asyncio.wait_for(self._all_ended(job_ids), timeout)
            except asyncio.TimeoutError:
                pass
            self._info(conn, msg)

        self.scheduler.spawn(answer())

    async def _all_ended(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            if self._row_ended(job_id):
                continue
            waiter = self._loop().create_future()
            waiting = self._ended.setdefault(job_id, [])
            waiting.append(waiter)
            try:
                await waiter
            finally:
                if waiter in waiting:
                    waiting.remove(waiter)

    def _info(self, conn: JobConnection, msg: messages.Message, **extra: Any) -> None:
        row = self.store.get(msg["job"])
        conn.channel.write({"t": messages.JOB_INFO, "id": msg["id"], "job": row.public() if row else None, **extra})

    @staticmethod
    def _loop() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    # ---- submit -----------------------------------------------------------------------------

    def _submit(self, conn: JobConnection, msg: messages.Message, draining: bool) -> None:
        request_id = msg.get("id")
        spec = job_protocol.check_spec(msg.get("spec"), f"{conn.submitter_id}@{conn.address.rsplit(':', 1)[0]}")
        array = job_protocol.check_array(msg.get("array"))
        if isinstance(spec, str) or isinstance(array, str) or not isinstance(request_id, int) \
                or (conn, request_id) in self._uploads:
            problem = spec if isinstance(spec, str) else array if isinstance(array, str) else \
                "a JOB_SUBMIT needs an integer 'id' not in use on this connection"
            return conn.channel.write(messages.error("bad-request", problem, request_id))
        try:
            req = Requirements.from_wire(spec.req)
            manifest = folder.Manifest.from_wire(msg.get("files"))
        except (ValueError, folder.FolderError) as exc:
            return conn.channel.write(messages.error("bad-request", str(exc), request_id))
        if self._recorded_before(conn, request_id, spec):
            return
        reasons = match(req, self.advert())
        if reasons:
            return conn.channel.write(messages.error("no-match", "; ".join(reasons), request_id))
        if draining:
            return conn.channel.write(messages.error("busy", "the peer is shutting down", request_id))
        sizes = manifest.blobs()  # once: built per needed digest it held the loop 0.17 s (1,609 files)
        self.janitor.use(sizes)  # before `missing`: a prune under way keeps them (peer/janitor.py)
        need = self.blobs.missing(sizes)
        count = len(array[0]) if array else 1
        builder = folder.Builder(manifest, self.blobs,
                                 lambda: [Path(self.store.reserve()) / WORK_DIR for _ in range(count)])
        pool = transfer.Pool()  # the chunks are received into buffers used again (the reader's, while it uploads)
        loop = self._loop()
        disk = transfer.DiskThread(on_room=lambda: loop.call_soon_threadsafe(_read_again, conn, upload)) \
            if need else None  # none for a folder the store has: no thread to start
        # the disk thread writes each blob as its job's file and places its other files (ADRs 0026, 0027)
        receiver = transfer.BlobReceiver(self.blobs, {d: sizes[d] for d in need}, disk, pool.release, builder)
        if need:
            conn.channel.reader.allocate = pool.allocate
        upload = self._uploads[(conn, request_id)] = Upload(spec, manifest, receiver, builder, disk, array)
        self._prepare_standby()  # a job comes: its supervisor starts meanwhile
        conn.channel.write({"t": messages.JOB_NEED, "id": request_id, "need": need, "holder": self.holder})
        if not need:
            self.scheduler.spawn(self._record(conn, request_id))

    def _recorded_before(self, conn: JobConnection, request_id: int, spec: JobSpec) -> bool:
        """Whether the submission's token names jobs recorded already (its submitter lost the answer and sent
        it again): if so, the answer is the (first) job, as it was then, and nothing new is recorded."""
        rows = self.store.submitted(spec.token)
        if rows:
            log.info("job %s: its submit came again; answered with the job recorded", rows[0].id)
            self._recorded(conn, request_id, rows)
        return bool(rows)

    def _recorded(self, conn: JobConnection, request_id: int, rows: list[JobRow]) -> None:
        """Answer a submit that recorded `rows`: the first one's JOB_INFO; a gang's rank's names this peer's own
        addresses ("at"), where its gang's watcher may reach it (peer/gangs.py)."""
        own = {"at": [list(a) for a in self.gangs.where(self.advert().peer_id)]} if "rank" in rows[0].spec.gang else {}
        conn.channel.write({"t": messages.JOB_INFO, "id": request_id, "job": rows[0].public(), "count": len(rows), **own})

    def _blob(self, conn: JobConnection, msg: messages.Message, buffers: list[Any]) -> None:
        """A piece of a blob the JOB_NEED asked for: checked here, hashed and written on the upload's disk
        thread (the event loop only decrypts and parses); the job is recorded once the last blob is stored."""
        upload = self._uploads.get((conn, msg.get("id")))  # type: ignore[arg-type]
        try:
            if upload is None:
                raise folder.FolderError("a BLOB must belong to a JOB_SUBMIT of this connection")
            if upload.receiver.feed(msg, buffers):
                self.scheduler.spawn(self._stored(conn, msg["id"], upload))
            elif upload.disk is not None and upload.disk.full:  # read again once it has room (`_read_again`)
                conn.channel.hold(True)
        except (OSError, folder.FolderError) as exc:
            self._upload_failed(conn, msg.get("id"), exc)

    async def _stored(self, conn: JobConnection, request_id: int, upload: Upload) -> None:
        """The last blob came: wait, off the event loop, for the disk thread to store every blob, then
        record the job (unless the connection went meanwhile: nothing of it is recorded)."""
        try:
            await self._loop().run_in_executor(None, upload.receiver.finish)
        except (OSError, folder.FolderError) as exc:
            return self._upload_failed(conn, request_id, exc)
        finally:
            conn.channel.reader.allocate = framing.receive_buffer
            conn.channel.hold(False)
        if self._uploads.get((conn, request_id)) is upload:
            await self._record(conn, request_id)

    def _upload_failed(self, conn: JobConnection, request_id: Any, exc: Exception) -> None:
        conn.channel.reader.allocate = framing.receive_buffer
        conn.channel.hold(False)
        self.forget_upload(conn, request_id)
        conn.channel.write(messages.error("bad-request", f"the upload failed: {exc}", request_id))

    def forget_upload(self, conn: JobConnection, request_id: Any) -> None:
        upload = self._uploads.pop((conn, request_id), None)
        if upload is not None:
            self.discard(*upload.drop())

    async def _record(self, conn: JobConnection, request_id: int) -> None:
        """Finish the job's folder (one per job of an array: the files whose blobs the store had already;
        those uploaded were placed as they came) on a thread, off the event loop; then record the job or
        the array's jobs with their folders (durably, in one transaction), and acknowledge it with the
        (first) job. The upload stays listed while its folders are built (its blobs are in use); if its
        connection went meanwhile, nothing is recorded."""
        upload = self._uploads[(conn, request_id)]
        upload.building = True
        pause_point("job-building")
        problem = None
        try:
            await self._loop().run_in_executor(None, _build, upload.manifest, upload.builder)
        except (OSError, folder.FolderError) as exc:
            problem = f"the job's folder cannot be built: {exc}"
        incoming = upload.incoming
        if self._uploads.pop((conn, request_id), None) is not upload or problem is not None \
                or self._recorded_before(conn, request_id, upload.spec):
            self.discard(*incoming)
            if problem is not None:
                conn.channel.write(messages.error("bad-request", problem, request_id))
            return
        size = upload.manifest.total_bytes
        try:  # the folders are moved into place in the transaction that records the jobs: both or neither
            rows = self.store.add_array(upload.spec, size, *upload.array, incoming) if upload.array \
                else [self.store.add(upload.spec, size, incoming[0])]
        except (OSError, sqlite3.Error) as exc:
            self.discard(*incoming)
            return conn.channel.write(messages.error("bad-request", f"the job cannot be recorded: {exc}", request_id))
        kill_point("job-recorded")
        log.info("job %s%s recorded from %s: %s", rows[0].id, f" (an array of {len(rows)})" if upload.array else "",
                 conn.address, shlex.join(upload.spec.command))
        self._recorded(conn, request_id, rows)
        for row in rows:
            if row.spec.gang:
                self.gangs.recorded(row)
            else:
                self._enqueue(row)

    # ---- running ----------------------------------------------------------------------------

    def _enqueue(self, row: JobRow) -> None:
        work = self.store.folder(row.id) / WORK_DIR
        if not work.is_dir():
            return self._end(row.id, FAILED, "its folder on the peer is gone", None)
        if row.spec.limit:
            if sum(array == row.spec.array for array in self._limited.values()) >= row.spec.limit:
                self._parked.setdefault(row.spec.array, []).append(row.id)
                return
            self._limited[row.id] = row.spec.array
        task = JobHolder(req=Requirements.from_wire(row.spec.req), job_id=row.id,
                         name=row.spec.name or row.spec.command[0], priority=row.spec.priority,
                         share=row.spec.share, user=row.spec.share,
                         start=lambda group, env: self._start(row.id, task, env))
        self.queued[row.id] = task
        if not self.scheduler.enqueue(task):
            self._preempt_for(row, task)
        if row.id in self.queued:  # it waits: a peer that pulls may take it
            self.owner.queued(row, task)

    def _preempt_for(self, row: JobRow, task: JobHolder) -> None:
        """`row` waits: stop one running preemptible job of lower priority whose slots it could start on
        (the lowest priority, then the last started) and whose slots its user's quota lets it take, for
        its grace, to queue it again once it stopped. The waiting job, first in the queue's order, then
        takes the slots."""
        victims = []
        for job_id, run in self.runs.items():
            held = self.store.get(job_id)
            if held is not None and not run.stopping and held.spec.preemptible \
                    and held.spec.priority < row.spec.priority and _could_start(task.req, run.task.group) \
                    and self.scheduler.state.within_quota(task, run.task):
                victims.append((held.spec.priority, -(held.started or 0.0), held, run))
        if not victims:
            return
        _, _, victim, run = min(victims, key=lambda v: v[:2])
        run.stopping = PREEMPTED
        self.store.update(victim.id, state=PREEMPTED)
        self._append_log(victim.id, f"gpulayer: preempted for job {row.id} (priority {row.spec.priority}); "
                                    f"SIGTERM, SIGKILL after {victim.spec.grace:g} s, then queued again\n")
        log.info("job %s preempted for job %s", victim.id, row.id)
        _write_private(self.store.folder(victim.id) / GRACE_FILE, str(victim.spec.grace).encode())
        _signal(run, signal.SIGTERM)

    def _start(self, job_id: str, task: JobHolder, slot_env: dict[str, str]) -> None:
        """The scheduler gave the job its slots: run it (a gang's rank waits for its gang's start)."""
        self.queued.pop(job_id, None)
        if not self.gangs.holds(job_id, task, slot_env):
            self.run(job_id, task, slot_env)

    def run(self, job_id: str, task: JobHolder, slot_env: dict[str, str]) -> None:
        """Run the job on the slots `task` holds, with `slot_env` (their device variables, and more)."""
        run = self.runs[job_id] = Run(task)
        run.runner = self.scheduler.spawn(self._run(job_id, run, slot_env))

    def _environment(self, row: JobRow, slot_env: dict[str, str]) -> dict[str, str]:
        array = {"GPULAYER_ARRAY_ID": row.spec.array, "GPULAYER_ARRAY_INDEX": str(row.spec.index)} \
            if row.spec.array else {}
        env = worker_env({**os.environ, **slot_env, **row.spec.env, "GPULAYER_JOB_ID": row.id, **array,
                          "GPULAYER_RESTARTS": str(row.restarts),
                          "PYTHONUNBUFFERED": "1"})
        env["PATH"] = os.pathsep.join(p for p in (str(self.bin), env.get("PATH")) if p)
        if self._pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self._pythonpath, env.get("PYTHONPATH")) if p)
        return env

    async def _run(self, job_id: str, run: Run, slot_env: dict[str, str]) -> None:
        """Run the job, again after a failure while it has retries left, and record how it ended."""
        row = self.store.get(job_id)
        assert row is not None
        home = self.store.folder(job_id)
        env = self._environment(row, slot_env)
        state, reason, code = FAILED, "", None
        peak = _peak_of(row)  # the largest of its runs' peak memory, (bytes, source); preempted runs' included
        ran = False  # whether a supervisor started (a job stopped before that never ran)
        for attempt in range(row.attempts + 1, row.attempts + row.spec.retries + 2):
            if run.stopping:  # stopped, timed out or preempted before this attempt's supervisor started
                state, reason, code = _outcome(None, run.stopping, row.spec.timeout)
                break
            (home / STATUS_FILE).unlink(missing_ok=True)
            ran = True
            try:
                cgroup = [] if self.cgroups is None else ["--cgroup", self.cgroups.make(job_id)]
                run.proc = await self._supervise(job_id, attempt, str(home / WORK_DIR), env, [
                    *cgroup, str(home / LOG_FILE), str(home / STATUS_FILE), str(home / GRACE_FILE), "--",
                    *row.spec.command])
            except OSError as exc:
                state, reason = FAILED, f"its supervisor could not start: {exc}"
                break
            if run.stopping:  # stopped while its supervisor started: it ends before or after running the command
                _signal(run, signal.SIGTERM)
            if row.spec.timeout:
                run.timer = self._loop().call_later(row.spec.timeout, self._time_out, job_id)
            await run.proc.wait()
            tree_peak = None  # what outlived its supervisor (one killed, say) goes too, its peak memory read first
            if self.cgroups is not None:
                tree_peak = await self._loop().run_in_executor(None, self.cgroups.end, job_id)
            if run.timer is not None:
                run.timer.cancel()
            status = _read_status(home / STATUS_FILE)
            state, reason, code = _outcome(status, run.stopping, row.spec.timeout)
            peak = _larger(peak, _measured(status, tree_peak))
            if state != FAILED or run.stopping in (LOST, PREEMPTED) or attempt > row.attempts + row.spec.retries:
                break
            self._append_log(job_id, f"gpulayer: attempt {attempt} {reason}; trying again\n")
            run.stopping = ""  # a timeout: the next run has its own
        self.runs.pop(job_id, None)
        if run.stopping == PREEMPTED:  # its slots go to the job it made way for; it waits again
            self.store.update(job_id, state=QUEUED, restarts=row.restarts + 1, pid=None, **_peak_columns(peak))
            self.scheduler.job_ended(run.task, PREEMPTED)
            self._limited.pop(job_id, None)  # its array's place is taken again when it is queued again
            return self.requeue(job_id)
        if run.stopping == LOST and not ran:  # the peer stops before the job started: it stays queued
            self.scheduler.job_ended(run.task, LOST)
            return
        if run.stopping == LOST:  # the peer stops: recorded as lost, as after a crash
            state, reason = LOST, "its peer was stopped while it ran (the log holds its output until then)"
        self._end(job_id, state, reason, code, **_peak_columns(peak))
        self.scheduler.job_ended(run.task, "ok" if state == SUCCEEDED else state)

    async def _supervise(self, job_id: str, attempt: int, cwd: str, env: dict[str, str],
                         argv: list[str]) -> asyncio.subprocess.Process:
        """The job's supervisor (jobs/shim.py with `argv`), the job recorded running with its pid before the
        supervisor may start the command: the standby one is handed the job (one commit), else (none was
        started, or it died) one is started for it. Then the next standby is started."""
        standby = await self._take_standby()
        try:
            if standby is not None:
                self.store.update(job_id, state=RUNNING, started=time.time(), attempts=attempt,
                                  pid=standby.proc.pid, pid_started=standby.started)
                if await standby.hand_over(cwd, env, argv):
                    return standby.proc
                log.info("job %s: its standby supervisor was gone; starting one", job_id)
            self.store.update(job_id, state=RUNNING, started=time.time(), attempts=attempt)
            proc = await asyncio.create_subprocess_exec(
                *SUPERVISOR, *argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True)
            self.store.update(job_id, pid=proc.pid, pid_started=_started_at(proc.pid))
            return proc
        finally:
            self._prepare_standby()

    def _prepare_standby(self) -> None:
        """Start the next job's supervisor ahead, unless one is (at most one waits; none once the peer stops)."""
        if self._standby is None and not self._closing:
            self._standby = self.scheduler.spawn(self._start_standby())

    async def _start_standby(self) -> Standby | None:
        """A standby supervisor (shim.py --standby) in a session of its own, reading its job from a pipe that only
        this process can write to (its end is not inherited); the peer's environment less the cluster key."""
        read, write = os.pipe()
        os.set_blocking(write, False)  # a handover that fits the pipe is written at once (hand_over)
        try:
            proc = await asyncio.create_subprocess_exec(
                *SUPERVISOR, "--standby", cwd="/", env=worker_env(dict(os.environ)), stdin=read,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            os.close(write)
            log.warning("cannot start a standby supervisor (jobs start without one): %s", exc)
            return None
        finally:
            os.close(read)
        return Standby(proc, write, _started_at(proc.pid))

    async def _take_standby(self) -> Standby | None:
        """The standby supervisor (awaited if it is still being started), no longer idle; None if there is none."""
        starting, self._standby = self._standby, None
        return None if starting is None else await starting

    def requeue(self, job_id: str) -> None:
        """Queue a recorded job (again): preempted, handed back, or pulled from another peer."""
        row = self.store.get(job_id)
        if row is not None:
            self._enqueue(row)

    def _time_out(self, job_id: str) -> None:
        run = self.runs.get(job_id)
        if run is not None and not run.stopping:
            run.stopping = "timeout"
            _signal(run, signal.SIGTERM)

    def stop(self, row: JobRow, grace: float) -> None:
        """SIGTERM to the job's process tree, SIGKILL after `grace` s; a queued job just ends, stopped."""
        if self.gangs.stop(row, grace):
            return
        task = self.queued.pop(row.id, None)
        if self._unpark(row) or (task is not None and self.scheduler.withdraw(task)) or self.owner.cancel(row.id):
            return self._end(row.id, STOPPED, "stopped before it started", None)
        run = self.runs.get(row.id)
        if run is None or run.stopping not in ("", PREEMPTED):  # a stop ends a preempted job: not queued again
            return
        run.stopping = STOPPED
        _write_private(self.store.folder(row.id) / GRACE_FILE, str(grace).encode())
        _signal(run, signal.SIGTERM)

    def _end(self, job_id: str, state: str, reason: str, code: int | None, **figures: Any) -> None:
        """Record the job ended (with `figures`: more columns, its peak memory), and answer whoever waits."""
        self.store.update(job_id, state=state, reason=reason, ended=time.time(), exit_code=code, pid=None, **figures)
        log.info("job %s %s%s", job_id, state, f": {reason}" if reason else "")
        self.gone(job_id)
        array = self._limited.pop(job_id, None)
        if array is not None:  # a place of its array's limit is free: the next of its jobs held back goes
            self._release_parked(array)
        self._retain()

    def gone(self, job_id: str) -> None:
        """The job ended here, or moved: whoever waits on it is answered."""
        for waiter in self._ended.pop(job_id, []):
            if not waiter.done():
                waiter.set_result(None)

    def _unpark(self, row: JobRow) -> bool:
        """Take a job that its array's limit holds back out of the waiting line; False if it is not there."""
        parked = self._parked.get(row.spec.array)
        if not parked or row.id not in parked:
            return False
        parked.remove(row.id)
        if not parked:
            del self._parked[row.spec.array]
        return True

    def _release_parked(self, array: str) -> None:
        parked = self._parked.get(array)
        if not parked:
            return
        row = self.store.get(parked.pop(0))
        if not parked:
            del self._parked[array]
        if row is not None and row.state == QUEUED:
            self._enqueue(row)

    def _retain(self) -> None:
        """Apply the retention limits: the jobs go at once; their folders, and the content that only they held,
        on the janitor's thread."""
        removed = self.store.retain(*self.retention)
        if removed:
            log.info("removed by the retention limits: job(s) %s", ", ".join(removed))
            self.janitor.empty_trash()
            self.janitor.prune(self._blobs_in_use)

    def _blobs_in_use(self) -> tuple[set[str], list[Path]]:
        """The digests of the uploads and pulls under way, and the manifest files of the jobs kept."""
        used = {d for m in [*(u.manifest for u in self._uploads.values()), *self.pulling.values()] for d in m.blobs()}
        return used, [self.store.folder(row.id) / MANIFEST_FILE for row in self.store.rows()]

    def delete(self, job_id: str) -> None:
        """Forget a job now; its folder goes to the trash, deleted on the janitor's thread."""
        self.store.remove(job_id)
        self.janitor.empty_trash()

    def discard(self, *paths: Path) -> None:
        """Remove folders of the jobs' folder: into the trash now, deleted on the janitor's thread."""
        for path in paths:
            self.store.discard(path)
        if paths:
            self.janitor.empty_trash()

    def _append_log(self, job_id: str, line: str) -> None:
        path = self.store.folder(job_id) / LOG_FILE
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(line)

    # ---- logs, files, removal ---------------------------------------------------------------

    async def _send_log(self, conn: JobConnection, msg: messages.Message, row: JobRow) -> None:
        """The job's log from `offset` (or its last `tail` lines), in JOB_LOG pieces; with `follow`,
        until the job ends. Then the job's JOB_INFO, with the offset reached."""
        path = self.store.folder(row.id) / LOG_FILE
        offset = msg.get("offset", 0) if msg.get("tail") is None else _tail_offset(path, msg["tail"])
        fast_until = time.monotonic() + FOLLOW_FAST_FOR_S
        while not conn.channel.closed:
            ended = self._row_ended(row.id)  # read before the log: what it wrote until it ended is read after
            offset = await self._send_from(conn, msg["id"], path, offset)
            if ended or not msg["follow"]:
                break
            await asyncio.sleep(FOLLOW_FAST_S if time.monotonic() < fast_until else FOLLOW_POLL_S)
        self._info(conn, msg, offset=offset)

    async def _send_from(self, conn: JobConnection, request_id: int, path: Path, offset: int) -> int:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return offset
        with f:
            f.seek(offset)
            while chunk := f.read(DATA_CHUNK):
                conn.channel.write({"t": messages.JOB_LOG, "id": request_id, "offset": offset}, [chunk])
                offset += len(chunk)
                await conn.channel.drain(DATA_CHUNK)
        return offset

    async def _send_files(self, conn: JobConnection, msg: messages.Message, row: JobRow) -> None:
        """The files asked for (or what the job created or changed) as FILE messages (jobs/transfer.py),
        then the JOB_INFO; a path that leaves the job's folder refuses the whole request."""
        work = self.store.folder(row.id) / WORK_DIR
        try:
            paths = msg.get("paths")
            if paths is None:
                shipped = folder.Manifest.from_wire(json.loads((work.parent / MANIFEST_FILE).read_text()), 1 << 62)
                paths = folder.changed_files(work, shipped)
            files = transfer.listing(work, paths)
        except (OSError, ValueError, folder.FolderError) as exc:
            return conn.channel.write(messages.error("bad-path", str(exc), msg["id"]))
        try:
            handover = partial(local_fetch.pass_file, conn.link) if msg.get("local") and conn.link else None
            pool = transfer.Pool()  # each chunk read into a buffer that comes back once sealed
            for piece, buffers in transfer.file_messages(work, files, msg["id"], allocate=pool.allocate,
                                                         handover=handover):
                conn.channel.write(piece, buffers, partial(pool.release, buffers[0]) if buffers else None)
                await conn.channel.drain(DATA_CHUNK)
                if conn.channel.closed:
                    return
        except (OSError, folder.FolderError) as exc:  # a file changed or went while it was sent
            return conn.channel.write(messages.error("bad-path", str(exc), msg["id"]))
        self._info(conn, msg)

    def _remove(self, conn: JobConnection, msg: messages.Message, row: JobRow) -> None:
        if row.state not in ENDED:
            return conn.channel.write(messages.error(
                "bad-request", f"job {row.id} is {row.state}: stop it first (`gpulayer stop {row.id}`)", msg["id"]))
        self.delete(row.id)
        conn.channel.write({"t": messages.JOB_INFO, "id": msg["id"], "job": row.public()})


def _build(manifest: folder.Manifest, builder: folder.Builder) -> None:
    """Each job's folder: its working folder (`builder`'s: what was uploaded is placed already), and the
    manifest it was shipped with."""
    builder.finish()
    shipped = json.dumps(manifest.to_wire()).encode()
    for path in builder.dests:
        _write_private(path.parent / MANIFEST_FILE, shipped)


def _read_again(conn: JobConnection, upload: Upload) -> None:
    """The upload's disk thread has room again: read its connection again (on the event loop)."""
    if upload.disk is None or not upload.disk.full:
        conn.channel.hold(False)


def _could_start(req: Requirements, group: list[Slot]) -> bool:
    """Whether a job of `req` could start on the slots of `group` once they are free."""
    return len({s.device for s in group}) >= req.devices and all(
        req.gpu_memory_gb is None or s.memory_gb is None or s.memory_gb >= req.gpu_memory_gb for s in group)


def _outcome(status: dict[str, int] | None, stopping: str, timeout: float | None) -> tuple[str, str, int | None]:
    """(state, reason, exit code) of an ended run; a signal is given as its negative number. No status, or
    an empty one, means the command never started: a supervisor stopped before its SIGTERM handler was set
    (or before any supervisor started) gives none, one stopped before it ran the command gives {}."""
    if not status:
        if stopping == STOPPED:
            return STOPPED, "stopped before it started", None
        if stopping == "timeout":
            return FAILED, f"ran past its timeout of {timeout:g} s before it started, and was stopped", None
        return FAILED, "its supervisor ended without a status", None
    code = -status["signal"] if "signal" in status else status.get("code")
    if stopping == STOPPED:
        return STOPPED, "stopped", code
    if stopping == "timeout":
        return FAILED, f"ran past its timeout of {timeout:g} s and was stopped", code
    if code == 0:
        return SUCCEEDED, "", 0
    if code is not None and code < 0:
        return FAILED, f"killed by {_signal_name(-code)}", code
    return FAILED, f"exited with code {code}", code


Peak = tuple[int, str]  # a job's peak memory: bytes, and what measured it ("cgroup", "largest-process")


def _measured(status: dict[str, int] | None, tree_peak: int | None) -> Peak | None:
    """A run's peak memory: its cgroup's (`tree_peak`, the whole tree), else the largest process's that its
    supervisor reported; None for a run whose command never started or whose supervisor left no figure."""
    if not status:
        return None
    if tree_peak is not None:
        return tree_peak, "cgroup"
    maxrss = status.get("maxrss")
    return (maxrss, "largest-process") if maxrss is not None and maxrss >= 0 else None


def _larger(a: Peak | None, b: Peak | None) -> Peak | None:
    return max((p for p in (a, b) if p is not None), key=lambda p: p[0], default=None)


def _peak_of(row: JobRow) -> Peak | None:
    return None if row.peak_memory_bytes is None else (row.peak_memory_bytes, row.peak_memory_source)


def _peak_columns(peak: Peak | None) -> dict[str, Any]:
    return {} if peak is None else {"peak_memory_bytes": peak[0], "peak_memory_source": peak[1]}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _read_status(path: Path) -> dict[str, int] | None:
    """The supervisor's status file; None if there is none, or if it is not a map of whole numbers that SQLite
    can hold (the file is within the job's reach: its process may have written it)."""
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(status, dict) or not all(type(v) is int and -1 << 63 <= v < 1 << 63 for v in status.values()):
        return None
    return status


def _signal(run: Run, sig: int) -> None:
    if run.proc is not None and run.proc.returncode is None:
        try:
            run.proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _write_and_close(fd: int, data: memoryview) -> bool:
    """Write all of `data` to the pipe `fd`, then close it; False if its reader is gone."""
    try:
        while data:
            data = data[os.write(fd, data):]
    except BrokenPipeError:
        return False
    finally:
        os.close(fd)
    return True


def _started_at(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _stop_leftover(row: JobRow) -> None:
    """The supervisor of a job that ran when the peer died may live on: SIGTERM it (it stops its tree),
    if that pid is still the same process (its start time says so)."""
    if row.pid is None or row.pid_started is None:
        return
    try:
        proc = psutil.Process(row.pid)
        if abs(proc.create_time() - row.pid_started) < 0.01:
            proc.terminate()
    except psutil.Error:
        pass


def _tail_offset(path: Path, lines: int) -> int:
    """The offset in `path` where its last `lines` lines begin (a newline that ends the file ends the last)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if lines == 0:
        return size
    newlines, position = 0, size
    with open(path, "rb") as f:
        while position > 0:
            step = min(DATA_CHUNK, position)
            position -= step
            f.seek(position)
            block = f.read(step)
            for index in range(len(block) - 1, -1, -1):
                if block[index] == 10 and position + index != size - 1:
                    newlines += 1
                    if newlines == lines:
                        return position + index + 1
    return 0


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
