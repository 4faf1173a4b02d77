"""Routing against peers whose advertised resources are set by --advertise-override.

There is no Mac or NVIDIA GPU here, so the `mps` and `cuda` peers below are CPU processes that
advertise those devices through the documented override; this tests the matching and routing
rules end to end (mDNS adverts, the submitter's choice, the peer's own check), not the devices.
"""

from __future__ import annotations

import os
import socket

import pytest

import gpulayer as gl
from gpulayer import serialization
from gpulayer.client import Client
from gpulayer.matching import Requirements
from gpulayer.protocol import framing, handshake, messages
from gpulayer.torch import AcceleratorUnavailable
from gpulayer.transport import blocking
from support import new_key, write_override

TORCH_MPS = [{"name": "torch", "version": "2.5.1", "capabilities": ["torch.cpu", "torch.mps"]},
             {"name": "mlx", "version": "0.21.0", "capabilities": ["mlx.cpu", "mlx.metal"]}]
TORCH_CUDA = [{"name": "torch", "version": "2.4.0", "capabilities": ["torch.cpu", "torch.cuda"]}]
TORCH_CPU = [{"name": "torch", "version": "2.13.0", "capabilities": ["torch.cpu"]}]


def device_env():
    return os.environ["GPULAYER_PEER_NAME"], os.environ["GPULAYER_DEVICE"]


@pytest.fixture(scope="module")
def fleet(peer_factory, tmp_path_factory):
    key = new_key()
    tmp = tmp_path_factory.mktemp("overrides")
    mac = write_override(tmp / "mac.json", "mps", memory_gb=32, frameworks=TORCH_MPS)
    nvidia = write_override(tmp / "nvidia.json", "cuda", memory_gb=24, frameworks=TORCH_CUDA)
    cpu = write_override(tmp / "cpu.json", "cpu", frameworks=TORCH_CPU)
    for name, path in (("mac", mac), ("nvidia", nvidia), ("cpubox", cpu)):
        peer_factory(name, "--advertise-override", str(path), key=key)
    client = Client(key=key.encode(), echo_output=False)
    client.start()
    assert client.directory.wait_for(lambda records: len(records) == 3, 10)
    yield client
    client.close()


def run(client, **requirements):
    return client.submit(device_env, req=Requirements.build(**requirements)).result(30)


def test_mps_tasks_run_only_on_the_mac_and_cuda_tasks_only_on_nvidia(fleet):
    for _ in range(5):
        assert run(fleet, accelerator="mps") == ("mac", "mps")
        assert run(fleet, accelerator="cuda") == ("nvidia", "cuda:0")


def test_gpu_means_either_and_cpu_prefers_the_peer_without_a_gpu(fleet):
    assert run(fleet, accelerator="gpu")[0] in ("mac", "nvidia")
    assert run(fleet, accelerator="cpu") == ("cpubox", "cpu")
    assert run(fleet) == ("cpubox", "cpu")


def test_gpu_memory_is_compared_with_unified_memory_on_a_mac(fleet):
    assert run(fleet, gpu_memory_gb=30) == ("mac", "mps")  # 32 GB unified beats 24 GB of VRAM
    assert run(fleet, accelerator="cuda", gpu_memory_gb=24) == ("nvidia", "cuda:0")
    with pytest.raises(gl.NoMatchingPeer) as info:
        run(fleet, accelerator="cuda", gpu_memory_gb=40)
    assert "needs 40 GB of GPU memory; peer has 24 GB dedicated" in str(info.value)


def test_frameworks_and_their_backends_decide(fleet):
    assert run(fleet, accelerator="mps", frameworks={"torch": ">=2.4"}) == ("mac", "mps")
    assert run(fleet, frameworks={"mlx": ">=0.10"}) == ("mac", "mps")
    with pytest.raises(gl.NoMatchingPeer) as info:
        run(fleet, accelerator="cuda", frameworks={"torch": ">=2.5"})
    assert "torch 2.4.0 does not satisfy >=2.5" in str(info.value)


def test_no_matching_peer_says_why_for_every_peer(fleet):
    with pytest.raises(gl.NoMatchingPeer) as info:
        run(fleet, accelerator="mps", devices=2)
    text = str(info.value)
    assert "mac (127.0.0.1:" in text and "multi-device runs are unsupported on mps" in text
    assert "nvidia (127.0.0.1:" in text and "task needs mps; peer offers cuda" in text
    assert "cpubox (127.0.0.1:" in text and "task needs mps; peer offers cpu" in text


def test_the_peer_itself_refuses_a_task_it_cannot_run(fleet):
    """A submitter that skips matching (a stale advert, a bug) is still refused by the peer."""
    record = next(r for r in fleet.directory.records() if r.advert.name == "nvidia")
    conn = blocking.BlockingConnection(socket.create_connection(record.addresses[0], timeout=10))
    try:
        handshake.client_handshake(conn, fleet.key, "test")
        conn.reader.max_frame = framing.max_message_bytes()
        conn.send({"t": messages.SUBMIT, "id": 1, "fn": serialization.dumps(device_env)[0],
                   "args": serialization.dumps(((), {}))[0], "req": Requirements.build(accelerator="mps").to_wire()})
        reply, _ = conn.recv()
    finally:
        conn.close()
    assert reply["t"] == messages.REJECT and reply["code"] == "no-match"
    assert "task needs mps; peer offers cuda" in reply["message"]


def test_a_device_the_jobs_torch_lacks_is_a_clear_error(fleet):
    """The mac override claims torch.mps; this box's CPU torch has none, as a Mac with a CPU-only torch."""
    def on_the_given_device():
        import torch

        import gpulayer as gl
        return torch.ones(2, device=gl.device()).sum().item()

    with pytest.raises(AcceleratorUnavailable) as info:
        fleet.submit(on_the_given_device, req=Requirements.build(accelerator="mps")).result(60)
    text = str(info.value)
    assert "the peer gave this task GPULAYER_DEVICE='mps', but torch" in text
    assert "torch.backends.mps.is_available() is False" in text and "gpulayer join --python" in text
    assert fleet.submit(on_the_given_device, req=Requirements.build(accelerator="cpu")).result(60) == 2.0
