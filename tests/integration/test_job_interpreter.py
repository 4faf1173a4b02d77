"""The job interpreter's Python as a matching rule (issue 10, item 1).

Two single-slot peers: "here" runs its tasks in this interpreter, the other in a venv of another
Python minor version (`gpulayer join --python`), built for the session with only what a worker
needs: msgpack and cloudpickle (the peer puts gpulayer itself on the worker's path). A function
shipped by value holds code objects that only its own Python minor version can load (3.12
crashes on 3.11 code, 3.9 raises TypeError), so the submitter must not send it there.
"""

from __future__ import annotations

import glob
import importlib.metadata
import math
import platform
import shutil
import socket
import subprocess
import sys

import pytest

import gpulayer as gl
from gpulayer import serialization
from gpulayer.client.inference import with_inferred
from gpulayer.matching import Requirements
from gpulayer.protocol import framing, handshake, messages
from gpulayer.transport import blocking

HERE = "%d.%d" % sys.version_info[:2]
OTHER_MINORS = [minor for minor in ("3.12", "3.9") if minor != HERE]


def job_python() -> str:
    """Defined in a test file, so shipped by value: its code object travels."""
    return platform.python_version()


def _find_python(minor: str) -> str | None:
    """A working python<minor> (pyenv's shims only work for the selected versions, so check it runs)."""
    for path in [*sorted(glob.glob(f"/root/.pyenv/versions/{minor}.*/bin/python{minor}")), shutil.which(f"python{minor}")]:
        if path and subprocess.run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                   capture_output=True, text=True).stdout.strip() == minor:
            return path
    return None


def job_venv(minor: str, tmp_path_factory) -> tuple[str, str]:
    """(the venv's python, its full version): a venv of Python `minor` with this submitter's
    cloudpickle version and a msgpack (its format is stable; new releases drop old Pythons);
    skips the test where that cannot be built."""
    found = _find_python(minor)
    if found is None:
        pytest.skip(f"no Python {minor} interpreter here (pyenv or PATH)")
    venv = tmp_path_factory.mktemp("job-venv") / minor
    subprocess.run([found, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = str(venv / "bin" / "python")
    pins = [f"cloudpickle=={importlib.metadata.version('cloudpickle')}", "msgpack>=1.0"]
    pip = subprocess.run([python, "-m", "pip", "install", "-q", *pins], capture_output=True, text=True)
    if pip.returncode != 0:
        pytest.skip(f"cannot install {' '.join(pins)} into a Python {minor} venv: {pip.stderr[-500:]}")
    version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return python, version


@pytest.fixture(scope="session")
def other_python(tmp_path_factory) -> tuple[str, str]:
    """The job venv of the first other minor version found."""
    minor = next((minor for minor in OTHER_MINORS if _find_python(minor)), None)
    if minor is None:
        pytest.skip(f"no Python {' or '.join(OTHER_MINORS)} interpreter here (pyenv or PATH)")
    return job_venv(minor, tmp_path_factory)


@pytest.fixture(scope="module")
def peers(peer_factory, cluster_key, gl_client, other_python):
    """gl's client, once it knows "here" and "other" (whose job interpreter is the venv)."""
    peer_factory("here", "--concurrency", "1", key=cluster_key)
    peer_factory("other", "--concurrency", "1", "--python", other_python[0], key=cluster_key)
    gl_client.start()
    assert gl_client.directory.wait_for(lambda records: len(records) == 2, 30)
    return gl_client


def test_a_function_shipped_by_value_is_refused_before_sending(peers, other_python):
    with pytest.raises(gl.NoMatchingPeer) as info:
        gl.run(job_python, peer="other")
    text = str(info.value)
    assert f"its job interpreter runs Python {other_python[1]}, but the task ships functions by value as " \
           f"Python {HERE} code" in text
    assert f"start the peer with --python pointing to a Python {HERE} interpreter, or a matching venv" in text
    assert "refused the task" not in text  # the submitter's own check: nothing was sent


def test_a_function_shipped_by_value_goes_to_the_peer_of_its_python(peers):
    for _ in range(3):
        assert gl.run(job_python) == platform.python_version()


def test_functions_pickled_by_reference_run_on_another_python(peers, other_python):
    assert gl.run(math.sqrt, 16.0, peer="other") == 4.0
    assert gl.run(platform.python_version, peer="other") == other_python[1]


def test_the_python_requirement_selects_peers(peers, other_python):
    minor = other_python[1].rsplit(".", 1)[0]
    assert gl.run(platform.python_version, python=f"=={minor}.*") == other_python[1]
    assert gl.run(platform.python_version, python=f"=={HERE}.*") == platform.python_version()
    with pytest.raises(gl.NoMatchingPeer) as info:
        gl.run(platform.python_version, python=">=4")
    assert f"its job interpreter runs Python {other_python[1]}, not python>=4" in str(info.value)


@pytest.mark.parametrize("python", [3.12, ">=three", ["3.12"]])
def test_a_bad_python_requirement_is_refused_at_once(python):
    with pytest.raises(ValueError, match="python must be a PEP 440 specifier"):
        gl.run(platform.python_version, python=python)


def test_the_peer_itself_refuses_code_of_another_python(peers):
    """A submitter that skips matching (a stale advert, a bug) is refused before a worker loads the code."""
    record = next(r for r in peers.directory.records() if r.advert.name == "other")
    fn = serialization.dumps(job_python)[0]
    args = serialization.dumps(((), {}))[0]
    req = with_inferred(Requirements.build(), job_python, fn, args)
    conn = blocking.BlockingConnection(socket.create_connection(record.addresses[0], timeout=10))
    try:
        handshake.client_handshake(conn, peers.key, "test")
        conn.reader.max_frame = framing.max_message_bytes()
        conn.send({"t": messages.SUBMIT, "id": 1, "fn": fn, "args": args, "req": req.to_wire()})
        reply, _ = conn.recv()
    finally:
        conn.close()
    assert reply["t"] == messages.REJECT and reply["code"] == "no-match"
    assert f"start the peer with --python pointing to a Python {HERE} interpreter" in reply["message"]



def test_the_system_python_of_a_mac_runs_functions_pickled_by_reference(peers, peer_factory, cluster_key,
                                                                         tmp_path_factory):
    """macOS's own Python is 3.9: the worker must start there, and code shipped by value must not go."""
    python, version = job_venv("3.9", tmp_path_factory)
    peer_factory("py39", "--concurrency", "1", "--python", python, key=cluster_key)
    assert peers.directory.wait_for(lambda records: any(r.advert.name == "py39" for r in records), 30)
    assert gl.run(platform.python_version, peer="py39") == version
    assert gl.run(math.sqrt, 2.25, peer="py39") == 1.5
    with pytest.raises(gl.NoMatchingPeer, match=f"its job interpreter runs Python {version}, but the task ships"):
        gl.run(job_python, peer="py39")
