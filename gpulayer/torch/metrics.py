"""Logged metrics stay on the device; they reach the host only through `to_host`.

`Module.log` appends a detached reference to the value (no kernel, no sync). At a sync point
the Trainer asks a `MetricStore` for the latest values or the epoch means; those are packed
into one tensor, optionally all-reduced across processes, and copied to the host by a single
`to_host` call, which counts the transfers so tests can assert how many syncs a run made.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch import Tensor

from ..accelerators import CUDA, has_float64

_transfers = 0


def host_transfer_count() -> int:
    """Number of device->host metric transfers made by this process so far."""
    return _transfers


def to_host(packed: Tensor) -> list[float]:
    """Copy a 1-D tensor of metric values to the host: the one device sync for metrics."""
    global _transfers
    _transfers += 1
    with _sync_allowed(packed.device):
        return packed.tolist()


@contextlib.contextmanager
def _sync_allowed(device: torch.device):
    """Suspend torch.cuda.set_sync_debug_mode for this deliberate transfer."""
    mode = torch.cuda.get_sync_debug_mode() if device.type == CUDA else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (not on MPS), else float32."""
    return torch.float64 if has_float64(device.type) else torch.float32


def gather(values: Sequence[Tensor | float], device: torch.device,
           all_reduce: Callable[[Tensor], None] | None = None) -> list[float]:
    """Values (device tensors or python floats) as python floats, with at most one transfer.

    `all_reduce`, when given, sums all the values across processes (in one packed tensor).
    """
    on_device = [isinstance(v, Tensor) for v in values]
    tensors = [v for v, d in zip(values, on_device) if d]  # 0-dim: MetricStore.log reshapes
    floats = [float(v) for v, d in zip(values, on_device) if not d]
    dtype = accumulation_dtype(device)
    if all_reduce is not None and values:
        parts = [torch.stack(tensors).to(device=device, dtype=dtype)] if tensors else []
        if floats:
            parts.append(torch.tensor(floats, dtype=dtype).to(device, non_blocking=True))
        packed = torch.cat(parts)
        all_reduce(packed)
        host = to_host(packed)
    else:  # host floats stay on the host
        host = (to_host(torch.stack(tensors).to(device=device, dtype=dtype)) if tensors else []) + floats
    from_device, from_host = iter(host[:len(tensors)]), iter(host[len(tensors):])
    return [next(from_device) if d else next(from_host) for d in on_device]


class _Series:
    """One metric name: its latest value and a weighted running sum, kept on the device."""

    __slots__ = ("last", "pending", "weights", "total", "count")

    def __init__(self):
        self.last: Tensor | float = 0.0
        self.pending: list[Tensor | float] = []
        self.weights: list[float] = []
        self.total: Tensor | float = 0.0
        self.count = 0.0

    def fold(self, dtype: torch.dtype) -> None:
        """Add the pending values into `total` with a few device kernels (no sync)."""
        by_weight: dict[float, list[Tensor]] = {}
        for value, weight in zip(self.pending, self.weights):
            if isinstance(value, Tensor):
                by_weight.setdefault(weight, []).append(value)
            else:
                self.total = self.total + value * weight
        for weight, values in by_weight.items():
            part = torch.stack(values).sum(dtype=dtype)
            self.total = self.total + (part if weight == 1.0 else part * weight)
        self.count += sum(self.weights)
        self.pending.clear()
        self.weights.clear()


class MetricStore:
    """The values logged during one stage run (a training epoch, a validation or test loop)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.series: dict[str, _Series] = {}
        self.prog_bar: set[str] = set()
        self.weight = 1.0  # the current batch's size, set by the Trainer

    def log(self, name: str, value: Tensor | float, prog_bar: bool = False) -> None:
        series = self.series.get(name)
        if series is None:
            series = self.series[name] = _Series()
            if prog_bar:
                self.prog_bar.add(name)
        if isinstance(value, Tensor):
            if value.dim():
                if value.numel() != 1:
                    raise ValueError(f"log({name!r}) needs a scalar; got a tensor of shape {tuple(value.shape)}")
                value = value.reshape(())
            value = value.detach()
        else:
            value = float(value)
        series.last = value
        series.pending.append(value)
        series.weights.append(self.weight)

    def _fold(self) -> None:
        dtype = accumulation_dtype(self.device)
        for series in self.series.values():
            series.fold(dtype)

    def latest(self, all_reduce=None, world_size: int = 1) -> dict[str, float]:
        """The most recent value of each metric (averaged over processes)."""
        self._fold()  # keeps `pending` short without a sync
        values = gather([s.last for s in self.series.values()], self.device, all_reduce)
        return {name: v / world_size for name, v in zip(self.series, values)}

    def means(self, all_reduce=None) -> dict[str, float]:
        """The batch-size-weighted mean of each metric over the stage (and over processes)."""
        self._fold()
        totals = [s.total for s in self.series.values()]
        counts = [s.count for s in self.series.values()]
        values = gather(totals + counts, self.device, all_reduce)
        n = len(totals)
        return {name: values[i] / values[n + i] for i, name in enumerate(self.series)}
