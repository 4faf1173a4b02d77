"""`glt.Trainer`: the training loop for a `glt.Module` on cpu, cuda or mps."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable

import torch
from torch import Tensor

from ..accelerators import AUTO
from . import accelerators, checkpoint, compiled, distributed, optim, precision as precision_rules, randomness
from .callbacks import Callback, ModelCheckpoint
from .metrics import MetricStore
from .module import Module
from .precision import Precision
from .progress import TrainerProgress, make_progress

_NO_SYNC_NEEDED = contextlib.nullcontext()


def _to_device(obj: Any, device: torch.device, float_dtype: torch.dtype | None) -> Any:
    """Move the tensors of a batch (nested tuples, lists, dicts) to `device`."""
    if isinstance(obj, Tensor):
        if float_dtype is not None and obj.is_floating_point():
            return obj.to(device, float_dtype, non_blocking=True)
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        moved = [_to_device(o, device, float_dtype) for o in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device, float_dtype)) for k, v in obj.items())
    return obj


def _batch_size(obj: Any) -> int:
    """The leading dimension of the batch's first tensor (1 when there is none)."""
    if isinstance(obj, Tensor):
        return obj.shape[0] if obj.dim() else 1
    if isinstance(obj, (list, tuple)) and obj:
        return _batch_size(obj[0])
    if isinstance(obj, dict) and obj:
        return _batch_size(next(iter(obj.values())))
    return 1


def _limit(length: int | None, limit: int | float | None) -> int | None:
    """Batches to run: `limit` as a count (int) or a fraction of `length` (float)."""
    if limit is None:
        return length
    if isinstance(limit, float):
        if length is None:
            raise ValueError("a fractional batch limit needs a loader with a length")
        return int(length * limit)
    return limit if length is None else min(length, limit)


def _length(loader: Iterable) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _overrides(obj: Any, base: type, name: str) -> bool:
    return getattr(type(obj), name) is not getattr(base, name)


class Trainer:
    """Trains a `glt.Module`.

    The accelerator and precision rules are checked here, before any device work:
    "auto" honours GPULAYER_DEVICE, else picks cuda > mps > cpu; MPS takes one device and
    '32-true' only; '16-mixed' needs CUDA. `devices > 1` trains with DDP in spawned processes.
    `callback_metrics` and `logged_metrics` hold python floats (see docs/trainer.md).
    """

    def __init__(self, max_epochs: int | None = None, max_steps: int = -1, accelerator: str = AUTO,
                 devices: int = 1, num_nodes: int = 1, precision: str | int = "32-true",
                 gradient_clip_val: float | None = None, accumulate_grad_batches: int = 1,
                 val_check_interval: int | float = 1.0, log_every_n_steps: int = 50,
                 limit_train_batches: int | float | None = None, limit_val_batches: int | float | None = None,
                 callbacks: list[Callback] | None = None, default_root_dir: str | None = None,
                 deterministic: bool = False, enable_progress_bar: bool = True, compile: bool | str | dict = False):
        self.placement = accelerators.resolve(accelerator, devices, num_nodes)
        name = precision_rules.normalize(precision)
        precision_rules.check(name, self.placement.kind)
        self.precision = Precision(name, self.placement.kind)
        for option, value in (("accumulate_grad_batches", accumulate_grad_batches),
                              ("log_every_n_steps", log_every_n_steps)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} must be a positive int, got {value!r}")
        if not (isinstance(val_check_interval, int) and val_check_interval >= 1 or
                isinstance(val_check_interval, float) and 0.0 < val_check_interval <= 1.0):
            raise ValueError(f"val_check_interval must be a batch count >= 1 or a fraction in (0, 1], "
                             f"got {val_check_interval!r}")
        self.max_epochs = 1000 if max_epochs is None and max_steps == -1 else max_epochs
        self.max_steps = max_steps
        self.gradient_clip_val = gradient_clip_val
        self.accumulate_grad_batches = accumulate_grad_batches
        self.val_check_interval = val_check_interval
        self.log_every_n_steps = log_every_n_steps
        self.limit_train_batches = limit_train_batches
        self.limit_val_batches = limit_val_batches
        # checkpointing runs last at an epoch end, so a checkpoint holds the other callbacks' new state
        self.callbacks = sorted(callbacks or [], key=lambda cb: isinstance(cb, ModelCheckpoint))
        self.default_root_dir = default_root_dir or os.getcwd()
        self.deterministic = deterministic
        self.enable_progress_bar = enable_progress_bar
        self._compile = compiled.parse(compile, self.placement.kind, self.placement.devices, num_nodes, name,
                                       accumulate_grad_batches)

        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.current_epoch = 0
        self.global_step = 0
        self.should_stop = False
        self.global_rank = 0
        self.world_size = 1
        self.device: torch.device | None = None  # set when a run starts
        self.module: Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: optim.SchedulerConfig | None = None
        self._all_reduce = None  # set in DDP worker processes
        self._ddp = None
        self._resume_epoch = 0  # the epoch a checkpoint saved now resumes at
        self._progress: TrainerProgress = TrainerProgress()
        self._store: MetricStore | None = None  # where Module.log writes now
        self._train_store: MetricStore | None = None
        self._epoch_val: dict[str, float] = {}  # this epoch's latest validation means
        self._prog_bar: set[str] = set()  # validation metrics logged with prog_bar=True
        self._clip_params: list[Tensor] = []
        self._compiled_step = None  # compile=: this fit's step function (compiled.py)

    def __getstate__(self):
        """Picklable for DDP workers: configuration and callbacks, not the state of a run."""
        return {**self.__dict__, "module": None, "optimizer": None, "lr_scheduler": None, "_progress": TrainerProgress(),
                "_store": None, "_train_store": None, "_ddp": None, "_clip_params": [], "_compiled_step": None}

    @property
    def accelerator(self) -> str:
        """The accelerator type in use: "cpu", "cuda" or "mps"."""
        return self.placement.kind

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    # ---------------------------------------------------------------- entry points

    def fit(self, model: Module, train_dataloaders: Iterable, val_dataloaders: Iterable | None = None,
            ckpt_path: str | None = None) -> None:
        """Train `model`. With `devices > 1`, trains in spawned DDP processes and loads the
        trained weights into `model` (which stays on its device) when they finish."""
        if self.placement.devices > 1:
            self._apply_summary(model, distributed.spawn_fit(self, model, train_dataloaders, val_dataloaders,
                                                             ckpt_path))
        else:
            self._fit(model, train_dataloaders, val_dataloaders, ckpt_path)

    def validate(self, model: Module, dataloaders: Iterable, ckpt_path: str | None = None) -> dict[str, float]:
        """Run `validation_step` over `dataloaders`; returns the metric means (single process)."""
        return self._evaluate_entry(model, dataloaders, "validation", ckpt_path)

    def test(self, model: Module, dataloaders: Iterable, ckpt_path: str | None = None) -> dict[str, float]:
        """Run `test_step` over `dataloaders`; returns the metric means (single process)."""
        return self._evaluate_entry(model, dataloaders, "test", ckpt_path)

    def save_checkpoint(self, path: str) -> None:
        """Write model, optimizer, scheduler, loop position and RNG state (rank 0 only)."""
        if not self.is_global_zero:
            return
        model = self.module
        checkpoint.save({
            "epoch": self._resume_epoch,
            "global_step": self.global_step,
            "state_dict": model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.scheduler.state_dict() if self.lr_scheduler else None,
            "precision": self.precision.state_dict(),
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "rng": randomness.capture(self.device),
        }, path)

    # ---------------------------------------------------------------- setup

    def _setup(self, model: Module) -> None:
        if not isinstance(model, Module):
            raise TypeError(f"glt.Trainer trains a glt.Module; got {type(model).__name__}")
        if self.deterministic:
            randomness.use_deterministic_algorithms()
        self.device = self.placement.device(self.global_rank)
        self.precision.setup()
        model.to(device=self.device, dtype=self.precision.param_dtype)
        model._trainer = self
        self.module = model
        self._progress = make_progress(self.enable_progress_bar and self.is_global_zero)

    def _fit_as_rank(self, rank: int, world_size: int, model, train, val, ckpt_path) -> None:
        """Called in each DDP worker process."""
        self.global_rank, self.world_size = rank, world_size
        self._all_reduce = distributed.all_reduce_sum
        self._fit(model, distributed.shard(train, rank, world_size),
                  None if val is None else distributed.shard(val, rank, world_size, shuffle=False), ckpt_path)

    def _summary(self, model: Module) -> dict:
        """What the parent of DDP workers takes back from rank 0."""
        return {"state_dict": {k: v.cpu() for k, v in model.state_dict().items()},
                "current_epoch": self.current_epoch, "global_step": self.global_step,
                "callback_metrics": self.callback_metrics, "logged_metrics": self.logged_metrics,
                "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks}}

    def _apply_summary(self, model: Module, summary: dict) -> None:
        model.load_state_dict(summary["state_dict"])
        model._trainer = self
        self.module = model
        self.current_epoch, self.global_step = summary["current_epoch"], summary["global_step"]
        self.callback_metrics, self.logged_metrics = summary["callback_metrics"], summary["logged_metrics"]
        self._load_callback_states(summary["callbacks"])

    def _load_callback_states(self, states: dict) -> None:
        for cb in self.callbacks:
            if cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])

    def _call(self, hook: str, model: Module) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, model)

    # ---------------------------------------------------------------- fit

    def _fit(self, model: Module, train: Iterable, val: Iterable | None, ckpt_path: str | None) -> None:
        self._setup(model)
        if val is not None and self.limit_val_batches != 0 and not _overrides(model, Module, "validation_step"):
            raise ValueError(f"val_dataloaders given but {type(model).__name__} has no validation_step")
        self.optimizer, self.lr_scheduler = optim.parse(model.configure_optimizers())
        self._clip_params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.current_epoch = self.global_step = self._resume_epoch = 0
        self.should_stop = False
        self.callback_metrics, self.logged_metrics = {}, {}
        try:
            self._call("on_fit_start", model)  # first: a ModelCheckpoint learns its dirpath, for ckpt_path="last"
            if ckpt_path:
                self._restore(model, checkpoint.load(checkpoint.resolve(ckpt_path, self.callbacks)))
            self._ddp = distributed.wrap(model, self.device) if self._all_reduce else None
            self._compiled_step = compiled.build(self._compile, self, model)
            while not self._finished():
                self._train_epoch(model, train, val)
            self._call("on_fit_end", model)
        finally:
            self._store = self._ddp = self._compiled_step = None
            self._progress.close()

    def _restore(self, model: Module, ckpt: dict) -> None:
        model.load_state_dict(ckpt["state_dict"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        if self.lr_scheduler is not None and ckpt["lr_scheduler"] is not None:
            self.lr_scheduler.scheduler.load_state_dict(ckpt["lr_scheduler"])
        self.precision.load_state_dict(ckpt["precision"])
        self._load_callback_states(ckpt["callbacks"])
        self.current_epoch = self._resume_epoch = ckpt["epoch"]
        self.global_step = ckpt["global_step"]
        # last, so the next epoch draws the same random numbers as in the interrupted run
        randomness.restore(ckpt["rng"], self.device)

    def _finished(self) -> bool:
        return (self.should_stop or (self.max_epochs is not None and self.current_epoch >= self.max_epochs)
                or 0 <= self.max_steps <= self.global_step)

    def _val_every(self, n_batches: int | None) -> int | None:
        """Batches between validations inside an epoch (None: only at the epoch end)."""
        interval = self.val_check_interval
        if isinstance(interval, int):
            return interval
        if n_batches is None or interval >= 1.0:
            return None
        return max(1, int(n_batches * interval))

    def _train_epoch(self, model: Module, loader: Iterable, val: Iterable | None) -> None:
        epoch = self.current_epoch
        self._resume_epoch = epoch
        distributed.set_epoch(loader, epoch)
        store = self._store = self._train_store = MetricStore(self.device)
        self._epoch_val, self._prog_bar = {}, set()
        n_batches = _limit(_length(loader), self.limit_train_batches)
        validating = val is not None and self.limit_val_batches != 0
        val_every = self._val_every(n_batches) if validating else None
        model.train()
        self._call("on_train_epoch_start", model)
        self._progress.start_epoch(epoch, n_batches)

        # the hot path: no host syncs, no per-step dispatch to callbacks that don't listen
        ddp = self._ddp
        step_fn = ddp if ddp is not None else self._compiled_step or model.training_step
        whole_step = isinstance(step_fn, compiled.CudaGraphStep)  # it runs backward and the optimizer step too
        batch_end = [cb for cb in self.callbacks if _overrides(cb, Callback, "on_train_batch_end")]
        accumulate, device, float_dtype = self.accumulate_grad_batches, self.device, self.precision.param_dtype
        autocast, backward = self.precision.autocast, self.precision.backward
        pending = batches_done = 0
        stop = False
        for batch_idx, batch in enumerate(loader):
            if batch_idx == n_batches:
                break
            batch = _to_device(batch, device, float_dtype)
            store.weight = _batch_size(batch)
            pending += 1
            step_now = pending == accumulate or batch_idx + 1 == n_batches
            if whole_step:  # compile="cudagraphs": one graph replay per step
                output = step_fn(batch, batch_idx)
            else:
                with ddp.no_sync() if ddp is not None and not step_now else _NO_SYNC_NEEDED:
                    with autocast:
                        output = step_fn(batch, batch_idx)
                    loss = output["loss"] if isinstance(output, dict) else output
                    if loss is None:
                        raise ValueError("training_step must return the loss tensor (or a dict with 'loss')")
                    backward(loss / accumulate if accumulate > 1 else loss)
            for cb in batch_end:
                cb.on_train_batch_end(self, model, output, batch, batch_idx)
            batches_done = batch_idx + 1
            if step_now:
                pending = 0
                stop = self._optimizer_step(batches_done, stepped=whole_step)
            if stop:
                break
            if val_every is not None and batches_done % val_every == 0 and batches_done != n_batches:
                self._validate_in_fit(model, val)
        if pending and not stop:  # a loader without a length ended mid-accumulation
            self._optimizer_step(batches_done)

        if validating:
            self._validate_in_fit(model, val)
        means = store.means(self._all_reduce)
        self._store = None
        self._resume_epoch = epoch + 1
        self.callback_metrics.update(means)
        self.logged_metrics = {**means, **self._epoch_val}
        self._progress.end_epoch(batches_done, self.global_step, self._shown(self.logged_metrics))
        if self.lr_scheduler is not None and self.lr_scheduler.interval == "epoch":
            self._step_scheduler()
        self._call("on_train_epoch_end", model)
        self.current_epoch = epoch + 1

    def _optimizer_step(self, batches_done: int, stepped: bool = False) -> bool:
        """Clip, step, zero the gradients (unless `stepped`: done in a CUDA graph), and publish
        metrics every `log_every_n_steps`. Returns whether `max_steps` is reached."""
        optimizer = self.optimizer
        if not stepped:
            if self.gradient_clip_val:
                self.precision.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(self._clip_params, self.gradient_clip_val)
            self.precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        if self.lr_scheduler is not None and self.lr_scheduler.interval == "step":
            self._step_scheduler()
        if self.global_step % self.log_every_n_steps == 0:
            self._publish_step(batches_done)
        return self.global_step == self.max_steps

    def _step_scheduler(self) -> None:
        config = self.lr_scheduler
        if config.monitor is None:
            config.scheduler.step()
        elif config.monitor in self.callback_metrics:
            config.scheduler.step(self.callback_metrics[config.monitor])
        else:
            raise KeyError(f"lr_scheduler monitors {config.monitor!r}, which was not logged; "
                           f"logged: {sorted(self.callback_metrics)}")

    def _publish_step(self, batches_done: int) -> None:
        """A log point: one transfer of the latest training values."""
        values = self._train_store.latest(self._all_reduce, self.world_size)
        self.callback_metrics.update(values)
        self.logged_metrics = values
        self._progress.update(batches_done, self.global_step, self._shown(values))

    def _shown(self, metrics: dict[str, float]) -> dict[str, float]:
        prog_bar = self._prog_bar | self._train_store.prog_bar
        return {k: v for k, v in metrics.items() if k in prog_bar}

    def _validate_in_fit(self, model: Module, val: Iterable) -> None:
        self._epoch_val, prog_bar = self._run_eval(model, val, "validation")
        self._prog_bar |= prog_bar
        self._store = self._train_store
        model.train()

    # ---------------------------------------------------------------- validate / test

    def _run_eval(self, model: Module, loader: Iterable, stage: str) -> tuple[dict[str, float], set[str]]:
        """One pass of validation_step/test_step; one transfer of the metric means at the end."""
        step_fn = model.validation_step if stage == "validation" else model.test_step
        n_batches = _limit(_length(loader), self.limit_val_batches if stage == "validation" else None)
        store = self._store = MetricStore(self.device)
        device, float_dtype, autocast = self.device, self.precision.param_dtype, self.precision.autocast
        model.eval()
        self._call(f"on_{stage}_start", model)
        with torch.no_grad():
            for batch_idx, batch in enumerate(loader):
                if batch_idx == n_batches:
                    break
                batch = _to_device(batch, device, float_dtype)
                store.weight = _batch_size(batch)
                with autocast:
                    step_fn(batch, batch_idx)
        means = store.means(self._all_reduce)
        self.callback_metrics.update(means)
        self.logged_metrics = means
        self._call(f"on_{stage}_end", model)
        return means, store.prog_bar

    def _evaluate_entry(self, model: Module, loader: Iterable, stage: str, ckpt_path: str | None) -> dict[str, float]:
        step = "validation_step" if stage == "validation" else "test_step"
        if not _overrides(model, Module, step):
            raise ValueError(f"{type(model).__name__} has no {step}")
        self._setup(model)
        try:
            if ckpt_path:
                model.load_state_dict(checkpoint.load(checkpoint.resolve(ckpt_path, self.callbacks))["state_dict"])
            means, _ = self._run_eval(model, loader, stage)
            self._progress.report(stage, means)
            return means
        finally:
            self._store = None
            self._progress.close()
