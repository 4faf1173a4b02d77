"""The env= task option, `gpulayer join --env`, and the device a task sees (issue 10, items 3 and 4).

One single-slot peer that advertises a Mac GPU through the documented override (there is no Mac
here). Like a real Mac peer it preloads torch (the CPU build of the venv) in its warm worker.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

import gpulayer as gl
from gpulayer import serialization
from gpulayer.errors import TaskTimeout
from gpulayer.matching import Requirements
from gpulayer.protocol import handshake, messages
from gpulayer.transport import blocking
from support import solo_peer, write_override

TORCH_MPS = [{"name": "torch", "version": "2.13.0", "capabilities": ["torch.cpu", "torch.mps"]}]
TORCH_CUDA = [{"name": "torch", "version": "2.13.0", "capabilities": ["torch.cpu", "torch.cuda"]}]
PEER_WIDE = "GL_TEST_PEER_WIDE"
TASK_VAR = "GL_TEST_TASK_VAR"


@pytest.fixture(scope="module")
def mac(peer_factory, cluster_key, gl_client, tmp_path_factory):
    """gl's client, for a Mac peer started with `--env GL_TEST_PEER_WIDE=from join`."""
    override = write_override(tmp_path_factory.mktemp("mac") / "mac.json", "mps", frameworks=TORCH_MPS)
    peer_factory("mac", "--concurrency", "1", "--advertise-override", str(override),
                 "--env", f"{PEER_WIDE}=from join", key=cluster_key)
    return gl_client


@pytest.fixture(scope="module")
def nvidia(peer_factory, tmp_path_factory):
    """(peer, client) of a cluster of its own: one peer that advertises a CUDA GPU."""
    override = write_override(tmp_path_factory.mktemp("nvidia") / "nvidia.json", "cuda", frameworks=TORCH_CUDA)
    yield from solo_peer(peer_factory, "nvidia", "--advertise-override", str(override))


def torch_state() -> tuple[bool, str | None, int]:
    """At the task's start: whether torch is loaded, the fallback variable, the worker's pid."""
    return "torch" in sys.modules, os.environ.get("PYTORCH_ENABLE_MPS_FALLBACK"), os.getpid()


def variable(name: str) -> tuple[str | None, int]:
    return os.environ.get(name), os.getpid()


def device_seen() -> tuple[str, str]:
    """GPULAYER_DEVICE, and what glt's accelerator="auto" makes of it (or why it fails)."""
    from gpulayer.torch.accelerators import resolve

    try:
        auto = resolve("auto").kind
    except Exception as exc:
        auto = f"{type(exc).__name__}: {exc}"
    return os.environ["GPULAYER_DEVICE"], auto


def test_a_variable_read_at_import_is_set_before_torch_loads_in_a_worker_of_its_own(mac):
    loaded, fallback, one_off = gl.run(torch_state, env={"PYTORCH_ENABLE_MPS_FALLBACK": "1"})
    assert (loaded, fallback) == (False, "1")
    loaded, fallback, warm = gl.run(torch_state)
    assert (loaded, fallback) == (True, None)  # a warm worker again, torch preloaded, without the variable
    assert not psutil.pid_exists(one_off)  # the task's own worker was stopped before the warm one started


def test_the_task_of_a_fresh_worker_streams_output_and_honours_its_timeout(mac):
    def shout() -> str:
        print("from a fresh worker")
        return os.environ["PYTORCH_MPS_HIGH_WATERMARK_RATIO"]

    future = gl.submit(shout, env={"PYTORCH_MPS_HIGH_WATERMARK_RATIO": "0.0"})
    assert future.result(60) == "0.0" and "from a fresh worker" in future.stdout
    with pytest.raises(TaskTimeout):
        gl.run(time.sleep, 120, env={"PYTORCH_ENABLE_MPS_FALLBACK": "1"}, timeout=1)
    assert gl.run(torch_state)[:2] == (True, None)


def test_other_variables_are_set_in_the_warm_worker_for_the_task_only(mac):
    before, warm = gl.run(variable, TASK_VAR)
    assert before is None
    assert gl.run(variable, TASK_VAR, env={TASK_VAR: "a=b ü"}) == ("a=b ü", warm)
    assert gl.run(variable, TASK_VAR) == (None, warm)
    assert gl.run(variable, PEER_WIDE, env={PEER_WIDE: "the task's"}) == ("the task's", warm)
    assert gl.run(variable, PEER_WIDE) == ("from join", warm)  # the peer-wide value is back


def test_remote_functions_and_map_carry_env(mac):
    @gl.remote(env={TASK_VAR: "remote"})
    def read() -> str | None:
        return os.environ.get(TASK_VAR)

    assert read() == "remote"
    assert read.options(env={TASK_VAR: "options"})() == "options"
    assert gl.map(variable, [TASK_VAR, PEER_WIDE], env={TASK_VAR: "map"}, progress=False)[0][0] == "map"


@pytest.mark.parametrize("env, error, text", [
    ({"": "x"}, ValueError, "'' is not a variable name"),
    ({"A=B": "x"}, ValueError, "'A=B' is not a variable name"),
    ({"A\0": "x"}, ValueError, "is not a variable name"),
    ({"A": 1}, ValueError, r"env\['A'\] must be a str without NUL, not 1"),
    ({"A": "x\0"}, ValueError, r"env\['A'\] must be a str without NUL"),
    ({"GPULAYER_DEVICE": "cpu"}, ValueError, "the peer sets GPULAYER_DEVICE for the task's slot"),
    ({"CUDA_VISIBLE_DEVICES": "1"}, ValueError, "the peer sets CUDA_VISIBLE_DEVICES"),
    ({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, ValueError, "the peer sets CUDA_DEVICE_ORDER"),
    (["A=B"], TypeError, "env must be a dict of variable names to str values, not list"),
])
def test_bad_env_is_refused_when_given(env, error, text):
    with pytest.raises(error, match=text):
        gl.submit(variable, TASK_VAR, env=env)
    with pytest.raises(error, match=text):
        gl.remote(env=env)(variable)


def test_the_peer_refuses_a_bad_env_itself(mac):
    """A submitter that skips the check (another implementation, a bug) gets bad-request for that task."""
    record = next(r for r in mac.directory.records() if r.advert.name == "mac")
    conn = blocking.BlockingConnection(socket.create_connection(record.addresses[0], timeout=30))
    try:
        handshake.client_handshake(conn, mac.key, "test")
        msg = messages.submit(1, serialization.dumps(variable)[0], serialization.dumps(((TASK_VAR,), {}))[0],
                              Requirements.build().to_wire(), None, "variable", {"GPULAYER_DEVICE_INDEX": "1"})
        conn.send(msg)
        reply, _ = conn.recv()
    finally:
        conn.close()
    assert (reply["t"], reply["code"]) == (messages.ERROR, "bad-request")
    assert "the peer sets GPULAYER_DEVICE_INDEX" in reply["message"]


def test_a_cpu_task_on_a_mac_is_given_the_cpu(mac):
    assert gl.run(device_seen, accelerator="cpu") == ("cpu", "cpu")
    device, auto = gl.run(device_seen)  # no accelerator: the peer's best, as before
    assert device == "mps" and auto.startswith("AcceleratorUnavailable") and "mps" in auto  # no MPS here
    assert gl.run(device_seen, accelerator="mps")[0] == "mps"
    assert gl.run(device_seen, accelerator="cpu", env={"PYTORCH_ENABLE_MPS_FALLBACK": "1"}) == ("cpu", "cpu")


def test_a_cpu_task_on_a_cuda_peer_is_given_the_cpu_and_may_hide_the_gpu(nvidia):
    _, client = nvidia

    def run(**options):
        env = options.pop("env", None)
        return client.submit(devices_seen, req=Requirements.build(**options), env=env).result(60)

    def devices_seen() -> tuple[str, str, bool]:
        return os.environ["GPULAYER_DEVICE"], os.environ["CUDA_VISIBLE_DEVICES"], "torch" in sys.modules

    assert run() == ("cuda:0", "0", True)
    assert run(accelerator="cpu") == ("cpu", "0", True)  # the slot's GPU stays visible: see _device_env
    assert run(accelerator="cpu", env={"CUDA_VISIBLE_DEVICES": ""}) == ("cpu", "", False)  # a fresh worker
    assert run() == ("cuda:0", "0", True)


def test_join_refuses_a_gpulayer_setting_as_env():
    out = subprocess.run([sys.executable, "-m", "gpulayer.peer", "--env", "GPULAYER_KEY=secret"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "GPULAYER_KEY is a GPUlayer setting" in out.stderr
