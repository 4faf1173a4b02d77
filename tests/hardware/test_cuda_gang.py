"""A gang on a real CUDA peer (issue 29): the one-GPU smoke test, a gang of one rank with devices=1
whose gl.distributed.init() joins NCCL and all-reduces on the GPU. Skips where CUDA is absent."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here", allow_module_level=True)

from gpulayer.client import Client  # noqa: E402
from gpulayer.matching import Requirements  # noqa: E402
from support import new_key  # noqa: E402


def nccl_sum() -> tuple[str, list[float], str]:
    """Join the gang's group and all-reduce a CUDA tensor; the backend, the sum and the device."""
    import os

    import torch
    import torch.distributed as dist

    import gpulayer as gl

    gl.distributed.init()
    total = torch.full((4,), float(os.environ["RANK"]) + 1, device=gl.device())
    dist.all_reduce(total)
    return dist.get_backend(), total.cpu().tolist(), str(total.device)


def test_a_gang_of_one_cuda_rank_joins_nccl(peer_factory):
    key = new_key()
    peer_factory("cuda-gang", key=key)
    client = Client(key=key.encode(), echo_output=False)
    try:
        req = Requirements.build(accelerator="cuda", devices=1)
        assert client.submit_gang(nccl_sum, (), {}, req=req, nodes=1).result(300) == [("nccl", [1.0] * 4, "cuda:0")]
    finally:
        client.close()
