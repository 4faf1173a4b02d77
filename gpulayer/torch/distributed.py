"""DDP: one spawned process per device, gradients synchronized by DDP; in a gang, over its ranks.

The parent process spawns `devices` workers (torch.multiprocessing.spawn). Each joins a process
group (NCCL on CUDA, gloo on CPU), trains a copy of the model on its shard of the data, and the
first writes the final weights and metrics to a temporary file the parent loads afterwards. In a
gang's rank (num_nodes=N), the group spans the N × devices processes of all the ranks; with one
device, the rank's own process trains (`fit_in_gang`).
"""
from __future__ import annotations

import os
import socket
import tempfile

import cloudpickle
import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  before any process group: see _fit_worker
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from ..accelerators import CPU, CUDA, DISTRIBUTED
from . import randomness
from .accelerators import UnsupportedConfiguration

# NVLink multicast off (it can take shared GPUs out of service); kept for every spawned process.
ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def all_reduce_sum(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


class _TrainingStep(nn.Module):
    """Routes DDP's forward to `Module.training_step`, so DDP sees the pass and syncs gradients."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, batch, batch_idx):
        return self.module.training_step(batch, batch_idx)


def wrap(module: nn.Module, device: torch.device) -> DistributedDataParallel:
    """A DDP-wrapped callable `(batch, batch_idx) -> training_step output`."""
    return DistributedDataParallel(_TrainingStep(module), device_ids=[device] if device.type == CUDA else None)


def shard(loader, rank: int, world_size: int, shuffle: bool | None = None) -> DataLoader:
    """The same DataLoader, reading only this rank's part of the dataset (DistributedSampler)."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
        raise UnsupportedConfiguration("devices > 1 needs map-style torch DataLoaders with a batch_size")
    if shuffle is None:
        shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                      worker_init_fn=loader.worker_init_fn, persistent_workers=loader.persistent_workers)


def set_epoch(loader, epoch: int) -> None:
    """Reshuffle a DistributedSampler for `epoch` (no-op for other loaders)."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_fit(trainer, module, train, val, ckpt_path) -> dict:
    """Run `trainer.fit` in one process per device; returns the first process's `trainer.rank_zero_summary()`.
    In a gang's rank (num_nodes > 1) the processes are this rank's part of DDP over all the gang's."""
    devices = trainer.placement.devices
    with tempfile.TemporaryDirectory(prefix="glt-ddp-") as tmp:
        result = os.path.join(tmp, "rank0.pt")
        # cloudpickle: classes that came to this process by value (a task's, a rank's) reach the processes too
        work = cloudpickle.dumps((trainer, module, train, val))
        args = (devices, _free_port(), randomness.capture(torch.device(CPU)), work, ckpt_path, result)
        mp.spawn(_fit_worker, args=args, nprocs=devices, join=True)
        return torch.load(result, map_location=CPU, weights_only=True)


def fit_in_gang(trainer, module, train, val, ckpt_path) -> None:
    """`fit` in this process as its gang rank's part of DDP over the gang's ranks (num_nodes=N): the
    gang's group (gl.distributed.init), left at the end."""
    from .. import distributed as gang

    gang.init()
    try:
        trainer.fit_as_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), module, train, val, ckpt_path)
        dist.barrier()  # no rank leaves the group while another still talks to it
    finally:
        gang.shutdown()


def _fit_worker(local, devices, port, rng, work, ckpt_path, result) -> None:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    trainer, module, train, val = cloudpickle.loads(work)  # this process's own copy
    kind = trainer.placement.kind
    if kind == CUDA:
        torch.cuda.set_device(local)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    randomness.restore(rng, torch.device(CPU))
    # torch.distributed.nn.functional binds the WORLD group of the moment as its functions' default argument.
    # DDP imports it: imported only after init_process_group, it would keep this group (gloo's threads) alive
    # past destroy_process_group, to the interpreter's exit, which then aborted the rank now and then
    # ("terminate called without an active exception"). It is imported with this module, before the group.
    rank, world_size = _join(local, devices, trainer.placement.nodes, DISTRIBUTED[CUDA] if kind == CUDA else "gloo",
                             port)
    try:
        trainer.fit_as_rank(rank, world_size, module, train, val, ckpt_path)
        if local == 0:
            torch.save(trainer.rank_zero_summary(module), result)
        # no rank tears gloo down while another still talks to it (that aborts the process); should a rank
        # fail instead, spawn terminates the others, so this never waits for a rank that is gone
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _join(local: int, devices: int, nodes: int, backend: str, port: int) -> tuple[int, int]:
    """Join the process group as the `local`th of this host's `devices` processes: alone, over a local
    port; in a gang's rank, as rank RANK × devices + local of WORLD_SIZE × devices, through the gang's
    rendezvous (its variables set to this process's). Returns (rank, world size)."""
    if nodes == 1:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=local, world_size=devices)
        return local, devices
    from .. import distributed as gang

    rank, world_size = int(os.environ["RANK"]) * devices + local, int(os.environ["WORLD_SIZE"]) * devices
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(devices))
    gang.init(backend=backend)
    return rank, world_size
