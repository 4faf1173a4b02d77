"""Checkpoint files: writing, reading (always to CPU first), and naming."""
from __future__ import annotations

import os

import torch

FORMAT = "gpulayer.torch/1"


def save(state: dict, path: str) -> None:
    """Write atomically: a crash mid-write never leaves a truncated checkpoint."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save({"format": FORMAT, **state}, tmp)
    os.replace(tmp, path)


def load(path: str) -> dict:
    """Read a checkpoint onto the CPU; the Trainer moves it to its own device."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a gpulayer.torch checkpoint")
    return state


def resolve(ckpt_path: str, callbacks: list) -> str:
    """A path, or "last"/"best": the last or best file of the Trainer's ModelCheckpoint."""
    if ckpt_path not in ("last", "best"):
        if not os.path.isfile(ckpt_path):
            raise FileNotFoundError(f"checkpoint {ckpt_path!r} does not exist")
        return ckpt_path
    from .callbacks import ModelCheckpoint

    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint):
            path = cb.best_model_path if ckpt_path == "best" else cb.last_path()
            if path and os.path.isfile(path):
                return path
    raise FileNotFoundError(f"ckpt_path={ckpt_path!r}: no ModelCheckpoint callback has written such a checkpoint")
