"""Leases (ADR 0013) against real peers on loopback: a warm worker lent to a submitter runs its tasks
on the submitter's own connection, with the semantics of tasks through the peer: output, exceptions,
timeouts, cancels, worker deaths, fairness to other submitters, the idle end, and hostile input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import CancelledError
from pathlib import Path

import pytest

from gpulayer import serialization
from gpulayer.client import Client
from gpulayer.errors import TaskTimeout, WorkerDied
from gpulayer.protocol import messages
from support import authenticated, solo_peer, wait_until


@pytest.fixture(scope="module")
def solo(peer_factory):
    """One single-slot peer and a submitter of its cluster."""
    yield from solo_peer(peer_factory, "lender")


def leased(client: Client, peer):
    """The client's lease of `peer`, once it has one (a few tasks in)."""
    for _ in range(200):
        lease = client.leases.by_peer.get(peer.peer_id)
        if lease is not None and not lease.closed:
            return lease
        client.submit(os.getpid, req=_cpu()).result(30)
        time.sleep(0.01)
    return None


def _cpu():
    from gpulayer.matching import Requirements

    return Requirements.build(accelerator="cpu")


def status(client: Client, peer) -> dict:
    return client.connection_to(peer.peer_id, [("127.0.0.1", peer.port)]).request(messages.status_request(), 10)


def run(client: Client, fn, *args, **options):
    return client.submit(fn, args, req=_cpu(), **options)


def test_a_loop_of_tasks_runs_on_a_lease_with_the_worker_answering_directly(solo):
    peer, client = solo
    assert leased(client, peer) is not None
    pids = {run(client, os.getpid).result(30) for _ in range(50)}
    assert len(pids) == 1  # the leased warm worker ran them all
    devices = status(client, peer)["devices"]
    assert devices[0]["busy"] and devices[0]["pid"] in pids  # its slot counts as busy while it is lent
    futures = [run(client, pow, 2, i) for i in range(500)]  # pipelined on the lease
    assert [f.result(30) for f in futures] == [2 ** i for i in range(500)]
    done = status(client, peer)["done"]
    wait_until(lambda: not status(client, peer)["devices"][0]["busy"], 10)  # it ends when idle (0.5 s)
    assert status(client, peer)["done"] >= done + 500  # the peer counts the tasks the lease ran


def test_output_exceptions_and_big_arguments_behave_as_through_the_peer(solo):
    peer, client = solo
    assert leased(client, peer) is not None

    def noisy(n):
        print("out", n)
        os.write(1, b"fd %d\n" % n)  # past sys.stdout, as C code writes
        subprocess.run(["sh", "-c", f"echo child {n}; echo child-err {n} >&2"], check=True)
        print("err", n, file=sys.stderr)
        return n

    future = run(client, noisy, 7)
    assert future.result(30) == 7
    assert future.stdout == "out 7\nfd 7\nchild 7\n" and future.stderr == "child-err 7\nerr 7\n"
    assert "child 7" not in peer.log()

    def leave_a_child(n):  # it writes after the lease ended: to the peer's log, as through the peer
        subprocess.Popen(["sh", "-c", f"sleep 1.5; echo late child {n}"])
        return n

    assert run(client, leave_a_child, 8).result(30) == 8
    wait_until(lambda: "late child 8" in peer.log(), 15)

    def fail():
        raise KeyError("on the lease")

    with pytest.raises(KeyError, match="on the lease") as info:
        run(client, fail).result(30)
    assert 'raise KeyError("on the lease")' in str(info.value.__cause__)  # the remote traceback, with source
    big = bytes(range(256)) * 4096  # 1 MiB: through the peer, by shared memory
    assert run(client, len, big).result(30) == len(big)
    assert run(client, os.getpid).result(30) == run(client, os.getpid).result(30)


def test_leases_one_after_another_leave_no_descriptors_behind(solo):
    """Each lease makes pipes for the worker's descriptors 1 and 2 and gives them back when it ends."""
    peer, client = solo

    def open_descriptors():
        return os.getpid(), len(os.listdir("/proc/self/fd"))

    seen = []
    for _ in range(3):
        assert leased(client, peer) is not None
        seen.append(run(client, open_descriptors).result(30))
        wait_until(lambda: not client.leases.by_peer.get(peer.peer_id), 10)  # it ended (idle)
    assert len(set(seen)) == 1, seen  # the same worker, with as many descriptors open each time


def test_a_timeout_on_a_lease_kills_the_worker_and_the_next_task_runs(solo):
    peer, client = solo
    assert leased(client, peer) is not None
    before = run(client, os.getpid).result(30)
    with pytest.raises(TaskTimeout, match="timeout of 0.5 s"):
        run(client, time.sleep, 30, timeout=0.5).result(30)
    wait_until(lambda: not _alive(before), 15)  # the peer killed the leased worker
    assert run(client, os.getpid).result(30) != before


def mark_then_sleep(started: str, seconds: float, finished: str | None = None) -> None:
    """A leased task that writes its worker's pid to `started`, sleeps, then writes `finished` (if named)."""
    Path(started).write_text(str(os.getpid()))
    time.sleep(seconds)
    if finished:
        Path(finished).write_text(str(os.getpid()))


def test_cancelling_a_task_that_runs_on_a_lease_stops_it(solo, tmp_path):
    peer, client = solo
    lease = leased(client, peer)
    assert lease is not None
    started, marker = tmp_path / "started", tmp_path / "finished"
    future = run(client, mark_then_sleep, str(started), 3, str(marker))
    killed = int(wait_until(lambda: started.exists() and started.read_text(), 30))
    worker = run(client, os.getpid)  # kept back behind it (submitted with it, it could run first)
    behind = worker._task.task_id
    assert future.cancel()
    with pytest.raises(CancelledError):
        future.result(1)
    assert worker.result(30) != killed  # placed again: it did not start on the killed worker
    # never written to the worker, which ends: had it been, its fate would hang on whether LEASE_END is read
    # before the connection resets (the worker exits with it unread), and it could fail as WorkerDied
    assert lease.sent_up_to < behind
    wait_until(lambda: not _alive(killed), 15)
    assert not marker.exists()


def test_a_task_cancelled_at_the_worker_before_it_starts_never_runs_and_the_lease_goes_on(solo, tmp_path):
    peer, client = solo
    assert leased(client, peer) is not None
    started, skipped = tmp_path / "started", tmp_path / "skipped"
    first = run(client, time.sleep, 0.3)  # written at once; the two behind it go together when it answers
    running = run(client, mark_then_sleep, str(started), 1)
    queued = run(client, mark_then_sleep, str(skipped), 0)  # at the worker, behind the one that runs
    pid = int(wait_until(lambda: started.exists() and started.read_text(), 30))
    later = [run(client, pow, 3, i) for i in range(5)]  # kept back while the worker is busy
    assert queued.cancel()
    # its answer (ERROR cancelled) is not a stop: the worker goes on, and what was kept back is sent
    assert [f.result(30) for f in later] == [3 ** i for i in range(5)]
    assert first.result(30) is None and running.result(30) is None
    assert not skipped.exists() and run(client, os.getpid).result(30) == pid  # the same worker


def test_a_worker_killed_mid_lease_fails_one_task_and_the_others_are_placed_again(solo, tmp_path):
    peer, client = solo
    assert leased(client, peer) is not None
    started = tmp_path / "started"
    first = run(client, mark_then_sleep, str(started), 60, retries=0)
    rest = [run(client, pow, 3, i) for i in range(20)]
    os.kill(int(wait_until(lambda: started.exists() and started.read_text(), 30)), signal.SIGKILL)
    with pytest.raises(WorkerDied):
        first.result(30)
    assert [f.result(30) for f in rest] == [3 ** i for i in range(20)]


def test_another_submitter_gets_the_slot_while_a_lease_holds_it(solo, tmp_path):
    peer, client = solo
    assert leased(client, peer) is not None
    stop = time.monotonic() + 20
    script = tmp_path / "other.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from gpulayer.client import Client
        from gpulayer.matching import Requirements
        client = Client(key={peer.key!r}.encode(), echo_output=False)
        started = time.monotonic()
        assert client.submit(abs, (-5,), req=Requirements.build(accelerator="cpu")).result(30) == 5
        print(time.monotonic() - started)
        client.close()
    """))
    other = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "GPULAYER_LEASES": "0"})
    while other.poll() is None and time.monotonic() < stop:  # keep the lease busy meanwhile
        run(client, time.sleep, 0.05).result(30)
    out, _ = other.communicate(timeout=30)
    assert other.returncode == 0
    assert float(out) < 10  # it did not wait for the end of our stream of tasks


def test_a_peer_that_stops_lets_the_leased_task_finish_and_ends_the_lease(peer_factory, tmp_path):
    for peer, client in solo_peer(peer_factory, "stopping"):
        assert leased(client, peer) is not None
        started = tmp_path / "started"
        running = run(client, mark_then_sleep, str(started), 1.0)
        wait_until(started.exists, 30)
        # a clean stop: it drains what runs, then exits (0); a peer still there 10 s on (ten times the
        # task's length) is killed, and stop() gives None
        assert peer.stop(timeout=10) == 0
        assert running.result(10) is None


def test_with_leases_off_every_task_goes_through_the_peer(peer_factory, monkeypatch):
    monkeypatch.setenv("GPULAYER_LEASES", "0")
    for peer, client in solo_peer(peer_factory, "no-lease"):
        for _ in range(30):
            run(client, abs, -1).result(30)
        assert not client.leases.by_peer


def test_hostile_input_on_a_leased_connection_gets_clear_errors(solo):
    peer, client = solo
    wait_until(lambda: not status(client, peer)["devices"][0]["busy"], 10)
    conn = authenticated(peer, "hostile1234")
    try:
        for bad in [messages.lease(1, {"acc": "cuda"}, 1.0), messages.lease(1, _cpu().to_wire(), float("nan")),
                    {**messages.lease(1, _cpu().to_wire(), 1.0), "id": "one"}]:
            conn.send(bad)
            refused = conn.recv(time.monotonic() + 10)[0]  # the connection stays the peer's
            assert refused["t"] == messages.ERROR and refused["code"] in ("no-lease", "bad-request"), refused
        conn.send(messages.lease(2, _cpu().to_wire(), 1.0))
        granted = conn.recv(time.monotonic() + 10)[0]
        assert (granted["t"], granted["id"]) == (messages.LEASE, 2)
        fn, args = serialization.dumps(abs)[0], serialization.dumps(((-3,), {}))[0]
        for bad in [{"t": messages.SUBMIT, "id": "x", "fn": fn, "args": args},
                    {"t": messages.SUBMIT, "id": 5, "fn": "text", "args": args},
                    {**messages.submit(6, fn, args, {}, float("nan"), "abs")},
                    {**messages.submit(7, fn, args, {}, None, "abs"), "keep": "a" * 32},
                    messages.submit(8, fn, args, {}, None, "abs", env={"LD_PRELOAD": "x"})]:
            conn.send(bad)
            reply = conn.recv(time.monotonic() + 10)[0]
            assert (reply["t"], reply["code"]) == (messages.ERROR, "bad-request")
        conn.send(messages.submit(9, fn, args, {}, None, "abs"))
        reply, _ = conn.recv(time.monotonic() + 10)
        assert reply["t"] == messages.RESULT and serialization.loads(reply["data"]) == 3
        conn.send(messages.submit(9, fn, args, {}, None, "abs"))  # an id used already
        assert conn.recv(time.monotonic() + 10)[0]["code"] == "bad-request"
        conn.send({"t": messages.ACTOR})  # not a message of a lease: it ends
        while (msg := conn.recv(time.monotonic() + 10)[0])["t"] != messages.LEASE_END:
            assert msg["t"] == messages.ERROR
    finally:
        conn.close()
    wait_until(lambda: not status(client, peer)["devices"][0]["busy"], 10)  # the worker serves its peer again


def _answer(conn) -> dict:
    """The next answer on a raw connection, past the peer's offer of a local link."""
    for _ in range(8):
        msg = conn.recv(time.monotonic() + 10)[0]
        if msg["t"] != messages.LOCAL:
            return msg
    raise AssertionError("no answer among 8 messages")


def test_the_peer_and_a_leased_worker_refuse_a_bad_submit_for_the_same_reason(solo):
    """One check of SUBMIT on both paths: the same malformed task gets the same reason from the peer
    (a REJECT) and from a leased worker (an ERROR), a task id that is not a positive integer included."""
    peer, client = solo
    fn, args = serialization.dumps(abs)[0], serialization.dumps(((-3,), {}))[0]
    bad = [{**messages.submit(1, fn, args, {}, None, "abs"), "id": task_id} for task_id in (0, -4, True)] + [
        {**messages.submit(2, fn, args, {}, None, "abs"), "fn": "text"},
        messages.submit(3, fn, args, {}, float("nan"), "abs"),
        {**messages.submit(4, fn, args, {}, None, "abs"), "keep": "abc"},
        {**messages.submit(5, fn, args, {}, None, "abs"), "refs": "nope"}]
    through_peer = authenticated(peer, "peerpath1234")
    wait_until(lambda: not status(client, peer)["devices"][0]["busy"], 10)
    on_lease = authenticated(peer, "leasepath123")
    try:
        on_lease.send(messages.lease(1, _cpu().to_wire(), 1.0))
        assert _answer(on_lease)["t"] == messages.LEASE
        for msg in bad:
            through_peer.send(dict(msg))
            rejected = _answer(through_peer)
            on_lease.send(dict(msg))
            refused = _answer(on_lease)
            assert (rejected["t"], rejected.get("code"), refused["t"], refused.get("code")) == \
                (messages.REJECT, "bad-request", messages.ERROR, "bad-request"), (msg, rejected, refused)
            assert rejected["message"] == refused["message"], msg
    finally:
        through_peer.close()
        on_lease.close()
    wait_until(lambda: not status(client, peer)["devices"][0]["busy"], 10)
    assert run(client, abs, -4).result(30) == 4


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
