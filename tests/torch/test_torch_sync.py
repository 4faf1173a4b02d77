"""Device->host syncs of metrics: only through metrics.to_host, and exactly where expected."""
import pytest
import torch

import gpulayer.torch as glt
from glt_models import Regressor, loader, trainer


class ManyLogs(Regressor):
    """Logs five values per training step and three per validation step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        for i in range(4):
            self.log(f"extra{i}", loss * i)
        return loss

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("val_a", 1.0)
        self.log("val_b", batch[1].mean())


def count_syncs(model, **kwargs):
    before = glt.host_transfer_count()
    trainer(**kwargs).fit(model, loader(256), loader(64))  # 16 training batches, 4 validation batches
    return glt.host_transfer_count() - before


@pytest.mark.parametrize("model", [Regressor, ManyLogs])
@pytest.mark.parametrize("kwargs, expected", [
    # log points (optimizer steps // log_every_n_steps) + validations + training epoch ends
    ({"max_epochs": 3, "log_every_n_steps": 5}, 48 // 5 + 3 + 3),
    ({"max_epochs": 3, "log_every_n_steps": 50}, 0 + 3 + 3),
    ({"max_epochs": 2, "log_every_n_steps": 3, "accumulate_grad_batches": 2}, 16 // 3 + 2 + 2),
    ({"max_epochs": 2, "log_every_n_steps": 4, "val_check_interval": 0.25}, 32 // 4 + 2 * 4 + 2),
    ({"max_epochs": 2, "log_every_n_steps": 1, "val_check_interval": 5}, 32 + 2 * 4 + 2),
])
def test_exact_sync_count(model, kwargs, expected):
    assert count_syncs(model(), **kwargs) == expected


def test_validate_and_test_sync_once():
    t = trainer()
    before = glt.host_transfer_count()
    t.validate(ManyLogs(), loader(64))
    t.test(Regressor(), loader(64))
    assert glt.host_transfer_count() - before == 2


def test_no_item_or_float_on_the_hot_path(monkeypatch):
    """The loop, logging, clipping and SGD never call .item()/float(): only to_host's batched .tolist().
    (Batches come from lists: a DataLoader itself calls .item() on a CPU tensor to draw its seed.)"""
    def forbidden(*args):
        raise AssertionError("host sync outside metrics.to_host")

    train, val = list(loader(128)), list(loader(64))
    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "__float__", forbidden)
    t = trainer(max_epochs=2, log_every_n_steps=3, gradient_clip_val=1.0)
    t.fit(ManyLogs(optimizer="sgd"), train, val)
    assert set(t.callback_metrics) == {"train_loss", "extra0", "extra1", "extra2", "extra3",
                                       "val_loss", "val_a", "val_b"}
