"""`save_hyperparameters` / `hparams`, shared by `glt.Module` and `glt.LightningDataModule`."""
from __future__ import annotations

import copy
import inspect
from argparse import Namespace
from typing import Any, Sequence


class AttributeDict(dict):
    """A dict whose keys read as attributes: `self.hparams.lr`."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(f"no hyperparameter {key!r}; saved: {sorted(self)}") from e

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


def _init_args(frame) -> dict[str, Any]:
    """The arguments of the `__init__` running in `frame`, `**kwargs` spread out."""
    info = inspect.getargvalues(frame)
    args = {name: info.locals[name] for name in info.args[1:]}  # not self
    if info.keywords:
        args.update(info.locals[info.keywords])
    return args


class HyperparametersMixin:
    """Lightning's `save_hyperparameters`: the `__init__` arguments become `self.hparams`, are written
    to the logger's hparams and into checkpoints, and rebuild the object in `load_from_checkpoint`."""

    _log_hyperparams = False

    def save_hyperparameters(self, *args: Any, ignore: Sequence[str] | str | None = None, frame=None,
                             logger: bool = True) -> None:
        """Save the caller's `__init__` arguments (all, or those named in `args`), or one dict or
        Namespace given in `args`; `ignore` drops names."""
        if len(args) == 1 and isinstance(args[0], (dict, Namespace)):
            saved = dict(vars(args[0]) if isinstance(args[0], Namespace) else args[0])
        else:
            caller = frame or inspect.currentframe().f_back  # type: ignore[union-attr]
            init = _init_args(caller)
            unknown = [a for a in args if a not in init]
            if unknown or not all(isinstance(a, str) for a in args):
                raise ValueError(f"save_hyperparameters{args}: name __init__ arguments ({sorted(init)}) or "
                                 f"pass one dict")
            saved = {k: v for k, v in init.items() if not args or k in args}
        drop = [ignore] if isinstance(ignore, str) else list(ignore or [])
        saved = {k: v for k, v in saved.items() if k not in drop}
        object.__setattr__(self, "_hparams", AttributeDict(saved))
        object.__setattr__(self, "_hparams_initial", copy.deepcopy(AttributeDict(saved)))
        object.__setattr__(self, "_log_hyperparams", logger)

    @property
    def logs_hyperparameters(self) -> bool:
        """Whether the saved hyperparameters go to the logger (`save_hyperparameters(logger=...)`)."""
        return self._log_hyperparams

    @property
    def hparams(self) -> AttributeDict:
        if not hasattr(self, "_hparams"):
            object.__setattr__(self, "_hparams", AttributeDict())
        return self._hparams  # type: ignore[attr-defined]

    @property
    def hparams_initial(self) -> AttributeDict:
        """The hyperparameters as saved, whatever was changed in `hparams` since."""
        return copy.deepcopy(getattr(self, "_hparams_initial", AttributeDict()))
