"""`glt.Trainer`: the training loop for a `glt.Module` (a LightningModule) on cpu, cuda or mps.

The hooks run in Lightning's order (see hooks.py and docs/trainer.md); the hot path calls only
the hooks somebody overrides, and metrics reach the host only at the sync points (metrics.py).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import os
import time
import warnings
from typing import Any, Iterable

import torch
from torch import Tensor
from torch.optim.lr_scheduler import ReduceLROnPlateau

from ..accelerators import AUTO
from . import (accelerators, checkpoint, compiled, datamodule as datamodules, distributed, loggers as loggers_, optim,
               options, precision as precision_rules, profilers, randomness, resume as resumes)
from .batches import batch_size as _batch_size, to_device as _to_device
from .callbacks import Callback, EarlyStopping, ModelCheckpoint
from .hooks import TRANSFER_HOOKS, Dispatch, ModelHooks, overrides as _overrides, warn_unsupported
from .metrics import MetricStore, Published
from .module import Module
from .precision import Precision
from .progress import TrainerProgress, make_progress
from .summary import summarize

_NO_SYNC_NEEDED = contextlib.nullcontext()
_STAGE_STEP = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}
_STAGE_HOOK = {"validate": "validation", "test": "test", "predict": "predict"}
_STAGE_LOADER = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}


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


def _tensors(values: dict[str, float]) -> dict[str, Tensor]:
    """Host values as the 0-dim tensors Lightning keeps in callback_metrics (no device sync)."""
    return {k: torch.tensor(v) for k, v in values.items()}


def _batch_outputs(output: Any, accumulate: int) -> dict[str, Any]:
    """What on_train_batch_end receives, as in Lightning: {"loss": the detached loss (divided by
    accumulate_grad_batches), and training_step's other keys}."""
    loss, extra = (output["loss"], {k: v for k, v in output.items() if k != "loss"}) if isinstance(output, dict) \
        else (output, {})
    return {"loss": (loss / accumulate if accumulate > 1 else loss).detach(), **extra}


class _Source:
    """A stage's loader, asked of the DataModule or the module when the loop first needs it (as Lightning)."""

    def __init__(self, source, name: str):
        self.source, self.name = source, name

    def defined(self) -> bool:
        return datamodules.loader_defined(self.source, self.name)

    def get(self):
        return datamodules.check_single(datamodules.loader(self.source, self.name), self.name)


def _resolve(loader):
    """The loader itself (asked of its source if need be), with seeded workers after seed_everything(workers=True)."""
    loader = loader.get() if isinstance(loader, _Source) else loader
    randomness.seed_workers(loader)
    resumes.shield_workers(loader)
    return loader


class Trainer:
    """Trains a `glt.Module` (alias `LightningModule`), with Lightning's arguments and meaning.

    The accelerator and precision rules are checked here, before any device work:
    "auto" honours GPULAYER_DEVICE, else picks cuda > mps > cpu; MPS takes one device and
    '32-true' only; '16-mixed' needs CUDA. `devices > 1` trains with DDP in spawned processes.
    `callback_metrics` and `logged_metrics` hold 0-dim CPU tensors, `progress_bar_metrics`
    python floats (see docs/trainer.md). Unknown arguments raise TypeError; Lightning arguments
    glt does not implement are accepted only at their default.
    """

    def __init__(self, accelerator: str = AUTO, strategy: str = "auto", devices: int | str = 1, num_nodes: int = 1,
                 precision: str | int = "32-true", logger: Any = True, callbacks: list[Callback] | None = None,
                 fast_dev_run: bool | int = False, max_epochs: int | None = None, min_epochs: int | None = None,
                 max_steps: int = -1, max_time: Any = None, limit_train_batches: int | float | None = None,
                 limit_val_batches: int | float | None = None, limit_test_batches: int | float | None = None,
                 limit_predict_batches: int | float | None = None, val_check_interval: int | float = 1.0,
                 check_val_every_n_epoch: int = 1, num_sanity_val_steps: int = 2, log_every_n_steps: int = 50,
                 enable_checkpointing: bool = True, enable_progress_bar: bool = True,
                 enable_model_summary: bool = True, accumulate_grad_batches: int = 1,
                 gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None,
                 deterministic: bool = False, benchmark: bool | None = None, inference_mode: bool = True,
                 profiler: str | None = None, default_root_dir: str | None = None,
                 enable_autolog_hparams: bool = True, compile: bool | str | dict = False,
                 resume_every_n_steps: int | None = None, **lightning_options):
        options.check_default_only(lightning_options)
        resumes.check_interval(resume_every_n_steps)
        if devices == AUTO or devices == -1:
            devices = options.auto_devices(accelerators.resolve(accelerator, 1, num_nodes).kind)
        self.placement = accelerators.resolve(accelerator, options.devices_count(devices), num_nodes)
        options.check_strategy(strategy, self.placement.devices)
        name = precision_rules.normalize(precision)
        precision_rules.check(name, self.placement.kind)
        self.precision = Precision(name, self.placement.kind)
        self.fast_dev_run = fast_dev_run
        fast = options.fast_dev_batches(fast_dev_run)
        if fast:  # Lightning's meaning: n batches of each stage, one epoch, no sanity check, loggers or checkpoints
            max_epochs, max_steps, num_sanity_val_steps, val_check_interval, log_every_n_steps = 1, fast, 0, 1.0, 1
            limit_train_batches = limit_val_batches = limit_test_batches = limit_predict_batches = fast
            check_val_every_n_epoch, logger = 1, False
        for option, value in (("accumulate_grad_batches", accumulate_grad_batches),
                              ("log_every_n_steps", log_every_n_steps),
                              ("check_val_every_n_epoch", check_val_every_n_epoch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} must be a positive int, got {value!r}")
        if not (isinstance(val_check_interval, int) and val_check_interval >= 1 or
                isinstance(val_check_interval, float) and 0.0 < val_check_interval <= 1.0):
            raise ValueError(f"val_check_interval must be a batch count >= 1 or a fraction in (0, 1], "
                             f"got {val_check_interval!r}")
        if not isinstance(num_sanity_val_steps, int) or num_sanity_val_steps < -1:
            raise ValueError(f"num_sanity_val_steps must be a batch count, or -1 for all, got {num_sanity_val_steps!r}")
        if gradient_clip_algorithm not in (None, "norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}; use 'norm' or 'value'")
        if min_epochs is not None and (not isinstance(min_epochs, int) or min_epochs < 0):
            raise ValueError(f"min_epochs must be a count >= 0, got {min_epochs!r}")
        # Lightning's: 1000 epochs when neither limit is given, max_epochs=-1 for no epoch limit
        self.max_epochs = 1000 if max_epochs is None and max_steps == -1 else None if max_epochs == -1 else max_epochs
        self.min_epochs = min_epochs
        self.max_steps = max_steps
        self.max_time = max_time
        self._max_seconds = options.max_time_seconds(max_time)
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm or "norm"
        self.accumulate_grad_batches = accumulate_grad_batches
        self.val_check_interval = val_check_interval
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.num_sanity_val_steps = num_sanity_val_steps
        self.log_every_n_steps = log_every_n_steps
        self.limit_train_batches = limit_train_batches
        self.limit_val_batches = limit_val_batches
        self.limit_test_batches = limit_test_batches
        self.limit_predict_batches = limit_predict_batches
        self.default_root_dir = os.fspath(default_root_dir) if default_root_dir else os.getcwd()
        self.loggers = loggers_.resolve(logger, self.default_root_dir)
        self.callbacks = self._checked_callbacks(callbacks, enable_checkpointing)
        self.enable_checkpointing = enable_checkpointing
        self.deterministic = deterministic
        self.benchmark = benchmark
        self.inference_mode = inference_mode
        self.enable_progress_bar = enable_progress_bar
        self.enable_model_summary = enable_model_summary
        self.enable_autolog_hparams = enable_autolog_hparams
        self.profiler = profilers.resolve(profiler)
        self.resume_every_n_steps = resume_every_n_steps
        self._compile = compiled.parse(compile, self.placement.kind, self.placement.devices, num_nodes, name,
                                       accumulate_grad_batches)

        self.callback_metrics: dict[str, Tensor] = {}
        self.logged_metrics: dict[str, Tensor] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self.current_epoch = 0
        self.global_step = 0
        self.should_stop = False
        self.sanity_checking = False
        self.state = "initializing"  # "fit", "validate", "test", "predict" while one runs, then "finished"
        self.global_rank = 0
        self.world_size = 1
        self.device: torch.device | None = None  # set when a run starts
        self.module: Module | None = None
        self.datamodule: datamodules.LightningDataModule | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: optim.SchedulerConfig | None = None
        self.num_training_batches: int | float = float("inf")
        self.num_val_batches: list[int | float] = []
        self._all_reduce = None  # set in DDP worker processes
        self._ddp = None
        self._resume_epoch = 0  # the epoch a checkpoint saved now resumes at
        self._progress: TrainerProgress = TrainerProgress()
        self.hooks: Dispatch | None = None  # this run's hooks, bound to its module and callbacks (compiled.py reads it)
        self.metric_store: MetricStore | None = None  # where Module.log writes now; None where nothing is collected
        self._train_store: MetricStore | None = None
        self.clip_params: list[Tensor] = []  # what gradient clipping applies to: the optimizer's parameters
        self._compiled_step = None  # compile=: this fit's step function (compiled.py)
        self._deadline: float | None = None  # max_time, on time.monotonic()
        self._val: Any = None  # this fit's validation loader (or its _Source until first needed)
        self._train: Any = None  # the same for training
        self._train_started = False
        self._resume: resumes.Resume | None = None  # this fit's resume checkpoint (resume.py), if it keeps one
        self._position: dict | None = None  # where the resumed epoch stopped: its batches done and RNG states

    def __getstate__(self):
        """Picklable for DDP workers: configuration and callbacks, not the state of a run."""
        return {**self.__dict__, "module": None, "optimizer": None, "lr_scheduler": None,
                "_progress": TrainerProgress(), "metric_store": None, "_train_store": None, "_ddp": None, "clip_params": [],
                "_compiled_step": None, "hooks": None, "datamodule": None, "_val": None, "_train": None,
                "_resume": None, "_position": None}

    @staticmethod
    def _checked_callbacks(callbacks, enable_checkpointing: bool) -> list[Callback]:
        if not isinstance(callbacks, (list, tuple)):
            callbacks = [] if callbacks is None else [callbacks]
        callbacks = list(callbacks)
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be glt.Callback instances; got {type(cb).__name__}")
        has_checkpoint = any(isinstance(cb, ModelCheckpoint) for cb in callbacks)
        if has_checkpoint and not enable_checkpointing:
            raise ValueError("a ModelCheckpoint callback was given with enable_checkpointing=False")
        if enable_checkpointing and not has_checkpoint:
            callbacks.append(ModelCheckpoint())
        return _checkpoints_last(callbacks)

    # ---------------------------------------------------------------- what hooks and users read

    @property
    def accelerator(self) -> str:
        """The accelerator type in use: "cpu", "cuda" or "mps"."""
        return self.placement.kind

    @property
    def num_devices(self) -> int:
        return self.placement.devices

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def local_rank(self) -> int:
        return self.global_rank

    node_rank = 0

    @property
    def logger(self):
        """The first logger (None without one)."""
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str:
        """The first logger's version folder, else `default_root_dir`."""
        return self.loggers[0].log_dir if self.loggers else self.default_root_dir

    @property
    def lightning_module(self) -> Module | None:
        return self.module

    @property
    def model(self) -> Module | None:
        return self.module

    @property
    def optimizers(self) -> list:
        return [self.optimizer] if self.optimizer is not None else []

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        return next(iter(self.checkpoint_callbacks), None)

    @property
    def early_stopping_callback(self) -> EarlyStopping | None:
        return next((cb for cb in self.callbacks if isinstance(cb, EarlyStopping)), None)

    @property
    def received_sigterm(self) -> bool:
        """Whether this fit, run as a job, got a SIGTERM: it saves and stops at the next step boundary."""
        return self._resume is not None and self._resume.requested

    @property
    def estimated_stepping_batches(self) -> int | float:
        """The optimizer steps this fit will take (for OneCycleLR in configure_optimizers), as Lightning's:
        max_steps when set, else epochs x ceil(batches per epoch / accumulate_grad_batches)."""
        if self.max_steps != -1:
            return self.max_steps
        if self.state != "fit":
            raise RuntimeError("estimated_stepping_batches is known during fit only")
        self._train_loader()
        batches = self.num_training_batches
        per_epoch = -(-batches // self.accumulate_grad_batches) if batches != float("inf") else batches
        return per_epoch * self.max_epochs if self.max_epochs is not None else float("inf")

    training = property(lambda self: self.state == "fit" and not self.sanity_checking
                        and self.metric_store is self._train_store)
    validating = property(lambda self: self.state == "validate" or self.sanity_checking)
    testing = property(lambda self: self.state == "test")
    predicting = property(lambda self: self.state == "predict")

    # ---------------------------------------------------------------- entry points

    def fit(self, model: Module, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: datamodules.LightningDataModule | None = None, ckpt_path: str | None = None) -> None:
        """Train `model` on the given loaders, a DataModule's, or the module's own `*_dataloader`s.
        With `devices > 1`, trains in spawned DDP processes and loads the trained weights into `model`
        (which stays on its device) when they finish."""
        if isinstance(train_dataloaders, datamodules.LightningDataModule):
            train_dataloaders, datamodule = None, train_dataloaders
        self._begin(model, "fit", datamodule, train_dataloaders is not None or val_dataloaders is not None)
        source = self.datamodule or model
        train = datamodules.check_single(train_dataloaders, "train_dataloaders") if train_dataloaders is not None \
            else _Source(source, "train_dataloader")
        val = datamodules.check_single(val_dataloaders, "val_dataloaders") if val_dataloaders is not None \
            else None if train_dataloaders is not None else _Source(source, "val_dataloader")
        try:
            if self.placement.nodes > 1 and self.placement.devices == 1:  # one rank of a gang (docs/gangs.md)
                distributed.fit_in_gang(self, model, _resolve(train), _resolve(val), ckpt_path)
            elif self.placement.devices > 1:
                for lg in self.loggers:
                    lg.log_dir  # noqa: B018 - the version folder is chosen here, once, not in each process
                train = _resolve(train)
                if train is None:
                    raise ValueError("fit needs train_dataloaders, a datamodule or the module's train_dataloader()")
                self._apply_summary(model, distributed.spawn_fit(self, model, train, _resolve(val), ckpt_path))
            else:
                self._fit(model, train, val, ckpt_path)
        finally:
            self._end(model, "fit")

    def validate(self, model: Module | None = None, dataloaders: Any = None, ckpt_path: str | None = None,
                 verbose: bool = True,
                 datamodule: datamodules.LightningDataModule | None = None) -> list[dict[str, float]]:
        """Run `validation_step` over the loader; returns `[{metric: mean}]` (single process)."""
        return self._evaluate_entry(model, dataloaders, datamodule, "validate", ckpt_path, verbose)

    def test(self, model: Module | None = None, dataloaders: Any = None, ckpt_path: str | None = None,
             verbose: bool = True, datamodule: datamodules.LightningDataModule | None = None) -> list[dict[str, float]]:
        """Run `test_step` over the loader; returns `[{metric: mean}]` (single process)."""
        return self._evaluate_entry(model, dataloaders, datamodule, "test", ckpt_path, verbose)

    def predict(self, model: Module | None = None, dataloaders: Any = None,
                datamodule: datamodules.LightningDataModule | None = None, return_predictions: bool | None = None,
                ckpt_path: str | None = None) -> list | None:
        """Run `predict_step` over the loader; returns its outputs, one per batch (single process)."""
        outputs = self._evaluate_entry(model, dataloaders, datamodule, "predict", ckpt_path, False)
        return outputs if return_predictions is None or return_predictions else None

    def save_checkpoint(self, path: str, weights_only: bool = False) -> None:
        """Write model, optimizer, scheduler, loop position, RNG state, callback and DataModule states and
        the hyperparameters (rank 0 only); `weights_only`: the model and hyperparameters only."""
        if self.is_global_zero:
            checkpoint.save(self._checkpoint_state(weights_only), path)

    def _checkpoint_state(self, weights_only: bool) -> dict[str, Any]:
        model = self.module
        state: dict[str, Any] = {"epoch": self._resume_epoch, "global_step": self.global_step,
                                 "state_dict": model.state_dict()}
        if model.hparams:
            state["hyper_parameters"] = dict(model.hparams)
        if not weights_only:
            state.update({
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.scheduler.state_dict() if self.lr_scheduler else None,
                "precision": self.precision.state_dict(),
                "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
                "rng": randomness.capture(self.device),
            })
            if self.datamodule is not None:
                state["datamodule"] = self.datamodule.state_dict()
                if self.datamodule.hparams:
                    state["datamodule_hyper_parameters"] = dict(self.datamodule.hparams)
            if self.hooks is not None:
                self.hooks("on_save_checkpoint", state)
        return state

    def print(self, *args, **kwargs) -> None:
        if self.is_global_zero:
            print(*args, **kwargs)

    # ---------------------------------------------------------------- setup and teardown

    def _begin(self, model: Module | None, stage: str, datamodule, loaders_given: bool) -> None:
        """Lightning's start of a run: configure_callbacks, prepare_data, setup(stage), configure_model."""
        if not isinstance(model, Module):
            raise TypeError(f"glt.Trainer runs a glt.Module (gpulayer.torch.LightningModule); got "
                            f"{type(model).__name__}. Subclass gpulayer.torch.LightningModule and define "
                            f"training_step and configure_optimizers (and validation_step/test_step/predict_step "
                            f"for those stages)")
        if datamodule is not None and loaders_given:
            raise ValueError("pass either dataloaders or a datamodule, not both")
        if datamodule is not None and not isinstance(datamodule, datamodules.LightningDataModule):
            raise TypeError(f"datamodule must be a glt.LightningDataModule; got {type(datamodule).__name__}")
        if model.automatic_optimization is not True:
            raise NotImplementedError("manual optimization (automatic_optimization = False) is not supported by "
                                      "glt.Trainer: return the loss from training_step")
        warn_unsupported(model)
        self.state, self.module, self.datamodule = stage, model, datamodule
        model.trainer = self
        if datamodule is not None:
            datamodule.trainer = self
        self._merge_model_callbacks(model)
        self.hooks = Dispatch(self, model, self.callbacks)
        if self.is_global_zero:
            if datamodule is not None:
                datamodule.prepare_data()
            model.prepare_data()
        if datamodule is not None:
            datamodule.setup(stage)
        self.hooks("setup", stage)
        model.configure_model()

    def _merge_model_callbacks(self, model: Module) -> None:
        """configure_callbacks' callbacks replace the Trainer's of the same type, as in Lightning."""
        extra = model.configure_callbacks()
        extra = list(extra) if isinstance(extra, (list, tuple)) else [extra] if extra else []
        for cb in extra:
            if not isinstance(cb, Callback):
                raise TypeError(f"configure_callbacks must return glt.Callback instances; got {type(cb).__name__}")
        types = {type(cb) for cb in extra}
        self.callbacks = _checkpoints_last([cb for cb in self.callbacks if type(cb) not in types] + extra)

    def _end(self, model: Module, stage: str) -> None:
        self.hooks("teardown", stage)
        if self.datamodule is not None:
            self.datamodule.teardown(stage)
        if self.is_global_zero:
            for lg in self.loggers:
                lg.finalize("success")
            summary = self.profiler.summary()
            if summary:
                print(summary)
        self.state = "finished"

    def _setup(self, model: Module) -> None:
        if self.deterministic:
            randomness.use_deterministic_algorithms()
        if self.benchmark is not None:
            torch.backends.cudnn.benchmark = self.benchmark
        self.device = self.placement.device(self.global_rank)
        self.precision.setup()
        model.to(device=self.device, dtype=self.precision.param_dtype)
        model.trainer = self
        self.module = model
        self._progress = make_progress(self.enable_progress_bar and self.is_global_zero)
        if self.hooks is None:  # a DDP worker: the parent ran the start of the run
            self.hooks = Dispatch(self, model, self.callbacks)

    def fit_as_rank(self, rank: int, world_size: int, model, train, val, ckpt_path) -> None:
        """`fit` as DDP rank `rank` of `world_size`: called in each worker process (distributed.py)."""
        self.global_rank, self.world_size = rank, world_size
        self._all_reduce = distributed.all_reduce_sum
        if rank:
            self.loggers = []
        self._fit(model, distributed.shard(train, rank, world_size),
                  None if val is None else distributed.shard(val, rank, world_size, shuffle=False), ckpt_path)
        for lg in self.loggers:  # rank 0's: its rows are in this process
            lg.finalize("success")

    def rank_zero_summary(self, model: Module) -> dict:
        """What the parent of DDP workers takes back from rank 0 (distributed.py)."""
        return {"state_dict": {k: v.cpu() for k, v in model.state_dict().items()},
                "current_epoch": self.current_epoch, "global_step": self.global_step,
                "callback_metrics": self.callback_metrics, "logged_metrics": self.logged_metrics,
                "progress_bar_metrics": self.progress_bar_metrics,
                "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks}}

    def _apply_summary(self, model: Module, summary: dict) -> None:
        model.load_state_dict(summary["state_dict"])
        model.trainer = self
        self.module = model
        self.current_epoch, self.global_step = summary["current_epoch"], summary["global_step"]
        self.callback_metrics, self.logged_metrics = summary["callback_metrics"], summary["logged_metrics"]
        self.progress_bar_metrics = summary["progress_bar_metrics"]
        self._load_callback_states(summary["callbacks"])

    def _load_callback_states(self, states: dict) -> None:
        for cb in self.callbacks:
            if cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])

    def _batch_mover(self, model: Module):
        """The batch transfer: the Trainer's own, or the transfer hooks where the module or the DataModule
        overrides one (the DataModule's first, as Lightning picks them)."""
        device, float_dtype = self.device, self.precision.param_dtype
        dm = self.datamodule
        hooks = [getattr(dm, name) if dm is not None and hasattr(type(dm), name) else
                 getattr(model, name) if _overrides(model, ModelHooks, name) else None for name in TRANSFER_HOOKS]
        if not any(hooks):
            return lambda batch: _to_device(batch, device, float_dtype)
        before, transfer, after = (hook or getattr(model, name) for hook, name in zip(hooks, TRANSFER_HOOKS))

        def move(batch):
            return after(transfer(before(batch, 0), device, 0), 0)
        return move

    # ---------------------------------------------------------------- publishing metrics

    def _logger_step(self) -> int:
        """Lightning's logging step: the optimizer steps done before this one (global_step - 1) in fit."""
        return max(self.global_step - 1, 0) if self.state == "fit" else self.global_step

    def _publish(self, values: Published) -> None:
        """Hand one sync point's host values to callback_metrics, the progress bar and the loggers."""
        tensors = _tensors({**values.plain, **values})
        self.callback_metrics.update(tensors)
        logged = {k: values[k] for k in values.logger}
        self.logged_metrics.update({k: tensors[k] for k in logged})
        self.progress_bar_metrics.update({k: values[k] for k in values.prog_bar})
        if logged and self.loggers and self.is_global_zero:
            row = {**logged, "epoch": self.current_epoch}
            for lg in self.loggers:
                lg.log_metrics(row, self._logger_step())

    def _log_hyperparams(self, model: Module) -> None:
        if not (self.enable_autolog_hparams and self.loggers and self.is_global_zero):
            return
        params = dict(self.datamodule.hparams_initial) if self.datamodule is not None and \
            self.datamodule.logs_hyperparameters else {}
        if model.logs_hyperparameters:
            params.update(model.hparams_initial)
        for lg in self.loggers:
            lg.log_hyperparams(params)
            lg.save()

    def _epoch_hook(self, name: str) -> None:
        """An epoch-level training hook: what it logs defaults to on_epoch (Lightning's rule)."""
        store = self._train_store
        store.epoch_hook = True
        try:
            self.hooks(name)
        finally:
            store.epoch_hook = False

    # ---------------------------------------------------------------- fit

    def _fit(self, model: Module, train: Any, val: Any, ckpt_path: str | None) -> None:
        self._setup(model)
        hooks = self.hooks
        self._train = train  # resolved on first need (estimated_stepping_batches may ask early)
        self.optimizer, self.lr_scheduler = optim.parse(model.configure_optimizers())
        self.clip_params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.current_epoch = self.global_step = self._resume_epoch = 0
        self.should_stop = self._train_started = False
        self.callback_metrics, self.logged_metrics, self.progress_bar_metrics = {}, {}, {}
        self._deadline = None if self._max_seconds is None else time.monotonic() + self._max_seconds
        resume = self._resume = None if self._all_reduce else \
            resumes.Resume.for_fit(self.default_root_dir, self.resume_every_n_steps)
        self._position = None
        ckpt_path = self._resume_from(resume, ckpt_path)
        try:
            if resume is not None:
                resume.install()
            hooks("on_fit_start")
            if self.enable_model_summary and self.is_global_zero:
                print(summarize(model))
            self._log_hyperparams(model)
            if ckpt_path:
                self._restore(model, checkpoint.load(checkpoint.resolve(ckpt_path, self.callbacks)))
                if resume is not None and ckpt_path == resume.path:
                    self.print(f"glt: resumed from {ckpt_path}: epoch {self.current_epoch}, step {self.global_step}"
                               + (f", batch {self._position['batch']}" if self._position else ""))
            self._ddp = distributed.wrap(model, self.device) if self._all_reduce else None
            self._compiled_step = compiled.build(self._compile, self, model)
            if isinstance(val, _Source) and not val.defined():
                val = None
            if val is not None and not _overrides(model, Module, "validation_step"):
                if self.limit_val_batches != 0:
                    warnings.warn(f"validation data given but {type(model).__name__} has no validation_step: "
                                  f"validation is skipped", stacklevel=3)
                val = None
            self._val = val  # a loader, or where to ask for it when validation first runs (as Lightning)
            self._sanity_check(model, val)
            train = self._train_loader()
            # Lightning makes the first epoch's iterator here, before on_train_start (a DataLoader draws its
            # base seed then): the same seed gives the same batches
            batches = self._epoch_iterator(train) if not self._finished() else None
            while not self._finished():
                self._train_epoch(model, train, val, batches)
                batches = None
            if self._train_started:
                hooks("on_train_end")
            hooks("on_fit_end")
            if resume is not None:
                if resume.requested:  # the SIGTERM came after the last step: the next run ends at once
                    self._save_resume(None)
                resume.discard()
        except BaseException as e:
            hooks("on_exception", e)
            raise
        finally:
            if resume is not None:
                resume.uninstall()
            self.metric_store = self._ddp = self._compiled_step = self._resume = self._position = None
            self._progress.close()

    def _resume_from(self, resume: resumes.Resume | None, ckpt_path: str | None) -> str | None:
        """The checkpoint to resume from: as a job, the fit's resume checkpoint whenever there is one
        (else `ckpt_path`); elsewhere with `ckpt_path="last"`, that one first."""
        found = resume.found() if resume is not None else None
        if found and (resume.on_sigterm or ckpt_path == "last"):
            return found
        if resume is not None and resume.on_sigterm and resumes.restarts():
            self.print(f"glt: restart {resumes.restarts()} of this job, and no {resume.path} to resume from: "
                       f"{'from ' + ckpt_path if ckpt_path else 'training from the start'}")
        return ckpt_path

    def _save_resume(self, batches_done: int | None) -> None:
        """Write the resume checkpoint at this step boundary, `batches_done` into the epoch (None: the fit
        is over); after a SIGTERM, stop the fit (SIGTERMException)."""
        resume = self._resume
        state = self._checkpoint_state(False)
        state["loop"] = {"finished": True} if batches_done is None else \
            {"batch": batches_done, "rng_iter": resume.rng_iter, "rng_first": resume.rng_first}
        checkpoint.save(state, resume.path)
        if resume.requested:
            self.print(f"glt: SIGTERM: saved {resume.path} at epoch {self.current_epoch}, step {self.global_step}; "
                       f"stopping")
            raise resumes.SIGTERMException(resumes.EXIT_CODE)

    def _mark(self, point: str) -> None:
        """A point where the epoch's loader draws its seeds ("rng_iter": making its iterator, "rng_first":
        its first batch): resuming mid-epoch puts the interrupted epoch's RNG states back there, and a fit
        with a resume checkpoint keeps them for its saves."""
        if self._position is not None:
            randomness.restore(self._position[point], self.device)
        if self._resume is not None:
            setattr(self._resume, point, randomness.capture(self.device))

    def _epoch_iterator(self, loader: Iterable) -> Any:
        self._mark("rng_iter")
        return iter(loader)

    def _fast_forward(self, batches: Any) -> int:
        """Resuming mid-epoch: skip the batches the interrupted run had done (they are drawn, not trained
        on), then put back its RNG states at that step; the batches skipped (0 when not resuming)."""
        self._mark("rng_first")
        position, self._position = self._position, None
        if position is None:
            return 0
        collections.deque(itertools.islice(batches, position["batch"]), maxlen=0)
        randomness.restore(position["rng"], self.device)
        return position["batch"]

    def _restore(self, model: Module, ckpt: dict) -> None:
        if "optimizer" not in ckpt:
            raise ValueError("this checkpoint holds the weights only (save_weights_only=True): it cannot resume "
                             "training; load it with Module.load_from_checkpoint")
        model.on_load_checkpoint(ckpt)  # Lightning: the module's first, then the callbacks'
        for cb in self.callbacks:
            if _overrides(cb, Callback, "on_load_checkpoint"):
                cb.on_load_checkpoint(self, model, ckpt)
        model.load_state_dict(ckpt["state_dict"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        if self.lr_scheduler is not None and ckpt["lr_scheduler"] is not None:
            self.lr_scheduler.scheduler.load_state_dict(ckpt["lr_scheduler"])
        self.precision.load_state_dict(ckpt["precision"])
        self._load_callback_states(ckpt["callbacks"])
        if self.datamodule is not None and "datamodule" in ckpt:
            self.datamodule.load_state_dict(ckpt["datamodule"])
        self.current_epoch = self._resume_epoch = ckpt["epoch"]
        self.global_step = ckpt["global_step"]
        loop = ckpt.get("loop")  # a resume checkpoint's (resume.py): where in the epoch it stopped
        if loop is not None and loop.get("finished"):
            self.should_stop = True
        elif loop is not None:
            self._position = {**loop, "rng": ckpt["rng"]}
        # last, so the next epoch draws the same random numbers as in the interrupted run
        randomness.restore(ckpt["rng"], self.device)

    def _sanity_check(self, model: Module, val: Any) -> None:
        """Lightning's sanity check: `num_sanity_val_steps` validation batches before training; what they
        log is dropped (and never copied to the host), and the RNG states are restored after it."""
        if val is None or self.num_sanity_val_steps == 0 or self.limit_val_batches == 0:
            return
        steps = None if self.num_sanity_val_steps == -1 else self.num_sanity_val_steps
        self.sanity_checking = True
        rng = randomness.capture(self.device)
        try:
            self.hooks("on_sanity_check_start")
            self._run_eval(model, self._val_loader(), "validation", limit=steps, publish=False)
            self.hooks("on_sanity_check_end")
        finally:
            self.sanity_checking = False
            randomness.restore(rng, self.device)

    def _can_stop(self, epochs_done: int) -> bool:
        return self.min_epochs is None or epochs_done >= self.min_epochs

    def _finished(self) -> bool:
        return ((self.should_stop and self._can_stop(self.current_epoch))
                or (self.max_epochs is not None and self.current_epoch >= self.max_epochs)
                or 0 <= self.max_steps <= self.global_step)

    def _val_every(self, n_batches: int | None) -> int | None:
        """Batches between validations inside an epoch (None: only at the epoch end)."""
        interval = self.val_check_interval
        if isinstance(interval, int):
            return interval
        if n_batches is None or interval >= 1.0:
            return None
        return max(1, int(n_batches * interval))

    def _train_epoch(self, model: Module, loader: Iterable, val: Iterable | None, batches=None) -> None:
        epoch = self.current_epoch
        self._resume_epoch = epoch
        distributed.set_epoch(loader, epoch)
        store = self.metric_store = self._train_store = MetricStore(self.device, training=True)
        n_batches = _limit(_length(loader), self.limit_train_batches)
        validating = (val is not None and self.limit_val_batches != 0
                      and (epoch + 1) % self.check_val_every_n_epoch == 0)
        val_every = self._val_every(n_batches) if validating else None
        model.train()
        hooks = self.hooks
        if not self._train_started:
            self._train_started = True
            self._epoch_hook("on_train_start")
        self._epoch_hook("on_train_epoch_start")
        self._progress.start_epoch(epoch, n_batches)

        # the hot path: no host syncs, no per-step dispatch to hooks that nobody overrides
        ddp = self._ddp
        step_fn = ddp if ddp is not None else self._compiled_step or model.training_step
        whole_step = isinstance(step_fn, compiled.CudaGraphStep)  # it runs backward and the optimizer step too
        batch_start, batch_end = hooks.calls("on_train_batch_start"), hooks.calls("on_train_batch_end")
        before_zero_grad = hooks.calls("on_before_zero_grad")
        before_backward, after_backward = hooks.calls("on_before_backward"), hooks.calls("on_after_backward")
        move, profile = self._batch_mover(model), self.profiler.profile
        accumulate, optimizer = self.accumulate_grad_batches, self.optimizer
        autocast, backward = self.precision.autocast, self.precision.backward
        log_every, deadline = self.log_every_n_steps, self._deadline
        resume = self._resume
        pending = 0
        stop = skipped = False
        batches = self._epoch_iterator(loader) if batches is None else batches
        batches_done = skip = self._fast_forward(batches)
        for batch_idx, batch in enumerate(batches, skip):
            if batch_idx == n_batches:
                break
            with profile("run_training_batch"):
                batch = move(batch)
                store.weight = _batch_size(batch)
                if batch_start and any(r == -1 for r in [fn(batch, batch_idx) for fn in batch_start]
                                       if isinstance(r, int)):
                    skipped = True  # Lightning: on_train_batch_start returning -1 ends the epoch
                    break
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
                        for fn in before_zero_grad if pending == 1 else ():
                            fn(optimizer)  # Lightning's place; the gradients were zeroed after the last step
                        for fn in before_backward:
                            fn(loss)
                        backward(loss / accumulate if accumulate > 1 else loss)
                        for fn in after_backward:
                            fn()
                batches_done = batch_idx + 1
                if step_now:
                    pending = 0
                    stop = self._optimizer_step(batches_done, stepped=whole_step)
                    self._step_scheduler("step", batch_idx)
                if batch_end:
                    outputs = _batch_outputs(output, accumulate)
                    for fn in batch_end:
                        fn(outputs, batch, batch_idx)
                if step_now and self.global_step % log_every == 0:
                    self._publish_step(batches_done)
            if deadline is not None and time.monotonic() >= deadline:
                self.should_stop = True
            if stop or (self.should_stop and self._can_stop(epoch)):
                break
            if val_every is not None and batches_done % val_every == 0 and batches_done != n_batches:
                self._validate_in_fit(model, val)
            if resume is not None and not pending and resume.due(self.global_step):
                self._save_resume(batches_done)
        if pending and not stop and not skipped:  # a loader without a length ended mid-accumulation
            self._optimizer_step(batches_done)
        if batches_done == n_batches if n_batches is not None else not (stop or skipped or self.should_stop):
            self._step_scheduler("epoch", epoch, plateau=False)  # Lightning: after the epoch's last batch

        if validating:
            self._validate_in_fit(model, val)
        self._resume_epoch = epoch + 1
        self._publish_epoch(store)
        self._progress.end_epoch(batches_done, self.global_step, self.progress_bar_metrics)
        store.epoch_hook = True
        self.metric_store = store  # the module's on_train_epoch_end logs into this epoch, before the monitors read
        for fn in hooks.calls("on_train_epoch_end"):
            fn()
            if store.dirty:
                self._publish_epoch(store)
        self.metric_store = None
        self._step_scheduler("epoch", epoch, plateau=True)
        self.current_epoch = epoch + 1

    def _publish_epoch(self, store: MetricStore) -> None:
        self._publish(store.means(self._all_reduce, self.world_size))

    def _optimizer_step(self, batches_done: int, stepped: bool = False) -> bool:
        """Unscale, clip, step, zero the gradients (unless `stepped`: done in a CUDA graph).
        Returns whether `max_steps` is reached."""
        optimizer = self.optimizer
        if not stepped:
            before_step = self.hooks.calls("on_before_optimizer_step")
            if self.gradient_clip_val or before_step:
                self.precision.unscale_(optimizer)  # the hooks and clipping see the true gradients
            for fn in before_step:
                fn(optimizer)
            if self.gradient_clip_val:
                if self.gradient_clip_algorithm == "value":
                    torch.nn.utils.clip_grad_value_(self.clip_params, self.gradient_clip_val)
                else:
                    torch.nn.utils.clip_grad_norm_(self.clip_params, self.gradient_clip_val)
            self.precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return self.global_step == self.max_steps

    def _step_scheduler(self, interval: str, index: int, plateau: bool | None = None) -> None:
        """Step the scheduler if it runs at this `interval`, every `frequency` batches or epochs
        (`index` counts from 0); `plateau` picks ReduceLROnPlateau or the others (None: either)."""
        config = self.lr_scheduler
        if config is None or config.interval != interval or (index + 1) % config.frequency:
            return
        if plateau is not None and plateau != isinstance(config.scheduler, ReduceLROnPlateau):
            return
        if not isinstance(config.scheduler, ReduceLROnPlateau):
            config.scheduler.step()
        elif config.monitor in self.callback_metrics:
            config.scheduler.step(float(self.callback_metrics[config.monitor]))
        elif config.strict:
            raise KeyError(f"lr_scheduler monitors {config.monitor!r}, which was not logged; "
                           f"logged: {sorted(self.callback_metrics)}")
        else:
            warnings.warn(f"lr_scheduler monitors {config.monitor!r}, which was not logged: not stepped "
                          f"(strict=False)", stacklevel=2)

    def _publish_step(self, batches_done: int) -> None:
        """A log point: one transfer of the latest training values."""
        self._publish(self._train_store.latest(self._all_reduce, self.world_size))
        self._progress.update(batches_done, self.global_step, self.progress_bar_metrics)

    def _train_loader(self) -> Iterable:
        train = self._train = _resolve(self._train)
        if train is None:
            raise ValueError("fit needs train_dataloaders, a datamodule or the module's train_dataloader()")
        self.num_training_batches = _limit(_length(train), self.limit_train_batches) or float("inf")
        return train

    def _val_loader(self) -> Iterable:
        self._val = _resolve(self._val)
        return self._val

    def _validate_in_fit(self, model: Module, val: Iterable) -> None:
        self._run_eval(model, self._val_loader(), "validation")
        self.metric_store = self._train_store

    # ---------------------------------------------------------------- validate / test / predict

    def _no_grad(self):
        return torch.inference_mode() if self.inference_mode else torch.no_grad()

    def _run_eval(self, model: Module, loader: Iterable, stage: str, limit: int | None = None,
                  publish: bool = True) -> Published:
        """One pass of validation_step/test_step with its hooks; one transfer of the metric means at the
        end (none when `publish` is False: the sanity check)."""
        step_fn = model.validation_step if stage == "validation" else model.test_step
        stage_limit = self.limit_val_batches if stage == "validation" else self.limit_test_batches
        n_batches = _limit(_length(loader), stage_limit)
        if limit is not None:
            n_batches = limit if n_batches is None else min(n_batches, limit)
        if publish:
            self.num_val_batches = [n_batches if n_batches is not None else float("inf")]
        store = self.metric_store = MetricStore(self.device)
        hooks, move, autocast = self.hooks, self._batch_mover(model), self.precision.autocast
        batch_start, batch_end = hooks.calls(f"on_{stage}_batch_start"), hooks.calls(f"on_{stage}_batch_end")
        getattr(model, f"on_{stage}_model_eval")()
        hooks(f"on_{stage}_start")
        hooks(f"on_{stage}_epoch_start")
        with self._no_grad(), self.profiler.profile(f"run_{stage}_loop"):
            for batch_idx, batch in enumerate(loader):
                if batch_idx == n_batches:
                    break
                batch = move(batch)
                store.weight = _batch_size(batch)
                for fn in batch_start:
                    fn(batch, batch_idx, 0)
                with autocast:
                    output = step_fn(batch, batch_idx)
                for fn in batch_end:
                    fn(output, batch, batch_idx, 0)
            hooks(f"on_{stage}_epoch_end")
        if not publish:
            store.reset_metrics()
        values = store.means(self._all_reduce, self.world_size) if publish else Published()
        self.metric_store = None  # Lightning: no logging in on_validation_end
        if publish:
            self._publish(values)
        hooks(f"on_{stage}_end")
        getattr(model, f"on_{stage}_model_train")()
        return values

    def _run_predict(self, model: Module, loader: Iterable) -> list:
        n_batches = _limit(_length(loader), self.limit_predict_batches)
        hooks, move, autocast = self.hooks, self._batch_mover(model), self.precision.autocast
        batch_start, batch_end = hooks.calls("on_predict_batch_start"), hooks.calls("on_predict_batch_end")
        outputs = []
        model.on_predict_model_eval()
        hooks("on_predict_start")
        hooks("on_predict_epoch_start")
        with self._no_grad(), self.profiler.profile("run_predict_loop"):
            for batch_idx, batch in enumerate(loader):
                if batch_idx == n_batches:
                    break
                batch = move(batch)
                for fn in batch_start:
                    fn(batch, batch_idx, 0)
                with autocast:
                    output = model.predict_step(batch, batch_idx)
                for fn in batch_end:
                    fn(output, batch, batch_idx, 0)
                outputs.append(output)
        hooks("on_predict_epoch_end")
        hooks("on_predict_end")
        return outputs

    def _evaluate_entry(self, model: Module | None, dataloaders: Any, datamodule, stage: str,
                        ckpt_path: str | None, verbose: bool):
        if isinstance(dataloaders, datamodules.LightningDataModule):
            dataloaders, datamodule = None, dataloaders
        if model is None:  # Lightning: the model of the last fit, from its best checkpoint when there is one
            model = self.module
            if model is None:
                raise ValueError(f"trainer.{stage}() needs a model (no fit ran before)")
            if ckpt_path is None and self.checkpoint_callback is not None and self.checkpoint_callback.best_model_path:
                ckpt_path = "best"
        step = _STAGE_STEP[stage]
        if stage != "predict" and not _overrides(model, Module, step):
            raise ValueError(f"{type(model).__name__} has no {step}")
        self._begin(model, stage, datamodule, dataloaders is not None)
        try:
            loader = _resolve(datamodules.check_single(dataloaders, "dataloaders") if dataloaders is not None
                              else datamodules.loader(self.datamodule or model, _STAGE_LOADER[stage]))
            if loader is None:
                raise ValueError(f"trainer.{stage} needs dataloaders, a datamodule or the module's "
                                 f"{_STAGE_LOADER[stage]}()")
            self._setup(model)
            if ckpt_path:
                ckpt = checkpoint.load(checkpoint.resolve(ckpt_path, self.callbacks))
                model.on_load_checkpoint(ckpt)
                model.load_state_dict(ckpt["state_dict"])
            if stage == "predict":
                return self._run_predict(model, loader)
            values = self._run_eval(model, loader, _STAGE_HOOK[stage])
            results = {k: v for k, v in values.items() if k in values.logger}
            if verbose:
                self._progress.report(stage, results)
            return [results]
        finally:
            self.metric_store = None
            self._progress.close()
            self._end(model, stage)


def _checkpoints_last(callbacks: list[Callback]) -> list[Callback]:
    """ModelCheckpoints run last (Lightning's order), so a checkpoint holds the other callbacks' new state."""
    return sorted(callbacks, key=lambda cb: isinstance(cb, ModelCheckpoint))
