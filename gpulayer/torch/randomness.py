"""Seeding, deterministic kernels, and the RNG state that checkpoints carry."""
from __future__ import annotations

import os
import random

import torch

from ..accelerators import CUDA, MPS

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed python, numpy (if installed) and torch (all devices); returns the seed.

    As Lightning's: without `seed`, PL_GLOBAL_SEED or 0; `workers=True` sets PL_SEED_WORKERS=1, and the
    Trainer then gives DataLoaders with workers and no worker_init_fn one that seeds python and numpy
    in each worker (torch seeds its own generator per worker)."""
    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(workers))
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


def seed_worker(worker_id: int) -> None:
    """A DataLoader worker's python and numpy seeds, from the torch seed torch gave that worker."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)


def seed_workers(loader) -> None:
    """After seed_everything(workers=True): `seed_worker` for a DataLoader with workers and no worker_init_fn."""
    from torch.utils.data import DataLoader

    if (os.environ.get("PL_SEED_WORKERS") == "1" and isinstance(loader, DataLoader) and loader.num_workers > 0
            and loader.worker_init_fn is None):
        loader.worker_init_fn = seed_worker


def use_deterministic_algorithms() -> None:
    """Prefer deterministic kernels (warn where torch has none) and fix cuDNN/cuBLAS choices."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def capture(device: torch.device) -> dict:
    """The RNG states a resumed run needs, in types `torch.load(weights_only=True)` accepts."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, keys.tolist(), pos, has_gauss, gauss)
    if device.type == CUDA:
        state[CUDA] = torch.cuda.get_rng_state(device)
    elif device.type == MPS:
        state[MPS] = torch.mps.get_rng_state()
    return state


def restore(state: dict, device: torch.device) -> None:
    """Restore what `capture` saved; device states only when resuming on the same device type."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if device.type == CUDA and CUDA in state:
        torch.cuda.set_rng_state(state[CUDA], device)
    elif device.type == MPS and MPS in state:
        torch.mps.set_rng_state(state[MPS])
