"""Where tasks start: a folder of their own, in a scratch folder of the peer's (the task's folder is
removed when it ends, the scratch folder when the peer stops), or in --workdir DIR (kept).

Not the folder the peer was started in: a service's is "/" (launchd) or a home folder, and a
Trainer's default checkpoints (lightning_logs/) or any relative path a task writes would land there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpulayer.client import Client
from gpulayer.matching import Requirements
from support import new_key

ANY = Requirements.build()


def write_here() -> tuple[str, list[str]]:
    Path("written-by-task.txt").write_text("hello")
    return os.getcwd(), sorted(os.listdir("."))


def run_on(peer, key: str):
    client = Client(key=key.encode(), peers=peer.address, mdns=False, echo_output=False)
    try:
        return client.submit(write_here, req=ANY).result(60)
    finally:
        client.close()


def test_tasks_start_in_a_scratch_folder_that_goes_with_the_peer(peer_factory):
    key = new_key()
    peer = peer_factory("scratch", "--no-mdns", "--concurrency", "1", key=key)
    cwd, files = run_on(peer, key)
    assert Path(cwd).parents[1].name.startswith("gpulayer-work-") and files == ["written-by-task.txt"]
    assert Path(cwd).resolve() != Path.cwd().resolve()
    assert not (Path.cwd() / "written-by-task.txt").exists()
    assert not Path(cwd).exists()  # the task's folder went with the task
    peer.stop(timeout=15)
    assert not Path(cwd).parents[1].exists()


def test_workdir_is_where_tasks_start_and_is_kept(peer_factory, tmp_path):
    key = new_key()
    peer = peer_factory("kept", "--no-mdns", "--concurrency", "1", "--workdir", str(tmp_path), key=key)
    cwd, files = run_on(peer, key)
    assert Path(cwd).parents[1] == tmp_path and files == ["written-by-task.txt"]
    assert run_on(peer, key)[0] != cwd  # the next task has a folder of its own
    peer.stop(timeout=15)
    assert (Path(cwd) / "written-by-task.txt").read_text() == "hello"


@pytest.mark.parametrize("folder", ["/nonexistent/gpulayer", "FILE"])
def test_a_workdir_that_is_not_a_writable_folder_is_refused(tmp_path, folder):
    if folder == "FILE":
        folder = str(tmp_path / "a-file")
        Path(folder).write_text("")
    out = subprocess.run([sys.executable, "-m", "gpulayer.peer", "--workdir", folder], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "GPULAYER_KEY": new_key()})
    assert out.returncode == 2 and "is not a writable folder" in out.stderr, out.stderr
