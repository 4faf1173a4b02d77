"""devices=N on a (override-advertised) two-GPU peer: one worker that sees both devices, both slots held.

No CUDA here: the peer advertises two GPUs through --advertise-override, so this checks the
peer's placement and the environment its workers get, not the GPUs themselves.
"""

from __future__ import annotations

import os
import time

import pytest

import gpulayer as gl
from gpulayer.client import Client
from gpulayer.matching import Requirements
from support import new_key, wait_until, write_override


def visible(seconds=0.0):
    time.sleep(seconds)
    return os.environ["CUDA_VISIBLE_DEVICES"], os.environ["GPULAYER_DEVICE"], os.getpid()


@pytest.fixture(scope="module")
def two_gpus(peer_factory, tmp_path_factory):
    key = new_key()
    override = write_override(tmp_path_factory.mktemp("o") / "two.json", "cuda", memory_gb=80, count=2)
    peer_factory("twogpu", "--advertise-override", str(override), key=key)
    client = Client(key=key.encode(), echo_output=False)
    yield client
    client.close()


def test_a_two_device_task_sees_both_gpus_and_holds_both_slots(two_gpus):
    client = two_gpus
    pair = Requirements.build(accelerator="cuda", devices=2)
    single = Requirements.build(accelerator="cuda")
    before = {client.submit(visible, req=single).result(60)[0] for _ in range(4)}
    assert before <= {"0", "1"}
    future = client.submit(visible, (1.5,), req=pair)
    wait_until(lambda: client.peers(wait=0)[0]["busy"] == 2, 30)
    assert future.result(60)[:2] == ("0,1", "cuda:0")
    after = [client.submit(visible, req=single).result(60) for _ in range(4)]
    assert {v for v, _, _ in after} <= {"0", "1"}  # back to one device per warm worker


def test_more_devices_than_the_peer_has_is_refused_with_a_reason(two_gpus):
    with pytest.raises(gl.NoMatchingPeer, match="devices=3; peer has 2"):
        two_gpus.submit(visible, req=Requirements.build(accelerator="cuda", devices=3))
