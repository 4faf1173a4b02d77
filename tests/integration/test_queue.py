"""The queue of a peer's jobs (issue 28): priorities, and equal priorities shared between submitters in
turn. Real peers in subprocesses, real TCP; each job writes its name when it starts, so the order
in which the one-slot peer started them is read from the jobs' own output."""

from __future__ import annotations

from pathlib import Path

from support import wait_until
from test_jobs import jobs_peer  # noqa: F401  (the fixture: a one-slot peer with a state folder of its own)


def _cpu():
    from gpulayer.matching import Requirements

    return Requirements.build(accelerator="cpu")


def _marker(log: Path, name: str) -> list[str]:
    """A job that appends its name to `log` when it starts."""
    return ["python", "-c", f"open({str(log)!r}, 'a').write({name!r} + '\\n')"]


def test_the_highest_priority_starts_first_then_submitters_in_turn(jobs_peer, tmp_path, monkeypatch):
    _, _, _, jobs = jobs_peer()
    release, log = tmp_path / "release", tmp_path / "started"
    blocker = jobs.submit(["python", "-c", f"import os, time\nwhile not os.path.exists({str(release)!r}): "
                                           "time.sleep(0.02)"], None, _cpu())
    wait_until(lambda: blocker.refresh().state == "running", 60)
    queued = []
    for user, names, priority in [("alice", ["a1", "a2", "a3"], 0), ("bob", ["b1", "b2", "b3"], 0),
                                  ("carol", ["low"], -1), ("alice", ["urgent"], 5)]:
        monkeypatch.setenv("LOGNAME", user)  # the user a submitter gives (getpass reads LOGNAME first)
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
