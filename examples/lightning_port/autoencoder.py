"""Lightning's quick start (the LitAutoEncoder of lightning.ai/docs/pytorch/stable/starter/introduction.html),
unchanged but for the import, on a small synthetic MNIST-like dataset (no download).

    python examples/lightning_port/autoencoder.py --root /tmp/ae

bench/lightning_parity.py runs this file under Lightning too (the import swapped back) and compares.
"""
import argparse
import os

import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset, random_split

import gpulayer.torch as L



def fake_mnist(n: int = 1536, seed: int = 0) -> TensorDataset:
    """Ten blurred digit-like prototypes plus noise, 1x28x28 in [0, 1], with labels."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.rand(10, 1, 28, 28, generator=g).round()
    labels = torch.randint(0, 10, (n,), generator=g)
    images = (0.8 * prototypes[labels] + 0.2 * torch.rand(n, 1, 28, 28, generator=g)).clamp(0, 1)
    return TensorDataset(images, labels)


# define the LightningModule
class LitAutoEncoder(L.LightningModule):
    def __init__(self, hidden: int = 64, latent: int = 3, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Linear(hidden, latent))
        self.decoder = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, 28 * 28))

    def training_step(self, batch, batch_idx):
        # training_step defines the train loop.
        # it is independent of forward
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = nn.functional.mse_loss(x_hat, x)
        # Logging to TensorBoard (if installed) by default
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        val_loss = nn.functional.mse_loss(self.decoder(self.encoder(x)), x)
        self.log("val_loss", val_loss, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        test_loss = nn.functional.mse_loss(self.decoder(self.encoder(x)), x)
        self.log("test_loss", test_loss)

    def configure_optimizers(self):
        optimizer = optim.Adam(self.parameters(), lr=self.hparams.lr)
        return optimizer


def main(root: str, max_epochs: int = 2, accelerator: str = "cpu") -> dict:
    L.seed_everything(42)
    dataset = fake_mnist()
    train_set, val_set, test_set = random_split(dataset, [1024, 256, 256], generator=torch.Generator().manual_seed(42))
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=64)
    test_loader = DataLoader(test_set, batch_size=64)

    # init the autoencoder
    autoencoder = LitAutoEncoder()

    # train the model (hint: here are some helpful Trainer arguments for rapid idea iteration)
    trainer = L.Trainer(max_epochs=max_epochs, accelerator=accelerator, devices=1, default_root_dir=root,
                        log_every_n_steps=4, enable_progress_bar=False)
    trainer.fit(model=autoencoder, train_dataloaders=train_loader, val_dataloaders=val_loader)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    test_metrics = trainer.test(autoencoder, dataloaders=test_loader, verbose=False)[0]

    # load checkpoint
    checkpoint = trainer.checkpoint_callback.best_model_path
    restored = LitAutoEncoder.load_from_checkpoint(checkpoint)
    same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(restored.state_dict().values(),
                                                         autoencoder.state_dict().values()))

    # embed 4 fake images
    with torch.no_grad():
        fake_image_batch = torch.rand(4, 28 * 28, generator=torch.Generator().manual_seed(1)).to(restored.device)
        embeddings = restored.encoder(fake_image_batch)
    return {"fit": fit_metrics, "test": test_metrics, "checkpoint": os.path.relpath(checkpoint, root),
            "restored_equal": same, "hparams": dict(restored.hparams), "embeddings_shape": list(embeddings.shape),
            "global_step": trainer.global_step, "log_dir": os.path.relpath(trainer.log_dir, root)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="lightning_port_runs")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    print(main(args.root, args.epochs, args.accelerator))
