"""A small Lightning-style trainer for PyTorch that runs the same on cpu, cuda and mps,
locally or inside a GPUlayer task (it honours the GPULAYER_DEVICE the peer sets).

    import gpulayer.torch as glt          # or: import gpulayer.torch as L
    trainer = glt.Trainer(max_epochs=5, accelerator="auto")
    trainer.fit(model, train_loader, val_loader)

Lightning's names are here too (`L.LightningModule`, `L.LightningDataModule`, `L.Trainer`,
`L.seed_everything`, callbacks and loggers), so Lightning code moves over with the import
swapped. See docs/trainer.md for what is supported and what warns.
"""
from .accelerators import AcceleratorUnavailable, UnsupportedConfiguration, available_accelerators
from .callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from .datamodule import LightningDataModule
from .hparams import AttributeDict
from .loggers import CSVLogger, Logger, TensorBoardLogger
from .metrics import host_transfer_count
from .module import LightningModule, Module
from .randomness import seed_everything
from .trainer import Trainer

__all__ = [
    "AcceleratorUnavailable", "AttributeDict", "CSVLogger", "Callback", "EarlyStopping", "LightningDataModule",
    "LearningRateMonitor", "LightningModule", "Logger", "ModelCheckpoint", "Module", "TensorBoardLogger", "Trainer",
    "UnsupportedConfiguration", "available_accelerators", "host_transfer_count", "seed_everything",
]
