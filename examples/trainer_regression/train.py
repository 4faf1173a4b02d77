"""Train a small MLP on y = 3*x1 - 2*x2 + noise with glt.Trainer and print the loss per epoch.

    python examples/trainer_regression/train.py --accelerator auto --epochs 8
    python examples/trainer_regression/train.py --accelerator cuda --remote   # on a GPUlayer peer
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpulayer.torch as glt


class Regressor(glt.Module):
    def __init__(self, hidden: int = 32, lr: float = 3e-3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False, prog_bar=True)  # the epoch's mean
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)


class PrintEpoch(glt.Callback):
    """Prints and keeps each epoch's mean losses."""

    def __init__(self):
        self.history: list[dict] = []

    def on_train_epoch_end(self, trainer, module):
        metrics = trainer.callback_metrics
        self.history.append({"epoch": trainer.current_epoch, "train_loss": float(metrics["train_loss"]),
                             "val_loss": float(metrics["val_loss"])})
        print(f"epoch {trainer.current_epoch}: train_loss={metrics['train_loss']:.4f} "
              f"val_loss={metrics['val_loss']:.4f}", flush=True)


def make_loaders(n: int = 4096, batch_size: int = 64, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    y = 3 * x[:, :1] - 2 * x[:, 1:] + 0.1 * torch.randn(n, 1, generator=g)
    split = n * 7 // 8
    return (DataLoader(TensorDataset(x[:split], y[:split]), batch_size=batch_size, shuffle=True),
            DataLoader(TensorDataset(x[split:], y[split:]), batch_size=256))


def train_fn(accelerator: str = "auto", epochs: int = 8, seed: int = 0) -> dict:
    """Train and return the per-epoch losses; module-level so `gl.run` can ship it to a peer."""
    glt.seed_everything(seed)
    train, val = make_loaders(seed=seed)
    epochs_cb = PrintEpoch()
    trainer = glt.Trainer(max_epochs=epochs, accelerator=accelerator, callbacks=[epochs_cb],
                          enable_progress_bar=False)
    trainer.fit(Regressor(), train, val)
    return {"device": str(trainer.device), "epoch_losses": [e["train_loss"] for e in epochs_cb.history],
            "val_loss": float(trainer.callback_metrics["val_loss"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", choices=["auto", "cpu", "cuda", "mps"], default="auto")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--remote", action="store_true", help="train inside a task on a GPUlayer peer")
    args = parser.parse_args()
    if args.remote:
        import gpulayer as gl

        # on the peer, "auto" picks the device the peer assigned to the task (GPULAYER_DEVICE); train_fn
        # takes an accelerator of its own, so the task options are given apart from its arguments
        options = gl.options(accelerator=args.accelerator if args.accelerator != "auto" else None,
                             frameworks={"torch": ">=2.3"})
        result = options.run(train_fn, "auto", args.epochs)
        print(f"remote run on {result['device']}:")
        for epoch, loss in enumerate(result["epoch_losses"]):
            print(f"epoch {epoch}: train_loss={loss:.4f}")
    else:
        result = train_fn(args.accelerator, args.epochs)
    print(f"final val_loss={result['val_loss']:.4f} on {result['device']}")


if __name__ == "__main__":
    main()
