"""Callbacks: hooks the Trainer calls, plus checkpointing and early stopping."""
from __future__ import annotations

import math
import os


class Callback:
    """Override the hooks you need; each receives the Trainer and the Module.

    Only callbacks that override `on_train_batch_end` are called per batch.
    `state_dict`/`load_state_dict` carry a callback's state through checkpoints.
    """

    @property
    def state_key(self) -> str:
        return type(self).__qualname__

    def on_fit_start(self, trainer, module): ...
    def on_fit_end(self, trainer, module): ...
    def on_train_epoch_start(self, trainer, module): ...
    def on_train_epoch_end(self, trainer, module): ...
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx): ...
    def on_validation_start(self, trainer, module): ...
    def on_validation_end(self, trainer, module): ...
    def on_test_start(self, trainer, module): ...
    def on_test_end(self, trainer, module): ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


def _check_mode(mode: str) -> None:
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r}; use 'min' or 'max'")


def _better(a: float, b: float, mode: str, delta: float = 0.0) -> bool:
    return a < b - delta if mode == "min" else a > b + delta


def _monitored(trainer, name: str) -> float:
    try:
        return trainer.callback_metrics[name]
    except KeyError:
        logged = sorted(trainer.callback_metrics)
        raise KeyError(f"monitored metric {name!r} was not logged; logged: {logged}") from None


class ModelCheckpoint(Callback):
    """Save checkpoints at the end of each training epoch (after that epoch's validation).

    With `monitor`, keeps the `save_top_k` best by `mode`; without, the `save_top_k` latest.
    `save_top_k=-1` keeps all, `0` none. `save_last` also writes `last.ckpt`. `filename` is a
    str.format pattern over `epoch`, `step` and the logged metrics; ".ckpt" is appended.
    `dirpath` defaults to `<Trainer.default_root_dir>/checkpoints`. Only rank 0 writes.
    """

    def __init__(self, dirpath: str | None = None, monitor: str | None = None, mode: str = "min",
                 save_top_k: int = 1, save_last: bool = False, filename: str = "epoch={epoch}-step={step}"):
        _check_mode(mode)
        if save_top_k < -1:
            raise ValueError(f"save_top_k={save_top_k}; use -1 (all), 0 (none) or a positive count")
        self.dirpath, self.monitor, self.mode = dirpath, monitor, mode
        self.save_top_k, self.save_last, self.filename = save_top_k, save_last, filename
        self.best_k_models: dict[str, float] = {}  # path -> score (global step when no monitor)
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint[monitor={self.monitor}]"

    def last_path(self) -> str:
        return self.last_model_path or (os.path.join(self.dirpath, "last.ckpt") if self.dirpath else "")

    def on_fit_start(self, trainer, module):
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")

    def on_train_epoch_end(self, trainer, module):
        if self.save_top_k:
            self._save_top_k(trainer)
        if self.save_last:
            self.last_model_path = os.path.join(self.dirpath, "last.ckpt")
            trainer.save_checkpoint(self.last_model_path)

    def _save_top_k(self, trainer) -> None:
        metrics = trainer.callback_metrics
        try:
            name = self.filename.format_map({**metrics, "epoch": trainer.current_epoch, "step": trainer.global_step})
        except KeyError as e:
            raise KeyError(f"ModelCheckpoint filename {self.filename!r} names {e}, which was not logged") from None
        path = os.path.join(self.dirpath, name + ".ckpt")
        mode = self.mode if self.monitor else "max"
        score = _monitored(trainer, self.monitor) if self.monitor else float(trainer.global_step)
        if self.monitor and math.isnan(score):
            return
        scores, worst = self.best_k_models, None
        if self.save_top_k != -1 and len(scores) >= self.save_top_k and path not in scores:
            worst = (max if mode == "min" else min)(scores, key=scores.get)
            if not _better(score, scores[worst], mode):
                return
        trainer.save_checkpoint(path)
        scores[path] = score
        if worst is not None:
            del scores[worst]
            if trainer.is_global_zero and os.path.exists(worst):
                os.remove(worst)
        self.best_model_path = (min if mode == "min" else max)(scores, key=scores.get)
        self.best_model_score = scores[self.best_model_path] if self.monitor else None

    def state_dict(self) -> dict:
        return {"best_k_models": dict(self.best_k_models), "best_model_path": self.best_model_path,
                "best_model_score": self.best_model_score, "last_model_path": self.last_model_path}

    def load_state_dict(self, state: dict) -> None:
        self.best_k_models = dict(state["best_k_models"])
        self.best_model_path = state["best_model_path"]
        self.best_model_score = state["best_model_score"]
        self.last_model_path = state["last_model_path"]


class EarlyStopping(Callback):
    """Stop training when `monitor` has not improved by more than `min_delta` for `patience` epochs."""

    def __init__(self, monitor: str, patience: int = 3, mode: str = "min", min_delta: float = 0.0):
        _check_mode(mode)
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, abs(min_delta)
        self.wait = 0
        self.best: float | None = None
        self.stopped_epoch: int | None = None

    @property
    def state_key(self) -> str:
        return f"EarlyStopping[monitor={self.monitor}]"

    def on_train_epoch_end(self, trainer, module):
        value = _monitored(trainer, self.monitor)
        if self.best is None or _better(value, self.best, self.mode, self.min_delta):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch

    def state_dict(self) -> dict:
        return {"wait": self.wait, "best": self.best, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.wait, self.best, self.stopped_epoch = state["wait"], state["best"], state["stopped_epoch"]
