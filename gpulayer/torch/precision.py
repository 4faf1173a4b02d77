"""Numeric precision: which dtypes a Trainer computes in, and its rules per accelerator."""
from __future__ import annotations

import contextlib

import torch

from ..accelerators import CPU, MPS, mps_precision_problem
from .accelerators import UnsupportedConfiguration

PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed")
_ALIASES = {32: "32-true", "32": "32-true", 64: "64-true", "64": "64-true",
            16: "16-mixed", "16": "16-mixed", "bf16": "bf16-mixed"}
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def normalize(precision: str | int) -> str:
    name = _ALIASES.get(precision, precision)
    if name not in PRECISIONS:
        raise UnsupportedConfiguration(f"precision={precision!r}; choose one of {', '.join(PRECISIONS)}")
    return name


def check(name: str, kind: str) -> None:
    """Raise if accelerator type `kind` cannot train in precision `name`."""
    problem = mps_precision_problem(name) if kind == MPS else None
    if problem:
        raise UnsupportedConfiguration(f"precision={name!r}: {problem}")
    if kind == CPU and name == "16-mixed":
        raise UnsupportedConfiguration("precision='16-mixed' needs CUDA; on CPU use 'bf16-mixed' or '32-true'")


class Precision:
    """Autocast, loss scaling (fp16 only) and dtype conversion for one precision on one device type."""

    def __init__(self, name: str, device_type: str):
        self.name = name
        self.device_type = device_type
        self.param_dtype = torch.float64 if name == "64-true" else None
        self.autocast = contextlib.nullcontext()
        self.scaler = None

    def setup(self) -> None:
        """Create the device-side state: the autocast context and, for fp16, the GradScaler."""
        dtype = _AUTOCAST.get(self.name)
        # one reusable context: entered once per step, never nested
        self.autocast = torch.autocast(self.device_type, dtype=dtype) if dtype else contextlib.nullcontext()
        self.scaler = torch.amp.GradScaler(self.device_type) if self.name == "16-mixed" else None

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale (before clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()

    def state_dict(self) -> dict:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
