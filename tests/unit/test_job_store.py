"""The peer's job store (jobs/store.py) and the job requests' checks (protocol/jobs.py): real SQLite files."""

from __future__ import annotations

import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest

from gpulayer.protocol import jobs as job_protocol, messages
from gpulayer.jobs.store import (ARRIVING, ENDED, MOVED, QUEUED, SUCCEEDED, JobSpec, JobStore, check_job_id,
                                 holder_of)


def test_ids_name_their_holder_and_are_never_reused(tmp_path):
    store = JobStore(tmp_path / "state")
    first, second = store.add(JobSpec(["a"]), 0), store.add(JobSpec(["b"]), 0)
    assert first.id == f"{store.holder}-1" and second.id == f"{store.holder}-2"
    assert holder_of(second.id) == store.holder and check_job_id(second.id) is None
    store.remove(second.id)
    store.close()
    again = JobStore(tmp_path / "state")  # the same state folder: the same holder, the next number
    assert again.holder == store.holder and again.add(JobSpec(["c"]), 0).id == f"{store.holder}-3"
    assert JobStore(tmp_path / "other").holder != store.holder


def _record_and_die(state: str) -> None:
    store = JobStore(Path(state))
    store.add(JobSpec(["train"], name="durable"), 5)
    os._exit(0)  # no close, no clean exit: what was committed must be on disk


def test_a_recorded_job_survives_its_process_dying(tmp_path):
    process = multiprocessing.get_context("spawn").Process(target=_record_and_die, args=(str(tmp_path / "s"),))
    process.start()
    process.join(60)
    rows = JobStore(tmp_path / "s").rows()
    assert [(r.spec.name, r.state, r.folder_bytes) for r in rows] == [("durable", QUEUED, 5)]


def test_the_store_is_private(tmp_path):
    store = JobStore(tmp_path / "state")
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "state" / "jobs.sqlite3").stat().st_mode) == 0o600
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_retention_removes_the_oldest_ended_jobs_first(tmp_path):
    store = JobStore(tmp_path / "state")
    now = time.time()
    ids = []
    for age_days, size in [(40, 10), (5, 30), (3, 30), (1, 30)]:
        row = store.add(JobSpec(["x"]), size)
        store.folder(row.id).mkdir()
        store.update(row.id, state=SUCCEEDED, ended=now - age_days * 86400)
        ids.append(row.id)
    running = store.add(JobSpec(["y"]), 50)
    assert store.retain(max_age_s=30 * 86400, max_bytes=120, now=now) == ids[:2]  # too old, then the oldest
    assert [r.id for r in store.rows()] == [*ids[2:], running.id]
    assert not store.folder(ids[0]).exists() and store.folder(ids[2]).exists()
    assert all(r.state not in ENDED for r in store.rows([QUEUED]))


def test_a_pulled_job_keeps_its_id_and_the_moved_record_goes_with_retention(tmp_path):
    owner, puller = JobStore(tmp_path / "owner"), JobStore(tmp_path / "puller")
    row = owner.add(JobSpec(["x"], priority=2, user="ann"), 7)
    arrived = puller.add_arriving(row.id, row.spec, row.submitted, 7, owner.holder)
    assert (arrived.id, arrived.state, arrived.moved, arrived.spec) == (row.id, ARRIVING, owner.holder, row.spec)
    assert puller.add(JobSpec(["y"]), 0).id == f"{puller.holder}-2"  # its own ids go on from its own count
    owner.update(row.id, state=MOVED, moved=puller.holder, ended=time.time() - 40 * 86400)
    assert owner.get(row.id).public()["moved"] == puller.holder
    assert owner.retain(max_age_s=30 * 86400, max_bytes=1 << 30) == [row.id]


def test_a_state_folder_of_an_earlier_release_gets_the_moved_column(tmp_path):
    import sqlite3

    old = JobStore(tmp_path / "state")
    row = old.add(JobSpec(["x"]), 0)
    old.db.execute("ALTER TABLE jobs DROP COLUMN moved")
    old.close()
    assert "moved" not in {c[1] for c in sqlite3.connect(tmp_path / "state" / "jobs.sqlite3").execute(
        "PRAGMA table_info(jobs)")}
    again = JobStore(tmp_path / "state")
    assert again.get(row.id).moved == "" and again.get(row.id).state == QUEUED


def test_a_state_folder_of_an_earlier_release_opens_with_no_peak_memory_and_records_one(tmp_path):
    """A jobs table without the peak memory columns (before they were added), with an ended job: the store opens,
    that job reads as having no figure (None, not 0), and a job that ends afterwards records its figure."""
    import sqlite3

    old = JobStore(tmp_path / "state")
    ended, later = old.add(JobSpec(["x"]), 0), old.add(JobSpec(["y"]), 0)
    old.update(ended.id, state=SUCCEEDED, exit_code=0)
    for column in ("peak_memory_bytes", "peak_memory_source"):
        old.db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
    old.close()
    assert not {"peak_memory_bytes", "peak_memory_source"} & {c[1] for c in sqlite3.connect(
        tmp_path / "state" / "jobs.sqlite3").execute("PRAGMA table_info(jobs)")}
    again = JobStore(tmp_path / "state")
    shown = again.get(ended.id).public()
    assert (shown["state"], shown["peak_memory_bytes"], shown["peak_memory_source"]) == (SUCCEEDED, None, None)
    again.update(later.id, state=SUCCEEDED, peak_memory_bytes=210 << 20, peak_memory_source="largest-process")
    again.close()
    shown = JobStore(tmp_path / "state").get(later.id).public()
    assert (shown["peak_memory_bytes"], shown["peak_memory_source"]) == (210 << 20, "largest-process")


def test_a_state_folder_with_a_half_recorded_row_of_an_earlier_release_opens_and_finds_tokens(tmp_path):
    """Releases before the token wrote a placeholder spec '' first, in a transaction of its own: a crash could
    leave it, and an index over every spec's JSON could then not be made (the store would not open)."""
    first = JobStore(tmp_path / "state")
    token = "0123456789abcdef0123456789abcdef"
    row = first.add(JobSpec(["x"], token=token), 0)
    first.db.execute("INSERT INTO jobs (id, spec, state, submitted, folder_bytes) VALUES ('', '', ?, 0, 0)",
                     (QUEUED,))
    first.db.execute("DROP INDEX jobs_by_token")
    first.close()
    again = JobStore(tmp_path / "state")
    assert [r.id for r in again.submitted(token)] == [row.id]


@pytest.mark.parametrize("value", ["", "abc-1", "0123456789ab-0", "0123456789AB-1", "0123456789ab-1/..", 7, None])
def test_malformed_job_ids_are_refused(value):
    assert "a job id is" in check_job_id(value)


@pytest.mark.parametrize("msg, says", [
    ({"t": messages.JOB_LOGS, "id": 1, "job": "0123456789ab-1", "offset": -1, "follow": False}, "offset"),
    ({"t": messages.JOB_STOP, "id": 1, "job": "0123456789ab-1", "grace": float("nan")}, "grace"),
    ({"t": messages.JOB_FETCH, "id": 1, "job": "0123456789ab-1", "paths": "etc"}, "paths"),
    ({"t": messages.JOB_WAIT, "id": True, "job": "0123456789ab-1"}, "integer 'id'"),
    ({"t": messages.JOB_PULL, "id": 1, "holder": "../etc", "advert": {}, "wait": 0}, "holder"),
    ({"t": messages.JOB_PULL, "id": 1, "holder": "0123456789ab", "advert": {"a": 1}, "wait": 0}, "advert"),
    ({"t": messages.JOB_PULL, "id": 1, "holder": "0123456789ab", "advert": {}, "wait": 1e9}, "wait"),
    ({"t": messages.JOB_TAKE, "id": 1, "holder": "0123456789ab", "job": "0123456789ab-1", "step": "run"}, "step"),
    ({"t": messages.JOB_TAKE, "id": 1, "holder": "0123456789ab", "job": "0123456789ab-1", "step": "need",
      "need": ["../x"]}, "digests"),
    ({"t": messages.JOB_TAKE, "id": 1, "holder": "0123456789ab", "job": "x", "step": "commit"}, "a job id is"),
])
def test_malformed_requests_are_refused_with_the_reason(msg, says):
    assert says in job_protocol.check_request(msg)


@pytest.mark.parametrize("spec, says", [
    ({"command": []}, "non-empty list"),
    ({"command": ["a\0b"]}, "non-empty list"),
    ({"command": ["x"], "retries": -1}, "retries"),
    ({"command": ["x"], "env": {"GPULAYER_JOB_ID": "forged"}}, "GPULAYER_JOB_ID"),
    ({"command": ["x"], "timeout": float("inf")}, "timeout"),
])
def test_malformed_specs_are_refused_with_the_reason(spec, says):
    assert says in job_protocol.check_spec(spec, "me")


def test_an_array_and_its_folders_are_recorded_all_or_none(tmp_path):
    """A folder that cannot be moved into place (here: gone) records none of the array's jobs, and the
    folders already moved are removed; `sweep` removes what no recorded job owns."""
    store = JobStore(tmp_path / "state")
    folders = [Path(store.reserve()) for _ in range(3)]
    (folders[0] / "work").mkdir()
    folders[2].rmdir()
    with pytest.raises(FileNotFoundError):
        store.add_array(JobSpec(["sweep"]), 0, range(3), 0, folders)
    assert store.rows() == [] and not list(store.jobs_dir.iterdir())
    placed = store.add_array(JobSpec(["sweep"]), 0, range(1), 0, [Path(store.reserve())])
    assert [p.name for p in store.jobs_dir.iterdir()] == [placed[0].id]
    stray = store.folder(f"{store.holder}-99")
    stray.mkdir()
    assert store.sweep() == [stray.name] and [p.name for p in store.jobs_dir.iterdir()] == [placed[0].id]


def test_an_array_that_fails_half_way_records_none_of_its_jobs(tmp_path):
    """The store's connection is in autocommit mode: its transactions are explicit (on main, the array's
    first row was committed with an empty id before its spec failed)."""
    store = JobStore(tmp_path / "state")
    with pytest.raises(TypeError):
        store.add_array(JobSpec(["x"], env={"A": object()}), 0, range(2), 0)  # type: ignore[dict-item]
    assert store.rows() == []
    assert [r.spec.index for r in store.add_array(JobSpec(["x"]), 0, range(2), 0)] == [0, 1]


GANG_RANK = {"job": "0123456789ab-1", "peer": "p", "at": [["127.0.0.1", 7000]], "addr": "127.0.0.1"}


@pytest.mark.parametrize("gang", [
    {"rank": 2, "size": 2},  # no rank 2 of 2
    {"rank": 0, "size": 1},  # a gang has 2 ranks or more
    {"rank": 0, "size": 257},
    {"size": 2, "ranks": [GANG_RANK]},  # one entry a rank
    {"size": 2, "ranks": [GANG_RANK, {**GANG_RANK, "job": "../x"}]},
    {"size": 2, "ranks": [GANG_RANK, {**GANG_RANK, "at": [["h", 70000]]}]},
    {"size": 2, "ranks": [GANG_RANK, {**GANG_RANK, "extra": 1}]},
    {"size": 2, "ranks": [GANG_RANK, {**GANG_RANK, "own": [["h", 0], ["h"]]}]},  # the rank's peer's addresses
    {"size": 2, "ranks": [GANG_RANK, {**GANG_RANK, "own": "h:7000"}]},
    {"size": 2, "ranks": [GANG_RANK, {**GANG_RANK, "own": [["h", 7000]] * 17}]},
    {"size": 2, "ranks": [GANG_RANK, {**GANG_RANK, "peer_id": ""}]},  # the id its handshake must prove
    {"size": 2, "ranks": [GANG_RANK, {**GANG_RANK, "peer_id": 12}]},
    {"size": 2, "ranks": [GANG_RANK, {**GANG_RANK, "peer_id": "a\nb"}]},
    {"rank": 0, "size": 2, "ranks": []},
    [0, 2],
])
def test_malformed_gangs_are_refused_with_the_reason(gang):
    assert "a job's 'gang' is" in job_protocol.check_spec({"command": ["x"], "gang": gang}, "me")


def test_a_gangs_spec_is_taken_whole():
    rank = job_protocol.check_spec({"command": ["x"], "gang": {"rank": 1, "size": 2}}, "me")
    whole = job_protocol.check_spec({"command": ["x"], "gang": {"size": 2, "ranks": [GANG_RANK] * 2}}, "me")
    assert rank.gang == {"rank": 1, "size": 2} and whole.gang["ranks"] == [GANG_RANK] * 2
    paths = [GANG_RANK, {**GANG_RANK, "peer_id": "0123456789ab", "own": [["10.77.0.2", 7000]]}]  # protocol 3's optional fields
    assert job_protocol.check_spec({"command": ["x"], "gang": {"size": 2, "ranks": paths}}, "me").gang["ranks"] == paths
    start = {"t": messages.JOB_GANG, "id": 1, "job": "0123456789ab-1", "op": "start", "env": {"RANK": "1"}}
    assert job_protocol.check_request(start) is None


@pytest.mark.parametrize("fields", [
    {"op": "run"},
    {"op": "start", "env": {"LD_PRELOAD": "/tmp/x.so"}},  # only the rendezvous variables
    {"op": "start", "env": {"RANK": 0}},
    {"op": "start", "env": {"RANK": "0\0"}},
])
def test_a_malformed_gang_request_is_refused(fields):
    msg = {"t": messages.JOB_GANG, "id": 1, "job": "0123456789ab-1", **fields}
    assert "a JOB_GANG's 'op'" in job_protocol.check_request(msg)
