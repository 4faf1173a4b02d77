"""Lightning's Trainer arguments that glt reads into its own settings: devices="auto", strategy,
max_time, fast_dev_run, and the arguments accepted only at their default."""
from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

from ..accelerators import CUDA, ENV_DEVICE
from . import accelerators
from .accelerators import UnsupportedConfiguration

SINGLE = ("auto", "single_device")
DDP = ("ddp", "ddp_spawn", "ddp_notebook")

# Lightning Trainer arguments glt takes only at Lightning's default (anything else changes training)
DEFAULT_ONLY = {"overfit_batches": 0.0, "reload_dataloaders_every_n_epochs": 0, "use_distributed_sampler": True,
                "barebones": False, "plugins": None, "sync_batchnorm": False, "model_registry": None,
                "min_steps": None, "detect_anomaly": False}


def check_default_only(kwargs: dict[str, Any]) -> None:
    """Lightning arguments glt accepts at their default; anything else raises, naming it."""
    unknown = sorted(set(kwargs) - set(DEFAULT_ONLY))
    if unknown:
        raise TypeError(f"glt.Trainer got unexpected keyword arguments {unknown}")
    changed = {k: v for k, v in kwargs.items() if v != DEFAULT_ONLY[k]}
    if changed:
        raise UnsupportedConfiguration(f"glt.Trainer does not support {changed} (accepted only at Lightning's "
                                       f"defaults: {', '.join(f'{k}={DEFAULT_ONLY[k]!r}' for k in changed)})")


def auto_devices(kind: str) -> int:
    """devices="auto" (or -1): every CUDA GPU present, unless GPULAYER_DEVICE pins one; else 1."""
    if kind != CUDA or os.environ.get(ENV_DEVICE):
        return 1
    return accelerators.available_accelerators().get(CUDA, 1)


def devices_count(devices: Any) -> int:
    """A device count: an int or a string of digits (lists of indices are not supported)."""
    if isinstance(devices, str) and devices.isdigit():
        return int(devices)
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise UnsupportedConfiguration(f"devices={devices!r}: use a count or 'auto' (lists of device indices are "
                                       f"not supported; set {ENV_DEVICE} or CUDA_VISIBLE_DEVICES)")
    return devices


def check_strategy(strategy: Any, devices: int) -> None:
    """"auto", "single_device" (one device) and the DDP names (glt's spawned DDP) are accepted."""
    if not isinstance(strategy, str) or strategy not in SINGLE + DDP:
        raise UnsupportedConfiguration(f"strategy={strategy!r} is not supported by glt.Trainer; use 'auto' "
                                       f"(devices > 1 trains with DDP in spawned processes), 'single_device' or "
                                       f"one of {', '.join(DDP)}")
    if strategy == "single_device" and devices > 1:
        raise UnsupportedConfiguration(f"strategy='single_device' with devices={devices}")


def max_time_seconds(max_time: Any) -> float | None:
    """"DD:HH:MM:SS", a timedelta or a dict of timedelta arguments, in seconds."""
    if max_time is None:
        return None
    if isinstance(max_time, timedelta):
        return max_time.total_seconds()
    if isinstance(max_time, dict):
        return timedelta(**max_time).total_seconds()
    if isinstance(max_time, str) and re.fullmatch(r"\d+:\d+:\d+:\d+", max_time):
        days, hours, minutes, seconds = map(int, max_time.split(":"))
        return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds).total_seconds()
    raise ValueError(f"max_time={max_time!r}; use 'DD:HH:MM:SS', a datetime.timedelta or a dict like {{'hours': 1}}")


def fast_dev_batches(fast_dev_run: Any) -> int:
    """The batches per stage of a fast_dev_run (0: off)."""
    if isinstance(fast_dev_run, bool):
        return int(fast_dev_run)
    if isinstance(fast_dev_run, int) and fast_dev_run >= 0:
        return fast_dev_run
    raise ValueError(f"fast_dev_run={fast_dev_run!r}; use a bool or a batch count >= 0")
