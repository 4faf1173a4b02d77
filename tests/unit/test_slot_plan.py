"""How a peer turns its resources into slots and worker environments."""

from __future__ import annotations

from gpulayer.peer.scheduler import default_preload, plan_slots
from gpulayer.resources.model import Device, Framework, Resources


def resources(devices=(), frameworks=(), cpus=8) -> Resources:
    return Resources("h", "Linux", "x86_64", "cpu", cpus, 64.0, "3.11.7", list(devices), list(frameworks))


def gpu(kind, index, memory=80.0):
    return Device(index, kind, f"{kind} {index}", memory, "unified" if kind == "mps" else "dedicated")


def test_a_mac_runs_one_task_at_a_time_unless_told_otherwise():
    mac = resources([gpu("mps", 0, 32.0)])
    assert [(s.device, s.env["GPULAYER_DEVICE"]) for s in plan_slots(mac, None)] == [("mps:0", "mps")]
    assert len(plan_slots(mac, 3)) == 3


def test_each_cuda_gpu_gets_its_own_slots_and_sees_only_itself():
    box = resources([gpu("cuda", 0), gpu("cuda", 1, 24.0)])
    slots = plan_slots(box, None)
    assert [(s.device, s.env["CUDA_VISIBLE_DEVICES"], s.env["GPULAYER_DEVICE"], s.memory_gb) for s in slots] == [
        ("cuda:0", "0", "cuda:0", 80.0), ("cuda:1", "1", "cuda:0", 24.0)]
    assert [s.device for s in plan_slots(box, 2)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert len({s.index for s in plan_slots(box, 2)}) == 4


def test_cpu_slots_default_to_the_cores_and_share_them(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    slots = plan_slots(resources(cpus=8), None)
    assert len(slots) == 8 and {s.env["OMP_NUM_THREADS"] for s in slots} == {"1"}
    assert plan_slots(resources(cpus=8), 2)[0].env["OMP_NUM_THREADS"] == "4"


def test_an_operators_thread_setting_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in plan_slots(resources(cpus=8), 2)[0].env


def test_gpu_workers_preload_their_frameworks():
    torch = Framework("torch", "2.5.1", ("torch.mps",))
    mlx = Framework("mlx", "0.21.0", ("mlx.metal",))
    assert default_preload(resources([gpu("mps", 0)], [torch, mlx])) == ["torch", "mlx"]
    assert default_preload(resources([gpu("cuda", 0)], [torch, mlx])) == ["torch"]
    assert default_preload(resources([], [torch])) == []
