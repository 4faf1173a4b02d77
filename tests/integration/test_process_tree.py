"""A task's whole process tree dies on timeout and cancel; workers never see the cluster key."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

import gpulayer as gl
from gpulayer.matching import Requirements
from support import process_gone as gone, solo_peer, wait_until

ANY = Requirements.build()
GONE_WITHIN_S = 10.0
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="child subreaper is Linux-only")


def start_setsid_child_then_sleep(pid_file, seconds):
    """A grandchild in a session of its own (out of the worker's process group), then a long sleep."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(child.pid))
    os.replace(pid_file + ".tmp", pid_file)
    time.sleep(seconds)


def start_orphan_then_sleep(pid_file, seconds):
    """A double fork: an intermediate process starts a setsid `sleep` and exits at once, so the sleep
    is orphaned before any kill (re-parented to the worker where it is a child subreaper)."""
    import subprocess

    script = ("import subprocess, sys\n"
              "p = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
              "open(sys.argv[1] + '.tmp', 'w').write(str(p.pid))\n")
    subprocess.run([sys.executable, "-c", script, pid_file], check=True)
    os.replace(pid_file + ".tmp", pid_file)
    time.sleep(seconds)


def start_short_orphan():
    """An orphan that exits by itself soon after: it must not stay a zombie of the worker."""
    import subprocess

    subprocess.run(["sh", "-c", "sleep 0.2 &"], check=True)
    return os.getpid()


def key_in_environment(key):
    return {"GPULAYER_KEY" in os.environ, any(key in value for value in os.environ.values())}


@pytest.fixture(scope="module")
def solo(peer_factory):
    yield from solo_peer(peer_factory, "tree")


@pytest.fixture
def grandchildren():
    """Pids the test read from its tasks; whatever is still alive afterwards is killed."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def read_pid(path, pids: list[int]) -> int:
    wait_until(path.exists, timeout=30)
    pid = int(path.read_text())
    pids.append(pid)
    return pid


def assert_gone_soon(pid: int) -> None:
    wait_until(lambda: gone(pid), timeout=GONE_WITHIN_S, interval=0.05)


def test_a_timeout_kills_a_setsid_grandchild(solo, tmp_path, grandchildren):
    peer, client = solo
    pid_file = tmp_path / "grandchild.pid"
    future = client.submit(start_setsid_child_then_sleep, (str(pid_file), 30), req=ANY, timeout=1)
    pid = read_pid(pid_file, grandchildren)
    with pytest.raises(gl.TaskTimeout):
        future.result(30)
    assert_gone_soon(pid)


def test_a_cancel_kills_a_setsid_grandchild(solo, tmp_path, grandchildren):
    peer, client = solo
    pid_file = tmp_path / "grandchild.pid"
    future = client.submit(start_setsid_child_then_sleep, (str(pid_file), 30), req=ANY)
    pid = read_pid(pid_file, grandchildren)
    assert not gone(pid)
    assert future.cancel() and future.cancelled()
    assert_gone_soon(pid)
    assert client.submit(os.getpid, req=ANY).result(30)  # the slot came back


@linux_only
def test_a_timeout_kills_an_orphan_whose_parent_already_exited(solo, tmp_path, grandchildren):
    peer, client = solo
    pid_file = tmp_path / "orphan.pid"
    future = client.submit(start_orphan_then_sleep, (str(pid_file), 30), req=ANY, timeout=3)
    pid = read_pid(pid_file, grandchildren)
    assert psutil.Process(pid).ppid() in peer.workers()  # adopted by the worker, not by init
    with pytest.raises(gl.TaskTimeout):
        future.result(30)
    assert_gone_soon(pid)


@linux_only
def test_orphans_that_exit_do_not_stay_zombies_of_a_warm_worker(solo):
    peer, client = solo
    worker = client.submit(start_short_orphan, req=ANY).result(30)

    def reaped() -> bool:  # between tasks, at most once a second, zombies seen twice
        assert client.submit(os.getpid, req=ANY).result(30) == worker  # the same warm worker throughout
        return not [c for c in psutil.Process(worker).children() if gone(c.pid)]

    wait_until(reaped, timeout=10, interval=0.2)


def test_a_task_cannot_read_the_cluster_key_from_its_environment(solo):
    peer, client = solo
    assert peer.env["GPULAYER_KEY"] == peer.key  # the peer itself got the key from its environment
    assert client.submit(key_in_environment, (peer.key,), req=ANY).result(30) == {False}
