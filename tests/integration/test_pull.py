"""Peers pull waiting work (issue 28, item 2; ADR 0019): real peers in subprocesses, real TCP, real zeroconf on
loopback. Jobs queued on one peer are taken over by peers that start later, each exactly once (read from the
jobs' own output), pinned jobs stay; a kill -9 of the owner in the middle of a hand-over runs the job once in
the end; forged hand-over requests are refused and change nothing."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from support import authenticated, new_key, wait_until


def _cpu(peer: str | None = None):
    from gpulayer.matching import Requirements

    return Requirements.build(accelerator="cpu", peer=peer)


def _held(release: Path) -> str:
    return f"while [ ! -e {release} ]; do sleep 0.05; done"


def _writes(out: Path, release: Path | None = None) -> list[str]:
    """A job that appends "<its id> <the peer it ran on>" to `out` (one short write: O_APPEND keeps lines whole),
    then, given `release`, holds its slot until that file exists."""
    hold = f"; {_held(release)}" if release else ""
    return ["sh", "-c", f'echo "$GPULAYER_JOB_ID $GPULAYER_PEER_NAME" >> {out}{hold}']


def _blocker(release: Path) -> list[str]:
    return ["sh", "-c", _held(release)]


def _ran(out: Path) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in out.read_text().splitlines()] if out.exists() else []  # type: ignore[misc]


def _state_in(state_dir: Path, job_id: str) -> str | None:
    """The job's state in a peer's own SQLite store (read only), None when it holds no such row."""
    db = sqlite3.connect(f"file:{state_dir / 'jobs.sqlite3'}?mode=ro", uri=True, timeout=5)
    try:
        row = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
    finally:
        db.close()
    return row[0] if row else None


@pytest.fixture
def cluster_of_jobs(peer_factory, tmp_path):
    """start(name, *args) -> peer: one-slot peers of one fresh cluster, each with a state folder of its own;
    `jobs` is that cluster's jobs API."""
    from gpulayer.client import Client
    from gpulayer.client.jobs import Jobs

    key = new_key()
    client = Client(key=key.encode(), echo_output=False)

    def start(name: str, *args: str, wait: bool = True, env: dict | None = None):
        return peer_factory(name, "--concurrency", "1", "--state-dir", str(tmp_path / f"{name}-state"), *args,
                            key=key, env=env, wait=wait)

    start.jobs = Jobs(client)
    start.key = key
    yield start
    client.close()


def test_peers_that_join_pull_the_queued_jobs_each_runs_once_and_pinned_ones_stay(cluster_of_jobs, tmp_path):
    cluster_of_jobs("owner")
    jobs = cluster_of_jobs.jobs
    release, out = tmp_path / "release", tmp_path / "out"
    blocker = jobs.submit(_blocker(release), None, _cpu(peer="owner"))
    wait_until(lambda: blocker.refresh().state == "running", 60)
    pinned = [jobs.submit(_writes(out), None, _cpu(peer="owner"), name="pinned") for _ in range(5)]
    # each holds its slot until released: a joiner that hears of the owner late still takes one
    loose = [jobs.submit(_writes(out, release), None, _cpu(), name="loose") for _ in range(200)]
    assert {j.peer for j in pinned + loose} == {"owner"} and not out.exists()  # all queued behind the blocker
    owner_holder = blocker.id.split("-")[0]
    joiners = [cluster_of_jobs(f"joiner{n}", wait=False) for n in range(4)]
    for peer in joiners:
        peer.wait_ready()
    # all four run jobs pulled from the owner while its only slot is still held
    wait_until(lambda: {peer for _, peer in _ran(out)} == {p.name for p in joiners}, 120, detail=lambda: _ran(out))
    release.touch()
    every = pinned + loose
    wait_until(lambda: len(_ran(out)) >= len(every), 180)
    assert blocker.wait(60) == "succeeded"

    def settled() -> dict | None:
        rows = {r["id"]: r for r in jobs.rows()}
        done = set(rows) >= {j.id for j in every} and all(r["state"] == "succeeded" for r in rows.values())
        return rows if done else None

    rows = wait_until(settled, 60, interval=0.5)
    ran = _ran(out)
    assert sorted(job_id for job_id, _ in ran) == sorted(j.id for j in every)  # each exactly once
    where = dict(ran)
    assert {where[j.id] for j in pinned} == {"owner"}
    pulled = [j for j in loose if where[j.id] != "owner"]
    assert len(pulled) >= 4
    assert all(rows[j.id]["peer"] == where[j.id] for j in every)  # `gpulayer jobs` shows where it ran
    assert not {r["state"] for r in rows.values()} & {"queued", "moving", "arriving", "moved"}
    moved = jobs.job(pulled[0].id)  # found through the owner's forwarding record
    assert (moved.state, moved.peer) == ("succeeded", where[pulled[0].id])
    assert moved.info["moved"] == owner_holder  # the puller's record names the peer it came from


def test_a_kill_9_of_the_owner_during_a_hand_over_runs_the_job_once(cluster_of_jobs, tmp_path):
    owner = cluster_of_jobs("owner")
    jobs = cluster_of_jobs.jobs
    release, out, project = tmp_path / "release", tmp_path / "out", tmp_path / "project"
    project.mkdir()
    with open(project / "big.bin", "wb") as f:  # blobs that take a while to cross: the hand-over's window
        for n in range(48):
            f.write(bytes([n]) * (1 << 20))
    blocker = jobs.submit(_blocker(release), None, _cpu(peer="owner"))
    wait_until(lambda: blocker.refresh().state == "running", 60)
    job = jobs.submit(_writes(out), project, _cpu())
    state_dir = tmp_path / "owner-state"
    assert _state_in(state_dir, job.id) == "queued"
    puller = cluster_of_jobs("puller")
    seen = wait_until(lambda: (state := _state_in(state_dir, job.id)) != "queued" and state, 60, interval=0.002)
    owner.kill()
    assert seen == "moving"  # the owner had offered it, the puller had not committed
    release.touch()
    owner.start()  # on the same state folder: the hand-over is undone there, or the puller's commit is answered
    assert jobs.job(job.id).wait(120) == "succeeded"
    wait_until(lambda: {_state_in(state_dir, job.id), _state_in(tmp_path / "puller-state", job.id)}
               <= {"succeeded", "moved", None}, 60)
    assert [job_id for job_id, _ in _ran(out)] == [job.id]  # once, on one of the two
    assert puller.alive() and owner.alive()


def test_a_forged_or_stray_hand_over_is_refused_and_changes_nothing(cluster_of_jobs, tmp_path):
    import socket

    from gpulayer.errors import AuthError
    from gpulayer.protocol import framing, handshake, messages
    from gpulayer.resources.model import Advert
    from gpulayer.transport import blocking

    owner = cluster_of_jobs("owner", "--no-pull")
    jobs = cluster_of_jobs.jobs
    release, out = tmp_path / "release", tmp_path / "out"
    running = jobs.submit(_blocker(release), None, _cpu())
    wait_until(lambda: running.refresh().state == "running", 60)
    queued = jobs.submit(_writes(out), None, _cpu())
    holder = "0123456789ab"

    def take(conn, job_id: str, step: str = "commit", **fields) -> dict:
        conn.send({"t": messages.JOB_TAKE, "id": 7, "job": job_id, "holder": holder, "step": step, **fields})
        return conn.recv(time.monotonic() + 10)[0]

    # no key: the request is not read, the connection is closed
    with socket.create_connection(("127.0.0.1", owner.port), timeout=10) as sock:
        raw = blocking.BlockingConnection(sock)
        raw.recv(time.monotonic() + 10)  # the HELLO
        sock.sendall(b"".join(bytes(p) for p in framing.encode(
            {"t": messages.JOB_TAKE, "id": 1, "job": queued.id, "holder": holder, "step": "commit"})))
        reply = raw.recv(time.monotonic() + 10)[0]
        assert reply["t"] == messages.ERROR and reply["code"] == "auth"
    # the wrong key: the handshake fails
    with socket.create_connection(("127.0.0.1", owner.port), timeout=10) as sock:
        with pytest.raises(AuthError):
            handshake.client_handshake(blocking.BlockingConnection(sock), new_key().encode(), "intruder")
    # with the key: a job that is not being handed over, queued or running, is not taken; nor its blobs
    conn = authenticated(owner)
    try:
        for job_id, step in [(queued.id, "commit"), (queued.id, "need"), (running.id, "commit"),
                             (f"{holder}-1", "commit")]:
            reply = take(conn, job_id, step, **({"need": []} if step == "need" else {}))
            assert (reply["t"], reply["code"]) == (messages.ERROR, "no-handover"), reply
        conn.send({"t": messages.JOB_PULL, "id": 8, "holder": holder, "advert": {"bad": "advert"}, "wait": 0})
        reply = conn.recv(time.monotonic() + 10)[0]
        assert (reply["t"], reply["code"]) == (messages.ERROR, "bad-request")
        # a puller of this cluster is offered the queued job (not the running one); another connection that
        # names the same puller cannot commit it; once the puller's connection goes, the job is queued again
        advert = Advert.from_txt(owner_advert(owner)).to_txt()
        conn.send({"t": messages.JOB_PULL, "id": 9, "holder": holder, "advert": advert, "wait": 0})
        offer = conn.recv(time.monotonic() + 10)[0]
        assert offer["t"] == messages.JOB_OFFER and offer["job"]["id"] == queued.id
        assert queued.refresh().state == "moving"
        other = authenticated(owner)
        try:
            reply = take(other, queued.id)
            assert (reply["t"], reply["code"]) == (messages.ERROR, "no-handover")
        finally:
            other.close()
    finally:
        conn.close()
    wait_until(lambda: queued.refresh().state == "queued", 30)
    assert running.refresh().state == "running"
    release.touch()
    assert queued.wait(60) == "succeeded" and running.wait(60) == "succeeded"
    assert _ran(out) == [(queued.id, "owner")]


def owner_advert(peer) -> dict:
    """The peer's advert as its HELLO gives it (a puller sends its own; here one that fits)."""
    from gpulayer.protocol import handshake
    from gpulayer.transport import blocking
    import socket

    with socket.create_connection(("127.0.0.1", peer.port), timeout=10) as sock:
        conn = blocking.BlockingConnection(sock)
        return handshake.client_handshake(conn, peer.key.encode(), "reader")["advert"]


def test_a_moved_job_is_found_on_its_puller_while_its_owner_is_down(cluster_of_jobs, tmp_path):
    """The id names the owner, killed (kill -9) after the job moved: another process re-attaches by id and
    follows the log to the end, found on the puller by asking the peers it knows over the secure channel."""
    from gpulayer.client import Client
    from gpulayer.client.jobs import Jobs

    owner = cluster_of_jobs("owner")
    jobs = cluster_of_jobs.jobs
    hold, release = tmp_path / "hold", tmp_path / "release"
    blocker = jobs.submit(_blocker(hold), None, _cpu(peer="owner"))
    wait_until(lambda: blocker.refresh().state == "running", 60)
    job = jobs.submit(["sh", "-c", f"echo first; while [ ! -e {release} ]; do sleep 0.05; done; echo last"],
                      None, _cpu())
    cluster_of_jobs("puller")
    wait_until(lambda: (job.refresh().state, job.peer) == ("running", "puller"), 60)
    owner.kill()
    hold.touch()
    client = Client(key=cluster_of_jobs.key.encode(), echo_output=False, discovery_timeout=3.0)
    try:
        again = Jobs(client).job(job.id)  # a fresh process's view: nothing cached
        assert (again.state, again.peer) == ("running", "puller")
        release.touch()
        assert again.logs(follow=True).split() == ["first", "last"]
        assert again.wait(60) == "succeeded"
    finally:
        client.close()


def test_a_queued_job_whose_blob_a_running_job_wrote_into_moves_with_its_files_as_shipped(cluster_of_jobs, tmp_path):
    """The running job's file is the stored blob (ADR 0025); it rewrites it after the second job of the same folder
    was queued (a copy). The owner's store then lacks that blob intact, so it sends the queued job's own copy,
    which the puller checks against its digest: the job moves, and runs with the file as shipped."""
    cluster_of_jobs("owner")
    jobs = cluster_of_jobs.jobs
    project, go, release, out = tmp_path / "project", tmp_path / "go", tmp_path / "release", tmp_path / "out"
    project.mkdir()
    (project / "config.txt").write_text("lr=0.1\n")
    rewrite = f"{_held(go)}; echo lr=9.9 > config.txt; echo rewritten > {out}; {_held(release)}"
    first = jobs.submit(["sh", "-c", rewrite], project, _cpu(peer="owner"))
    wait_until(lambda: first.refresh().state == "running", 60)
    queued = jobs.submit(["sh", "-c", f"cat config.txt >> {out}; echo $GPULAYER_PEER_NAME >> {out}"], project, _cpu())
    go.touch()
    wait_until(lambda: out.exists(), 60)
    cluster_of_jobs("puller")
    try:
        assert queued.wait(60) == "succeeded"
        assert out.read_text().splitlines() == ["rewritten", "lr=0.1", "puller"]
    finally:
        release.touch()
    assert first.wait(60) == "succeeded"


def test_an_arriving_job_whose_owner_never_comes_back_is_lost_on_the_puller_and_never_runs(cluster_of_jobs,
                                                                                            tmp_path):
    """The owner dies (kill -9) right after it recorded the job moved, before the puller heard: past the
    bound the puller records the job lost, naming the owner, deletes its folder and never runs it."""
    owner = cluster_of_jobs("owner", env={"GPULAYER_TEST_KILL_AT": "job-moved"})
    jobs = cluster_of_jobs.jobs
    release, out = tmp_path / "release", tmp_path / "out"
    blocker = jobs.submit(_blocker(release), None, _cpu(peer="owner"))
    wait_until(lambda: blocker.refresh().state == "running", 60)
    job = jobs.submit(_writes(out), None, _cpu())
    puller = cluster_of_jobs("puller", env={"GPULAYER_PULL_ARRIVING_S": "2"})
    wait_until(lambda: not owner.alive(), 60)
    release.touch()
    puller_state = tmp_path / "puller-state"
    assert _state_in(tmp_path / "owner-state", job.id) == "moved"
    wait_until(lambda: _state_in(puller_state, job.id) == "lost", 60)
    lost = jobs.job(job.id)  # the owner is down: found on the puller
    assert lost.peer == "puller" and lost.state == "lost"
    assert f"{job.id.split('-')[0]}-*" in lost.reason and "may have run there" in lost.reason
    assert not [p for p in puller_state.rglob(job.id)]  # its folder is deleted
    assert puller.alive() and not out.exists()


def _hand_over_faults(actions: list[str]):
    """The proxy's hook: the next of `actions` hits each JOB_TAKE "commit" that follows a "need" on its
    connection (a hand-over's own commit, not one asked again for an arriving job): "cut" resets the
    connection before the commit passes, "answer" lets it pass and resets before the owner's answer. Records
    are told apart by size (ids of one length): a JOB_PULL carries an advert (over 200 bytes), a "need" is a
    few bytes longer than a "commit"."""
    import socket
    import struct

    sizes: dict[str, int] = {}

    def reset(pipe) -> None:
        pipe.state["gone"] = True
        for sock in pipe.sources.values():
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        for sock in pipe.sources.values():
            sock.shutdown(socket.SHUT_RDWR)

    def hook(pipe, direction: str, record: bytes) -> None:
        state = pipe.state
        if state.get("gone"):
            return
        if direction == "c2p" and len(record) >= 200:
            state["pulls"] = True  # a puller's connection (gossip's carries one shorter record)
        elif direction == "c2p" and state.get("pulls"):
            need = sizes.setdefault("need", len(record)) <= len(record)  # the first take step is a "need"
            if need:
                state["after_need"] = True
            elif state.pop("after_need", False) and actions:
                state["action"] = action = actions.pop(0)
                if action == "cut":
                    return reset(pipe)
                state["drop_answer"] = True
        elif direction == "p2c" and state.pop("drop_answer", False):
            return reset(pipe)
        pipe.send(direction, record)

    return hook


def test_hand_overs_cut_or_with_their_answer_lost_run_each_job_once(cluster_of_jobs, tmp_path):
    """The puller reaches the owner through a relay (mDNS off, the relay as its gossip seed), which cuts a
    hand-over before the commit, then drops the owner's answer to the next commit: every job runs exactly
    once, none is lost, and the relay did act on each. (Gossip gives the puller the owner's own address a
    few seconds later: the faults hit the first hand-overs, which come at once.)"""
    from gpulayer.client import Client
    from gpulayer.client.jobs import Jobs
    import socket

    from test_secure_channel import Pipe, Proxy

    class FromElsewhere(Proxy):
        """Connects to the owner from 127.0.0.2: the puller's port that the owner's gossip learns from the
        relayed PEERS (at 127.0.0.2) does not answer, so the owner's address never reaches the puller."""

        def serve(self, sock: socket.socket) -> None:
            upstream = socket.create_connection(self.target, timeout=5, source_address=("127.0.0.2", 0))
            upstream.settimeout(None)
            self.pipes.append(Pipe(sock, upstream, self.hook))

    owner = cluster_of_jobs("owner", "--no-mdns")
    client = Client(key=cluster_of_jobs.key.encode(), peers=owner.address, mdns=False, echo_output=False)
    jobs = Jobs(client)
    release, out = tmp_path / "release", tmp_path / "out"
    blocker = jobs.submit(_blocker(release), None, _cpu(peer="owner"))
    wait_until(lambda: blocker.refresh().state == "running", 60)
    every = [jobs.submit(_writes(out), None, _cpu()) for _ in range(6)]
    actions = ["cut", "answer"]
    proxy = FromElsewhere(("127.0.0.1", owner.port), _hand_over_faults(actions))
    try:
        cluster_of_jobs("puller", "--no-mdns", "--seed", proxy.address)
        wait_until(lambda: len(_ran(out)) >= len(every), 90)  # all pulled while the owner's slot is held
        assert not actions  # each fault hit a hand-over
        release.touch()
        assert blocker.wait(60) == "succeeded"
        assert all(j.wait(60) == "succeeded" for j in every)
    finally:
        release.touch()
        proxy.close()
        client.close()
    ran = _ran(out)
    assert sorted(job_id for job_id, _ in ran) == sorted(j.id for j in every)  # each exactly once
    assert "puller" in {peer for _, peer in ran}
    assert {a for p in proxy.pipes for a in [p.state.get("action")] if a} == {"cut", "answer"}
