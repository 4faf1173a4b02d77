"""The one vocabulary of accelerators, shared by matching, resources, the peer, the API and the trainer.

It imports nothing heavy (no torch): submitters, peers and workers all use it. A rule about
an accelerator (which names exist, the order "auto" tries, what MPS cannot do) lives here
and only here.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

CPU, CUDA, MPS = "cpu", "cuda", "mps"
GPU = "gpu"  # a task's alias: cuda or mps, whichever the peer has
AUTO = "auto"  # the trainer's choice: the first of AUTO_ORDER that is present

KINDS = (CPU, CUDA, MPS)  # what a machine (and a device) can be
GPU_KINDS = (CUDA, MPS)  # in the order a machine with both reports its accelerator
AUTO_ORDER = (CUDA, MPS, CPU)
TASK_CHOICES = (None, CPU, CUDA, MPS, GPU)  # gl.run(accelerator=...)
TRAINER_CHOICES = (AUTO, CPU, CUDA, MPS, GPU)  # glt.Trainer(accelerator=...)

ENV_DEVICE = "GPULAYER_DEVICE"  # set by a peer inside a task: "cpu", "cuda:0" or "mps"
ENV_DEVICE_INDEX = "GPULAYER_DEVICE_INDEX"

DEDICATED, UNIFIED = "dedicated", "unified"  # a GPU's memory: its own (VRAM), or the system's (Apple, GB10)
MEMORY_KIND = {CUDA: DEDICATED, MPS: UNIFIED}  # the default memory kind of each GPU kind
HOST_MEMORY = "host"  # the memory kind of a machine without a GPU
NCCL, UNSUPPORTED = "nccl", "unsupported"  # a device's multi-device backend, or none
DISTRIBUTED = {CUDA: NCCL, MPS: UNSUPPORTED}  # the multi-device backend of each GPU kind

# The MPS facts: one device in one process, no float64, full precision only, unified memory.
MPS_MAX_DEVICES = 1
MPS_PRECISIONS = ("32-true",)
MPS_HAS_FLOAT64 = False


def is_gpu(kind: str | None) -> bool:
    return kind in GPU_KINDS


def has_float64(kind: str) -> bool:
    """Whether tensors of float64 exist on accelerator `kind` (not on MPS)."""
    return kind != MPS or MPS_HAS_FLOAT64


def mps_precision_problem(precision: str) -> str | None:
    """Why MPS cannot train in `precision` ("32-true", "64-true", "bf16-mixed", ...); None when it can."""
    if precision in MPS_PRECISIONS:
        return None
    why = "MPS has no float64" if precision == "64-true" else "mixed precision is not supported on MPS"
    return f"{why}; only {' or '.join(map(repr, MPS_PRECISIONS))} is supported on MPS"


def machine_accelerator(device_kinds: Container[str]) -> str:
    """A machine's accelerator from the kinds of its devices: cuda, else mps, else cpu."""
    return next((kind for kind in GPU_KINDS if kind in device_kinds), CPU)


def auto_choice(present: Mapping[str, object] | set[str] | Callable[[str], bool]) -> str:
    """The first of AUTO_ORDER that is present (cpu always is)."""
    has = present if callable(present) else present.__contains__
    return next((kind for kind in AUTO_ORDER if kind == CPU or has(kind)), CPU)
