"""`glt.LightningDataModule`, and where each stage's loader comes from."""
from __future__ import annotations

from typing import Any, Iterable

from .hparams import HyperparametersMixin

class LightningDataModule(HyperparametersMixin):
    """Data for the Trainer, as in Lightning: `prepare_data` (once, on the first process), then
    `setup(stage)` ("fit", "validate", "test", "predict"), the `*_dataloader` methods, `teardown(stage)`."""

    def __init__(self):
        self.trainer = None

    def prepare_data(self) -> None: ...
    def setup(self, stage: str) -> None: ...
    def teardown(self, stage: str) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """Saved in checkpoints under "datamodule"."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def loader_defined(source: Any, name: str) -> bool:
    """Whether `source` (a DataModule or a module) defines the `*_dataloader` method `name`."""
    method = getattr(type(source), name, None)
    return source is not None and method is not None and method is not getattr(LightningDataModule, name, None)


def loader(source: Any, name: str) -> Iterable | None:
    """`source.<name>()` (a DataModule's or a module's `*_dataloader`), or None when it has none."""
    return getattr(source, name)() if loader_defined(source, name) else None


def check_single(loaders: Any, what: str) -> Any:
    """Refuse a list of several DataLoaders: glt runs one loader per stage."""
    from torch.utils.data import DataLoader

    if isinstance(loaders, (list, tuple, dict)) and loaders and all(
            isinstance(x, DataLoader) for x in (loaders.values() if isinstance(loaders, dict) else loaders)):
        if len(loaders) != 1:
            raise ValueError(f"{what}: {len(loaders)} DataLoaders given; glt.Trainer runs one per stage")
        return next(iter(loaders.values())) if isinstance(loaders, dict) else loaders[0]
    return loaders
