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


REDUCE_FX = ("mean", "sum", "max", "min")


def reduce_name(reduce_fx) -> str:
    """'mean', 'sum', 'max' or 'min', also for torch.mean/sum/max/min as Lightning accepts them."""
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", repr(reduce_fx))
    if name not in REDUCE_FX:
        raise ValueError(f"reduce_fx={reduce_fx!r}; use one of {', '.join(REDUCE_FX)} (or torch.mean/sum/max/min)")
    return name


def _is_metric(value) -> bool:
    """A torchmetrics Metric (or anything with its update/compute/reset), without importing torchmetrics."""
    return not isinstance(value, Tensor) and all(callable(getattr(value, name, None))
                                                 for name in ("update", "compute", "reset"))


class _Series:
    """One metric name: how it was logged, its latest value, and its epoch reduction, kept on the device."""

    __slots__ = ("on_step", "on_epoch", "reduce", "prog_bar", "logger", "last", "pending", "weights", "total", "count",
                 "metric")

    def __init__(self, on_step: bool, on_epoch: bool, reduce: str, prog_bar: bool, logger: bool):
        self.on_step, self.on_epoch, self.reduce = on_step, on_epoch, reduce
        self.prog_bar, self.logger = prog_bar, logger
        self.last: Tensor | float = 0.0
        self.pending: list[Tensor | float] = []
        self.weights: list[float] = []
        self.total: Tensor | float | None = None
        self.count = 0.0
        self.metric = None  # a torchmetrics Metric logged on_epoch: computed (and reset) at the stage's end

    def compute_metric(self, dtype: torch.dtype) -> None:
        """The epoch value of a logged Metric object, as Lightning takes it: compute(), then reset()."""
        if self.metric is not None and self.total is None:
            self.total, self.count = self.metric.compute().detach().reshape(()).to(dtype), 1.0
            self.metric.reset()

    def fold(self, dtype: torch.dtype) -> None:
        """Reduce the pending values into `total` with a few device kernels (no sync)."""
        if not self.pending:
            return
        if self.reduce in ("max", "min"):
            values = [v if isinstance(v, Tensor) else torch.tensor(v) for v in self.pending]
            device = next((v.device for v in values if v.device.type != "cpu"), values[0].device)
            stacked = torch.stack([v.to(device, dtype) for v in values])
            part = stacked.amax() if self.reduce == "max" else stacked.amin()
            if self.total is not None:
                part = torch.maximum(part, self.total) if self.reduce == "max" else torch.minimum(part, self.total)
            self.total, self.count = part, 1.0
        else:
            weighted = self.reduce == "mean"
            total = 0.0 if self.total is None else self.total
            by_weight: dict[float, list[Tensor]] = {}
            if not weighted or self.weights.count(self.weights[0]) == len(self.weights):
                by_weight[self.weights[0] if weighted else 1.0] = self.pending  # the usual case: no Python loop
            else:
                for value, weight in zip(self.pending, self.weights):
                    by_weight.setdefault(weight, []).append(value)
            for weight, values in by_weight.items():
                tensors = [v for v in values if isinstance(v, Tensor)]
                part = torch.stack(tensors).sum(dtype=dtype) if tensors else 0.0
                if len(tensors) < len(values):  # numbers logged from the host
                    part = part + sum(v for v in values if not isinstance(v, Tensor))
                total = total + (part if weight == 1.0 else part * weight)
            self.total = total
            self.count = self.count + sum(self.weights) if weighted else 1.0
        self.pending.clear()
        self.weights.clear()


class Published(dict):
    """Metric values copied to the host at a sync point, by key, with where each goes."""

    def __init__(self):
        super().__init__()
        self.logger: set[str] = set()  # keys for the loggers
        self.prog_bar: set[str] = set()  # keys for the progress bar
        self.plain: dict[str, float] = {}  # the name as logged, for callback_metrics ("loss" beside "loss_step")

    def add(self, key: str, name: str, value: float, series: _Series, to_logger: bool = True) -> None:
        self[key] = value
        self.plain[name] = value
        if series.logger and to_logger:
            self.logger.add(key)
        if series.prog_bar:
            self.prog_bar.add(key)


class MetricStore:
    """The values logged during one stage run (a training epoch, a validation or test loop).

    `on_step` values are published at log points (their latest value), `on_epoch` values at the
    end of the stage (reduced with `reduce_fx`, batch-size weighted for "mean"). Logged with
    both, a metric is published as `<name>_step` and `<name>_epoch`, as in Lightning.
    """

    def __init__(self, device: torch.device, training: bool = False):
        self.device = device
        self.training = training
        self.epoch_hook = False  # True while an epoch-level hook runs: the defaults become on_epoch
        self.series: dict[str, _Series] = {}
        self.weight = 1.0  # the current batch's size, set by the Trainer
        self.dirty = False  # something was logged since the last `means`

    def defaults(self) -> tuple[bool, bool]:
        """Lightning's (on_step, on_epoch) when the caller gives none."""
        return (True, False) if self.training and not self.epoch_hook else (False, True)

    def log(self, name: str, value: Tensor | float, prog_bar: bool = False, logger: bool = True,
            on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx="mean",
            batch_size: int | None = None) -> None:
        series = self.series.get(name)
        if series is None:
            default_step, default_epoch = self.defaults()
            on_step = default_step if on_step is None else on_step
            on_epoch = default_epoch if on_epoch is None else on_epoch
            if not (on_step or on_epoch):
                raise ValueError(f"log({name!r}, on_step=False, on_epoch=False) records nothing")
            if on_step and self.epoch_hook:
                raise ValueError(f"log({name!r}, on_step=True) in an epoch-level hook; an epoch hook logs "
                                 f"on_epoch values only")
            reduce = "metric" if _is_metric(value) else reduce_name(reduce_fx)
            series = self.series[name] = _Series(on_step, on_epoch, reduce, prog_bar, logger)
        if _is_metric(value):
            self._log_metric(name, series, value)
            return
        if series.reduce == "metric":
            raise TypeError(f"log({name!r}) was given a Metric object before; log the same kind of value each time")
        if isinstance(value, Tensor):
            if value.dim():
                if value.numel() != 1:
                    raise ValueError(f"log({name!r}) needs a scalar; got a tensor of shape {tuple(value.shape)}")
                value = value.reshape(())
            value = value.detach()
        elif isinstance(value, (int, float)):
            value = float(value)
        else:
            raise TypeError(f"log({name!r}) takes a tensor, a number or a torchmetrics Metric; got "
                            f"{type(value).__name__}")
        series.last = value
        self.dirty = True
        if series.on_epoch:
            series.pending.append(value)
            series.weights.append(self.weight if batch_size is None else float(batch_size))

    def _log_metric(self, name: str, series: _Series, metric) -> None:
        """A torchmetrics Metric: its value of this batch (what calling it returned) on_step, its
        compute() over the stage on_epoch, as in Lightning."""
        if series.reduce != "metric":
            raise TypeError(f"log({name!r}) was given tensors or numbers before, now a Metric object")
        if series.on_step:
            batch_value = getattr(metric, "_forward_cache", None)
            if batch_value is None:
                raise ValueError(f"log({name!r}, <Metric>, on_step=True) needs the metric called on this batch "
                                 f"(metric(preds, target)), not only updated")
            series.last = batch_value.detach().reshape(())
        series.metric = metric
        self.dirty = True

    def reset_metrics(self) -> None:
        """Drop what logged Metric objects accumulated (after the sanity check, as Lightning does)."""
        for series in self.series.values():
            if series.metric is not None:
                series.metric.reset()

    def _fold(self) -> None:
        dtype = accumulation_dtype(self.device)
        for series in self.series.values():
            series.fold(dtype)

    def _check_reducible(self, all_reduce) -> None:
        if all_reduce is not None:
            bad = [n for n, s in self.series.items() if s.on_epoch and s.reduce in ("max", "min")]
            if bad:
                raise ValueError(f"reduce_fx max/min of {bad} across DDP processes is not supported; "
                                 f"use 'mean' or 'sum'")

    def latest(self, all_reduce=None, world_size: int = 1) -> Published:
        """The most recent value of each `on_step` metric (averaged over processes)."""
        self._fold()  # keeps `pending` short without a sync
        step = [(n, s) for n, s in self.series.items() if s.on_step]
        values = gather([s.last for _, s in step], self.device, all_reduce)
        out = Published()
        for (name, series), value in zip(step, values):
            out.add(f"{name}_step" if series.on_epoch else name, name, value / world_size, series)
        return out

    def means(self, all_reduce=None, world_size: int = 1) -> Published:
        """Each `on_epoch` metric reduced over the stage (and over processes), and the latest
        value of each `on_step` metric: one transfer."""
        self._fold()
        self._check_reducible(all_reduce)
        for series in self.series.values():
            if series.on_epoch:
                series.compute_metric(accumulation_dtype(self.device))
        self.dirty = False
        epoch = [(n, s) for n, s in self.series.items() if s.on_epoch]
        step = [(n, s) for n, s in self.series.items() if s.on_step]
        values = gather([s.total for _, s in epoch] + [s.count for _, s in epoch] + [s.last for _, s in step],
                        self.device, all_reduce)
        n = len(epoch)
        out = Published()
        for (name, series), value in zip(step, values[2 * n:]):  # for callback_metrics, logged at log points
            out.add(f"{name}_step" if series.on_epoch else name, name, value / world_size, series, to_logger=False)
        for i, (name, series) in enumerate(epoch):
            mean = series.reduce in ("mean", "metric")  # a Metric is synced by torchmetrics: each rank holds it
            value = values[i] / values[n + i] if mean else values[i] / (values[n + i] / world_size)
            out.add(f"{name}_epoch" if series.on_step else name, name, value, series)
        return out
