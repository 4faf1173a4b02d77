"""Each task on a warm worker starts from the same state, in a folder of its own (issue 26, items 2 and 4).

Against a real single-slot peer, so that one warm worker runs the tasks one after another, through
the peer and on a lease (ADR 0013): both paths run a task in the worker's CleanRoom.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import cloudpickle
import pytest

import cleanroom_state
import gpulayer as gl
from gpulayer.client import Client
from gpulayer.matching import Requirements
from support import new_key, wait_until

CPU = Requirements.build(accelerator="cpu")
COUNTER = 0
cloudpickle.register_pickle_by_value(cleanroom_state)  # a module of the user's that the peer does not have


@pytest.fixture(scope="module")
def lone(peer_factory):
    """A single-slot peer of its own cluster, and a submitter with leases and one without."""
    key = new_key()
    peer = peer_factory("lone", "--concurrency", "1", key=key)
    clients = {leases: Client(key=key.encode(), echo_output=False, leases=leases) for leases in (True, False)}
    yield peer, clients
    for client in clients.values():
        client.close()


def run(client: Client, fn, *args):
    return client.submit(fn, args, req=CPU).result(60)


def meddle(change: bool):
    """Changes what a task may change of its process when `change`; reports what it found first."""
    global COUNTER
    found = {"cwd": os.getcwd(), "listing": sorted(os.listdir(".")), "argv": list(sys.argv),
             "leak": os.environ.get("GPULAYER_LEAK"), "peer": os.environ.get("GPULAYER_PEER_NAME"),
             "path0": sys.path[0], "counter": COUNTER, "module": cleanroom_state.VALUE, "pid": os.getpid()}
    if change:
        Path("checkpoint.txt").write_text("epoch 3")
        os.makedirs("logs/run1")
        os.chdir("/tmp")
        sys.argv[:] = ["train.py", "--lr", "0.1"]
        os.environ["GPULAYER_LEAK"] = "1"
        del os.environ["GPULAYER_PEER_NAME"]
        sys.path.insert(0, "/nowhere")
        COUNTER += 1
        cleanroom_state.VALUE = 99
    return found


@pytest.mark.parametrize("leases", [False, True], ids=["through-the-peer", "on-a-lease"])
def test_a_task_starts_from_the_state_the_one_before_it_found(lone, leases):
    peer, clients = lone
    client = clients[leases]
    first = run(client, meddle, False)
    if leases:  # the same worker, lent: once the lease has come
        wait_until(lambda: run(client, meddle, False) and client.leases.by_peer.get(peer.peer_id), 30)
    changed = run(client, meddle, True)
    after = run(client, meddle, False)
    assert after["pid"] == changed["pid"]  # the same warm worker ran both
    assert after["listing"] == [] and after["cwd"] != changed["cwd"]  # a fresh, empty folder of its own
    assert not os.path.exists(changed["cwd"])  # the used one is gone with what the task wrote
    assert os.path.dirname(after["cwd"]) == os.path.dirname(first["cwd"])  # under the peer's workdir
    for name in ("argv", "leak", "peer", "path0", "counter", "module"):
        assert after[name] == first[name], name
    assert after["peer"] == "lone" and after["leak"] is None and after["counter"] == 0 and after["module"] == 0


def keep_a_checkpoint():
    Path("model.ckpt").write_text("weights")
    return str(gl.task_folder(keep=True))


def test_a_task_that_asks_keeps_its_folder_and_the_next_gets_another(lone):
    _, clients = lone
    kept = Path(run(clients[False], keep_a_checkpoint))
    assert (kept / "model.ckpt").read_text() == "weights"
    assert run(clients[False], os.getcwd) != str(kept)
    assert (kept / "model.ckpt").read_text() == "weights"  # still there after the next task


def write_then_read(rendezvous: str, text: str) -> str:
    """Writes `text` to a file of a name every task uses, waits until the other task has written too
    (a file in `rendezvous` each, bounded), then reads it back."""
    import time

    Path("checkpoint.txt").write_text(text)
    Path(rendezvous, text).touch()
    deadline = time.monotonic() + 30
    while len(os.listdir(rendezvous)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return Path("checkpoint.txt").read_text()


def test_tasks_running_at_once_never_share_a_folder(peer_factory, tmp_path):
    key = new_key()
    peer_factory("pair", "--concurrency", "2", key=key)
    client = Client(key=key.encode(), echo_output=False)
    try:
        futures = [client.submit(write_then_read, (str(tmp_path), text), req=CPU) for text in ("a", "b")]
        assert [f.result(60) for f in futures] == ["a", "b"]
    finally:
        client.close()


def read_data():
    return Path("data/train.csv").read_text()


def test_a_missing_relative_path_says_that_files_do_not_travel(lone):
    _, clients = lone
    with pytest.raises(FileNotFoundError) as info:
        run(clients[False], read_data)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "'data/train.csv'" in notes and "Files do not travel with a function" in notes


def test_task_folder_outside_a_task_says_so():
    with pytest.raises(RuntimeError, match="for code that runs as a task"):
        gl.task_folder()
