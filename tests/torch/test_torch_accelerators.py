"""Accelerator and precision rules, with the hardware replaced through the availability seam."""
import re

import pytest
import torch

import gpulayer.torch as glt
from gpulayer.torch import accelerators

CUDA2 = {"cuda": 2, "cpu": 8}
MAC = {"mps": 1, "cpu": 8}
CPU = {"cpu": 8}


@pytest.fixture
def present(monkeypatch):
    def set_present(found):
        monkeypatch.setattr(accelerators, "available_accelerators", lambda: dict(found))
    return set_present


def make(**kwargs):
    return glt.Trainer(enable_progress_bar=False, **kwargs)


def test_error_types():
    assert issubclass(glt.AcceleratorUnavailable, RuntimeError)
    assert issubclass(glt.UnsupportedConfiguration, ValueError)


@pytest.mark.parametrize("found, expected", [
    ({"cuda": 1, "mps": 1, "cpu": 8}, "cuda"), (MAC, "mps"), (CPU, "cpu")])
def test_auto_prefers_cuda_then_mps_then_cpu(present, found, expected):
    present(found)
    assert make().accelerator == expected


def test_gpu_means_cuda_or_mps(present):
    present(CUDA2)
    assert make(accelerator="gpu").accelerator == "cuda"
    present(MAC)
    assert make(accelerator="gpu").accelerator == "mps"
    present(CPU)
    with pytest.raises(glt.AcceleratorUnavailable, match="present: cpu"):
        make(accelerator="gpu")


@pytest.mark.parametrize("found, asked, present_text", [
    (CPU, "cuda", "cpu"), (CPU, "mps", "cpu"), (CUDA2, "mps", "cuda (2 devices), cpu"),
    (MAC, "cuda", "mps (1 device), cpu")])
def test_absent_accelerator_names_what_is_present(present, found, asked, present_text):
    present(found)
    message = f"'{asked}' is not present; present: {present_text}"
    with pytest.raises(glt.AcceleratorUnavailable, match=re.escape(message)):
        make(accelerator=asked)


def test_more_cuda_devices_than_present(present):
    present(CUDA2)
    with pytest.raises(glt.AcceleratorUnavailable, match="devices=3"):
        make(accelerator="cuda", devices=3)
    assert make(accelerator="cuda", devices=2).placement.devices == 2


def test_gpulayer_device_steers_auto(present, monkeypatch):
    present(CUDA2)
    monkeypatch.setenv("GPULAYER_DEVICE", "cpu")
    assert make().accelerator == "cpu"
    monkeypatch.setenv("GPULAYER_DEVICE", "cuda:1")
    trainer = make()
    assert (trainer.accelerator, trainer.placement.index) == ("cuda", 1)
    assert make(accelerator="cuda").placement.index == 1  # same type: the peer's device index is kept
    assert make(accelerator="cpu").accelerator == "cpu"  # an explicit other type wins
    with pytest.raises(glt.UnsupportedConfiguration, match="pins one device"):
        make(devices=2)
    monkeypatch.setenv("GPULAYER_DEVICE", "mps")
    with pytest.raises(glt.AcceleratorUnavailable, match="cannot use mps"):
        make()
    monkeypatch.setenv("GPULAYER_DEVICE", "tpu-ish")
    with pytest.raises(glt.UnsupportedConfiguration, match="GPULAYER_DEVICE"):
        make()


def test_gpulayer_device_on_real_cpu(monkeypatch):
    monkeypatch.setenv("GPULAYER_DEVICE", "cpu")
    trainer = make(max_epochs=1)
    assert trainer.accelerator == "cpu"


@pytest.mark.parametrize("kwargs, match", [
    ({"devices": 2}, "MPS trains on one device"),
    ({"num_nodes": 2}, "MPS trains on one device.*use MLX distributed .* or accelerator=\"cpu\" with gloo"),
    ({"precision": "bf16-mixed"}, "only '32-true' is supported on MPS"),
    ({"precision": "16-mixed"}, "only '32-true' is supported on MPS"),
    ({"precision": "64-true"}, "MPS has no float64"),
])
def test_mps_rules_raise_at_construction(present, kwargs, match):
    present(MAC)
    for accelerator in ("mps", "auto", "gpu"):
        with pytest.raises(glt.UnsupportedConfiguration, match=match):
            make(accelerator=accelerator, **kwargs)


def test_mps_32_true_constructs_without_touching_the_device(present, monkeypatch):
    present(MAC)
    monkeypatch.setattr(torch.Tensor, "to", lambda *a, **k: pytest.fail("device work at construction"))
    trainer = make(accelerator="mps", precision="32-true")
    assert trainer.accelerator == "mps" and trainer.device is None


@pytest.mark.parametrize("kwargs, error, match", [
    ({"precision": "16-mixed"}, glt.UnsupportedConfiguration, "needs CUDA"),
    ({"precision": "8-bit"}, glt.UnsupportedConfiguration, "precision='8-bit'"),
    ({"accelerator": "tpu"}, glt.UnsupportedConfiguration, "accelerator='tpu'"),
    ({"devices": 0}, glt.UnsupportedConfiguration, "devices must be a positive int"),
    ({"num_nodes": 2}, glt.UnsupportedConfiguration, r"trains over the ranks of a gang: .*nodes=2\)"),
    ({"accumulate_grad_batches": 0}, ValueError, "accumulate_grad_batches"),
    ({"val_check_interval": 1.5}, ValueError, "val_check_interval"),
])
def test_invalid_options(present, kwargs, error, match):
    present(CPU)
    with pytest.raises(error, match=match):
        make(**kwargs)


@pytest.mark.parametrize("found", [CUDA2, CPU])
@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed"])
def test_precisions_allowed(present, found, precision):
    present(found)
    assert make(precision=precision).precision.name == precision


def test_precision_aliases():
    assert make(precision=32).precision.name == "32-true"
    assert make(precision="bf16").precision.name == "bf16-mixed"
    assert make(precision=64).precision.name == "64-true"


def test_devices_auto_takes_every_gpu_unless_a_peer_pins_one(present, monkeypatch):
    present(CUDA2)
    assert make(devices="auto").placement.devices == 2 and make(devices=-1).num_devices == 2
    assert make(devices="auto", accelerator="cpu").num_devices == 1
    monkeypatch.setenv("GPULAYER_DEVICE", "cuda:1")
    assert make(devices="auto").placement == accelerators.Placement("cuda", 1, 1)
    monkeypatch.delenv("GPULAYER_DEVICE")
    present(MAC)
    assert make(devices="auto").placement == accelerators.Placement("mps", None, 1)
    with pytest.raises(glt.UnsupportedConfiguration, match="32-true"):
        make(devices="auto", precision="bf16-mixed")
    with pytest.raises(glt.UnsupportedConfiguration, match="one device"):
        make(devices=2, strategy="ddp")
