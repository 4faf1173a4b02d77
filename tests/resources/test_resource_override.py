"""--advertise-override files: applied as documented, rejected with clear errors."""

import json
import re

import pytest

from gpulayer.resources.detect import parse_facts
from gpulayer.resources.model import Device, Framework
from gpulayer.resources.override import apply_override, load_override

MAC = {
    "system": "Darwin",
    "machine": "arm64",
    "cpu_name": "Apple M2 Max",
    "memory_gb": 32,
    "devices": [{"kind": "mps", "name": "Apple M2 Max GPU (MPS)", "memory_gb": 32}],
    "frameworks": [{"name": "torch", "version": "2.5.1", "capabilities": ["torch.cpu", "torch.mps"]}],
}


@pytest.fixture
def linux(load_facts):
    return parse_facts(load_facts("linux_cpu_mlx"))


@pytest.fixture
def write(tmp_path):
    def write(data, text=None):
        path = tmp_path / "override.json"
        path.write_text(json.dumps(data) if text is None else text)
        return path

    return write


def test_mps_override(linux, write):
    path = write(MAC)
    res = apply_override(linux, load_override(path), str(path))
    assert (res.accelerator, res.memory_kind, res.source) == ("mps", "unified", f"override:{path}")
    assert res.devices == [Device(0, "mps", "Apple M2 Max GPU (MPS)", 32.0, "unified", "override", "unsupported")]
    assert res.frameworks == [Framework("torch", "2.5.1", ("torch.cpu", "torch.mps"))]
    assert (res.host, res.cpu_count, res.python) == (linux.host, linux.cpu_count, linux.python)  # kept as detected


def test_source_is_the_override_path(linux):
    for source in ("/etc/gpulayer/mac.json", "override:/etc/gpulayer/mac.json"):
        assert apply_override(linux, MAC, source).source == "override:/etc/gpulayer/mac.json"
    with pytest.raises(ValueError, match=r"^advertise override /etc/o\.json: host"):
        apply_override(linux, {"host": 1}, "override:/etc/o.json")


def test_cuda_defaults_and_partial_override(linux):
    data = {"devices": [{"kind": "cuda", "name": "NVIDIA A100-SXM4-80GB", "memory_gb": 80}] * 2, "cpu_count": 64}
    res = apply_override(linux, data, "a.json")
    assert [(d.index, d.memory_kind, d.distributed, d.validation) for d in res.devices] == [
        (0, "dedicated", "nccl", "override"),
        (1, "dedicated", "nccl", "override"),
    ]
    assert (res.cpu_count, res.frameworks) == (64, linux.frameworks)


def test_empty_devices_advertise_cpu_only(load_facts):
    res = apply_override(parse_facts(load_facts("linux_8x_h100")), {"devices": []}, "cpu.json")
    assert res.accelerator == "cpu"


def device(**fields):
    return {"devices": [{"kind": "mps", "name": "Apple M2 GPU (MPS)", "memory_gb": 8, **fields}]}


def framework(**fields):
    return {"frameworks": [{"name": "torch", "version": "2.5.1", **fields}]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([MAC], "expected a JSON object, got"),
        ({"gpus": []}, "unknown field 'gpus' (known: host, system,"),
        ({"source": "detected"}, "unknown field 'source'"),
        (device(kind="rocm"), "devices[0].kind: expected 'cuda' or 'mps', got 'rocm'"),
        (device(memory_gb=-1), "devices[0].memory_gb: expected a number >= 0, got -1"),
        (device(memory_gb="32"), "devices[0].memory_gb: expected a number >= 0, got '32'"),
        ({"devices": [{"kind": "mps", "name": "M2"}]}, "devices[0]: missing required field 'memory_gb'"),
        (device(vram=8), "devices[0]: unknown field 'vram'"),
        (device(index=-1), "devices[0].index: expected an integer >= 0, got -1"),
        (device(memory_kind="shared"), "devices[0].memory_kind: expected 'dedicated' or 'unified', got 'shared'"),
        (device(memory_kind="dedicated"), "devices[0].memory_kind: an mps device shares the Mac's unified memory; "
                                          "'dedicated' is only for cuda"),
        ({"devices": {"kind": "mps"}}, "devices: expected a list, got"),
        ({"cpu_count": True}, "cpu_count: expected an integer >= 1, got True"),
        ({"cpu_count": 0}, "cpu_count: expected an integer >= 1, got 0"),
        ({"memory_gb": float("nan")}, "memory_gb: expected a number >= 0, got nan"),
        ({"host": ""}, "host: expected a non-empty string, got ''"),
        ({"python": "three"}, "python: expected a version like '2.13.0', got 'three'"),
        ({"frameworks": [{"name": "torch"}]}, "frameworks[0]: missing required field 'version'"),
        (framework(version=2.5), "frameworks[0].version: expected a non-empty string, got 2.5"),
        (framework(capabilities="torch.mps"), "frameworks[0].capabilities: expected a list"),
        (framework(capabilities=[""]), "frameworks[0].capabilities[0]: expected a non-empty string"),
    ],
)
def test_bad_override_names_file_and_field(write, linux, data, message):
    path = write(data)
    with pytest.raises(ValueError, match=re.escape(f"advertise override {path}: {message}")):
        load_override(path)
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_override(linux, data, str(path))  # dicts built in code get the same checks


def test_unreadable_files(write, tmp_path):
    with pytest.raises(ValueError, match=r"override\.json: not valid JSON"):
        load_override(write(None, text="{devices: []}"))
    with pytest.raises(ValueError, match=r"missing\.json: cannot read: No such file or directory"):
        load_override(tmp_path / "missing.json")
