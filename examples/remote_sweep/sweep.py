"""A hyperparameter sweep: one glt.Trainer run per (lr, hidden) config, spread over every matching peer.

    python examples/remote_sweep/sweep.py                       # any peer with torch
    python examples/remote_sweep/sweep.py --accelerator cuda    # only CUDA peers, one GPU per run
    python examples/remote_sweep/sweep.py --backend ray --ray-address HEAD:6379   # the same on a Ray cluster
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpulayer as gl
import gpulayer.torch as glt

LEARNING_RATES = (3e-4, 1e-3, 3e-3, 1e-2)
HIDDEN_SIZES = (16, 64)


class MLP(glt.Module):
    def __init__(self, hidden: int, lr: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def make_loaders(seed: int, n: int = 2048) -> tuple[DataLoader, DataLoader]:
    """A nonlinear target, so that both the learning rate and the width matter."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.sin(2 * x[:, :1]) + x[:, 1:2] * x[:, 2:3] - 0.5 * x[:, 3:] ** 2 + 0.05 * torch.randn(n, 1, generator=g)
    split = n * 7 // 8
    return (DataLoader(TensorDataset(x[:split], y[:split]), batch_size=64, shuffle=True),
            DataLoader(TensorDataset(x[split:], y[split:]), batch_size=256))


def train_config(config: dict) -> dict:
    """Runs on a peer: train one config; "auto" is the device the peer gave this task."""
    glt.seed_everything(config["seed"])
    train, val = make_loaders(config["seed"])
    trainer = glt.Trainer(max_epochs=config["epochs"], accelerator="auto", enable_progress_bar=False,
                          enable_model_summary=False, logger=False, enable_checkpointing=False)
    trainer.fit(MLP(config["hidden"], config["lr"]), train, val)
    return {**config, "val_loss": float(trainer.callback_metrics["val_loss"]), "epochs_run": trainer.current_epoch,
            "device": str(trainer.device), "peer": os.environ.get("GPULAYER_PEER_NAME", "local")}


def format_table(results: list[dict]) -> str:
    lines = [f"{'rank':>4}  {'lr':>8}  {'hidden':>6}  {'val_loss':>9}  {'epochs':>6}  {'device':<8}  peer"]
    for rank, r in enumerate(sorted(results, key=lambda r: r["val_loss"]), 1):
        lines.append(f"{rank:>4}  {r['lr']:>8g}  {r['hidden']:>6}  {r['val_loss']:>9.4f}  {r['epochs_run']:>6}  "
                     f"{r['device']:<8}  {r['peer']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", choices=["auto", "cpu", "cuda", "mps"], default="auto",
                        help="the peers to use (auto: any peer with torch)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["lan", "ray"], default=None,
                        help="where the runs go (default: GPULAYER_BACKEND, else the LAN's peers)")
    parser.add_argument("--ray-address", default=None, help="the Ray cluster (default: GPULAYER_RAY_ADDRESS)")
    args = parser.parse_args()
    if args.backend == "ray":
        gl.configure(backend="ray", address=args.ray_address)
    configs = [{"lr": lr, "hidden": hidden, "epochs": args.epochs, "seed": args.seed}
               for lr, hidden in itertools.product(LEARNING_RATES, HIDDEN_SIZES)]
    try:  # gl.map draws a progress bar on a terminal
        results = gl.map(train_config, configs, accelerator=None if args.accelerator == "auto" else args.accelerator,
                         frameworks={"torch": ">=2.1"})
    except gl.NoMatchingPeer as exc:
        sys.exit(str(exc))
    print(format_table(results))


if __name__ == "__main__":
    main()
