"""Removing jobs off the peer's event loop (docs/jobs.md, "Retention"; gpulayer/peer/janitor.py).

Real peers in subprocesses, the job API of this process. A removed job's folder is renamed into the state
folder's trash at once and deleted on the janitor's thread: the peer answers meanwhile (shown with a
folder of 20,000 files, still in the trash when the answers came); a peer killed with SIGKILL while its
trash holds a folder empties it at its next start; a blob that a prune found unused but that an upload
started meanwhile needs is kept (the steps ordered by the peer's pause points, GPULAYER_TEST_PAUSE_IN).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import new_key, wait_until

FILES = 20_000  # small files: deleting them takes a while (0.3 s here), whatever the disk's speed


@pytest.fixture
def start_peer(peer_factory, tmp_path):
    """start(name, *args, env=...) -> (peer, state folder, jobs API): a one-slot peer with a state folder of its own."""
    from gpulayer.client import Client
    from gpulayer.client.jobs import Jobs

    key = new_key()
    client = Client(key=key.encode(), echo_output=False)

    def start(name: str, *args: str, env: dict | None = None):
        state = tmp_path / f"{name}-state"
        peer = peer_factory(name, "--concurrency", "1", "--state-dir", str(state), *args, key=key, env=env)
        return peer, state, Jobs(client)

    yield start
    client.close()


def _cpu():
    from gpulayer.matching import Requirements

    return Requirements.build(accelerator="cpu")


def _trashed(state, job_id: str) -> list:
    """What of the job's folder is in the trash, still being deleted (a peer that deletes on its event loop
    has no trash)."""
    trash = state / "trash"
    return [p for p in trash.iterdir() if p.name.startswith(f"{job_id}-")] if trash.exists() else []


def test_the_peer_answers_while_a_removed_jobs_folder_of_many_files_is_deleted(start_peer):
    from gpulayer.protocol import jobs as job_protocol, messages

    _, state, jobs = start_peer("janitor")
    job = jobs.submit(["python", "-c", f"for i in range({FILES}): open(f'f{{i}}', 'w').close()"], None, _cpu())
    assert job.wait(120) == "succeeded", job.logs()
    with jobs.link(jobs.holder(job.id)) as link:
        link.ask(job_protocol.request(messages.JOB_RM, 1, job.id))
        listed = link.ask(job_protocol.request(messages.JOB_LIST, 2))
        trashed = _trashed(state, job.id)  # looked at as the answer came: the folder is still being deleted
    assert job.id not in [row["id"] for row in listed["jobs"]]
    assert not (state / "jobs" / job.id).exists()
    assert len(trashed) == 1 and trashed[0].is_dir()
    wait_until(lambda: not any((state / "trash").iterdir()))


def test_a_peer_killed_while_it_deletes_a_removed_job_empties_its_trash_at_its_next_start(start_peer, tmp_path):
    from gpulayer.client.jobs import JobError

    pauses = tmp_path / "pauses"
    pauses.mkdir()
    peer, state, jobs = start_peer("trashed", env={"GPULAYER_TEST_PAUSE_IN": str(pauses)})
    job = jobs.submit(["python", "-c", "for i in range(200): open(f'f{i}', 'w').write('x')"], None, _cpu())
    assert job.wait(120) == "succeeded", job.logs()
    (pauses / "trash-emptying.hold").touch()
    job.remove()
    wait_until(lambda: (pauses / "trash-emptying.reached").exists())  # the janitor is about to delete it
    peer.proc.send_signal(signal.SIGKILL)
    assert peer.proc.wait(30) == -signal.SIGKILL
    assert not (state / "jobs" / job.id).exists() and len(_trashed(state, job.id)) == 1
    del peer.env["GPULAYER_TEST_PAUSE_IN"]
    peer.start()
    wait_until(lambda: not any((state / "trash").iterdir()))
    assert job.id not in [row["id"] for row in jobs.rows(include_old=True)]
    with pytest.raises(JobError, match="no-job"):
        job.refresh()


def test_a_blob_a_prune_found_unused_is_kept_for_an_upload_that_started_meanwhile(start_peer, tmp_path):
    """Job `first` ships blob X; `second`'s end makes retention remove `first`, and the prune (on the janitor's
    thread) pauses once it knows what is in use, X not among it. Then `third`, shipping X again, is submitted:
    the peer finds X in its store and asks for nothing, and pauses before it builds the folder. The prune
    goes on and ends; then the folder is built, from X."""
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    (pauses / "blobs-pruning.hold").touch()
    _, state, jobs = start_peer("pruning", "--job-retention-gb", str(1.5 / 1024),  # 1.5 MiB of job folders
                                env={"GPULAYER_TEST_PAUSE_IN": str(pauses)})
    x = secrets.token_bytes(1 << 20)
    folders = {}
    for name, content in (("first", x), ("second", secrets.token_bytes(1 << 20)), ("third", x)):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "weights.bin").write_bytes(content)
    first = jobs.submit(["true"], folders["first"], _cpu())
    assert first.wait(60) == "succeeded"
    second = jobs.submit(["true"], folders["second"], _cpu())
    assert second.wait(60) == "succeeded"
    wait_until(lambda: (pauses / "blobs-pruning.reached").exists())  # `first` is removed, X is unused
    (pauses / "job-building.hold").touch()
    (pauses / "job-building.reached").unlink()  # reached by the first two
    with ThreadPoolExecutor(1) as pool:
        submitted = pool.submit(jobs.submit, ["python", "-c", "import hashlib; print(hashlib.sha256("
                                              "open('weights.bin', 'rb').read()).hexdigest())"],
                                folders["third"], _cpu())
        wait_until(lambda: (pauses / "job-building.reached").exists())  # it asked for nothing: X is stored
        (pauses / "blobs-pruning.hold").unlink()
        wait_until(lambda: (pauses / "blobs-pruned.reached").exists())
        (pauses / "job-building.hold").unlink()
        third = submitted.result(60)
    assert third.wait(60) == "succeeded", third.reason
    assert third.logs() == hashlib.sha256(x).hexdigest() + "\n"
    assert os.path.exists(state / "jobs" / third.id / "work" / "weights.bin")
