"""Two or more CUDA GPUs on one host (issue 31): what no one-GPU machine can show.

1. `gpulayer resources detect` lists every GPU, each with distributed=nccl.
2. A peer with both GPUs: a devices=2 task sees both, and glt.Trainer(devices=2) inside it trains
   with DDP over NCCL to the weights of one GPU with the same global batch.
3. Two peers, one GPU each: a gang of 2 all-reduces over NCCL, and DDP over the gang gives those
   weights too.
4. Single-slot tasks at once on the 2-GPU peer land on different GPUs, and a gpu_memory_gb that
   fits one card but not two such tasks keeps them apart.

Every test skips, with its reason, where fewer than 2 CUDA GPUs are present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs; fewer are present", allow_module_level=True)

from gpulayer.client import Client  # noqa: E402
from gpulayer.matching import Requirements  # noqa: E402
from support import holds_for, new_key, wait_until  # noqa: E402

PAIR = Requirements.build(accelerator="cuda", devices=2)
ONE_GPU = Requirements.build(accelerator="cuda")
# glt_models (tests/torch) importable by the peers' workers and the DDP processes they start
PEER_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "torch"), os.environ.get("PYTHONPATH")]))}
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # NCCL's and cuBLAS's reduction orders differ from one GPU's


def fit_weights(devices: int, batch_size: int, num_nodes: int = 1) -> dict:
    """Fit the trainer tests' regressor (SGD, seed 0, unshuffled) on CUDA; its weights on the CPU."""
    import gpulayer.torch as glt
    from glt_models import Regressor, loader

    glt.seed_everything(0)
    model = Regressor(hidden=32, lr=0.05, optimizer="sgd")
    glt.Trainer(accelerator="cuda", devices=devices, num_nodes=num_nodes, max_epochs=2, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
                ).fit(model, loader(256, batch_size=batch_size))
    return {name: value.detach().cpu() for name, value in model.state_dict().items()}


def assert_same_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **TOLERANCE)


def ddp_task() -> dict:
    """In a devices=2 task: what it sees, and the weights of DDP over both GPUs on batches of 8 each."""
    import os

    import torch

    return {"visible": os.environ["CUDA_VISIBLE_DEVICES"], "count": torch.cuda.device_count(),
            "weights": fit_weights(devices=2, batch_size=8)}


@pytest.fixture(scope="module")
def both_gpus(peer_factory):
    """A peer with both GPUs (its detection, no override) and a submitter of its cluster."""
    key = new_key()
    peer_factory("two-gpus", key=key, env=PEER_ENV)
    client = Client(key=key.encode(), echo_output=False)
    yield client
    client.close()


def test_resources_detect_lists_every_gpu_with_nccl():
    out = subprocess.run([sys.executable, "-m", "gpulayer.cli", "resources", "detect", "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    devices = json.loads(out.stdout)["devices"]
    assert [d["kind"] for d in devices] == ["cuda"] * torch.cuda.device_count()
    assert {d["distributed"] for d in devices} == {"nccl"}


def test_a_two_device_task_trains_ddp_over_nccl_to_the_weights_of_one_gpu(both_gpus):
    result = both_gpus.submit(ddp_task, req=PAIR).result(600)
    assert (result["visible"], result["count"]) == ("0,1", 2)
    assert_same_weights(result["weights"], fit_weights(devices=1, batch_size=16))


def nccl_sum_on(mib: int) -> tuple[str, str, float]:
    """In a gang rank: join NCCL, all-reduce `mib` MiB of (rank + 1); the backend, the GPU it was given
    (CUDA_VISIBLE_DEVICES) and one element of the sum."""
    import os

    import torch
    import torch.distributed as dist

    import gpulayer as gl

    gl.distributed.init()
    total = torch.full((mib << 18,), float(os.environ["RANK"]) + 1, device=gl.device())
    dist.all_reduce(total)
    return dist.get_backend(), os.environ["CUDA_VISIBLE_DEVICES"], total[-1].item()


@pytest.fixture(scope="module")
def one_gpu_each(peer_factory):
    """Two peers of one cluster on loopback, each given one GPU (CUDA_VISIBLE_DEVICES)."""
    key = new_key()
    for index in (0, 1):
        peer_factory(f"gpu{index}", key=key, env={**PEER_ENV, "CUDA_VISIBLE_DEVICES": str(index)})
    client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    client.start()
    assert client.directory.wait_for(lambda records: len(records) == 2, 60)
    yield client
    client.close()


def test_a_gang_of_two_peers_all_reduces_over_nccl(one_gpu_each):
    ranks = one_gpu_each.submit_gang(nccl_sum_on, (64,), {}, req=ONE_GPU, nodes=2).result(600)
    assert [(backend, total) for backend, _, total in ranks] == [("nccl", 3.0)] * 2
    assert {gpu for _, gpu, _ in ranks} == {"0", "1"}  # each rank on its own peer's GPU


def test_ddp_over_a_gang_of_two_gives_the_weights_of_one_gpu(one_gpu_each):
    ranks = one_gpu_each.submit_gang(fit_weights, (1, 8, 2), {}, req=ONE_GPU, nodes=2).result(600)
    single = fit_weights(devices=1, batch_size=16)
    for weights in ranks:
        assert_same_weights(weights, single)


def hold_until_released(folder: str) -> str:
    """Note this task's GPU in `folder`, then wait (bounded) for the test's release file."""
    import os
    import time

    visible = os.environ["CUDA_VISIBLE_DEVICES"]
    Path(folder, f"started-{os.getpid()}").write_text(visible)
    deadline = time.monotonic() + 120
    while not Path(folder, "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return visible


def started_on(folder: Path) -> list[str]:
    return sorted(p.read_text() for p in folder.glob("started-*"))


@pytest.mark.parametrize("slots, memory_share", [(None, None), ("2", 0.6)], ids=["one-slot-per-gpu", "memory-keeps-apart"])
def test_two_single_gpu_tasks_at_once_land_on_different_gpus(peer_factory, tmp_path, slots, memory_share):
    """Two tasks at once take one GPU each. With 2 slots a GPU (--concurrency 2: GPU 0's two slots come
    first) and tasks that each ask for 60% of a card, a third such task waits: neither card has room
    for a second one."""
    key = new_key()
    peer_factory(f"spread-{slots}", *(("--concurrency", slots) if slots else ()), key=key)
    client = Client(key=key.encode(), echo_output=False)
    try:
        card_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
        req = Requirements.build(accelerator="cuda", gpu_memory_gb=memory_share * card_gb if memory_share else None)
        futures = [client.submit(hold_until_released, (str(tmp_path),), req=req) for _ in range(2 if slots is None else 3)]
        wait_until(lambda: len(started_on(tmp_path)) >= 2, 120)
        if slots:
            holds_for(lambda: len(started_on(tmp_path)) == 2, 2.0)
        assert started_on(tmp_path)[:2] == ["0", "1"]
        (tmp_path / "release").touch()
        assert sorted(f.result(180) for f in futures[:2]) == ["0", "1"]
        for future in futures[2:]:
            future.result(180)
    finally:
        client.close()
