"""Which device a Trainer runs on, and the rules for accelerators.

`available_accelerators` is the one place that asks torch what is present; tests
replace it to exercise the rules for hardware this machine lacks.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from ..accelerators import (AUTO, AUTO_ORDER, CPU, CUDA, ENV_DEVICE, GPU, GPU_KINDS, MPS, MPS_MAX_DEVICES,
                            TRAINER_CHOICES, auto_choice, is_gpu)

ACCELERATORS = TRAINER_CHOICES
PRIORITY = AUTO_ORDER  # the order "auto" tries


class AcceleratorUnavailable(RuntimeError):
    """The requested accelerator (or number of devices) is not present here."""


class UnsupportedConfiguration(ValueError):
    """A Trainer option that the chosen accelerator cannot honour."""


def available_accelerators() -> dict[str, int]:
    """Accelerator types present on this machine -> number of devices of that type."""
    present = {}
    if torch.cuda.is_available():
        present[CUDA] = torch.cuda.device_count()
    if torch.backends.mps.is_available():
        present[MPS] = MPS_MAX_DEVICES
    present[CPU] = os.cpu_count() or 1
    return present


@dataclass(frozen=True)
class Placement:
    """Where training runs: an accelerator type, an optional device index, and a process count."""

    kind: str  # "cpu" | "cuda" | "mps"
    index: int | None
    devices: int
    nodes: int = 1  # the ranks of the gang it trains over (num_nodes; docs/gangs.md)

    def device(self, rank: int = 0) -> torch.device:
        """The device of process `rank` (cuda: one GPU per process)."""
        if self.kind != CUDA:
            return torch.device(self.kind)
        if self.devices > 1:
            return torch.device(CUDA, rank)
        return torch.device(CUDA, self.index if self.index is not None else torch.cuda.current_device())


def _describe(present: dict[str, int]) -> str:
    return ", ".join(f"{k} ({n} device{'s' if n != 1 else ''})" if k != CPU else k for k, n in present.items())


def _env_device() -> torch.device | None:
    spec = os.environ.get(ENV_DEVICE)
    if not spec:
        return None
    try:
        return torch.device(spec)
    except RuntimeError as e:
        raise UnsupportedConfiguration(f"{ENV_DEVICE}={spec!r} is not a torch device name") from e


def _missing_backend(kind: str, present: dict[str, int]) -> str:
    """Why the device a peer gave this task is not usable: the job's torch lacks that backend."""
    check = "torch.backends.mps.is_available()" if kind == MPS else "torch.cuda.is_available()"
    return (f"the peer gave this task {ENV_DEVICE}={os.environ[ENV_DEVICE]!r}, but torch {torch.__version__} "
            f"in this job interpreter ({sys.executable}) cannot use {kind} ({check} is False; present: "
            f"{_describe(present)}). Install a torch build with {kind} support in the peer's job interpreter "
            f"(gpulayer join --python ...), or ask for accelerator='cpu'")


def resolve(accelerator: str = AUTO, devices: int = 1, num_nodes: int = 1) -> Placement:
    """Pick the device for `Trainer(accelerator, devices, num_nodes)`, enforcing the rules.

    "auto" honours GPULAYER_DEVICE when set, else picks cuda, then mps, then cpu; "gpu" means
    cuda or mps. An explicit accelerator of the same type as GPULAYER_DEVICE takes its index.
    """
    if accelerator not in ACCELERATORS:
        raise UnsupportedConfiguration(f"accelerator={accelerator!r}; choose one of {', '.join(ACCELERATORS)}")
    if not isinstance(devices, int) or devices < 1:
        raise UnsupportedConfiguration(f"devices must be a positive int, got {devices!r}")
    present = available_accelerators()
    env = _env_device()
    if accelerator == AUTO:
        kind = env.type if env is not None else auto_choice(present)
    elif accelerator == GPU:
        if env is not None and is_gpu(env.type):
            kind = env.type
        else:
            kind = next((k for k in GPU_KINDS if k in present), None)
            if kind is None:
                raise AcceleratorUnavailable(f"accelerator='gpu' needs cuda or mps; present: {_describe(present)}")
    else:
        kind = accelerator
    if kind not in present:
        if env is not None and env.type == kind:
            raise AcceleratorUnavailable(_missing_backend(kind, present))
        raise AcceleratorUnavailable(f"accelerator {kind!r} is not present; present: {_describe(present)}")
    index = env.index if env is not None and env.type == kind else None

    if kind == MPS and (devices > MPS_MAX_DEVICES or num_nodes > 1):
        across = ("; for a group of Macs, use MLX distributed (gl.distributed.init(\"mlx\") in a gang) or "
                  "accelerator=\"cpu\" with gloo") if num_nodes > 1 else ""
        raise UnsupportedConfiguration(
            f"MPS trains on one device in one process; got devices={devices}, num_nodes={num_nodes}{across}"
        )
    if num_nodes != 1:
        _check_gang(num_nodes, devices)
    if kind == CUDA and devices > present[CUDA]:
        raise AcceleratorUnavailable(f"devices={devices} CUDA GPUs requested; present: {_describe(present)}")
    if index is not None and devices > 1:
        raise UnsupportedConfiguration(
            f"{ENV_DEVICE}={os.environ[ENV_DEVICE]!r} pins one device; devices={devices} cannot be honoured"
        )
    return Placement(kind, index, devices, num_nodes)


def _check_gang(num_nodes: int, devices: int) -> None:
    """num_nodes > 1 trains over the ranks of the gang this runs in, `devices` processes each (docs/gangs.md)."""
    world = os.environ.get("WORLD_SIZE") if os.environ.get("GPULAYER_RANK_ADDR") else None
    if world is None:
        raise UnsupportedConfiguration(f"num_nodes={num_nodes} trains over the ranks of a gang: run the function "
                                       f"that calls fit with gl.run(train, nodes={num_nodes})")
    if world != str(num_nodes):
        raise UnsupportedConfiguration(f"num_nodes={num_nodes} in a gang of {world} ranks: a gang trains with "
                                       "num_nodes equal to its nodes=")
