"""Callbacks: hooks the Trainer calls, plus checkpointing and early stopping."""
from __future__ import annotations

import math
import os
import re
import warnings

import torch


class Callback:
    """Override the hooks you need; each receives the Trainer and the Module first, as in Lightning.

    Hooks nobody overrides cost nothing (per-batch ones included).
    `state_dict`/`load_state_dict` carry a callback's state through checkpoints.
    """

    @property
    def state_key(self) -> str:
        return type(self).__qualname__

    def setup(self, trainer, pl_module, stage: str): ...
    def teardown(self, trainer, pl_module, stage: str): ...
    def on_fit_start(self, trainer, pl_module): ...
    def on_fit_end(self, trainer, pl_module): ...
    def on_sanity_check_start(self, trainer, pl_module): ...
    def on_sanity_check_end(self, trainer, pl_module): ...
    def on_train_start(self, trainer, pl_module): ...
    def on_train_end(self, trainer, pl_module): ...
    def on_train_epoch_start(self, trainer, pl_module): ...
    def on_train_epoch_end(self, trainer, pl_module): ...
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx): ...
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx): ...
    def on_validation_start(self, trainer, pl_module): ...
    def on_validation_end(self, trainer, pl_module): ...
    def on_validation_epoch_start(self, trainer, pl_module): ...
    def on_validation_epoch_end(self, trainer, pl_module): ...
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0): ...
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0): ...
    def on_test_start(self, trainer, pl_module): ...
    def on_test_end(self, trainer, pl_module): ...
    def on_test_epoch_start(self, trainer, pl_module): ...
    def on_test_epoch_end(self, trainer, pl_module): ...
    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0): ...
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0): ...
    def on_predict_start(self, trainer, pl_module): ...
    def on_predict_end(self, trainer, pl_module): ...
    def on_predict_epoch_start(self, trainer, pl_module): ...
    def on_predict_epoch_end(self, trainer, pl_module): ...
    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0): ...
    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0): ...
    def on_before_backward(self, trainer, pl_module, loss): ...
    def on_after_backward(self, trainer, pl_module): ...
    def on_before_optimizer_step(self, trainer, pl_module, optimizer): ...
    def on_before_zero_grad(self, trainer, pl_module, optimizer): ...
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict): ...
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict): ...
    def on_exception(self, trainer, pl_module, exception: BaseException): ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


def monitors(callback: Callback) -> bool:
    """EarlyStopping and ModelCheckpoint run after the module's on_train_epoch_end (they read what it logs)."""
    return isinstance(callback, (EarlyStopping, ModelCheckpoint))


def _check_mode(mode: str) -> None:
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r}; use 'min' or 'max'")


def _better(a: float, b: float, mode: str, delta: float = 0.0) -> bool:
    return a < b - delta if mode == "min" else a > b + delta


def _monitored(trainer, name: str) -> float:
    try:
        return float(trainer.callback_metrics[name])
    except KeyError:
        logged = sorted(trainer.callback_metrics)
        raise KeyError(f"monitored metric {name!r} was not logged; logged: {logged}") from None


def _auto_named(filename: str) -> str:
    """Lightning's auto_insert_metric_name: "{epoch}-{val_loss:.2f}" -> "epoch={epoch}-val_loss={val_loss:.2f}"."""
    for group in re.findall(r"(\{.*?)[:}]", filename):
        name = group[1:]
        filename = filename.replace(group, f"{name}={{{name}")
    return filename


class ModelCheckpoint(Callback):
    """Save checkpoints at the end of training epochs (after that epoch's validation), as Lightning's.

    With `monitor`, keeps the `save_top_k` best by `mode`; without, the `save_top_k` latest.
    `save_top_k=-1` keeps all, `0` none. `save_last` also writes `last.ckpt`. `filename` is a
    str.format pattern over `epoch`, `step` and the logged metrics (default "{epoch}-{step}"); with
    `auto_insert_metric_name` each field is written `name=value`; ".ckpt" is appended.
    `dirpath` defaults to `<log_dir>/checkpoints` of the Trainer's first logger, else
    `<default_root_dir>/checkpoints`. `every_n_epochs` saves every n-th epoch; `save_weights_only`
    writes the weights and hyperparameters only. Only rank 0 writes; nothing is written under fast_dev_run.
    """

    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | None = None, filename: str | None = None, monitor: str | None = None,
                 verbose: bool = False, save_last: bool | None = None, save_top_k: int = 1,
                 save_weights_only: bool = False, mode: str = "min", auto_insert_metric_name: bool = True,
                 every_n_train_steps: int | None = None, train_time_interval=None, every_n_epochs: int | None = None,
                 save_on_train_epoch_end: bool | None = None, enable_version_counter: bool = True):
        _check_mode(mode)
        if save_top_k < -1:
            raise ValueError(f"save_top_k={save_top_k}; use -1 (all), 0 (none) or a positive count")
        for option, value in (("every_n_train_steps", every_n_train_steps),
                              ("train_time_interval", train_time_interval)):
            if value:
                raise ValueError(f"ModelCheckpoint({option}=...) is not supported: glt saves at epoch ends "
                                 f"(every_n_epochs)")
        if save_on_train_epoch_end is False:
            raise ValueError("ModelCheckpoint(save_on_train_epoch_end=False) is not supported: glt saves at the "
                             "epoch end, after that epoch's validation")
        if every_n_epochs is not None and (not isinstance(every_n_epochs, int) or every_n_epochs < 0):
            raise ValueError(f"every_n_epochs={every_n_epochs!r}; use a count >= 0")
        if save_last not in (None, True, False):
            raise ValueError(f"save_last={save_last!r}; use True or False ('link' is not supported)")
        self.dirpath, self.monitor, self.mode, self.verbose = dirpath, monitor, mode, verbose
        self.save_top_k, self.save_last, self.save_weights_only = save_top_k, bool(save_last), save_weights_only
        self.filename = filename or "{epoch}-{step}"
        self.auto_insert_metric_name = auto_insert_metric_name
        self.every_n_epochs = 1 if every_n_epochs is None else every_n_epochs
        self.best_k_models: dict[str, float] = {}  # path -> score (global step when no monitor)
        self.kth_best_model_path = ""
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint[monitor={self.monitor}]"

    def last_path(self) -> str:
        return self.last_model_path or (os.path.join(self.dirpath, "last.ckpt") if self.dirpath else "")

    def setup(self, trainer, pl_module, stage):
        if self.dirpath is None:
            root = trainer.loggers[0].log_dir if trainer.loggers else trainer.default_root_dir
            self.dirpath = os.path.join(root, "checkpoints")

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.fast_dev_run or not self.every_n_epochs or (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        if self.save_top_k:
            self._save_top_k(trainer)
        if self.save_last:
            self.last_model_path = os.path.join(self.dirpath, "last.ckpt")
            self._save(trainer, self.last_model_path)

    def _save(self, trainer, path: str) -> None:
        trainer.save_checkpoint(path, weights_only=self.save_weights_only)
        if self.verbose and trainer.is_global_zero:
            print(f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: saved {path}")

    def format_checkpoint_name(self, metrics: dict, epoch: int, step: int) -> str:
        pattern = _auto_named(self.filename) if self.auto_insert_metric_name else self.filename
        try:
            name = pattern.format_map({**metrics, "epoch": epoch, "step": step})
        except KeyError as e:
            raise KeyError(f"ModelCheckpoint filename {self.filename!r} names {e}, which was not logged") from None
        return os.path.join(self.dirpath, name + self.FILE_EXTENSION)

    def _save_top_k(self, trainer) -> None:
        path = self.format_checkpoint_name(trainer.callback_metrics, trainer.current_epoch, trainer.global_step)
        mode = self.mode if self.monitor else "max"
        score = _monitored(trainer, self.monitor) if self.monitor else float(trainer.global_step)
        if self.monitor and math.isnan(score):
            return
        scores, worst = self.best_k_models, None
        if self.save_top_k != -1 and len(scores) >= self.save_top_k and path not in scores:
            worst = (max if mode == "min" else min)(scores, key=scores.get)
            if not _better(score, scores[worst], mode):
                if self.verbose and trainer.is_global_zero:
                    print(f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: "
                          f"{self.monitor!r} was not in top {self.save_top_k}")
                return
        self._save(trainer, path)
        scores[path] = score
        if worst is not None:
            del scores[worst]
            if trainer.is_global_zero and os.path.exists(worst):
                os.remove(worst)
        self.best_model_path = (min if mode == "min" else max)(scores, key=scores.get)
        self.kth_best_model_path = (max if mode == "min" else min)(scores, key=scores.get)
        self.best_model_score = scores[self.best_model_path] if self.monitor else None

    def state_dict(self) -> dict:
        return {"best_k_models": dict(self.best_k_models), "best_model_path": self.best_model_path,
                "best_model_score": self.best_model_score, "last_model_path": self.last_model_path,
                "dirpath": self.dirpath}

    def load_state_dict(self, state: dict) -> None:
        self.best_k_models = dict(state["best_k_models"])
        self.best_model_path = state["best_model_path"]
        self.best_model_score = state["best_model_score"]
        self.last_model_path = state["last_model_path"]


class EarlyStopping(Callback):
    """Stop training when `monitor` has not improved by more than `min_delta` for `patience` checks
    (one per epoch end), as Lightning's. `check_finite` stops on NaN/inf; `stopping_threshold` stops once
    the metric is that good, `divergence_threshold` once it is that bad; `strict=False` skips the check
    (with a warning) when the metric was not logged; `verbose` prints each decision."""

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: str = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None, log_rank_zero_only: bool = False):
        _check_mode(mode)
        if check_on_train_epoch_end is False:
            raise ValueError("EarlyStopping(check_on_train_epoch_end=False) is not supported: glt checks at the "
                             "epoch end, after that epoch's validation")
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, abs(min_delta)
        self.verbose, self.strict, self.check_finite = verbose, strict, check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.wait_count = 0
        self.best_score: float | None = None
        self.stopped_epoch = 0
        self.stopping_reason_message: str | None = None

    @property
    def state_key(self) -> str:
        return f"EarlyStopping[monitor={self.monitor}]"

    # the names of glt before Lightning's
    wait = property(lambda self: self.wait_count)
    best = property(lambda self: self.best_score)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.fast_dev_run:
            return
        if self.monitor not in trainer.callback_metrics and not self.strict:
            warnings.warn(f"EarlyStopping: {self.monitor!r} was not logged; the check is skipped", stacklevel=2)
            return
        value = _monitored(trainer, self.monitor)
        stop, reason = self._evaluate(value)
        if stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason_message = reason
        if reason and self.verbose and trainer.is_global_zero:
            print(reason)

    def _evaluate(self, value: float) -> tuple[bool, str | None]:
        name = self.monitor
        if self.check_finite and not math.isfinite(value):
            return True, f"Monitored metric {name} = {value} is not finite. Signaling Trainer to stop."
        if self.stopping_threshold is not None and _better(value, self.stopping_threshold, self.mode):
            return True, f"Stopping threshold reached: {name} = {value} reached {self.stopping_threshold}."
        if self.divergence_threshold is not None and _better(self.divergence_threshold, value, self.mode):
            return True, f"Divergence threshold reached: {name} = {value} passed {self.divergence_threshold}."
        if self.best_score is None or _better(value, self.best_score, self.mode, self.min_delta):
            reason = f"Metric {name} improved. New best score: {value:.3f}" if self.verbose else None
            self.best_score, self.wait_count = value, 0
            return False, reason
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (f"Monitored metric {name} did not improve in the last {self.wait_count} records. "
                          f"Best score: {self.best_score:.3f}. Signaling Trainer to stop.")
        return False, None

    def state_dict(self) -> dict:
        return {"wait_count": self.wait_count, "best_score": self.best_score, "stopped_epoch": self.stopped_epoch,
                "patience": self.patience}

    def load_state_dict(self, state: dict) -> None:
        self.wait_count, self.best_score, self.stopped_epoch = state["wait_count"], state["best_score"], \
            state["stopped_epoch"]


class LearningRateMonitor(Callback):
    """Log each optimizer's learning rate, as Lightning's: `lr-<Optimizer>` (`.../pg<i>` with several param
    groups; the scheduler's `name` when it has one), with `-momentum` and `-weight_decay` on request.
    `logging_interval="step"` logs at every log point, `"epoch"` at each epoch start, None at the
    scheduler's interval (an optimizer without a scheduler: both). The values are host floats: no sync."""

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False):
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"logging_interval={logging_interval!r}; use None, 'step' or 'epoch'")
        self.logging_interval, self.log_momentum, self.log_weight_decay = logging_interval, log_momentum, \
            log_weight_decay

    def on_train_start(self, trainer, pl_module):
        if not trainer.loggers:
            raise ValueError("LearningRateMonitor needs a logger: the Trainer has logger=False")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.logging_interval != "epoch" and (trainer.global_step + 1) % trainer.log_every_n_steps == 0:
            self._log(trainer, "step" if self.logging_interval is None else None)

    def on_train_epoch_start(self, trainer, pl_module):
        if self.logging_interval != "step":
            self._log(trainer, "epoch" if self.logging_interval is None else None)

    def _log(self, trainer, interval: str | None) -> None:
        """The stats of the optimizer whose scheduler steps at `interval` (None: any), or that has none."""
        config, optimizer = trainer.lr_scheduler, trainer.optimizer
        if config is not None and interval not in (None, config.interval):
            return
        base = (config.name if config is not None and config.name else None) or f"lr-{type(optimizer).__name__}"
        groups = optimizer.param_groups
        stats: dict[str, float] = {}
        for i, group in enumerate(groups):
            name = base if len(groups) == 1 else f"{base}/pg{i + 1}"
            stats[name] = float(group["lr"])
            if self.log_momentum:
                stats[f"{name}-momentum"] = float(group["betas"][0] if "betas" in group else group.get("momentum", 0))
            if self.log_weight_decay:
                stats[f"{name}-weight_decay"] = float(group.get("weight_decay", 0))
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in stats.items()})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(stats, trainer.global_step)
