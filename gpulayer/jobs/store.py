"""The peer's record of its jobs: one SQLite file in its state folder (docs/adr/0016-jobs.md).

One writer, the peer's event loop. Every change is committed with synchronous=FULL in WAL mode
before the peer answers for it, so that a job acknowledged to its submitter survives a kill -9 of
the peer or a power cut. The folder is the peer user's alone (0700, the files 0600).

The store deletes nothing itself: what goes (a removed job's folder, a stray one) is renamed into the
state folder's `trash/`, at once and atomically, and deleted from there off the event loop
(peer/janitor.py); a trash that a crash left is emptied at the next start.

A job id is "<holder>-<n>": the holder is this state folder's own id (12 hex digits, made once
and kept with the jobs), n counts the jobs it ever recorded. So an id names the peer that holds it,
is never reused, and stays valid across restarts of that peer.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sqlite3

QUEUED, RUNNING, SUCCEEDED, FAILED, STOPPED, LOST = "queued", "running", "succeeded", "failed", "stopped", "lost"
PREEMPTED = "preempted"  # being stopped for a job of higher priority; queued again once it stopped
# a queued job pulled by another peer (docs/adr/0019-pulling-queued-jobs.md): on its owner it is "moving" (offered,
# out of the queue) then "moved" (a forwarding record naming the puller); on the puller "arriving" until the owner
# recorded it moved, then queued
MOVING, MOVED, ARRIVING = "moving", "moved", "arriving"
STATES = (QUEUED, RUNNING, PREEMPTED, SUCCEEDED, FAILED, STOPPED, LOST, MOVING, MOVED, ARRIVING)
PREEMPT_GRACE_S = 30.0  # the default of --grace: from SIGTERM to SIGKILL when a job is preempted
ENDED = frozenset({SUCCEEDED, FAILED, STOPPED, LOST})

RETENTION_DAYS, RETENTION_GB = 30.0, 50.0  # the defaults of the peer's --job-retention-days and --job-retention-gb
JOB_ID = re.compile(r"([0-9a-f]{12})-([1-9][0-9]{0,9})")
HOLDER_HEX = 12
KILL_AT_ENV, PAUSE_IN_ENV = "GPULAYER_TEST_KILL_AT", "GPULAYER_TEST_PAUSE_IN"
PAUSE_MAX_S = 60.0  # a pause point waits at most this long for its test

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    n INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    submitted REAL NOT NULL,
    started REAL,
    ended REAL,
    exit_code INTEGER,
    attempts INTEGER NOT NULL DEFAULT 0,
    pid INTEGER,
    pid_started REAL,
    folder_bytes INTEGER NOT NULL DEFAULT 0
);
"""


def check_job_id(value: Any) -> str | None:
    """Why `value` is not a job id ("<12 hex digits>-<n>"), or None."""
    if not isinstance(value, str) or not JOB_ID.fullmatch(value):
        shown = "".join(ch for ch in repr(value) if ch.isprintable())[:60]
        return f"a job id is <12 hex digits>-<number> (as `gpulayer submit` prints it), not {shown}"
    return None


def holder_of(job_id: str) -> str:
    """The holder id (the peer's job identity) that a valid job id names."""
    return job_id.split("-", 1)[0]


@dataclass
class JobSpec:
    """What a job runs, as its submitter asked: recorded once, never changed."""

    command: list[str]
    name: str = ""
    env: dict[str, str] = field(default_factory=dict)
    req: dict[str, Any] = field(default_factory=dict)  # Requirements.to_wire()
    timeout: float | None = None
    retries: int = 0
    submitter: str = ""  # the submitter's id (its AUTH's "client") and host, for `gpulayer jobs`
    function: bool = False  # a function job (gl.submit(..., detach=True)): its result is a file of its folder
    priority: int = 0  # higher starts first (docs/jobs.md, "The queue")
    user: str = ""  # the submitter's login name, as it says: its share of the slots is its user@host's
    array: str = ""  # the id of its array's first job (`--array`), which names the array
    index: int | None = None  # its index in that array (GPULAYER_ARRAY_INDEX)
    limit: int = 0  # at most this many of its array run (or wait for a slot) at once; 0: no limit
    preemptible: bool = False  # it may be stopped for a job of higher priority, and queued again
    grace: float = PREEMPT_GRACE_S  # seconds from SIGTERM to SIGKILL when it is preempted
    pinned: bool = False  # submitted for one peer (--peer): no other peer pulls it
    gang: dict[str, Any] = field(default_factory=dict)  # a gang's (peer/gangs.py): {"rank", "size"} for a rank,
    # {"size", "ranks": [{"job", "peer", "at", "addr"}]} for the gang's own record on rank 0's peer
    token: str = ""  # the submission's random token (32 hex digits): a submit sent again records nothing new

    @property
    def share(self) -> str:
        """Whose share of the slots the job counts in: its user at its submitter's host."""
        host = self.submitter.rsplit("@", 1)[-1]
        return f"{self.user}@{host}" if self.user else self.submitter


@dataclass
class JobRow:
    """One job as the store holds it."""

    id: str
    spec: JobSpec
    state: str
    reason: str
    submitted: float
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    attempts: int = 0
    pid: int | None = None
    pid_started: float | None = None
    folder_bytes: int = 0
    restarts: int = 0  # how often it was preempted and queued again (GPULAYER_RESTARTS)
    moved: str = ""  # the holder it moved to (moving, moved) or came from (a pulled job)
    peak_memory_bytes: int | None = None  # the most memory its runs used at once; None while unknown
    peak_memory_source: str = ""  # what measured it: "cgroup" (its whole tree) or "largest-process"

    def public(self) -> dict[str, Any]:
        """What a JOB_INFO reply carries for this job (no pid)."""
        return {"id": self.id, "name": self.spec.name, "state": self.state, "reason": self.reason,
                "command": self.spec.command, "submitter": self.spec.submitter, "function": self.spec.function,
                "priority": self.spec.priority, "user": self.spec.user, "array": self.spec.array,
                "index": self.spec.index, "preemptible": self.spec.preemptible, "restarts": self.restarts,
                "submitted": self.submitted, "started": self.started, "ended": self.ended,
                "exit_code": self.exit_code, "attempts": self.attempts, "folder_bytes": self.folder_bytes,
                "moved": self.moved, "gang": self.spec.gang, "peak_memory_bytes": self.peak_memory_bytes,
                "peak_memory_source": self.peak_memory_source or None}


class StateDirInUse(Exception):
    """Another live peer holds this state folder."""


def private_dir(path: Path) -> Path:
    """`path` made (with its parents) and set to 0700."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    return path


class JobStore:
    """The jobs of one state folder: `open()` it, then read and change rows; `close()` at the end."""

    def __init__(self, state_dir: Path):
        self.dir = private_dir(state_dir)
        self.jobs_dir = private_dir(state_dir / "jobs")
        self.trash_dir = private_dir(state_dir / "trash")  # what is being deleted (peer/janitor.py)
        path = state_dir / "jobs.sqlite3"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # created private before SQLite opens it
        os.close(fd)
        path.chmod(0o600)
        import sqlite3  # here: a submitter imports this module for the job's names only

        self.db: sqlite3.Connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(jobs)")}
        for column, kind in (("restarts", "INTEGER NOT NULL DEFAULT 0"), ("moved", "TEXT NOT NULL DEFAULT ''"),
                             ("peak_memory_bytes", "INTEGER"), ("peak_memory_source", "TEXT NOT NULL DEFAULT ''")):
            if column not in columns:  # a state folder of an earlier release
                with self.db:
                    self.db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
        # only over valid specs: a row an earlier release left half recorded (spec '') would fail the index
        self.db.execute("CREATE INDEX IF NOT EXISTS jobs_by_token ON jobs (json_extract(spec, '$.token')) "
                        "WHERE json_valid(spec)")
        self.holder = self._holder()

    def _holder(self) -> str:
        row = self.db.execute("SELECT value FROM meta WHERE key = 'holder'").fetchone()
        if row is not None:
            return str(row[0])
        holder = secrets.token_hex(HOLDER_HEX // 2)
        with self._transaction():
            self.db.execute("INSERT INTO meta (key, value) VALUES ('holder', ?)", (holder,))
        return holder

    def close(self) -> None:
        self.db.close()

    def folder(self, job_id: str) -> Path:
        """The job's own folder (its working folder is `work/` in it, its log `log`)."""
        return self.jobs_dir / job_id

    # ---- rows ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """Statements that commit together or not at all (the connection is in autocommit mode)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def add(self, spec: JobSpec, folder_bytes: int, folder: Path | None = None) -> JobRow:
        """Record a new queued job, durably, with `folder` (from `reserve`) moved into place as its own;
        its id is the next of this holder."""
        return self._insert([spec], folder_bytes, [folder] if folder else [], array=False)[0]

    def add_array(self, spec: JobSpec, folder_bytes: int, indices: range, limit: int,
                  folders: Sequence[Path] = ()) -> list[JobRow]:
        """Record one queued job per index, each with its folder, all or none; the first one's id names the
        array."""
        return self._insert([replace(spec, index=index, limit=limit) for index in indices], folder_bytes, folders,
                            array=True)

    def _insert(self, specs: list[JobSpec], folder_bytes: int, folders: Sequence[Path], array: bool) -> list[JobRow]:
        """Insert the jobs and move their folders into place in one transaction: the folders are renamed
        (and the rename made durable) before the commit, so a crash leaves every job recorded with its
        folder, or none recorded and at most folders that `sweep` removes at the next start."""
        now = time.time()
        ids: list[str] = []
        with self._transaction():
            for spec in specs:
                cursor = self.db.execute("INSERT INTO jobs (id, spec, state, submitted, folder_bytes) "
                                         "VALUES ('', '{}', ?, ?, ?)", (QUEUED, now, folder_bytes))
                ids.append(f"{self.holder}-{cursor.lastrowid}")
                spec = replace(spec, array=ids[0]) if array else spec
                self.db.execute("UPDATE jobs SET id = ?, spec = ? WHERE n = ?",
                                (ids[-1], json.dumps(asdict(spec)), cursor.lastrowid))
            if folders:
                self._place(folders, ids)
        return [row for row in map(self.get, ids) if row is not None]

    def add_arriving(self, job_id: str, spec: JobSpec, submitted: float, folder_bytes: int, source: str,
                     folder: Path | None = None) -> JobRow:
        """Record a job pulled from the holder `source` under its own id, with `folder` (from `reserve`) moved
        into place, durably, as arriving: it is this peer's to queue once its owner recorded it moved (the
        hand-over's second phase)."""
        with self._transaction():
            self.db.execute("INSERT INTO jobs (id, spec, state, submitted, folder_bytes, moved, reason) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (job_id, json.dumps(asdict(spec)), ARRIVING, submitted, folder_bytes, source,
                             f"arriving from the peer of jobs {source}-*, waiting for it to confirm the hand-over"))
            if folder is not None:
                self._place([folder], [job_id])
        row = self.get(job_id)
        assert row is not None
        return row

    def _place(self, folders: Sequence[Path], ids: list[str]) -> None:
        """Rename each folder to its job's, durably; on a failure the ones renamed are removed."""
        placed = []
        try:
            for folder, job_id in zip(folders, ids, strict=True):
                os.replace(folder, self.folder(job_id))
                placed.append(self.folder(job_id))
            _sync_dir(self.jobs_dir)
        except BaseException:
            for path in placed:
                shutil.rmtree(path, ignore_errors=True)
            raise
        kill_point("job-placed")

    def reserve(self) -> str:
        """A fresh private folder for a job being received (renamed to the job's once it is recorded)."""
        path = self.jobs_dir / f"incoming-{secrets.token_hex(8)}"
        path.mkdir(mode=0o700)
        return str(path)

    def get(self, job_id: str) -> JobRow | None:
        found = self.db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _row(found) if found else None

    def submitted(self, token: str) -> list[JobRow]:
        """The jobs recorded for the submission `token` (an array's all), oldest first; [] for no token."""
        if not token:
            return []
        query = f"SELECT {_COLUMNS} FROM jobs WHERE json_valid(spec) AND json_extract(spec, '$.token') = ? ORDER BY n"
        return [_row(r) for r in self.db.execute(query, (token,))]

    def rows(self, states: Iterable[str] = STATES) -> list[JobRow]:
        """The jobs in `states`, oldest first."""
        wanted = list(states)
        marks = ",".join("?" * len(wanted))
        query = f"SELECT {_COLUMNS} FROM jobs WHERE state IN ({marks}) ORDER BY n"
        return [_row(r) for r in self.db.execute(query, wanted)]

    def update(self, job_id: str, **values: Any) -> None:
        """Change a job's columns (state, reason, started, ended, exit_code, attempts, pid, pid_started, restarts,
        peak_memory_bytes, peak_memory_source)."""
        names = ", ".join(f"{name} = ?" for name in values)
        with self.db:
            self.db.execute(f"UPDATE jobs SET {names} WHERE id = ?", (*values.values(), job_id))

    def sweep(self) -> list[str]:
        """At the start, before any upload: move what of the jobs' folder is no recorded job's own (a
        receipt or a recording cut by a crash, a job forgotten but not yet moved away) into the trash; the
        names moved."""
        recorded = {row.id for row in self.rows()}
        stray = sorted(p.name for p in self.jobs_dir.iterdir() if p.name not in recorded)
        for name in stray:
            self.discard(self.jobs_dir / name)
        return stray

    def discard(self, path: Path) -> None:
        """Move `path` (a folder of the jobs' folder) into the trash, in one rename: it is gone from its place
        at once, whole, whatever happens next; the trash is emptied off the event loop (peer/janitor.py)."""
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, self.trash_dir / f"{path.name}-{secrets.token_hex(4)}")

    def remove(self, job_id: str) -> None:
        """Forget a job, and move its folder into the trash (a crash between the two leaves a folder that no
        recorded job owns: `sweep` moves it at the next start)."""
        self.db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        self.discard(self.folder(job_id))

    def retain(self, max_age_s: float, max_bytes: int, now: float | None = None) -> list[str]:
        """Remove ended jobs older than `max_age_s`, then the oldest ended ones until the folders of all
        jobs come to at most `max_bytes`; the ids removed."""
        now = time.time() if now is None else now
        ended = self.rows([*ENDED, MOVED])  # a moved job's forwarding record goes as an ended job does
        total = sum(r.folder_bytes for r in self.rows())
        removed = []
        for row in ended:  # oldest first
            if now - (row.ended or row.submitted) > max_age_s or total > max_bytes:
                self.remove(row.id)
                total -= row.folder_bytes
                removed.append(row.id)
        return removed


_COLUMNS = ("id, spec, state, reason, submitted, started, ended, exit_code, attempts, pid, pid_started, folder_bytes, "
            "restarts, moved, peak_memory_bytes, peak_memory_source")


def _row(values: tuple[Any, ...]) -> JobRow:
    job_id, spec, *rest = values
    return JobRow(job_id, JobSpec(**json.loads(spec)), *rest)


def _sync_dir(path: Path) -> None:
    """Make the renames in a folder durable (fsync of the folder)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def kill_point(point: str) -> None:
    """Tests only: the process kills itself with SIGKILL here when GPULAYER_TEST_KILL_AT names `point`
    (docs/configuration.md), to show what a crash at that point leaves."""
    if os.environ.get(KILL_AT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def pause_point(point: str) -> None:
    """Tests only: where GPULAYER_TEST_PAUSE_IN names a folder, the calling thread says it reached `point` (the
    file `<point>.reached` there) and waits while the file `<point>.hold` is there (at most PAUSE_MAX_S), so
    that a test can order two threads' steps (docs/configuration.md)."""
    folder = os.environ.get(PAUSE_IN_ENV)
    if not folder:
        return
    Path(folder, f"{point}.reached").touch()
    hold, deadline = Path(folder, f"{point}.hold"), time.monotonic() + PAUSE_MAX_S
    while hold.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def default_state_dir() -> Path:
    """$XDG_STATE_HOME/gpulayer (~/.local/state/gpulayer): the default base of a peer's state folder."""
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "gpulayer"
