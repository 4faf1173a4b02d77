"""Placement by free memory (issue 14, part 3): a peer starts a task asking gpu_memory_gb=X only on a
device where X is not reserved by the tasks holding its other slots, and queues it until then.

A mixed fake cluster (the --advertise-override seam) of real loopback peers runs hundreds of tasks
with random memory needs; each task records when it ran and where, and no device ever holds more
declared memory at once than it has."""

from __future__ import annotations

import json
import random
from contextlib import closing

import pytest
from support import new_key, wait_until, write_override

from gpulayer.client import Client
from gpulayer.errors import NoMatchingPeer
from gpulayer.matching import Requirements
from gpulayer.resources.utilisation import GB

TASKS = 300
SLOTS_PER_GPU = 4


def occupy(memory_gb: float, seconds: float) -> dict:
    """Hold the device for `seconds`; say where and when (this machine's clock: all peers share it)."""
    import os
    import time

    start = time.time()
    time.sleep(seconds)
    return {"peer": os.environ["GPULAYER_PEER_NAME"], "device": os.environ["GPULAYER_DEVICE_INDEX"],
            "start": start, "end": time.time(), "memory_gb": memory_gb}


@pytest.fixture(scope="module")
def fake_cluster(peer_factory, tmp_path_factory):
    """A 24 GB CUDA peer, a two-GPU 48 GB one and a 32 GB Mac, each with SLOTS_PER_GPU slots per GPU."""
    key, where = new_key(), tmp_path_factory.mktemp("memory")
    cards = {"mem-24": ("cuda", 24.0, 1), "mem-2x48": ("cuda", 48.0, 2), "mem-mac32": ("mps", 32.0, 1)}
    for name, (kind, memory, count) in cards.items():
        override = write_override(where / f"{name}.json", kind, memory_gb=memory, count=count)
        peer_factory(name, "--concurrency", str(SLOTS_PER_GPU), "--preload", "json",
                     "--advertise-override", str(override), key=key)
    client = Client(key=key.encode(), echo_output=False)
    yield client, {name: memory for name, (_, memory, _) in cards.items()}
    client.close()


def peak_reserved(runs: list[dict]) -> tuple[float, int]:
    """The most declared memory, and the most tasks, running at once in `runs` (intervals of one device)."""
    events = sorted([(r["start"], 1, r["memory_gb"]) for r in runs] + [(r["end"], 0, -r["memory_gb"]) for r in runs])
    held = peak = 0.0
    count = most = 0
    for _, starting, memory in events:  # at equal times the ends (0) come before the starts (1)
        held += memory
        count += 1 if starting else -1
        peak, most = max(peak, held), max(most, count)
    return peak, most


def test_hundreds_of_random_tasks_never_overcommit_a_device(fake_cluster):
    client, memory = fake_cluster
    rng = random.Random(14)
    needs = [round(rng.uniform(1.0, 30.0), 1) for _ in range(TASKS)]
    futures = [client.submit(occupy, (need, rng.uniform(0.01, 0.06)), req=Requirements.build(gpu_memory_gb=need),
                             timeout=120) for need in needs]
    runs = [f.result(300) for f in futures]

    assert sorted(r["memory_gb"] for r in runs) == sorted(needs)
    devices: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        assert run["memory_gb"] <= memory[run["peer"]], run  # never on a device too small for it
        devices.setdefault((run["peer"], run["device"]), []).append(run)
    assert len(devices) == 4  # every device of the cluster ran some
    shared = 0
    for (peer, device), on_it in devices.items():
        peak, most = peak_reserved(on_it)
        assert peak <= memory[peer] + 1e-6, f"{peer} GPU {device} held {peak:g} GB declared at once"
        shared += most > 1
    assert shared >= 2  # tasks did share devices (up to SLOTS_PER_GPU at once): the limit was memory


def test_a_task_no_device_can_hold_names_the_numbers(fake_cluster):
    client, _ = fake_cluster
    with pytest.raises(NoMatchingPeer) as info:
        client.submit(occupy, (60.0, 0.0), req=Requirements.build(gpu_memory_gb=60))
    text = str(info.value)
    assert "needs 60 GB of GPU memory; peer has 24 GB dedicated" in text
    assert "peer has 48 GB dedicated" in text and "peer has 32 GB unified" in text


# ---- measured free memory (the --measured-from seam replays NVML readings) -------------------------

def write_measured(path, used_gb: float, total_gb: float = 24.0):
    """Recorded NVML readings of one GPU with `used_gb` in use, for a peer's --measured-from."""
    reading = {"index": 0, "util_gpu": 50, "memory_used": int(used_gb * GB), "memory_total": int(total_gb * GB)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"nvml": [reading]}))
    tmp.replace(path)  # the peer's sampler never reads half a file
    return path


def measured_peer(peer_factory, where, name: str, used_gb: float, key: str):
    measured = write_measured(where / f"{name}-measured.json", used_gb)
    override = write_override(where / f"{name}.json", "cuda", memory_gb=24.0)
    peer_factory(name, "--concurrency", "2", "--preload", "json", "--advertise-override", str(override),
                 "--measured-from", str(measured), key=key)
    return measured


def peer_status(client: Client, name: str) -> dict:
    record = next(r for r in client.directory.records() if r.advert.name == name)
    return client.status(record)


def test_memory_in_use_outside_gpulayer_holds_a_task_back_until_it_is_freed(peer_factory, tmp_path):
    key = new_key()
    measured = measured_peer(peer_factory, tmp_path, "mem-shared-card", used_gb=20.0, key=key)
    with closing(Client(key=key.encode(), echo_output=False)) as client:
        assert client.submit(occupy, (0.0, 0.0), req=Requirements.build(accelerator="cuda")).result(30)["peer"] == "mem-shared-card"
        future = client.submit(occupy, (8.0, 0.0), req=Requirements.build(gpu_memory_gb=8), timeout=60)
        status = wait_until(lambda: (s := peer_status(client, "mem-shared-card"))["load"][1] == 1 and s, timeout=10)
        assert status["unreserved_gb"] == {"cuda:0": 24.0}  # nothing reserved: the memory is used outside
        assert status["free"] == pytest.approx(4.0, abs=0.01)  # 24 GB less the 20 GB measured in use
        assert not future.done()
        write_measured(measured, used_gb=2.0)  # the other program lets go of its memory
        assert future.result(30)["memory_gb"] == 8.0


def test_the_submitter_prefers_the_peer_where_the_memory_is_free_now(peer_factory, tmp_path):
    key = new_key()
    measured_peer(peer_factory, tmp_path, "mem-full-card", used_gb=20.0, key=key)
    measured_peer(peer_factory, tmp_path, "mem-idle-card", used_gb=0.0, key=key)
    with closing(Client(key=key.encode(), echo_output=False)) as client:
        for name in ("mem-full-card", "mem-idle-card"):  # one task each: the submitter hears their reports
            assert client.submit(occupy, (0.0, 0.0), req=Requirements.build(accelerator="cuda", peer=name)).result(30)["peer"] == name
        runs = [client.submit(occupy, (8.0, 0.0), req=Requirements.build(gpu_memory_gb=8)).result(30) for _ in range(8)]
        assert {r["peer"] for r in runs} == {"mem-idle-card"}
