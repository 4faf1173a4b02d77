"""Actors (issue 11) against real peers on loopback: state, order, concurrency, failures, lifetime,
isolation from tasks, handles passed on, and hostile input aimed at the actor messages."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np
import pytest

import gpulayer as gl
from gpulayer import serialization
from gpulayer.client.pool import DOWN_BACKOFF
from gpulayer.errors import TaskRejected, TaskTimeout
from gpulayer.peer_table import format_peers
from gpulayer.protocol import handshake, messages
from gpulayer.transport import blocking, shm
from support import key_config, wait_until, write_override

GRACE = "1"  # GPULAYER_ACTOR_GRACE of the peers here: seconds an actor outlives its submitter


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory, cluster_key):
    """A config folder holding the cluster key file, as `gpulayer key init` writes it: the peers' tasks
    (whose environment never holds the key) read it to call actors whose handles they were given."""
    return key_config(tmp_path_factory.mktemp("config"), cluster_key)


@pytest.fixture(scope="module")
def peer(peer_factory, cluster_key, key_dir, gl_client):
    """A two-slot CPU peer of the module's cluster, and gl's client set to that cluster."""
    return peer_factory("home", "--concurrency", "2", key=cluster_key,
                        env={"GPULAYER_ACTOR_GRACE": GRACE, "XDG_CONFIG_HOME": key_dir})


def status(peer) -> dict:
    return gl.default_client().connection_to(peer.peer_id, [("127.0.0.1", peer.port)]).request(
        messages.status_request(), 10)


def actors_on(peer) -> list[dict]:
    return status(peer)["actors"]


@gl.remote(accelerator="cpu")
class Recorder:
    """Keeps what it was given, in order."""

    def __init__(self, first=None):
        self.seen = [] if first is None else [first]

    def record(self, value):
        self.seen.append(value)
        return len(self.seen)

    def history(self):
        return self.seen

    def pid(self):
        return os.getpid()

    def fail(self, message):
        print("about to fail", flush=True)
        raise ValueError(message)

    def sleep(self, seconds, started=None):
        """Sleep; first create the file `started`, if named, so that a test knows the call runs."""
        if started:
            open(started, "w").close()
        time.sleep(seconds)
        return seconds

    def set_global(self):
        globals()["LEAKED"] = "actor state"
        os.environ["GL_ACTOR_LEAK"] = "1"
        return os.getpid()


def test_state_is_kept_across_1000_calls_in_order(peer):
    with Recorder("start") as rec:
        assert [rec.record(i) for i in range(300)] == list(range(2, 302))
        futures = [rec.record.submit(i) for i in range(300, 1000)]
        assert [f.result(60) for f in futures] == list(range(302, 1002))
        assert rec.history() == ["start", *range(1000)]
        assert rec.alive
    assert not rec.alive
    with pytest.raises(gl.ActorDied, match="closed"):
        rec.history()


def test_concurrent_callers_share_one_actor_and_each_sees_its_order(peer):
    rec = Recorder()
    results: dict[int, list[int]] = {}

    def caller(n):
        results[n] = [rec.record((n, i)) for i in range(100)]

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    seen = rec.history()
    assert len(seen) == 400
    for n in range(4):
        assert results[n] == sorted(results[n])  # each caller's calls ran in the order it sent them
        assert [v for v in seen if v[0] == n] == [(n, i) for i in range(100)]
    rec.close()


@gl.remote(accelerator="cpu", max_concurrency=3)
class Gate:
    """Calls that wait for each other: they pass only when `parties` run at once."""

    def __init__(self, parties):
        self.barrier = threading.Barrier(parties, timeout=20)
        self.active = self.most = 0
        self.lock = threading.Lock()

    def meet(self):
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            return self.barrier.wait()
        finally:
            with self.lock:
                self.active -= 1

    def step(self, seconds):
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        time.sleep(seconds)
        with self.lock:
            self.active -= 1

    def peak(self):
        return self.most


def test_max_concurrency_runs_that_many_calls_at_once(peer):
    with Gate(3) as gate:
        futures = [gate.meet.submit() for _ in range(3)]
        assert sorted(f.result(30) for f in futures) == [0, 1, 2]  # all three met at the barrier
        assert gate.peak() == 3
    with Gate.options(max_concurrency=1)(1) as one:
        for f in [one.step.submit(0.02) for _ in range(10)]:
            f.result(30)
        assert one.peak() == 1


def test_an_exception_comes_back_with_its_traceback_and_the_actor_lives_on(peer):
    with Recorder() as rec:
        rec.record("kept")
        future = rec.fail.submit("bad input")
        with pytest.raises(ValueError, match="bad input") as info:
            future.result(30)
        assert "in fail" in str(info.value.__cause__)
        assert future.stdout == "about to fail\n"
        assert rec.history() == ["kept"]


def test_a_call_past_its_timeout_stops_the_actor_and_a_cancelled_call_never_runs(peer):
    rec = Recorder()
    slow = rec.sleep.submit(1.0)
    queued = rec.record.submit("cancelled")
    assert queued.cancel()
    assert slow.result(30) == 1.0
    assert rec.history() == []  # the cancelled call never ran
    with pytest.raises(CancelledError):
        queued.result()
    with pytest.raises(TaskTimeout):
        rec.sleep.options(timeout=0.3)(30)
    with pytest.raises(gl.ActorDied, match="timeout"):
        rec.history()
    wait_until(lambda: not actors_on(peer), 20)


def test_kill_9_of_the_worker_gives_actor_died_and_restarts_re_create_it(peer):
    rec = Recorder()
    pid = rec.pid()
    pending = rec.sleep.submit(30)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(gl.ActorDied, match="died"):
        pending.result(30)
    with pytest.raises(gl.ActorDied):
        rec.history()
    assert gl.actors() == []

    again = Recorder.options(restarts=1)("first")
    again.record("lost")
    os.kill(again.pid(), signal.SIGKILL)
    wait_until(lambda: not again.alive, 20)
    with pytest.warns(RuntimeWarning, match="re-created"):
        assert again.history() == ["first"]  # a fresh instance, from the constructor's arguments
    assert again.pid() != pid
    os.kill(again.pid(), signal.SIGKILL)
    wait_until(lambda: not again.alive, 20)
    with pytest.raises(gl.ActorDied):  # no restarts left
        again.history()


def test_tasks_never_land_in_an_actors_slot_and_its_state_never_leaks(peer):
    rec = Recorder()
    actor_pid = rec.set_global()
    rows = status(peer)["devices"]
    assert sum(row["busy"] for row in rows) == 1 and actor_pid in [row["pid"] for row in rows]

    def probe():
        return os.getpid(), "LEAKED" in globals(), os.environ.get("GL_ACTOR_LEAK")

    for pid, leaked, env in [gl.run(probe) for _ in range(20)]:
        assert pid != actor_pid and not leaked and env is None
    rec.close()
    wait_until(lambda: all(not row["busy"] and row["pid"] for row in status(peer)["devices"]), 20)
    pids = {gl.submit(probe).result(30)[0] for _ in range(2)}
    for pid, leaked, env in [gl.run(probe) for _ in range(10)]:
        assert pid != actor_pid and not leaked and env is None
    assert actor_pid not in pids


def call_it(handle, value):
    """A task that calls an actor whose handle it was given (with its own cluster key: the key file)."""
    return handle.record(value), os.getpid()


@gl.remote(accelerator="cpu")
class Relay:
    def __init__(self, target):
        self.target = target

    def forward(self, value):
        return self.target.record(value)


def test_handles_passed_to_a_task_and_to_another_actor_call_the_same_actor(peer):
    with Recorder() as rec:
        rec.record("here")
        length, task_pid = gl.run(call_it, rec, "from a task")
        assert length == 2 and task_pid != rec.pid()
        with Relay(rec) as relay:
            assert relay.forward("from an actor") == 3
        assert rec.history() == ["here", "from a task", "from an actor"]
        assert [row["class"] for row in gl.actors()] == ["Recorder"]
        assert wait_until(lambda: gl.actors()[0]["calls"] >= 5, 10)  # a direct call is counted just after its reply


def test_gl_actors_and_the_peer_table_show_the_slots_actors_hold(peer):
    with Recorder() as rec:
        rec.record("one")
        expected = [{"actor": rec.actor_id, "class": "Recorder", "peer": "home", "address": f"127.0.0.1:{peer.port}",
                     "slot": rec.slot, "calls": 1, "pending": 0}]
        wait_until(lambda: gl.actors() == expected, 10)  # the count of calls served comes just after the reply
        line = next(line for line in format_peers(gl.peers(wait=0.2)).splitlines() if line.startswith("home"))
        assert "1/2 (1 held by actors)" in line
    assert gl.actors() == []


SUBMITTER = textwrap.dedent("""
    import sys, time
    import gpulayer as gl

    @gl.remote(accelerator="cpu")
    class Held:
        def ping(self):
            return "pong"

    held = Held()
    assert held.ping() == "pong"
    print(held.actor_id, flush=True)
    if sys.argv[1] == "wait":
        time.sleep(600)
""")


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_the_submitter_going_away_frees_the_slot(peer, cluster_key, tmp_path, how):
    script = tmp_path / "submitter.py"
    script.write_text(SUBMITTER)
    proc = subprocess.Popen([sys.executable, str(script), "wait" if how == "killed" else "exit"],
                            env={**os.environ, "GPULAYER_KEY": cluster_key}, stdout=subprocess.PIPE, text=True)
    try:
        actor_id = proc.stdout.readline().strip()
        assert len(actor_id) == messages.ACTOR_ID_HEX
        if how == "killed":
            assert [row["actor"] for row in actors_on(peer)] == [actor_id[:8]]
            proc.kill()
        proc.wait(60)
        wait_until(lambda: not actors_on(peer), 20)
        if how == "killed":
            assert "was gone for 1 s" in peer.log()
        else:
            assert "closed by its submitter" in peer.log()
    finally:
        proc.kill()
        proc.wait()


def raw_connection(peer, key: str, client_id: str) -> blocking.BlockingConnection:
    conn = blocking.BlockingConnection(socket.create_connection(("127.0.0.1", peer.port), timeout=10))
    handshake.client_handshake(conn, key.encode(), client_id)
    return conn


def answer(conn: blocking.BlockingConnection, msg: dict) -> dict:
    conn.send(msg)
    while True:
        reply, _ = conn.recv(time.monotonic() + 20)
        if reply["t"] != messages.PONG:
            return reply


def test_hostile_actor_messages_get_clear_errors_and_the_actor_serves_on(peer, cluster_key):
    rec = Recorder()
    rec.record("before")
    args = serialization.dumps(((), {}))[0]
    conn = raw_connection(peer, cluster_key, "0123456789ab")
    try:
        unknown = answer(conn, messages.call(1, "f" * 32, "history", args, None))
        assert (unknown["t"], unknown["code"], unknown["id"]) == (messages.ERROR, "no-actor", 1)
        for bad in [messages.call(2, "not-an-id", "history", args, None),
                    messages.call(3, rec.actor_id, "__class__", args, None),
                    messages.call(4, rec.actor_id, "history", "not bytes", None),  # type: ignore[arg-type]
                    messages.call(5, rec.actor_id, "history", args, -1),
                    {"t": messages.CALL, "id": 6, "actor": rec.actor_id, "method": ["history"], "args": args}]:
            reply = answer(conn, bad)
            assert (reply["t"], reply["code"], reply["id"]) == (messages.ERROR, "bad-request", bad["id"])
        no_id = answer(conn, {"t": messages.CALL, "id": "x", "actor": rec.actor_id})
        assert (no_id["code"], no_id["id"]) == ("bad-request", None)
        refused = answer(conn, messages.close(7, rec.actor_id))  # another submitter may not close it
        assert (refused["t"], refused["code"]) == (messages.ERROR, "not-owner")
        for conc in (0, 65, "2", True):
            made = answer(conn, messages.actor(8, serialization.dumps(dict)[0], args, {}, None, "dict", conc))
            assert (made["t"], made["code"]) == (messages.REJECT, "bad-request")
        # with its id, another key holder may call it (that is how handles passed to tasks work)
        called = answer(conn, messages.call(9, rec.actor_id, "record", serialization.dumps((("raw",), {}))[0], None))
        assert called["t"] == messages.RESULT and serialization.loads(called["data"]) == 2
    finally:
        conn.close()
    assert rec.history() == ["before", "raw"]
    rec.close()
    other = Recorder()
    with pytest.raises((TaskRejected, gl.RemoteError), match="not-owner"):
        gl.run(close_it, other)  # a task holding a copy of the handle
    assert other.history() == []
    other.close()


def close_it(handle):
    handle.close()


def test_kill_9_of_the_peer_gives_actor_died_and_restarts_move_it(peer_factory, cluster_key, tmp_path_factory,
                                                                  peer):
    override = write_override(tmp_path_factory.mktemp("gpus") / "cuda.json", "cuda")
    gpus = {name: peer_factory(name, "--concurrency", "1", "--advertise-override", str(override), key=cluster_key)
            for name in ("gpu1", "gpu2")}
    Worker = Recorder.options(accelerator="cuda", restarts=1)
    rec = Worker("first")
    holder = gpus[rec.peer]
    started = tmp_path_factory.mktemp("calls") / "started"
    pending = rec.sleep.submit(30, str(started))
    wait_until(started.exists, 30)
    holder.kill()
    with pytest.raises(gl.ActorDied):
        pending.result(30)
    with pytest.warns(RuntimeWarning, match="re-created on peer gpu"):
        assert rec.history() == ["first"]
    assert rec.peer != holder.name
    rec.close()
    plain = Recorder.options(accelerator="cuda")()
    gpus[plain.peer].kill()
    with pytest.raises(gl.ActorDied, match="unreachable|lost"):
        plain.history()


@pytest.mark.parametrize("script, framework", [("serve.py", "torch"), ("serve_mlx.py", "mlx.core")])
def test_the_inference_examples_serve_many_calls_from_one_model(peer, cluster_key, script, framework):
    pytest.importorskip(framework)
    out = subprocess.run([sys.executable, f"examples/actor_inference/{script}", "--accelerator", "cpu",
                          "--calls", "40"], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=240, env={**os.environ, "GPULAYER_KEY": cluster_key})
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"actor on peer home \(.*cpu\): (80|40) calls served", out.stdout), out.stdout


def test_a_peer_that_stops_ends_its_actors_without_waiting_for_them(peer_factory, cluster_key, peer):
    stopping = peer_factory("stopping", "--concurrency", "1", key=cluster_key)
    rec = Recorder.options(peer="stopping")()
    pending = rec.sleep.submit(60)
    # SIGTERM: drains tasks, not actors; a peer that waited for the 60 s call would be killed at 20 s (None)
    assert stopping.stop(timeout=20) == 0
    with pytest.raises(gl.ActorDied, match="shut down"):
        pending.result(30)
    with pytest.raises(gl.ActorDied):
        rec.history()


# ---- direct calls: the peer hands the connection to the actor's worker (ADR 0012) ---------------

@pytest.fixture()
def frozen(peer):
    """A context that stops the peer process (SIGSTOP) while it lasts: only its workers run."""
    @contextlib.contextmanager
    def freeze():
        os.kill(peer.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
    return freeze


def test_calls_go_straight_to_the_actors_worker_while_its_peer_is_frozen(peer, frozen):
    big = np.arange(shm.SHM_MIN // 8 * 2, dtype=np.int64)  # over the shared-memory threshold
    with Recorder() as rec:
        rec.record("through the connection the peer handed over")
        with frozen():
            assert [rec.record.submit(i).result(10) for i in range(50)] == list(range(2, 52))
            future = rec.fail.submit("still direct")
            with pytest.raises(ValueError, match="still direct"):
                future.result(10)
            assert future.stdout == "about to fail\n"  # a direct call's output comes on its connection
        # big arguments take the peer's way (shared memory on one host), and no call overtakes another
        mixed = [rec.record.submit(big if i % 2 else i) for i in range(8)]
        assert [f.result(30) for f in mixed] == list(range(52, 60))
        assert rec.history()[-8:-7] == [0] and np.array_equal(rec.history()[-7], big)
        assert wait_until(lambda: gl.actors()[0]["calls"] >= 60, 10)  # the worker reports direct calls


def test_a_peer_silent_for_three_heartbeats_ends_the_direct_calls_in_flight(peer, frozen, gl_client):
    rec = Recorder()
    rec.record("direct")
    pending = rec.sleep.submit(30)
    with frozen():
        with pytest.raises(gl.ActorDied, match="silent"):
            pending.result(20)  # 3 heartbeats of 1 s, and a little: long before the 30 s call could end
    rec.close()  # the actor itself lived on: its submitter connected again
    assert not actors_on(peer)
    # the silent peer is skipped for DOWN_BACKOFF: the test ends when it is placed on again, so that the
    # next one finds the module's peer as it was
    wait_until(lambda: gl_client.directory.get(peer.peer_id).up, 3 * DOWN_BACKOFF)


def test_with_direct_calls_off_every_call_goes_through_the_peer(peer, frozen, monkeypatch):
    monkeypatch.setenv("GPULAYER_DIRECT_CALLS", "0")
    with Recorder() as rec:
        rec.record("first")
        with frozen():
            waiting = rec.record.submit("second")
            with pytest.raises(FutureTimeout):
                waiting.result(1.0)  # the frozen peer holds it
        assert waiting.result(20) == 2


def direct_connection(peer, key: str, actor_id: str) -> blocking.BlockingConnection:
    conn = raw_connection(peer, key, "fedcba987654")
    handed = answer(conn, messages.direct(1, actor_id))
    assert (handed["t"], handed["id"]) == (messages.DIRECT, 1)
    return conn


def test_hostile_input_on_a_direct_connection_costs_that_connection_only(peer, cluster_key):
    rec = Recorder()
    rec.record("before")
    args = serialization.dumps(((), {}))[0]
    conn = raw_connection(peer, cluster_key, "fedcba987654")
    try:
        assert answer(conn, messages.direct(1, "f" * 32))["code"] == "no-actor"
        assert answer(conn, messages.direct(2, "nope"))["code"] == "bad-request"
        conn.send(messages.call(3, rec.actor_id, "sleep", serialization.dumps(((0.5,), {}))[0], None))
        busy = answer(conn, messages.direct(4, rec.actor_id))  # a call of its own is in flight
        assert (busy["code"], busy["id"]) == ("bad-request", 4)
        assert answer(conn, {"t": messages.STATUS, "id": 5})["t"] in (messages.RESULT, messages.STATUS)  # not handed over
    finally:
        conn.close()
    conn = direct_connection(peer, cluster_key, rec.actor_id)
    try:
        for bad in [messages.call(2, rec.actor_id, "__class__", args, None),
                    messages.call(3, rec.actor_id, "history", "not bytes", None),  # type: ignore[arg-type]
                    messages.call(4, rec.actor_id, "history", args, float("nan"))]:
            reply = answer(conn, bad)
            assert (reply["t"], reply["code"], reply["id"]) == (messages.ERROR, "bad-request", bad["id"])
        odd = answer(conn, {**messages.call(4, rec.actor_id, "history", args, None), "id": [4]})  # not an integer
        assert (odd["t"], odd["code"], odd["id"]) == (messages.ERROR, "bad-request", None)
        conn.send(messages.ping())
        assert conn.recv(time.monotonic() + 10)[0]["t"] == messages.PONG  # the worker answers it
        called = answer(conn, messages.call(5, rec.actor_id, "record", serialization.dumps((("raw",), {}))[0], None))
        assert called["t"] == messages.RESULT and serialization.loads(called["data"]) == 2
        refused = answer(conn, messages.submit(6, args, args, {}, None, "task"))
        assert (refused["t"], refused["code"]) == (messages.ERROR, "protocol")
        with pytest.raises(ConnectionError):
            conn.recv(time.monotonic() + 10)
    finally:
        conn.close()
    assert rec.history() == ["before", "raw"]
    rec.close()
