"""The peer's queue order (jobs/queue.py) and a state folder recorded before priorities (jobs/store.py)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass

import pytest

from gpulayer.jobs.queue import FairQueue
from gpulayer.jobs.store import QUEUED, JobSpec, JobStore
from gpulayer.protocol import jobs as job_protocol


@dataclass(eq=False)
class Work:
    name: str
    share: str
    priority: int = 0


def test_priority_first_then_submitters_in_turn_then_first_come_first_served():
    queue: FairQueue[Work] = FairQueue()
    items = [Work("a1", "a"), Work("a2", "a"), Work("b1", "b"), Work("hi", "c", 3), Work("lo", "b", -1)]
    for item in items:
        queue.append(item)
    assert [w.name for w in queue] == ["hi", "a1", "b1", "a2", "lo"]
    queue.remove(items[3])  # "hi" started
    queue.remove(items[0])  # "a1" started: b's turn comes before a's next
    assert [w.name for w in queue] == ["b1", "a2", "lo"] and len(queue) == 3
    assert items[0] not in queue and items[1] in queue
    with pytest.raises(ValueError):
        queue.remove(items[0])


def test_a_state_folder_of_jobs_recorded_before_priorities_opens(tmp_path):
    (tmp_path / "state").mkdir()
    old = sqlite3.connect(tmp_path / "state" / "jobs.sqlite3")  # the table and the spec of issue 27's peers
    old.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE jobs (n INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, spec TEXT NOT NULL,
            state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', submitted REAL NOT NULL, started REAL,
            ended REAL, exit_code INTEGER, attempts INTEGER NOT NULL DEFAULT 0, pid INTEGER, pid_started REAL,
            folder_bytes INTEGER NOT NULL DEFAULT 0);""")
    old_spec = {"command": ["true"], "name": "old", "env": {}, "req": {}, "timeout": None, "retries": 0,
                "submitter": "c1@10.0.0.1", "function": False}
    with old:
        old.execute("INSERT INTO jobs (id, spec, state, submitted) VALUES ('x-1', ?, ?, 0)",
                    (json.dumps(old_spec), QUEUED))
    old.close()
    store = JobStore(tmp_path / "state")
    row = store.get("x-1")
    assert row is not None and row.spec.priority == 0 and row.spec.share == "c1@10.0.0.1"
    assert row.restarts == 0 and not row.spec.preemptible and row.public()["priority"] == 0
    store.update("x-1", restarts=1)
    assert store.get("x-1").restarts == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("array", [[5, 4, 0], [0, 10_000, 0], [0, 9, 10_001], [-1, 3, 0], [0, 3], "0-3", [0, 3, True]])
def test_a_malformed_array_is_refused_with_a_reason(array):
    assert isinstance(job_protocol.check_array(array), str)


def test_an_array_is_its_indices_and_its_limit_and_is_recorded_whole(tmp_path):
    indices, limit = job_protocol.check_array([3, 7, 2])  # type: ignore[misc]
    assert list(indices) == [3, 4, 5, 6, 7] and limit == 2 and job_protocol.check_array(None) is None
    store = JobStore(tmp_path / "state")
    rows = store.add_array(JobSpec(["sweep"]), 0, indices, limit)
    assert [(r.spec.array, r.spec.index, r.spec.limit) for r in rows] == [(rows[0].id, i, 2) for i in range(3, 8)]


@pytest.mark.parametrize("fields", [{"priority": 10 ** 7}, {"priority": 1.5}, {"priority": False},
                                    {"user": "a@b"}, {"user": "x" * 65}, {"user": "\n"}])
def test_a_bad_priority_or_user_is_refused(fields):
    assert isinstance(job_protocol.check_spec({"command": ["true"], **fields}, "c@h"), str)
