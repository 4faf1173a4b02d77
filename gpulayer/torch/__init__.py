"""A small Lightning-style trainer for PyTorch that runs the same on cpu, cuda and mps,
locally or inside a GPUlayer task (it honours the GPULAYER_DEVICE the peer sets).

    import gpulayer.torch as glt
    trainer = glt.Trainer(max_epochs=5, accelerator="auto")
    trainer.fit(model, train_loader, val_loader)

See docs/trainer.md.
"""
from .accelerators import AcceleratorUnavailable, UnsupportedConfiguration, available_accelerators
from .callbacks import Callback, EarlyStopping, ModelCheckpoint
from .metrics import host_transfer_count
from .module import Module
from .randomness import seed_everything
from .trainer import Trainer

__all__ = [
    "AcceleratorUnavailable", "Callback", "EarlyStopping", "ModelCheckpoint", "Module", "Trainer",
    "UnsupportedConfiguration", "available_accelerators", "host_transfer_count", "seed_everything",
]
