"""Batches: moving them to the device, and their size (the weight of a logged value)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def to_device(obj: Any, device: torch.device, float_dtype: torch.dtype | None) -> Any:
    """Move the tensors of a batch (nested tuples, lists, dicts) to `device`."""
    if isinstance(obj, Tensor):
        if float_dtype is not None and obj.is_floating_point():
            return obj.to(device, float_dtype, non_blocking=True)
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        moved = [to_device(o, device, float_dtype) for o in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device, float_dtype)) for k, v in obj.items())
    return obj


def batch_size(obj: Any) -> int:
    """The leading dimension of the batch's first tensor (1 when there is none)."""
    if isinstance(obj, Tensor):
        return obj.shape[0] if obj.dim() else 1
    if isinstance(obj, (list, tuple)) and obj:
        return batch_size(obj[0])
    if isinstance(obj, dict) and obj:
        return batch_size(next(iter(obj.values())))
    return 1
