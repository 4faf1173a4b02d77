"""The queue of a peer's jobs and tasks (issue 28): priorities, equal priorities shared between submitters
in turn, arrays, preemption (and a glt.Trainer job that resumes after it), and per-user quotas. Real peers
in subprocesses, real TCP; the work writes when it starts, so the order in which a peer started it is
read from the work's own output."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulayer.checks import login_user
from support import authenticated, new_key, wait_until
from test_jobs import jobs_peer  # noqa: F401  (the fixture: a one-slot peer with a state folder of its own)


def _cpu():
    from gpulayer.matching import Requirements

    return Requirements.build(accelerator="cpu")


@pytest.fixture
def as_user(monkeypatch):
    """as_user(name): submit as `name` from now on (the login name getpass reads first; the one this
    process read and kept is forgotten). The real one comes back after the test."""
    def become(name: str) -> None:
        monkeypatch.setenv("LOGNAME", name)
        login_user.cache_clear()

    yield become
    login_user.cache_clear()


def _marker(log: Path, name: str) -> list[str]:
    """A job that appends its name to `log` when it starts."""
    return ["python", "-c", f"open({str(log)!r}, 'a').write({name!r} + '\\n')"]


def test_the_highest_priority_starts_first_then_submitters_in_turn(jobs_peer, tmp_path, as_user):
    _, _, _, jobs = jobs_peer()
    release, log = tmp_path / "release", tmp_path / "started"
    blocker = jobs.submit(["python", "-c", f"import os, time\nwhile not os.path.exists({str(release)!r}): "
                                           "time.sleep(0.02)"], None, _cpu())
    wait_until(lambda: blocker.refresh().state == "running", 60)
    queued = []
    for user, names, priority in [("alice", ["a1", "a2", "a3"], 0), ("bob", ["b1", "b2", "b3"], 0),
                                  ("carol", ["low"], -1), ("alice", ["urgent"], 5)]:
        as_user(user)
        queued += [jobs.submit(_marker(log, name), None, _cpu(), name=name, priority=priority) for name in names]
    assert {(j.info["user"], j.info["priority"]) for j in queued} == {
        ("alice", 0), ("bob", 0), ("carol", -1), ("alice", 5)}
    release.touch()
    assert [job.wait(60) for job in queued] == ["succeeded"] * len(queued)
    assert log.read_text().split() == ["urgent", "a1", "b1", "a2", "b2", "a3", "b3", "low"]


def test_a_bad_priority_is_refused_and_records_nothing(jobs_peer):
    from gpulayer.client.jobs import JobError

    _, state, _, jobs = jobs_peer()
    for bad in (10 ** 7, True):
        try:
            jobs.submit(["true"], None, _cpu(), priority=bad)
        except JobError as exc:
            assert "priority" in str(exc)
        else:
            raise AssertionError(f"priority={bad!r} was accepted")
    assert jobs.rows() == []


def test_an_array_runs_each_index_once_within_its_limit_and_is_listed_as_one(jobs_peer, tmp_path):
    from test_jobs import gpulayer

    peer, _, key, jobs = jobs_peer("array", "--concurrency", "10")  # more slots than the array's limit
    out, running = tmp_path / "out", tmp_path / "running"
    out.mkdir(), running.mkdir()
    script = ("import os, time\n"
              f"i, running = os.environ['GPULAYER_ARRAY_INDEX'], {str(running)!r}\n"
              "open(os.path.join(running, i), 'w').close()\n"
              "seen = len(os.listdir(running))\n"
              "time.sleep(0.3)\n"  # the job's own work: long enough for its siblings to overlap it
              "os.remove(os.path.join(running, i))\n"
              f"open(os.path.join({str(out)!r}, i), 'w').write(f\"{{seen}} {{os.environ['GPULAYER_ARRAY_ID']}}\")\n")
    submitted = gpulayer("submit", "--accelerator", "cpu", "--array", "0-99%8", "--", "python", "-c", script,
                         key=key, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    array_id = submitted.stdout.strip()
    assert "array" in submitted.stderr and "of 100 jobs" in submitted.stderr
    waited = gpulayer("wait", array_id, key=key)  # the array's id: until all of its jobs ended
    assert waited.returncode == 0, waited.stderr
    rows = [r for r in jobs.rows() if r.get("array") == array_id]
    assert sorted(r["index"] for r in rows) == list(range(100)) and {r["state"] for r in rows} == {"succeeded"}
    written = {p.name: p.read_text().split() for p in out.iterdir()}
    assert sorted(written, key=int) == [str(i) for i in range(100)]
    assert {ident for _, ident in written.values()} == {array_id}
    assert 1 < max(int(seen) for seen, _ in written.values()) <= 8  # they overlapped, eight at most
    listed = gpulayer("jobs", key=key)
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if line.startswith(array_id))
    assert line.startswith(f"{array_id}[0-99]") and "100 succeeded" in line
    assert not any(line.startswith(r["id"] + " ") for r in rows for line in listed.stdout.splitlines())


def test_stop_of_an_array_stops_all_of_its_jobs_and_starts_none_held_back(jobs_peer, tmp_path):
    from test_jobs import gpulayer

    _, _, key, jobs = jobs_peer("array-stop", "--concurrency", "4")
    started = tmp_path / "started"
    started.mkdir()
    script = ("import os, time\n"
              f"open(os.path.join({str(started)!r}, os.environ['GPULAYER_ARRAY_INDEX']), 'w').close()\n"
              "while True:\n    time.sleep(1)\n")
    array = jobs.submit(["python", "-c", script], None, _cpu(), array=(0, 19, 2))
    wait_until(lambda: len(list(started.iterdir())) == 2, 60)
    stopped = gpulayer("stop", array.id, "--grace", "1", key=key)
    assert stopped.returncode == 0, stopped.stderr
    rows = [r for r in jobs.rows() if r.get("array") == array.id]
    assert len(rows) == 20 and {r["state"] for r in rows} == {"stopped"}
    assert len(list(started.iterdir())) == 2  # those its limit held back never started


def _until_term(events: Path, name: str) -> str:
    """A job that writes "<name> start <restarts>" and, on SIGTERM, "<name> term"; in its first run it
    works until stopped, when restarted it ends."""
    return ("import os, signal, sys, time\n"
            f"events, name, restarts = {str(events)!r}, {name!r}, os.environ['GPULAYER_RESTARTS']\n"
            "def write(line):\n    with open(events, 'a') as f:\n        f.write(line + '\\n')\n"
            "def term(*_):\n    write(name + ' term')\n    sys.exit(143)\n"
            "signal.signal(signal.SIGTERM, term)\n"
            "write(f'{name} start {restarts}')\n"
            "while restarts == '0':\n    time.sleep(0.05)\n")


def test_a_preemptible_job_makes_way_for_a_higher_priority_and_runs_again(jobs_peer, tmp_path):
    _, _, _, jobs = jobs_peer()
    events = tmp_path / "events"
    low = jobs.submit(["python", "-c", _until_term(events, "low")], None, _cpu(), preemptible=True, grace=20)
    wait_until(lambda: events.exists() and events.read_text() == "low start 0\n", 60)
    high = jobs.submit(_marker(events, "high"), None, _cpu(), priority=1)
    assert high.wait(60) == "succeeded" and low.wait(60) == "succeeded"
    assert events.read_text().splitlines() == ["low start 0", "low term", "high", "low start 1"]
    assert low.info["restarts"] == 1 and high.info["restarts"] == 0
    assert f"preempted for job {high.id}" in low.logs()


def test_never_a_job_that_did_not_ask_nor_for_an_equal_priority(jobs_peer, tmp_path):
    _, _, _, jobs = jobs_peer()
    events = tmp_path / "events"
    willing = jobs.submit(["python", "-c", _until_term(events, "willing")], None, _cpu(), preemptible=True,
                          priority=3)
    wait_until(lambda: events.exists() and "willing start 0" in events.read_text(), 60)
    equal = jobs.submit(["python", "-c", _until_term(events, "unwilling")], None, _cpu(), priority=3)
    # the peer decides as it queues a job, before it reads the next request: no preemption was begun
    assert (willing.refresh().state, equal.refresh().state) == ("running", "queued")
    assert willing.stop(grace=5) == "stopped"
    wait_until(lambda: "unwilling start 0" in events.read_text(), 60)
    urgent = jobs.submit(_marker(events, "urgent"), None, _cpu(), priority=9)
    assert (equal.refresh().state, urgent.refresh().state) == ("running", "queued")
    assert equal.stop(grace=5) == "stopped", (equal.info, equal.logs())
    assert urgent.wait(60) == "succeeded"
    assert events.read_text().splitlines() == ["willing start 0", "willing term", "unwilling start 0",
                                               "unwilling term", "urgent"]
    assert willing.refresh().info["restarts"] == 0


RESUMABLE_FIT = Path(__file__).parents[1] / "torch" / "resumable_fit.py"


def test_a_preempted_trainer_job_resumes_from_its_checkpoint_and_ends_as_if_never_stopped(jobs_peer, tmp_path):
    """glt.Trainer as a preemptible job (resumable_fit.py: a seeded CPU fit of 18 steps, a spawned DataLoader
    worker) is preempted mid-epoch by a job of higher priority, saves on the SIGTERM, is queued again,
    resumes, and ends with the weights of the same fit run straight through, each batch trained once."""
    import torch

    straight = tmp_path / "straight"
    straight.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_JOB")}
    ran = subprocess.run([sys.executable, str(RESUMABLE_FIT)], cwd=straight, env=env, capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr

    _, _, _, jobs = jobs_peer()
    project, waiting, events = tmp_path / "project", tmp_path / "waiting", tmp_path / "events"
    project.mkdir()
    (project / "resumable_fit.py").write_bytes(RESUMABLE_FIT.read_bytes())
    fit = jobs.submit(["python", "resumable_fit.py", "--signal-at", "8", "--wait-for-sigterm", str(waiting),
                       "--workers", "1"], project, _cpu(), preemptible=True, grace=120)
    wait_until(waiting.exists, 120)  # in step 8 of 18, mid-epoch 1, until the SIGTERM comes
    high = jobs.submit(_marker(events, "high"), None, _cpu(), priority=1)
    assert high.wait(120) == "succeeded" and fit.wait(300) == "succeeded", fit.logs()
    assert fit.info["restarts"] == 1 and events.read_text() == "high\n"
    logs = fit.logs()
    assert "glt: SIGTERM: saved" in logs and "step 9; stopping" in logs and "epoch 1, step 9, batch 6" in logs
    back = tmp_path / "back"
    fit.fetch(["weights.pt", "batches"], to=back)
    assert (back / "batches").read_text() == (straight / "batches").read_text()  # none lost, none twice
    resumed, expected = torch.load(back / "weights.pt"), torch.load(straight / "weights.pt")
    assert resumed.keys() == expected.keys()
    assert all(torch.allclose(resumed[k], expected[k]) for k in expected)


def _note(log: str, name: str, release: str = "") -> str:
    """A task: append `name` to `log` as it starts; with `release`, work until that file exists."""
    import os
    import time

    with open(log, "a") as f:
        f.write(name + "\n")
    deadline = time.monotonic() + 120
    while release and not os.path.exists(release):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{release} never came")
        time.sleep(0.02)
    return name


def _queued(peers: list[dict]) -> int:
    return sum(row["queued"] or 0 for row in peers)


def test_waiting_tasks_start_highest_priority_first(peer_factory, tmp_path):
    """priority= of gl.submit, gl.map and @gl.remote's options: a busy one-slot peer starts its waiting
    tasks highest first, then first come first served; the order is read from the tasks' own output."""
    import threading

    import gpulayer as gl

    key = new_key()
    peer_factory("prio", "--concurrency", "1", key=key)
    log, release = tmp_path / "started", tmp_path / "release"
    gl.configure(key=key.encode(), interfaces=["127.0.0.1"], echo_output=False)
    try:
        blocker = gl.submit(_note, str(log), "blocker", str(release))
        wait_until(log.exists, 60)
        waiting = [gl.submit(_note, str(log), "low", priority=-1), gl.submit(_note, str(log), "plain")]
        mapped: list[str] = []
        mapper = threading.Thread(target=lambda: mapped.extend(gl.map(_note, [str(log)] * 2, ["m1", "m2"],
                                                                      priority=3)))
        mapper.start()
        wait_until(lambda: _queued(gl.peers(wait=0)) == 4, 60)
        waiting.append(gl.remote(_note).options(priority=9).submit(str(log), "urgent"))
        wait_until(lambda: _queued(gl.peers(wait=0)) == 5, 60)
        release.touch()
        assert [f.result(60) for f in [blocker, *waiting]] == ["blocker", "low", "plain", "urgent"]
        mapper.join(60)
        assert mapped == ["m1", "m2"]
        assert log.read_text().split() == ["blocker", "urgent", "m1", "m2", "plain", "low"]
    finally:
        gl.api.shutdown()


def test_a_bad_task_priority_is_refused_by_the_option_table_and_by_the_peer(peer_factory):
    import pytest

    import gpulayer as gl
    from gpulayer.protocol import messages

    for bad in (10 ** 7, True, 1.5, "high"):
        with pytest.raises(ValueError, match="priority must be a whole number"):
            gl.submit(_note, "log", "x", priority=bad)
    with pytest.raises(ValueError, match="priority must be a whole number"):
        gl.remote(priority=-(10 ** 7))(_note)
    peer = peer_factory("prio-check", "--concurrency", "1", key=new_key())
    conn = authenticated(peer)
    try:
        conn.send({**messages.submit(1, b"f", b"a", {}, None, "f"), "priority": "high"})
        for _ in range(8):  # past the peer's unasked messages
            reply, _ = conn.recv(time.monotonic() + 10)
            if reply["t"] == messages.REJECT:
                break
        assert (reply["id"], reply["code"]) == (1, "bad-request") and "priority" in reply["message"], reply
    finally:
        conn.close()


def _hold(events: str, name: str, release: str) -> str:
    """Work that writes "start NAME", works until `release` exists, then writes "end NAME"."""
    import os
    import time

    def write(line: str) -> None:
        with open(events, "a") as f:
            f.write(line + "\n")

    write(f"start {name}")
    deadline = time.monotonic() + 120
    while not os.path.exists(release):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{release} never came")
        time.sleep(0.02)
    write(f"end {name}")
    return name


def test_a_user_at_the_quota_waits_while_the_others_work_goes_first(jobs_peer, tmp_path, as_user):
    """`--max-slots-per-user 1` on a two-slot peer: alice's second job and her task wait although a slot is
    free, bob's job takes it; alice never holds two slots at once (read from the work's own output)."""
    import gpulayer as gl

    peer, _, key, jobs = jobs_peer("quota", "--concurrency", "2", "--max-slots-per-user", "1")
    events, release = tmp_path / "events", tmp_path / "release"
    hold = inspect.getsource(_hold) + "import sys\n_hold(*sys.argv[1:])\n"

    def job(name: str):
        return jobs.submit(["python", "-c", hold, str(events), name, str(release)], None, _cpu(), name=name)

    gl.configure(key=key.encode(), peers=f"127.0.0.1:{peer.port}", mdns=False, echo_output=False)
    try:
        as_user("alice")
        first = job("a1")
        wait_until(lambda: events.exists() and "start a1" in events.read_text(), 60)
        second = job("a2")
        task = gl.submit(_hold, str(events), "a-task", str(release), accelerator="cpu")
        wait_until(lambda: _queued(gl.peers(wait=0)) == 2, 60)
        assert second.refresh().state == "queued" and events.read_text().split("\n")[:-1] == ["start a1"]
        as_user("bob")
        other = job("b1")
        wait_until(lambda: "start b1" in events.read_text(), 60)  # the free slot went to bob
        release.touch()
        assert [j.wait(60) for j in (first, second, other)] == ["succeeded"] * 3 and task.result(60) == "a-task"
    finally:
        gl.api.shutdown()
    lines = events.read_text().splitlines()
    assert lines.index("start b1") < lines.index("start a2") and lines.index("start b1") < lines.index("start a-task")
    alice = 0
    for line in lines:
        if line.split()[1] != "b1":
            alice += 1 if line.startswith("start") else -1
            assert alice <= 1, lines
