"""Tiny models and data for the trainer tests.

A module of its own (not a test file) so DDP worker processes can import the classes they unpickle.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpulayer.torch as glt


def regression_data(n: int = 256, seed: int = 0) -> TensorDataset:
    """y = 3 x1 - 2 x2 + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    y = 3 * x[:, :1] - 2 * x[:, 1:] + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def loader(n: int = 256, batch_size: int = 16, shuffle: bool = False, seed: int = 0) -> DataLoader:
    return DataLoader(regression_data(n, seed), batch_size=batch_size, shuffle=shuffle)


class Regressor(glt.Module):
    """A small MLP; `optimizer` ("adam", "adam-fused", "sgd") and `scheduler` pick what
    configure_optimizers returns."""

    def __init__(self, hidden: int = 16, lr: float = 0.05, optimizer: str = "adam", dropout: float = 0.0,
                 scheduler=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))
        self.lr, self.optimizer_name, self.scheduler = lr, optimizer, scheduler

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.Adam(self.parameters(), lr=self.lr, fused=self.optimizer_name == "adam-fused")
        if self.scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": self.scheduler(opt)}


def trainer(**kwargs) -> glt.Trainer:
    """A quiet CPU Trainer without loggers, default checkpoint or model summary."""
    checkpointing = any(isinstance(cb, glt.ModelCheckpoint) for cb in kwargs.get("callbacks") or [])
    return glt.Trainer(**{"accelerator": "cpu", "enable_progress_bar": False, "logger": False,
                          "enable_checkpointing": checkpointing, "enable_model_summary": False, **kwargs})
