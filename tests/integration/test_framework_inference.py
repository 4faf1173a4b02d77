"""Framework requirements read from the function, and frameworks= for any installed distribution
(issue 10, items 2 and 7).

Two single-slot peers advertise a Mac GPU through the documented override (there is no Mac here):
"mac" offers torch.mps, "mac-torch-cpu" has torch without torch.mps (as torch built without MPS,
or a Mac whose torch cannot use its GPU). Both run the tasks in this venv's interpreter, which
has torch (CPU), mlx (CPU), msgpack and packaging installed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os

import mlx.core as mx
import pytest
import torch
from torch import nn

import gpulayer as gl
from gpulayer.client.inference import frameworks_used
from support import write_override

TORCH_MPS = [{"name": "torch", "version": "2.13.0", "capabilities": ["torch.cpu", "torch.mps"]},
             {"name": "mlx", "version": "0.32.4", "capabilities": ["mlx.cpu", "mlx.metal"]}]
TORCH_CPU_ONLY = [{"name": "torch", "version": "2.13.0", "capabilities": ["torch.cpu"]},
                  {"name": "mlx", "version": "0.32.4", "capabilities": ["mlx.cpu", "mlx.metal"]}]
NO_MPS = "mac-torch-cpu"


@pytest.fixture(scope="module")
def macs(peer_factory, cluster_key, gl_client, tmp_path_factory):
    """gl's client, once it knows both Mac peers."""
    tmp = tmp_path_factory.mktemp("macs")
    for name, frameworks in (("mac", TORCH_MPS), (NO_MPS, TORCH_CPU_ONLY)):
        override = write_override(tmp / f"{name}.json", "mps", frameworks=frameworks)
        peer_factory(name, "--concurrency", "1", "--advertise-override", str(override), key=cluster_key)
    gl_client.start()
    assert gl_client.directory.wait_for(lambda records: len(records) == 2, 30)
    return gl_client


def torch_sum() -> tuple[str, float]:
    """Uses torch (a module global): the peer's name and a tiny CPU op."""
    return os.environ["GPULAYER_PEER_NAME"], float((torch.arange(4.0) ** 2).sum())


def peer_name() -> str:
    return os.environ["GPULAYER_PEER_NAME"]


# ---- item 2: what the function uses decides, unless frameworks= says otherwise -------------------------

def test_a_function_using_torch_on_mps_needs_a_peer_with_torch_mps(macs):
    with pytest.raises(gl.NoMatchingPeer) as info:
        gl.run(torch_sum, accelerator="mps", peer=NO_MPS)
    assert "lacks capability torch.mps (the function uses torch)" in str(info.value)
    for _ in range(3):
        assert gl.run(torch_sum, accelerator="mps") == ("mac", 14.0)


def test_a_function_not_using_torch_is_unaffected(macs):
    assert gl.run(peer_name, accelerator="mps", peer=NO_MPS) == NO_MPS


def test_explicit_frameworks_override_what_is_inferred(macs):
    assert gl.run(torch_sum, accelerator="mps", peer=NO_MPS, frameworks={"mlx": ">=0.1"}) == (NO_MPS, 14.0)
    with pytest.raises(gl.NoMatchingPeer) as info:
        gl.run(torch_sum, accelerator="mps", frameworks={"torch": ">=99"})
    assert "torch 2.13.0 does not satisfy >=99" in str(info.value)


def test_cpu_tasks_need_no_gpu_backend(macs):
    assert gl.run(torch_sum, accelerator="cpu", peer=NO_MPS) == (NO_MPS, 14.0)


# ---- item 7: frameworks= names any installed distribution, answered by the peer ----------------------

def test_frameworks_accepts_any_installed_distribution(macs):
    assert gl.run(peer_name, frameworks={"msgpack": ">=1.0", "Packaging": ""}, peer=NO_MPS) == NO_MPS


def test_a_distribution_too_old_or_missing_is_refused_with_the_reason(macs):
    installed = importlib.metadata.version("msgpack")
    with pytest.raises(gl.NoMatchingPeer) as info:
        gl.run(peer_name, frameworks={"msgpack": ">=99"}, peer=NO_MPS)
    assert f"refused the task: msgpack {installed} does not satisfy >=99" in str(info.value)
    with pytest.raises(gl.NoMatchingPeer) as info:
        gl.run(peer_name, frameworks={"coremltools": ">=7"}, peer=NO_MPS)
    assert "refused the task: coremltools is not installed in the job interpreter" in str(info.value)


# ---- what counts as using a framework ------------------------------------------------------------------

class Net(nn.Module):
    """A class shipped by value whose base comes from torch."""


MODEL = nn.Linear(1, 1)


def make_net() -> Net:
    return Net()


def uses_model() -> object:
    return MODEL


def calls_torch_sum() -> object:
    return torch_sum()


def imports_mlx_inside() -> object:
    import mlx.core

    return mlx.core


def closure_over_mx():
    array = mx.array

    def inner():
        return array([1])
    return inner


def plain(x: float) -> float:
    return math.sqrt(x)


@pytest.mark.parametrize("fn, expected", [
    (torch_sum, ("torch",)),                              # a module global
    (make_net, ("torch",)),                               # a class shipped by value, torch in its bases
    (uses_model, ("torch",)),                             # an object whose class lives in torch
    (calls_torch_sum, ("torch",)),                        # through another function shipped by value
    (imports_mlx_inside, ("mlx",)),                       # an import inside the function
    (closure_over_mx(), ("mlx",)),                        # a closure cell
    (lambda: [torch.ones(1), mx.ones(1)], ("mlx", "torch")),
    (functools.partial(torch_sum), ("torch",)),
    (torch.ones, ("torch",)),                             # pickled by reference: its module counts
    (Net().forward, ("torch",)),                          # a bound method
    (plain, ()),
    (math.sqrt, ()),
    (peer_name, ()),
])
def test_frameworks_used(fn, expected):
    assert frameworks_used(fn) == expected
