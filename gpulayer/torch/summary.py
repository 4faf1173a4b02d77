"""The model summary a Trainer prints when fit starts (enable_model_summary=True)."""
from __future__ import annotations

from torch import nn


def _count(n: int) -> str:
    for unit, size in (("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def summarize(model: nn.Module) -> str:
    """A table of the top-level submodules (name, type, parameters), then the totals."""
    rows = [(name, type(child).__name__, sum(p.numel() for p in child.parameters()))
            for name, child in model.named_children()]
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    w_name = max([4] + [len(r[0]) for r in rows])
    w_type = max([4] + [len(r[1]) for r in rows])
    lines = [f"  | {'Name':<{w_name}} | {'Type':<{w_type}} | Params", "-" * (w_name + w_type + 18)]
    lines += [f"{i} | {n:<{w_name}} | {t:<{w_type}} | {_count(c)}" for i, (n, t, c) in enumerate(rows)]
    lines += ["-" * (w_name + w_type + 18), f"{_count(trainable)}  Trainable params",
              f"{_count(total - trainable)}  Non-trainable params", f"{_count(total)}  Total params"]
    return "\n".join(lines)
