"""A LightningDataModule (the MNISTDataModule of Lightning's "LightningDataModule" page, on synthetic
images), a classifier with predict_step, callbacks (EarlyStopping, ModelCheckpoint, one of its own)
and two loggers, written as in Lightning's docs with the import swapped.

    python examples/lightning_port/classifier.py --root /tmp/clf

bench/lightning_parity.py runs this file under Lightning too and compares the metrics.
"""
import argparse
import os

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

import gpulayer.torch as L
from gpulayer.torch import Callback
from gpulayer.torch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from gpulayer.torch.loggers import CSVLogger


class MNISTDataModule(L.LightningDataModule):
    def __init__(self, data_dir: str = "./", batch_size: int = 32, n: int = 2048):
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.batch_size = batch_size

    def prepare_data(self):
        # download: here a fixed synthetic set, written once
        path = os.path.join(self.data_dir, "fake_mnist.pt")
        if not os.path.exists(path):
            g = torch.Generator().manual_seed(0)
            prototypes = torch.rand(10, 1, 28, 28, generator=g).round()
            labels = torch.randint(0, 10, (self.hparams.n,), generator=g)
            images = (0.08 * prototypes[labels] + 0.92 * torch.rand(self.hparams.n, 1, 28, 28, generator=g))
            os.makedirs(self.data_dir, exist_ok=True)
            torch.save({"images": images, "labels": labels}, path)

    def setup(self, stage: str):
        data = torch.load(os.path.join(self.data_dir, "fake_mnist.pt"))
        full = TensorDataset(data["images"], data["labels"])
        # Assign train/val datasets for use in dataloaders
        if stage == "fit":
            self.mnist_train, self.mnist_val = random_split(
                TensorDataset(full.tensors[0][:1536], full.tensors[1][:1536]), [1280, 256],
                generator=torch.Generator().manual_seed(42))
        # Assign test dataset for use in dataloader(s)
        if stage == "test":
            self.mnist_test = TensorDataset(full.tensors[0][1536:1792], full.tensors[1][1536:1792])
        if stage == "predict":
            self.mnist_predict = TensorDataset(full.tensors[0][1792:], full.tensors[1][1792:])

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_predict, batch_size=self.batch_size)


class LitClassifier(L.LightningModule):
    def __init__(self, hidden_dim: int = 64, learning_rate: float = 2e-3):
        super().__init__()
        self.save_hyperparameters()
        self.l1 = nn.Linear(28 * 28, self.hparams.hidden_dim)
        self.l2 = nn.Linear(self.hparams.hidden_dim, 10)

    def forward(self, x):
        x = x.view(x.size(0), -1)
        return self.l2(torch.relu(self.l1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        acc = (logits.argmax(dim=1) == y).float().mean()
        self.log_dict({"val_loss": F.cross_entropy(logits, y), "val_acc": acc}, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("test_acc", (logits.argmax(dim=1) == y).float().mean())
        self.log("test_worst_batch_loss", F.cross_entropy(logits, y), reduce_fx="max")

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        x, _ = batch
        return self(x).argmax(dim=1)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch", "frequency": 2}}


class PrintingCallback(Callback):
    def __init__(self):
        self.epochs_seen = []

    def on_train_start(self, trainer, pl_module):
        print("Training is starting")

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs_seen.append(trainer.current_epoch)

    def on_train_end(self, trainer, pl_module):
        print("Training is ending")


def main(root: str, max_epochs: int = 4, accelerator: str = "cpu") -> dict:
    L.seed_everything(7, workers=True)
    dm = MNISTDataModule(data_dir=os.path.join(root, "data"), batch_size=64)
    model = LitClassifier()
    printing = PrintingCallback()
    checkpoint = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=2, filename="{epoch}-{val_loss:.3f}")
    trainer = L.Trainer(max_epochs=max_epochs, accelerator=accelerator, devices=1, default_root_dir=root,
                        logger=[CSVLogger(save_dir=root, name="csv")], log_every_n_steps=5,
                        callbacks=[printing, EarlyStopping(monitor="val_loss", mode="min", patience=3, verbose=True),
                                   checkpoint, LearningRateMonitor(logging_interval="epoch")],
                        enable_progress_bar=False)
    trainer.fit(model, datamodule=dm)
    fit = {k: float(v) for k, v in trainer.callback_metrics.items()}
    test = trainer.test(model, datamodule=dm, verbose=False)
    predictions = trainer.predict(model, datamodule=dm)
    best = LitClassifier.load_from_checkpoint(checkpoint.best_model_path)
    return {"fit": fit, "test": test[0], "predicted": sum(len(p) for p in predictions),
            "first_predictions": predictions[0][:8].tolist(), "epochs_seen": printing.epochs_seen,
            "best_checkpoint": os.path.relpath(checkpoint.best_model_path, root),
            "best_hidden_dim": best.hparams.hidden_dim, "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "global_step": trainer.global_step, "log_dir": os.path.relpath(trainer.log_dir, root)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="lightning_port_runs")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    print(main(args.root, args.epochs, args.accelerator))
