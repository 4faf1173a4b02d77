"""A pip install into a running peer's job interpreter needs no restart (issue 26, item 5): a task
that asks for a distribution or a framework that the last probe did not find makes the peer probe
again (when its sys.path changed, or a while after it last looked), and advertise what changed.

The job interpreter is a venv made the ordinary way; what gets installed are wheels built here: a
small pure-Python distribution, and one named torch (a stand-in with a version and nothing else:
the real one takes minutes to install on this machine), which shows the path of a framework that
the submitter itself matches against the advert.
"""

from __future__ import annotations

import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from gpulayer import serialization
from gpulayer.client import Client
from gpulayer.errors import NoMatchingPeer
from gpulayer.matching import Requirements
from gpulayer.peer.reprobe import REPROBE_GAP_S
from gpulayer.protocol import messages
from support import authenticated, job_venv, new_key

PROBING = "probing the job interpreter"  # the peer's log line for each new probe
MARKER = "gl-reprobe-marker"


def wheel(folder: Path, name: str, version: str, module: str, source: str) -> Path:
    """A pure-Python wheel of distribution `name` holding `module`.py with `source`."""
    stem = name.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    files = {f"{module}.py": source,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    path = folder / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for member, text in files.items():
            whl.writestr(member, text)
    return path


def pip_install(python: str, path: Path) -> None:
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(path)], check=True,
                   capture_output=True, timeout=240)


def marker_version() -> str:
    import gl_reprobe_marker

    return gl_reprobe_marker.VERSION


def torch_version() -> str:
    import torch

    return torch.__version__


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    return job_venv(tmp_path_factory.mktemp("reprobe") / "jobenv")


@pytest.fixture(scope="module")
def peer(peer_factory, venv):
    key = new_key()
    return peer_factory("reprobed", "--concurrency", "1", "--python", venv, key=key)


@pytest.fixture
def client(peer):
    client = Client(key=peer.key.encode(), echo_output=False, interfaces=["127.0.0.1"], discovery_timeout=2)
    yield client
    client.close()


def test_a_distribution_installed_while_the_peer_runs_is_found_by_the_next_task(peer, venv, client, tmp_path):
    marker = Requirements.build(accelerator="cpu", frameworks={MARKER: ""})
    with pytest.raises(NoMatchingPeer, match=f"refused the task: {MARKER} is not installed in the job interpreter"):
        client.submit(marker_version, req=marker).result(60)
    pip_install(venv, wheel(tmp_path, MARKER, "1.0", "gl_reprobe_marker", "VERSION = '1.0'\n"))
    assert client.submit(marker_version, req=marker).result(60) == "1.0"  # same peer, same submitter
    assert peer.alive()


def test_a_framework_installed_while_the_peer_runs_is_advertised(peer, venv, client, tmp_path):
    torch = Requirements.build(accelerator="cpu", frameworks={"torch": ">=0.0.1"})
    with pytest.raises(NoMatchingPeer, match="torch is not installed in the job interpreter"):
        client.submit(torch_version, req=torch).result(60)
    pip_install(venv, wheel(tmp_path, "torch", "0.0.1", "torch", "__version__ = '0.0.1'\n"))
    assert client.submit(torch_version, req=torch).result(60) == "0.0.1"
    [row] = client.peers(wait=0)
    assert row["frameworks"].get("torch") == "0.0.1", row  # the advert says so now
    fresh = Client(key=peer.key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    try:  # and so does the mDNS record that another submitter finds
        fresh.start()
        assert fresh.directory.wait_for(
            lambda records: any(dict(r.advert.frameworks).get("torch") == "0.0.1" for r in records), 30)
    finally:
        fresh.close()


def test_tasks_asking_for_what_is_missing_do_not_make_the_peer_probe_in_a_loop(peer):
    absent = Requirements.build(accelerator="cpu", frameworks={"gl-never-installed": ""}).to_wire()
    fn = serialization.dumps(marker_version)[0]
    before = peer.log().count(PROBING)
    conn = authenticated(peer)
    try:
        for task_id in range(1, 21):  # back to back: they arrive while the first one's probe runs
            conn.send(messages.submit(task_id, fn, serialization.dumps(((), {}))[0], absent, None, "marker_version"))
        answers = [conn.recv(time.monotonic() + 60)[0] for _ in range(20)]
    finally:
        conn.close()
    assert {(a["t"], a["code"]) for a in answers} == {(messages.REJECT, "no-match")}, answers
    assert all("gl-never-installed is not installed" in a["message"] for a in answers)
    probes = peer.log().count(PROBING) - before
    # one probe for the 20 (without the bound: 20); a second only if they outlasted REPROBE_GAP_S, 5x
    # the second or so that a probe of distributions and 20 refusals take here
    assert probes in (1, 2), probes


def test_a_task_cancelled_while_the_peer_probes_is_dropped(peer):
    lacking = Requirements.build(accelerator="cpu", frameworks={"gl-cancelled-while-probing": ""}).to_wire()
    fn, args = serialization.dumps(marker_version)[0], serialization.dumps(((), {}))[0]
    conn = authenticated(peer)
    try:
        conn.send(messages.submit(1, fn, args, lacking, None, "marker_version"))  # a name never looked for: a probe
        conn.send(messages.cancel(1))
        conn.send(messages.submit(2, fn, args, lacking, None, "marker_version"))  # answered after that probe
        answers = []
        while not any(a.get("id") == 2 for a in answers):
            msg, _ = conn.recv(time.monotonic() + 60)
            if msg["t"] in (messages.REJECT, messages.RESULT, messages.ERROR, messages.ACCEPT):
                answers.append(msg)
    finally:
        conn.close()
    assert [(a["t"], a["id"]) for a in answers] == [(messages.REJECT, 2)], answers  # nothing for the cancelled one
