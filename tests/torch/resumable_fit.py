"""A deterministic CPU fit for the resume tests, run as a script in its own working folder:

    python resumable_fit.py [--signal-at STEP --signal NAME] [--wait-for-sigterm MARKER] [--every N] [--workers N]

It trains a small MLP with dropout, a shuffled loader, gradient accumulation (2) and a per-step
scheduler over 3 epochs of 6 steps, validating (on a shuffled loader) twice an epoch, appending "<epoch> <batch>" for each batch trained to `batches`,
and saves the final weights to `weights.pt`. When the batch that begins step `--signal-at STEP` starts, in
the first run (GPULAYER_RESTARTS 0), it sends this process the signal `--signal NAME` if given, and
with `--wait-for-sigterm MARKER` writes MARKER and works until the Trainer got a SIGTERM (the peer's,
when it preempts the job). `--workers N` loads with N spawned DataLoader workers (a job's SIGTERM reaches them).
"""
import argparse
import os
import signal
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpulayer.torch as glt


class Net(glt.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        args, trainer = self.args, self.trainer
        with open("batches", "a") as f:
            f.write(f"{trainer.current_epoch} {batch_idx}\n")
        first_run = os.environ.get("GPULAYER_RESTARTS", "0") == "0" and not os.path.exists("signalled")
        if first_run and trainer.global_step == args.signal_at and batch_idx % 2 == 0:
            open("signalled", "w").close()
            if args.signal:
                os.kill(os.getpid(), getattr(signal, args.signal))
            if args.wait_for_sigterm:
                self.wait_for_sigterm(args.wait_for_sigterm)
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def wait_for_sigterm(self, marker):
        """Say so in `marker`, then work until the Trainer got its SIGTERM, and a little longer (time for
        the signal to reach the DataLoader workers too)."""
        open(marker, "w").close()
        deadline = time.monotonic() + 300
        while not self.trainer.received_sigterm:
            if time.monotonic() > deadline:
                raise TimeoutError("no SIGTERM came")
            time.sleep(0.02)
        time.sleep(0.5)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--signal", default="")
    parser.add_argument("--wait-for-sigterm", default="", metavar="MARKER")
    parser.add_argument("--every", type=int, default=None)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    glt.seed_everything(7)
    data = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=data)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(96, 1, generator=data)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, num_workers=args.workers,
                        multiprocessing_context="spawn" if args.workers else None)
    val = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=16, shuffle=True)
    model = Net(args)
    trainer = glt.Trainer(accelerator="cpu", max_epochs=3, accumulate_grad_batches=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          deterministic=True, resume_every_n_steps=args.every, val_check_interval=0.5)
    trainer.fit(model, loader, val)
    torch.save(model.state_dict(), "weights.pt")
    print(f"trained: epoch {trainer.current_epoch}, step {trainer.global_step}")


if __name__ == "__main__":
    main()
