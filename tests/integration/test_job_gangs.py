"""Gang jobs (issue 29, ADR 0020): `gpulayer submit --nodes N` records one rank on each of N peers of
one host and the gang on rank 0's peer, which watches the ranks: gloo's all_reduce sums right in both
ranks' merged log; a rank killed stops the other and is named; the gang finishes without its
submitter (SIGKILLed right after the submit) and is re-attached; stop stops every rank; a gang larger
than the matching peers is refused with the reasons."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import new_key, process_gone, wait_until

ALLREDUCE = """\
import os, sys
import torch
import torch.distributed as dist
import gpulayer as gl

gl.distributed.init()
value = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(value)
print("sum", value.item(), "world", os.environ["WORLD_SIZE"], "peer", os.environ["GPULAYER_PEER_NAME"], flush=True)
if len(sys.argv) > 1:
    open("out.txt", "w").write(os.environ["RANK"])
"""

PLAIN_TORCH = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env:// from MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
value = torch.tensor([10.0 ** int(os.environ["RANK"])])
dist.all_reduce(value)
print("plain", value.item(), flush=True)
dist.destroy_process_group()
"""

HANG = """\
import os, time
open(os.environ["MARKS"] + "/rank-" + os.environ["RANK"], "w").write(str(os.getpid()))
print("rank", os.environ["RANK"], "waiting", flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def gang_cluster(peer_factory, tmp_path_factory):
    """Three one-slot CPU peers of one cluster, each with a state folder of its own; (key, peers, folder)."""
    key = new_key()
    base = tmp_path_factory.mktemp("gang-jobs")
    peers = [peer_factory(f"j{i}", "--concurrency", "1", "--state-dir", str(base / f"state-{i}"), key=key)
             for i in range(3)]
    project = base / "project"
    project.mkdir()
    for name, text in (("allreduce.py", ALLREDUCE), ("plain.py", PLAIN_TORCH), ("hang.py", HANG)):
        (project / name).write_text(text)
    return key, peers, project


def gpulayer(*args: str, key: str, cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpulayer.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "GPULAYER_KEY": key})


def submit(key: str, project: Path, *args: str) -> str:
    done = gpulayer("submit", "--accelerator", "cpu", *args, key=key, cwd=project)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def hanging(key: str, project: Path, marks: Path, nodes: int) -> tuple[str, list[int]]:
    """A gang of `nodes` ranks running hang.py, once every rank runs: its id and the ranks' pids."""
    marks.mkdir(exist_ok=True)
    job_id = submit(key, project, "--nodes", str(nodes), "--env", f"MARKS={marks}", "--", "python", "hang.py")
    pids = wait_until(lambda: [int(p.read_text()) for p in sorted(marks.iterdir())]
                      if len(list(marks.iterdir())) == nodes and all(p.read_text() for p in marks.iterdir()) else None,
                      120)
    return job_id, pids


def listed(key: str, job_id: str) -> tuple[dict, list[dict]]:
    """The gang's row and its ranks' rows (None for a rank whose peer did not answer), as `gpulayer jobs
    --json` gives them."""
    rows = json.loads(gpulayer("jobs", "--json", key=key).stdout)
    gang = next(r for r in rows if r["id"] == job_id)
    by_id = {r["id"]: r for r in rows}
    return gang, [by_id.get(m["job"]) for m in gang["gang"]["ranks"]]


def test_a_two_rank_gloo_job_sums_in_both_ranks_merged_log(gang_cluster, tmp_path):
    key, peers, project = gang_cluster
    job_id = submit(key, project, "--nodes", "2", "--", "python", "allreduce.py", "write")
    waited = gpulayer("wait", job_id, key=key)
    assert waited.returncode == 0, waited.stderr + gpulayer("logs", job_id, key=key).stdout
    lines = gpulayer("logs", job_id, key=key).stdout.splitlines()
    sums = sorted(line for line in lines if " sum " in line)
    assert [line.split(" peer ")[0] for line in sums] == ["[rank 0] sum 3.0 world 2", "[rank 1] sum 3.0 world 2"]
    assert len({line.split(" peer ")[1] for line in sums}) == 2  # two distinct peers
    gang, ranks = listed(key, job_id)
    assert gang["state"] == "succeeded" and gang["exit_code"] == 0 and [r["state"] for r in ranks] == ["succeeded"] * 2
    table = gpulayer("jobs", key=key).stdout
    assert f"rank 0: {ranks[0]['id']}" in table and f"rank 1: {ranks[1]['id']}" in table
    for rank in (0, 1):  # fetch takes rank 0's folder, or --rank K's
        fetched = gpulayer("fetch", job_id, "out.txt", "--to", str(tmp_path / str(rank)),
                           *(["--rank", "1"] if rank else []), key=key)
        assert fetched.returncode == 0, fetched.stderr
        assert (tmp_path / str(rank) / "out.txt").read_text() == str(rank)


def test_a_plain_torch_distributed_script_runs_from_python(gang_cluster):
    from gpulayer.client import Client
    from gpulayer.client.jobs import Jobs
    from gpulayer.matching import Requirements

    key, _, project = gang_cluster
    client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    try:
        job = Jobs(client).submit(["python", "plain.py"], project, Requirements.build(accelerator="cpu"), nodes=3)
        assert len(job.ranks) == 3 and len({r.peer for r in job.ranks}) == 3
        assert job.wait(180) == "succeeded", job.logs()
        assert sorted(line for line in job.logs().splitlines() if "plain" in line) == \
            [f"[rank {k}] plain 111.0" for k in range(3)]
    finally:
        client.close()


def test_a_rank_killed_stops_the_other_and_is_named(gang_cluster, tmp_path):
    key, peers, project = gang_cluster
    job_id, pids = hanging(key, project, tmp_path / "marks", 2)
    gang, ranks = listed(key, job_id)
    assert gang["state"] == "running" and [r["state"] for r in ranks] == ["running"] * 2
    killed = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    assert wait_until(lambda: process_gone(pids[0]), 60)
    print(f"rank 0 gone {time.monotonic() - killed:.2f} s after the kill -9 of rank 1")
    waited = gpulayer("wait", job_id, key=key)
    assert waited.returncode == 128 + signal.SIGKILL, waited.stderr
    gang, ranks = listed(key, job_id)
    rank1_peer = gang["gang"]["ranks"][1]["peer"]
    assert gang["state"] == "failed" and gang["reason"].startswith(f"rank 1 on peer {rank1_peer}: failed (killed by SIGKILL")
    assert [r["state"] for r in ranks] == ["stopped", "failed"]


def test_the_gang_goes_on_without_its_submitter_and_is_reattached(gang_cluster, tmp_path):
    key, _, project = gang_cluster
    release = tmp_path / "release"
    (project / "wait_release.py").write_text(
        "import os, time\nwhile not os.path.exists(os.environ['RELEASE']):\n    time.sleep(0.05)\n"
        "print('released', os.environ['RANK'], flush=True)\n")
    submitter = subprocess.Popen(
        [sys.executable, "-m", "gpulayer.cli", "submit", "--accelerator", "cpu", "--nodes", "2", "--env",
         f"RELEASE={release}", "--", "python", "wait_release.py"], cwd=project, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, "GPULAYER_KEY": key})
    try:
        job_id = submitter.stdout.readline().decode().strip()  # printed once the gang is recorded
    finally:
        submitter.kill()
        submitter.wait(10)
    assert wait_until(lambda: listed(key, job_id)[0]["state"] == "running", 120)
    release.touch()
    followed = gpulayer("logs", "-f", job_id, key=key)
    assert followed.returncode == 0, followed.stderr
    assert sorted(line for line in followed.stdout.splitlines() if "released" in line) == \
        ["[rank 0] released 0", "[rank 1] released 1"]
    assert gpulayer("wait", job_id, key=key).returncode == 0


def test_stop_stops_every_rank(gang_cluster, tmp_path):
    key, _, project = gang_cluster
    job_id, pids = hanging(key, project, tmp_path / "marks", 3)
    stopped = gpulayer("stop", job_id, "--grace", "2", key=key)
    assert stopped.returncode == 0 and stopped.stdout.strip() == f"job {job_id} stopped", stopped.stderr
    gang, ranks = listed(key, job_id)
    assert gang["state"] == "stopped" and [r["state"] for r in ranks] == ["stopped"] * 3
    assert all(process_gone(pid) for pid in pids)


def test_a_gang_larger_than_the_matching_peers_is_refused_with_reasons(gang_cluster):
    key, _, project = gang_cluster
    refused = gpulayer("submit", "--accelerator", "cpu", "--nodes", "4", "--", "python", "hang.py", key=key,
                       cwd=project)
    assert refused.returncode != 0
    assert "needs 4 distinct matching peers; 3 match and are free" in refused.stderr
    assert "Traceback" not in refused.stderr
    # nothing was recorded on any peer
    rows = json.loads(gpulayer("jobs", "--json", key=key).stdout)
    assert not [r for r in rows if r.get("command") == ["python", "hang.py"] and r["state"] == "queued"]


@pytest.fixture
def two_peers(peer_factory, tmp_path):
    """Two one-slot CPU peers of a fresh cluster with state folders of their own (killed by the tests)."""
    key = new_key()
    peers = [peer_factory(f"k{i}", "--concurrency", "1", "--state-dir", str(tmp_path / f"state-{i}"), key=key)
             for i in range(2)]
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "hang.py").write_text(HANG)
    return key, peers, tmp_path


def running_gang(key: str, folder: Path) -> tuple[str, dict, list[int]]:
    """A gang of 2 running hang.py: its id, its row, and the ranks' pids."""
    job_id, pids = hanging(key, folder / "project", folder / "marks", 2)
    return job_id, listed(key, job_id)[0], pids


def test_a_ranks_peer_lost_fails_the_gang_naming_it_and_stops_the_other(two_peers):
    key, peers, folder = two_peers
    job_id, gang, pids = running_gang(key, folder)
    lost = next(p for p in peers if p.name == gang["gang"]["ranks"][1]["peer"])
    lost.kill()  # kill -9 of the peer and of what it started, as when its machine dies
    waited = gpulayer("wait", job_id, key=key)
    assert waited.returncode == 1, waited.stderr  # no exit code: its peer was lost
    gang, ranks = listed(key, job_id)
    assert gang["state"] == "failed" and gang["reason"].startswith(f"rank 1 on peer {lost.name}: its peer was lost")
    assert ranks[0]["state"] == "stopped" and ranks[1] is None
    assert process_gone(pids[0])


def test_the_watchers_peer_lost_stops_the_other_rank(two_peers):
    key, peers, folder = two_peers
    job_id, gang, pids = running_gang(key, folder)
    watcher = next(p for p in peers if p.name == gang["gang"]["ranks"][0]["peer"])
    other = next(p for p in peers if p is not watcher)
    watcher.kill()
    assert wait_until(lambda: process_gone(pids[1]), 30)  # its peer stopped it: the watcher's connection went
    rank1 = gang["gang"]["ranks"][1]["job"]
    from gpulayer.client import Client
    from gpulayer.client.jobs import Jobs

    client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    try:
        job = Jobs(client).job(rank1)
        assert job.wait(30) == "stopped" and "the gang's watcher (on rank 0's peer) went away" in job.logs()
    finally:
        client.close()
    assert other.alive
    watcher.start()  # restarted on its state folder: the gang it watched is recorded lost, rank 0 stopped
    gang, ranks = listed(key, job_id)
    assert gang["state"] == "lost" and ranks[0]["state"] == "lost"
    assert wait_until(lambda: process_gone(pids[0]), 30)


def test_a_reserved_slot_is_not_given_to_later_single_work(two_peers):
    """Rank 0's peer (the lower id) holds its slot while rank 1 waits behind a running job on the other
    peer: single jobs submitted meanwhile to either peer start only after the gang's rank there ended."""
    from gpulayer.client import Client
    from gpulayer.client.jobs import Jobs
    from gpulayer.matching import Requirements

    key, peers, folder = two_peers
    low, high = sorted(peers, key=lambda p: p.peer_id)
    project, release = folder / "project", folder / "release"
    (project / "wait_release.py").write_text(
        "import os, time\nwhile not os.path.exists(os.environ['RELEASE']):\n    time.sleep(0.05)\n")
    client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    jobs = Jobs(client)

    def pinned(peer, command):
        return jobs.submit(command, project, Requirements.build(accelerator="cpu", peer=peer.name),
                           env={"RELEASE": str(release)})

    try:
        blocker = pinned(high, ["python", "wait_release.py"])
        assert wait_until(lambda: blocker.refresh().state == "running", 60)
        gang = jobs.submit(["python", "-c", "print('rank ran')"], project, Requirements.build(accelerator="cpu"),
                           nodes=2)
        assert wait_until(lambda: f"rank 0 holds its slots on peer {low.name}" in gang.logs(), 60), gang.logs()
        later = [pinned(low, ["true"]), pinned(high, ["true"])]  # after the gang's ranks on both peers
        assert [job.refresh().state for job in later] == ["queued", "queued"]
        release.touch()
        assert gang.wait(120) == "succeeded", gang.logs()
        assert [job.wait(120) for job in later] == ["succeeded", "succeeded"]
        ranks = [rank.refresh() for rank in gang.ranks]
        for rank, job in zip(ranks, later):  # each single job started once the rank on its peer had ended
            assert job.info["started"] >= rank.info["ended"]
        assert blocker.wait(60) == "succeeded"
    finally:
        release.touch()
        client.close()


def test_a_rank_is_bound_to_the_connection_that_claimed_it(gang_cluster, tmp_path):
    """A rank recorded alone waits (it does not start by itself); once one connection claimed it, another
    key holder's connection cannot reserve or start it; when the claiming connection goes, it is stopped."""
    from dataclasses import replace

    from gpulayer.client import Client
    from gpulayer.client.jobs import JobError, JobLink, Jobs, _submit_over
    from gpulayer.jobs import folder
    from gpulayer.jobs.store import JobSpec
    from gpulayer.matching import Requirements
    from gpulayer.protocol import jobs as job_protocol, messages

    key, peers, project = gang_cluster
    client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    try:
        at = [("127.0.0.1", peers[0].port)]
        spec = replace(JobSpec(["python", "hang.py"], req=Requirements.build(accelerator="cpu").to_wire()),
                       gang={"rank": 1, "size": 2})
        with JobLink(client, at) as link:
            rank = _submit_over(link, spec, folder.scan(project), None)["job"]["id"]

        def gang_step(op: str) -> dict:
            return job_protocol.request(messages.JOB_GANG, 0, rank, op=op)

        with JobLink(client, at) as claimer, JobLink(client, at) as other:
            claimer.ask(gang_step("claim"))
            for op in ("claim", "reserve", "start"):
                with pytest.raises(JobError, match=f"not a rank waiting here for this gang's {op}"):
                    other.ask(gang_step(op))
            assert Jobs(client).job(rank).state == "queued"  # waiting for its gang: not started
        job = Jobs(client).job(rank)
        assert job.wait(30) == "stopped" and "watcher (on rank 0's peer) went away" in job.logs()
    finally:
        client.close()


def test_a_ranks_address_where_another_peer_answers_is_not_taken_for_it(gang_cluster, tmp_path):
    """Each address of a rank is a hint: a gang record naming, for rank 1, a peer id that the peer at its address
    does not prove fails the gang, rank 1 unreachable with the id that answered there; nothing of it ran."""
    from dataclasses import replace

    from gpulayer.client import Client
    from gpulayer.client.jobs import JobLink, Jobs, _submit_over
    from gpulayer.jobs import folder
    from gpulayer.jobs.store import JobSpec
    from gpulayer.matching import Requirements

    key, peers, project = gang_cluster
    client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    spec = JobSpec(["python", "hang.py"], req=Requirements.build(accelerator="cpu").to_wire())
    ranks = []
    try:
        for index, peer in enumerate(peers[:2]):
            at = [["127.0.0.1", peer.port]]
            with JobLink(client, [("127.0.0.1", peer.port)]) as link:
                job = _submit_over(link, replace(spec, gang={"rank": index, "size": 2}), folder.scan(project), None)
                ranks.append({"job": job["job"]["id"], "peer": peer.name, "at": at, "addr": "127.0.0.1",
                              "peer_id": link.hello["peer"], "own": at})
        answered, ranks[1]["peer_id"] = ranks[1]["peer_id"], "0123456789ab"  # no peer's id
        with JobLink(client, [("127.0.0.1", peers[0].port)]) as link:
            gang_id = _submit_over(link, replace(spec, gang={"size": 2, "ranks": ranks}), folder.scan(tmp_path),
                                   None)["job"]["id"]
        gang = Jobs(client).job(gang_id)
        assert gang.wait(30) == "failed"
        assert f"rank 1 on peer {peers[1].name}: its peer was lost: unreachable (127.0.0.1:{peers[1].port}: peer " \
               f"{answered}, not 0123456789ab)" in gang.reason
        assert [Jobs(client).job(r["job"]).state for r in ranks] == ["stopped", "queued"]  # rank 1: unclaimed
        Jobs(client).job(ranks[1]["job"]).stop(0)
    finally:
        client.close()


def test_a_rank_whose_peer_is_killed_as_it_records_it_is_recorded_once(peer_factory, tmp_path, monkeypatch):
    """kill -9 of a rank's peer with the rank recorded but its submit not acknowledged; the peer restarts
    on its state folder while the submitter sends the rank's submit (its token) again: the rank is
    recorded once, and the gang runs each rank once."""
    from concurrent.futures import ThreadPoolExecutor

    from gpulayer.client import Client
    from gpulayer.client import jobs as client_jobs
    from gpulayer.matching import Requirements

    monkeypatch.setattr(client_jobs, "SUBMIT_RETRY_S", 120.0)  # the restart below may be slow on a busy machine
    key = new_key()
    steady = peer_factory("r0", "--concurrency", "1", "--state-dir", str(tmp_path / "state-0"), key=key)
    crashing = peer_factory("r1", "--concurrency", "1", "--state-dir", str(tmp_path / "state-1"), key=key,
                            env={"GPULAYER_TEST_KILL_AT": "job-recorded"})
    client = Client(key=key.encode(), echo_output=False)  # mDNS (on loopback) finds the restarted peer's new port
    runs = tmp_path / "runs"
    try:
        with ThreadPoolExecutor(1) as pool:
            submitted = pool.submit(client_jobs.Jobs(client).submit, ["sh", "-c", 'echo "$RANK" >> "$RUNS"'], None,
                                    Requirements.build(accelerator="cpu"), env={"RUNS": str(runs)}, nodes=2)
            assert crashing.proc.wait(60) == -signal.SIGKILL
            del crashing.env["GPULAYER_TEST_KILL_AT"]
            crashing.start()
            gang = submitted.result(150)
        assert gang.wait(120) == "succeeded", gang.reason
    finally:
        client.close()
    assert sorted(runs.read_text().split()) == ["0", "1"]  # each rank ran once
    assert len(list((tmp_path / "state-1" / "jobs").iterdir())) in (1, 2)  # its rank (and the gang's record on rank 0's peer)
