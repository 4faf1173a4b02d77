"""`glt.Module` (alias `LightningModule`): an nn.Module that says how to train, validate, test and
predict itself, with Lightning's hooks and logging calls."""
from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
from torch import nn

from . import checkpoint
from .hooks import ModelHooks
from .hparams import HyperparametersMixin


class Module(HyperparametersMixin, ModelHooks, nn.Module):
    """Subclass and implement `training_step` and `configure_optimizers`.

    `training_step(batch, batch_idx)` returns the loss tensor (or a dict with a "loss" key).
    `validation_step` / `test_step` log their metrics with `self.log`; `predict_step` returns
    what `trainer.predict` collects (by default `self(batch)`).
    """

    _trainer = None  # set by the Trainer; not pickled
    _automatic_optimization = True

    def training_step(self, batch: Any, batch_idx: int):
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int):
        raise NotImplementedError(f"{type(self).__name__} has no validation_step but validation data was given")

    def test_step(self, batch: Any, batch_idx: int):
        raise NotImplementedError(f"{type(self).__name__} has no test_step but test data was given")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0):
        return self(batch)

    def configure_optimizers(self):
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers()")

    # ---------------------------------------------------------------- logging

    def log(self, name: str, value: torch.Tensor | float, prog_bar: bool = False, logger: bool | None = None,
            on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx="mean", enable_graph: bool = False,
            sync_dist: bool = False, sync_dist_group=None, add_dataloader_idx: bool = True,
            batch_size: int | None = None, metric_attribute: str | None = None, rank_zero_only: bool = False) -> None:
        """Record a scalar, as Lightning's `self.log`. It stays on the device; the Trainer reduces it
        (`reduce_fx`, batch-size weighted means) and copies it to the host only at its sync points.
        `value` may be a torchmetrics Metric: its batch value on_step, compute() (then reset()) on_epoch.
        Defaults: on_step=True, on_epoch=False in training_step and the training batch hooks;
        on_step=False, on_epoch=True in validation, test and the epoch hooks. Under DDP every value
        is reduced across processes (`sync_dist` is accepted; glt always syncs, in its one packed
        all-reduce per sync point)."""
        if sync_dist_group is not None:
            raise ValueError("log(sync_dist_group=...) is not supported: values are reduced over all processes")
        trainer = self._trainer
        if trainer is None:
            warnings.warn(f"self.log({name!r}) outside a glt.Trainer run records nothing", stacklevel=2)
            return
        store = trainer.metric_store
        if store is None:
            raise RuntimeError(f"self.log({name!r}) is called where nothing is collected: log in the training, "
                               f"validation or test steps and their batch or epoch hooks (not in predict, "
                               f"on_fit_start/end, setup or after the run)")
        store.log(name, value, prog_bar=prog_bar, logger=True if logger is None else logger,
                  on_step=on_step, on_epoch=on_epoch, reduce_fx=reduce_fx, batch_size=batch_size)

    def log_dict(self, dictionary: Mapping[str, Any], prog_bar: bool = False, logger: bool | None = None,
                 on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx="mean",
                 enable_graph: bool = False, sync_dist: bool = False, sync_dist_group=None,
                 add_dataloader_idx: bool = True, batch_size: int | None = None, rank_zero_only: bool = False) -> None:
        """`self.log` for each item of `dictionary`, with the same options."""
        for name, value in dictionary.items():
            self.log(name, value, prog_bar=prog_bar, logger=logger, on_step=on_step, on_epoch=on_epoch,
                     reduce_fx=reduce_fx, sync_dist=sync_dist, sync_dist_group=sync_dist_group,
                     batch_size=batch_size)

    def print(self, *args, **kwargs) -> None:
        """`print`, on the first process only."""
        if self._trainer is None or self._trainer.is_global_zero:
            print(*args, **kwargs)

    # ---------------------------------------------------------------- what the hooks can read

    @property
    def trainer(self):
        return self._trainer

    @trainer.setter
    def trainer(self, trainer) -> None:
        """Set by the Trainer that runs this module (not pickled)."""
        self._trainer = trainer

    @property
    def logger(self):
        """The Trainer's first logger (None without one)."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list:
        return self._trainer.loggers if self._trainer is not None else []

    @property
    def device(self) -> torch.device:
        tensor = next(self.parameters(), None)
        if tensor is None:
            tensor = next(self.buffers(), None)
        return tensor.device if tensor is not None else torch.device("cpu")

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def global_rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def local_rank(self) -> int:
        return self.global_rank  # single node

    @property
    def automatic_optimization(self) -> bool:
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        if not value:
            raise NotImplementedError("manual optimization (automatic_optimization = False) is not supported by "
                                      "glt.Trainer: return the loss from training_step")
        self._automatic_optimization = True

    def optimizers(self):
        """The optimizer the Trainer built from `configure_optimizers`."""
        return self._trainer.optimizer if self._trainer is not None else None

    def lr_schedulers(self):
        config = self._trainer.lr_scheduler if self._trainer is not None else None
        return config.scheduler if config is not None else None

    def freeze(self) -> None:
        """No gradients for any parameter, and eval mode."""
        for p in self.parameters():
            p.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        for p in self.parameters():
            p.requires_grad = True
        self.train()

    # ---------------------------------------------------------------- checkpoints

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str, map_location=None, hparams_file: str | None = None,
                             strict: bool | None = None, **kwargs):
        """A new module built from the checkpoint's saved hyperparameters (updated by `kwargs`, or read
        from `hparams_file`), with its weights, after `on_load_checkpoint(checkpoint)`."""
        ckpt = checkpoint.load(checkpoint_path)
        hparams = dict(ckpt.get("hyper_parameters") or {})
        if hparams_file is not None:
            import yaml  # PyYAML, only for hparams_file

            with open(hparams_file) as f:
                hparams.update(yaml.safe_load(f) or {})
        model = cls(**{**hparams, **kwargs})
        model.on_load_checkpoint(ckpt)
        model.load_state_dict(ckpt["state_dict"], strict=True if strict is None else strict)
        if map_location is not None:
            model.to(torch.device(map_location) if isinstance(map_location, str) else map_location)
        return model

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_trainer", None)
        return state


LightningModule = Module
