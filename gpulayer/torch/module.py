"""`glt.Module`: an nn.Module that says how to train, validate and test itself."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Module(nn.Module):
    """Subclass and implement `training_step` and `configure_optimizers`.

    `training_step(batch, batch_idx)` returns the loss tensor (or a dict with a "loss" key).
    `validation_step` / `test_step` log their metrics with `self.log`.
    """

    _trainer = None  # set by the Trainer; not pickled

    def training_step(self, batch: Any, batch_idx: int):
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int):
        raise NotImplementedError(f"{type(self).__name__} has no validation_step but validation data was given")

    def test_step(self, batch: Any, batch_idx: int):
        raise NotImplementedError(f"{type(self).__name__} has no test_step but test data was given")

    def configure_optimizers(self):
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers()")

    def log(self, name: str, value: torch.Tensor | float, prog_bar: bool = False) -> None:
        """Record a scalar. It stays on the device; the Trainer averages it over the epoch
        (weighted by batch size) and copies it to the host only at its sync points.
        Outside a training, validation or test loop this does nothing."""
        trainer = self._trainer
        if trainer is not None and trainer._store is not None:
            trainer._store.log(name, value, prog_bar)

    @property
    def trainer(self):
        return self._trainer

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

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_trainer", None)
        return state
