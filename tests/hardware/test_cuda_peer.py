"""A real CUDA peer: detection, routing and a GPU task end to end. Skips where CUDA is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here", allow_module_level=True)

import gpulayer as gl  # noqa: E402
from gpulayer import serialization  # noqa: E402
from gpulayer.client import Client  # noqa: E402
from gpulayer.matching import Requirements  # noqa: E402
from support import new_key  # noqa: E402


def cuda_matmul(n):
    import torch

    import gpulayer as gl

    device = gl.device()
    a = torch.randn(n, n, device=device, generator=torch.Generator(device).manual_seed(0))
    product = a @ a
    return {"device": str(device), "name": torch.cuda.get_device_name(device),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "a": a, "product": product}


def test_resources_detect_reports_each_gpu_validated():
    out = subprocess.run([sys.executable, "-m", "gpulayer.cli", "resources", "detect", "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    data = json.loads(out.stdout)
    assert data["accelerator"] == "cuda"
    assert len(data["devices"]) == torch.cuda.device_count()
    for device in data["devices"]:
        assert device["kind"] == "cuda" and device["memory_kind"] == "dedicated"
        assert device["independent"] == "hardware-validated"
    caps = {c for f in data["frameworks"] for c in f["capabilities"]}
    assert "torch.cuda" in caps


def test_a_cuda_task_runs_on_the_gpu_and_its_tensors_come_back_on_the_cpu(peer_factory):
    key = new_key()
    peer_factory("cuda-peer", key=key)
    client = Client(key=key.encode(), echo_output=False)
    try:
        req = Requirements.build(accelerator="cuda", frameworks={"torch": ">=2.0"}, gpu_memory_gb=8)
        result = client.submit(cuda_matmul, (1024,), req=req).result(300)
        assert result["device"] == "cuda:0" and result["visible"] == "0"
        assert result["product"].device.type == "cpu"  # moved for the trip home
        torch.testing.assert_close(result["product"], result["a"] @ result["a"], rtol=1e-3, atol=1e-2)
        with pytest.raises(gl.NoMatchingPeer, match="task needs mps; peer offers cuda"):
            client.submit(cuda_matmul, (8,), req=Requirements.build(accelerator="mps"))
    finally:
        client.close()


def test_a_cuda_tensor_is_pickled_from_pinned_host_memory_and_comes_back_equal():
    t = torch.randn(1024, 513, device="cuda").t()  # not contiguous
    data, buffers = serialization.dumps({"t": t, "b": t.to(torch.bfloat16)})
    back = serialization.loads(data, [bytearray(b) for b in buffers])
    assert back["t"].device.type == "cpu" and torch.equal(back["t"], t.cpu())
    assert back["b"].dtype == torch.bfloat16 and torch.equal(back["b"], t.to(torch.bfloat16).cpu())
    assert len(buffers) == 2 and all(torch.frombuffer(b, dtype=torch.uint8).is_pinned() for b in buffers)
