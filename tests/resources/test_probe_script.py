"""probe.py as the job interpreter runs it: stdlib only, and never crashing on a framework."""

import json
import logging
import platform
import subprocess
import sys

import pytest

from gpulayer.resources.detect import PROBE, collect_facts, parse_facts

FAKE_CUDA_TORCH = '''
"""A torch stand-in: CUDA with two GPUs, the second failing its op; no torch.backends.mps."""
__version__ = "2.4.1+cu121"


class _Props:
    name, total_memory = "NVIDIA H100 80GB HBM3", 85029158912


class cuda:
    is_available = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 2)
    get_device_properties = staticmethod(lambda index: _Props)


class distributed:
    is_available = is_nccl_available = staticmethod(lambda: True)


class backends:
    pass


class _Tensor(list):
    def __pow__(self, n):
        return _Tensor(x**n for x in self)

    def sum(self):
        return _Tensor([sum(self)])

    def item(self):
        return self[0]


def arange(n, device):
    if device == "cuda:1":
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
    return _Tensor(float(i) for i in range(int(n)))
'''


def run_probe(*flags) -> dict:
    done = subprocess.run([sys.executable, *flags, str(PROBE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def fake_package(tmp_path, monkeypatch, source: str) -> None:
    """Put a `torch` package with this source ahead of site-packages for the probe."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))


def test_isolated_mode_is_stdlib_only():
    torch = pytest.importorskip("torch")
    probe = run_probe("-I")
    assert probe["torch"]["version"] == torch.__version__
    assert probe["torch"]["mps"] == {"built": False, "available": False, "ok": None, "error": None}
    assert probe["mlx"]["backends"]["cpu"] == {"available": True, "ok": True, "error": None}
    assert probe["python"] == {"version": platform.python_version(), "executable": sys.executable}


def test_missing_frameworks_are_null():
    probe = run_probe("-I", "-S")  # no site-packages: neither torch nor mlx
    assert (probe["torch"], probe["mlx"]) == (None, None)


def test_broken_torch_is_an_error_and_its_output_kept_off_stdout(tmp_path, monkeypatch, caplog):
    noisy_and_broken = "import os\nprint('noise')\nos.write(1, b'C noise\\n')\nraise ImportError('broken build')\n"
    fake_package(tmp_path, monkeypatch, noisy_and_broken)
    with caplog.at_level(logging.WARNING):
        facts = collect_facts()
    assert facts["probe"]["torch"] == {"error": "ImportError: broken build"}
    assert "probe.torch: ImportError: broken build" in caplog.text
    res = parse_facts(facts)
    assert res.framework("torch") is None and res.framework("mlx") is not None


def test_cuda_devices_are_validated_one_by_one(tmp_path, monkeypatch, caplog):
    fake_package(tmp_path, monkeypatch, FAKE_CUDA_TORCH)
    facts = collect_facts()
    assert "probe.torch.cuda.devices[1]: RuntimeError: CUDA error" in caplog.text
    cuda = facts["probe"]["torch"]["cuda"]
    assert (cuda["available"], cuda["nccl"]) == (True, True)
    assert [(d["index"], d["ok"], d["error"]) for d in cuda["devices"]] == [
        (0, True, None),
        (1, False, "RuntimeError: CUDA error: uncorrectable ECC error encountered"),
    ]
    assert facts["probe"]["torch"]["mps"] == {"built": False, "available": False, "ok": None, "error": None}
    res = parse_facts(facts)
    assert [d.describe() for d in res.devices] == [
        "[0] cuda NVIDIA H100 80GB HBM3 (79.2 GB dedicated) independent=hardware-validated distributed=nccl",
        "[1] cuda NVIDIA H100 80GB HBM3 (79.2 GB dedicated) independent=detected distributed=nccl",
    ]
    assert res.framework("torch").capabilities == ("torch.cpu", "torch.cuda")
