"""The LightningModule hooks glt.Trainer calls, with Lightning's meaning and order, and the dispatch of
hook calls to callbacks and the module.

`ModelHooks` gives `glt.Module` a no-op default for each hook. `Dispatch` binds, for one run, the
overriding callbacks' hooks (called with `(trainer, module, ...)`) and then the module's own (called
with the hook's arguments), so a hook nobody overrides costs nothing on the hot path.
`warn_unsupported` names, once per class, the Lightning methods a module defines that glt never calls.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch

# LightningModule methods glt.Trainer does not call: a module that defines one is warned, once
UNSUPPORTED = {
    "optimizer_step": "the Trainer steps the optimizer itself (use on_before_optimizer_step)",
    "optimizer_zero_grad": "the Trainer zeroes the gradients itself (set_to_none=True; use on_before_zero_grad)",
    "configure_gradient_clipping": "use Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)",
    "lr_scheduler_step": "schedulers step with scheduler.step() / step(metric)",
    "backward": "the Trainer calls loss.backward() (scaled under 16-mixed; use on_before_backward)",
    "on_validation_model_zero_grad": "gradients are zeroed after every optimizer step",
    "configure_sharded_model": "removed in Lightning 2; use configure_model",
    "training_step_end": "removed in Lightning 2",
    "validation_step_end": "removed in Lightning 2",
    "test_step_end": "removed in Lightning 2",
    "training_epoch_end": "removed in Lightning 2; use on_train_epoch_end",
    "validation_epoch_end": "removed in Lightning 2; use on_validation_epoch_end",
    "test_epoch_end": "removed in Lightning 2; use on_test_epoch_end",
    "on_predict_model_train": "Lightning does not call it either",
}
_warned: set[tuple[type, str]] = set()


def warn_unsupported(obj: Any) -> None:
    """Warn once per class for each Lightning method it defines that glt.Trainer never calls."""
    for name, why in UNSUPPORTED.items():
        if hasattr(type(obj), name) and (type(obj), name) not in _warned:
            _warned.add((type(obj), name))
            warnings.warn(f"{type(obj).__name__}.{name} is defined but glt.Trainer never calls it: {why}",
                          stacklevel=3)


class ModelHooks:
    """The LightningModule hooks, as no-ops (the `*_model_eval/train` ones switch the mode)."""

    def prepare_data(self) -> None: ...
    def setup(self, stage: str) -> None: ...
    def teardown(self, stage: str) -> None: ...
    def configure_model(self) -> None: ...

    def configure_callbacks(self):
        """Callbacks to add to the Trainer's; one of the same type replaces the Trainer's."""
        return []

    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int): ...
    def on_train_batch_end(self, outputs, batch: Any, batch_idx: int) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict) -> None: ...

    def on_validation_model_eval(self) -> None:
        self.eval()  # type: ignore[attr-defined]

    def on_validation_model_train(self) -> None:
        self.train()  # type: ignore[attr-defined]

    def on_test_model_eval(self) -> None:
        self.eval()  # type: ignore[attr-defined]

    def on_test_model_train(self) -> None:
        self.train()  # type: ignore[attr-defined]

    def on_predict_model_eval(self) -> None:
        self.eval()  # type: ignore[attr-defined]

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        from .batches import to_device

        return to_device(batch, device, None)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch


TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def overrides(obj: Any, base: type, name: str) -> bool:
    """Whether `obj`'s class defines `name` other than `base` does."""
    return getattr(type(obj), name, None) is not getattr(base, name, None)


class Dispatch:
    """The hook calls of one run, bound once: callbacks first, then the module, as Lightning calls them
    (at `on_train_epoch_end` the monitoring callbacks, EarlyStopping and ModelCheckpoint, come after
    the module, so they see what the module logs there)."""

    def __init__(self, trainer, module, callbacks: list):
        from .callbacks import Callback

        self._trainer, self._module, self._callbacks, self._base = trainer, module, callbacks, Callback
        self._bound: dict[str, list[Callable]] = {}

    def calls(self, name: str) -> list[Callable]:
        bound = self._bound.get(name)
        if bound is None:
            from .callbacks import monitors

            cbs = [cb for cb in self._callbacks if overrides(cb, self._base, name)]
            if name == "on_train_epoch_end":
                cbs = [cb for cb in cbs if not monitors(cb)] + [None] + [cb for cb in cbs if monitors(cb)]
            else:
                cbs.append(None)
            module = self._module if overrides(self._module, ModelHooks, name) else None
            bound = self._bound[name] = [
                functools.partial(getattr(cb, name), self._trainer, self._module) if cb is not None
                else getattr(module, name) for cb in cbs if cb is not None or module is not None]
        return bound

    def __call__(self, name: str, *args) -> None:
        for fn in self.calls(name):
            fn(*args)
