"""The progress bars of a job's upload and fetch (issue 27): bytes moved, their rate and the time left.

One real peer in a subprocess (its disk can be held at a pause point). Through the Job API of this process,
the bars are drawn when asked for and never on pytest's stderr otherwise, and an upload with nothing to
send draws none. `gpulayer submit` in a pseudo-terminal draws its upload's bar by itself once the upload
has taken half a second (the peer's disk is held meanwhile), and none for a quick one.
"""

from __future__ import annotations

import fcntl
import os
import pty
import secrets
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from tqdm import tqdm

from support import holds_for, new_key, wait_until

BIG = 96 << 20  # over the peer's backlog and both ends' socket buffers: with its disk held, the upload waits


@pytest.fixture(scope="module")
def held_peer(peer_factory, tmp_path_factory):
    """(peer, key, Jobs, pause folder): a peer whose disk waits at "blob-writing" while the hold file is there."""
    from gpulayer.client import Client
    from gpulayer.client.jobs import Jobs

    key, pause = new_key(), tmp_path_factory.mktemp("pause")
    peer = peer_factory("progress", "--concurrency", "1", "--state-dir", str(tmp_path_factory.mktemp("state")),
                        key=key, env={"GPULAYER_TEST_PAUSE_IN": str(pause)})
    client = Client(key=key.encode(), echo_output=False)
    yield peer, key, Jobs(client), pause
    client.close()


def _cpu():
    from gpulayer.matching import Requirements

    return Requirements.build(accelerator="cpu")


def _project(folder, size: int) -> int:
    """A folder of one file of `size` random bytes and a script; its size."""
    folder.mkdir()
    (folder / "big.bin").write_bytes(secrets.token_bytes(size))
    (folder / "copy.py").write_text("import shutil; shutil.copy('big.bin', 'out.bin')\n")
    return size + (folder / "copy.py").stat().st_size


def _drawn(err: str, label: str, total: int) -> bool:
    """Whether tqdm drew `label`'s bar to its end: 100%, with the total in scaled bytes."""
    size = tqdm.format_sizeof(total)
    return f"{label}: 100%" in err and f"{size}/{size}" in err


def test_an_upload_and_a_fetch_draw_their_bars_when_asked_for_and_a_resubmit_none(held_peer, tmp_path, capsys):
    peer, _, jobs, _ = held_peer
    size = _project(tmp_path / "project", 6 << 20)
    capsys.readouterr()
    job = jobs.submit(["python", "copy.py"], tmp_path / "project", _cpu(), progress=True)
    assert _drawn(capsys.readouterr().err, f"upload to {peer.name}", size)
    assert job.wait(60) == "succeeded", job.reason
    again = jobs.submit(["true"], tmp_path / "project", _cpu(), progress=True)  # the peer has every blob
    assert again.wait(60) == "succeeded" and capsys.readouterr().err == ""
    job.fetch(["out.bin"], tmp_path / "back", progress=True)
    assert _drawn(capsys.readouterr().err, f"fetch from {peer.name}", 6 << 20)
    assert (tmp_path / "back" / "out.bin").read_bytes() == (tmp_path / "project" / "big.bin").read_bytes()
    # by default, a bar is drawn on a terminal only: pytest's stderr is none
    (tmp_path / "project" / "big.bin").write_bytes(secrets.token_bytes(6 << 20))
    changed = jobs.submit(["python", "copy.py"], tmp_path / "project", _cpu(), progress=None)
    assert changed.wait(60) == "succeeded"
    changed.fetch(["out.bin"], tmp_path / "again")
    assert capsys.readouterr().err == ""


def _on_a_terminal(argv: list[str], cwd, key: str, until=None) -> tuple[int, str, str]:
    """Run `argv` with its stderr on a pseudo-terminal (stdout on a pipe); `until(process)` is called once it
    runs. Its exit code, stdout and what it drew on the terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 160 columns, as a terminal has
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=slave,
                            env={**os.environ, "GPULAYER_KEY": key})
    os.close(slave)
    drawn = b""
    try:
        if until is not None:
            until(proc)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    piece = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal's other end closed it
                    piece = b""
                if not piece:
                    break
                drawn += piece
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc.returncode, out.decode(), drawn.decode("utf-8", "replace")


def test_gpulayer_submit_on_a_terminal_draws_its_upload_bar_once_it_takes_half_a_second(held_peer, tmp_path):
    peer, key, _, pause = held_peer
    size = _project(tmp_path / "slow", BIG)
    argv = [sys.executable, "-m", "gpulayer.cli", "submit", "--accelerator", "cpu", "--", "python", "copy.py"]
    (pause / "blob-writing.hold").touch()
    (pause / "blob-writing.reached").unlink(missing_ok=True)

    def hold_the_disk_a_second(submitter: subprocess.Popen) -> None:
        try:
            wait_until(lambda: (pause / "blob-writing.reached").exists(), 60)
            holds_for(lambda: submitter.poll() is None, 1.0)  # its upload waits for the disk meanwhile
        finally:
            (pause / "blob-writing.hold").unlink()

    code, out, drawn = _on_a_terminal(argv, tmp_path / "slow", key, hold_the_disk_a_second)
    assert code == 0, drawn
    assert _drawn(drawn, f"upload to {peer.name}", size)
    assert f"recorded on peer {peer.name}" in drawn and out.strip() in drawn
    # a quick upload (a small folder, the disk not held): no bar, on a terminal too
    _project(tmp_path / "quick", 1 << 20)
    code, out, drawn = _on_a_terminal(argv, tmp_path / "quick", key)
    assert code == 0 and "upload to" not in drawn and f"job {out.strip()} recorded" in drawn
