"""Reading what `Module.configure_optimizers` returns."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau

_SCHEDULER_KEYS = {"scheduler", "interval", "monitor", "frequency", "strict", "name"}


@dataclass
class SchedulerConfig:
    scheduler: Any
    interval: str = "epoch"  # "epoch" | "step"
    monitor: str | None = None  # the metric ReduceLROnPlateau reads
    frequency: int = 1  # step every `frequency` epochs or batches
    strict: bool = True  # a monitor that was not logged raises (False: warns and skips the step)
    name: str | None = None

    def __post_init__(self):
        if isinstance(self.frequency, bool) or not isinstance(self.frequency, int) or self.frequency < 1:
            raise ValueError(f"lr_scheduler frequency={self.frequency!r}; use a positive int")
        if self.interval not in ("epoch", "step"):
            raise ValueError(f"lr_scheduler interval={self.interval!r}; use 'epoch' or 'step'")
        if isinstance(self.scheduler, ReduceLROnPlateau) and self.monitor is None:
            raise ValueError("ReduceLROnPlateau needs a metric: return {'scheduler': ..., 'monitor': 'val_loss'}")


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) and value else value


def _one(value: Any, what: str) -> Any:
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"configure_optimizers returned {len(value)} {what}s; glt.Trainer supports one")
        return value[0]
    return value


def _scheduler(value: Any, monitor: str | None) -> SchedulerConfig | None:
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return None
    value = _one(value, "scheduler")
    if isinstance(value, dict):
        unknown = set(value) - _SCHEDULER_KEYS
        if unknown:
            raise ValueError(f"unsupported lr_scheduler keys {sorted(unknown)}; supported: {sorted(_SCHEDULER_KEYS)}")
        return SchedulerConfig(**{"monitor": monitor, **value})
    return SchedulerConfig(value, monitor=monitor)


def parse(config: Any) -> tuple[Optimizer, SchedulerConfig | None]:
    """Accepts: opt; [opt]; (opt, sched); ([opt], [sched]);
    {"optimizer": opt, "lr_scheduler": sched | {"scheduler": sched, "interval": ..., "frequency": ..., "monitor": ...,
    "strict": ..., "name": ...}, "monitor": ...}.
    """
    if isinstance(config, dict):
        optimizer, scheduler = config.get("optimizer"), _scheduler(config.get("lr_scheduler"), config.get("monitor"))
    elif isinstance(config, (list, tuple)) and len(config) == 2 and not isinstance(_first(config[1]), Optimizer):
        optimizer, scheduler = _one(config[0], "optimizer"), _scheduler(config[1], None)
    else:
        optimizer, scheduler = _one(config, "optimizer"), None
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"configure_optimizers must return a torch.optim.Optimizer (optionally with a scheduler); "
                        f"got {type(config).__name__}")
    return optimizer, scheduler
