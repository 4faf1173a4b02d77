"""parse_facts and format_resources on recorded facts from real kinds of machines."""

import copy

import pytest

from gpulayer.resources.detect import format_resources, parse_facts

VALIDATED, DETECTED = "independent=hardware-validated", "independent=detected"

# name -> (accelerator, device lines, framework lines, python, memory line)
EXPECTED = {
    "mac_m2_max": (
        "mps",
        [f"[0] mps Apple M2 Max GPU (MPS) (32.0 GB unified) {VALIDATED} distributed=unsupported"],
        ["torch 2.5.1: torch.cpu, torch.mps", "mlx 0.21.1: mlx.cpu, mlx.metal"],
        "3.11.9",
        "32.0 GB",
    ),
    "mac_m1_bare": (
        "mps",
        [f"[0] mps Apple M1 GPU (MPS) (16.0 GB unified) {DETECTED} distributed=unsupported"],
        ["none"],
        "3.9.6",
        "16.0 GB",
    ),
    "mac_intel": ("cpu", ["none (CPU only)"], ["torch 2.2.2: torch.cpu"], "3.11.9", "32.0 GB"),
    "linux_8x_h100": (
        "cuda",
        [f"[{i}] cuda NVIDIA H100 80GB HBM3 (79.2 GB dedicated) {VALIDATED} distributed=nccl" for i in range(8)],
        ["torch 2.4.1+cu121: torch.cpu, torch.cuda"],
        "3.10.12",
        "2015.3 GB",
    ),
    "linux_2x_4090_torch_cpu": (
        "cuda",
        [f"[{i}] cuda NVIDIA GeForce RTX 4090 (24.0 GB dedicated) {DETECTED} distributed=unsupported" for i in (0, 1)],
        ["torch 2.13.0+cpu: torch.cpu"],
        "3.11.7",
        "251.8 GB",
    ),
    "linux_cpu_mlx": ("cpu", ["none (CPU only)"], ["mlx 0.32.4: mlx.cpu"], "3.12.3", "62.8 GB"),
    "linux_h200_recorded": (
        "cuda",
        [f"[0] cuda NVIDIA H200 (139.8 GB dedicated) {VALIDATED} distributed=nccl"],
        ["torch 2.11.0+cu130: torch.cpu, torch.cuda"],
        "3.12.3",
        "125.8 GB",
    ),
}


def report_lines(res, label):
    return [line[10:] for line in format_resources(res).splitlines() if line[:10].rstrip() == label]


@pytest.mark.parametrize("name", EXPECTED)
def test_parse_recorded_facts(load_facts, name):
    accelerator, devices, frameworks, python, memory = EXPECTED[name]
    facts = load_facts(name)
    res = parse_facts(facts)
    assert res.accelerator == accelerator
    assert report_lines(res, "device") == devices
    assert report_lines(res, "framework") == frameworks
    assert res.python == python
    assert report_lines(res, "memory") == [memory]
    assert (res.host, res.system, res.machine) == (facts["hostname"], facts["system"], facts["machine"])
    assert res.source == "detected"


@pytest.mark.parametrize("name", EXPECTED)
def test_parse_is_pure(load_facts, name):
    facts = load_facts(name)
    before = copy.deepcopy(facts)
    assert parse_facts(facts) == parse_facts(facts)
    assert facts == before


def test_format_mac_report(load_facts):
    facts = load_facts("mac_m2_max")
    assert format_resources(parse_facts(facts), python_path=facts["probe_python"]).splitlines() == [
        "host      Annas-MacBook-Pro.local (Darwin arm64)",
        "cpu       12 x Apple M2 Max",
        "memory    32.0 GB",
        "python    3.11.9 (/Users/anna/.venvs/ml/bin/python)",
        f"device    [0] mps Apple M2 Max GPU (MPS) (32.0 GB unified) {VALIDATED} distributed=unsupported",
        "framework torch 2.5.1: torch.cpu, torch.mps",
        "framework mlx 0.21.1: mlx.cpu, mlx.metal",
        "source    detected",
    ]


def test_format_bare_reports(load_facts):
    lines = format_resources(parse_facts(load_facts("mac_m1_bare"))).splitlines()
    assert lines[4:] == [
        "device    [0] mps Apple M1 GPU (MPS) (16.0 GB unified) independent=detected distributed=unsupported",
        "framework none",
        "source    detected",
    ]
    assert "device    none (CPU only)" in format_resources(parse_facts(load_facts("linux_cpu_mlx"))).splitlines()


def test_mps_unknown_brand_and_mlx_only_validation(load_facts):
    facts = load_facts("mac_m2_max")
    facts["cpu_brand"] = None
    facts["probe"]["torch"] = None  # metal validated by mlx alone still counts
    assert format_resources(parse_facts(facts)).splitlines()[4] == (
        "device    [0] mps Apple arm64 GPU (MPS) (32.0 GB unified) independent=hardware-validated distributed=unsupported"
    )


def test_mps_memory_falls_back_to_ram(load_facts):
    facts = load_facts("mac_m1_bare")
    facts["sysctl"]["hw.memsize"] = None
    assert parse_facts(facts).devices[0].memory_gb == 16.0


def test_cuda_device_whose_op_failed_is_only_detected(load_facts):
    facts = load_facts("linux_8x_h100")
    facts["probe"]["torch"]["cuda"]["devices"][3].update(ok=False, error="RuntimeError: CUDA error: ECC error")
    validation = [d.validation for d in parse_facts(facts).devices]
    assert validation == ["hardware-validated"] * 3 + ["detected"] + ["hardware-validated"] * 4


def test_torch_device_list_wins_over_nvidia_smi(load_facts):
    facts = load_facts("linux_8x_h100")
    cuda = facts["probe"]["torch"]["cuda"]
    cuda["devices"] = cuda["devices"][:2]  # CUDA_VISIBLE_DEVICES=0,1
    assert len(parse_facts(facts).devices) == 2


def test_nvidia_smi_failure_gives_no_devices(load_facts):
    facts = load_facts("linux_2x_4090_torch_cpu")
    facts["nvidia_smi"] = {
        "stdout": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n\n",
        "error": "exit 9: ",
    }
    assert parse_facts(facts).devices == []


def test_nvidia_smi_without_memory_is_unified(load_facts):
    facts = load_facts("linux_2x_4090_torch_cpu")
    facts["nvidia_smi"]["stdout"] = "0, NVIDIA GB10, [N/A]\n"
    (device,) = parse_facts(facts).devices
    assert (device.name, device.memory_gb, device.memory_kind) == ("NVIDIA GB10", 251.8, "unified")


def test_failed_probe_leaves_system_facts(load_facts):
    facts = load_facts("linux_8x_h100")
    facts["probe"] = {"error": "TimeoutExpired: Command '['python', 'probe.py']' timed out after 60 seconds"}
    res = parse_facts(facts)
    assert (res.python, res.frameworks, res.cpu_count) == ("", [], 224)
    assert {d.validation for d in res.devices} == {"detected"}
    assert {d.distributed for d in res.devices} == {"unsupported"}
