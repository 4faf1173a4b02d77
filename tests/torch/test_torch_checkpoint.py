"""Checkpoints, resuming, and early stopping."""
import os

import pytest
import torch

import gpulayer.torch as glt
from glt_models import Regressor, loader, trainer


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)


def fit(seed, max_epochs, ckpt_path=None, callbacks=()):
    """A run that uses every RNG the resume must restore: shuffling, dropout, init."""
    glt.seed_everything(seed)
    model = Regressor(dropout=0.2, scheduler=step_lr)
    t = trainer(max_epochs=max_epochs, deterministic=True, callbacks=list(callbacks))
    t.fit(model, loader(96, shuffle=True), loader(32, seed=1), ckpt_path=ckpt_path)
    return model, t


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path):
    saver = glt.ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1)
    straight, t1 = fit(0, 4, callbacks=[saver])
    assert sorted(os.listdir(tmp_path)) == [f"epoch={e}-step={6 * (e + 1)}.ckpt" for e in range(4)]

    resumed, t2 = fit(123, 4, ckpt_path=str(tmp_path / "epoch=1-step=12.ckpt"))
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert (t2.current_epoch, t2.global_step) == (4, 24)
    assert t2.optimizer.param_groups[0]["lr"] == t1.optimizer.param_groups[0]["lr"]
    assert {k: v.item() for k, v in t2.callback_metrics.items()} == {k: v.item() for k, v in t1.callback_metrics.items()}


def test_checkpoint_loads_onto_the_cpu_and_into_a_fresh_model(tmp_path):
    model, t = fit(0, 1)
    path = str(tmp_path / "model.ckpt")
    t.save_checkpoint(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["epoch"] == 1 and state["global_step"] == 6
    assert all(v.device.type == "cpu" for v in state["state_dict"].values())
    fresh = Regressor(dropout=0.2)
    metrics = trainer().validate(fresh, loader(32, seed=1), ckpt_path=path)
    assert metrics == [pytest.approx({"val_loss": t.callback_metrics["val_loss"].item()})]


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "x.ckpt"
    torch.save({"state_dict": {}}, path)
    with pytest.raises(ValueError, match="not a gpulayer.torch checkpoint"):
        trainer().fit(Regressor(), loader(), ckpt_path=str(path))
    with pytest.raises(FileNotFoundError):
        trainer().fit(Regressor(), loader(), ckpt_path=str(tmp_path / "missing.ckpt"))


def test_model_checkpoint_keeps_the_best_and_last(tmp_path):
    saver = glt.ModelCheckpoint(dirpath=str(tmp_path), monitor="val_loss", save_top_k=2, save_last=True,
                                filename="{epoch}-{val_loss:.4f}")
    _, t = fit(0, 5, callbacks=[saver])
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 3 and "last.ckpt" in files
    assert saver.best_model_score == min(saver.best_k_models.values())
    assert os.path.basename(saver.best_model_path) in files
    resumed, t2 = fit(0, 6, ckpt_path="last", callbacks=[saver])  # resumes from last.ckpt at epoch 5
    assert t2.current_epoch == 6 and t2.global_step == 36
    with pytest.raises(FileNotFoundError, match="ckpt_path='last'"):
        trainer().fit(Regressor(), loader(), ckpt_path="last")


def test_model_checkpoint_unknown_monitor(tmp_path):
    with pytest.raises(KeyError, match="'nope' was not logged; logged: \\['train_loss', 'val_loss'\\]"):
        fit(0, 1, callbacks=[glt.ModelCheckpoint(dirpath=str(tmp_path), monitor="nope")])


class Plateau(Regressor):
    """Logs a metric that improves for three epochs and then stays flat."""

    VALUES = [5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]

    def validation_step(self, batch, batch_idx):
        self.log("score", self.VALUES[self.current_epoch])


def test_early_stopping_stops_on_a_plateau():
    stopper = glt.EarlyStopping("score", patience=2)
    t = trainer(max_epochs=10, callbacks=[stopper])
    t.fit(Plateau(), loader(32), loader(16))
    assert stopper.stopped_epoch == 4 and t.current_epoch == 5 and stopper.best == 3.0


def test_early_stopping_min_delta_and_max_mode():
    stopper = glt.EarlyStopping("score", patience=1, mode="max", min_delta=0.5)
    t = trainer(max_epochs=10, callbacks=[stopper])
    t.fit(Plateau(), loader(32), loader(16))
    assert stopper.stopped_epoch == 1  # the score falls: no improvement after epoch 0


def test_early_stopping_state_is_checkpointed(tmp_path):
    stopper = glt.EarlyStopping("score", patience=3)
    saver = glt.ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1)
    trainer(max_epochs=4, callbacks=[saver, stopper]).fit(Plateau(), loader(32), loader(16))
    resumed = glt.EarlyStopping("score", patience=3)
    t = trainer(max_epochs=10, callbacks=[resumed])
    t.fit(Plateau(), loader(32), loader(16), ckpt_path=str(tmp_path / "epoch=3-step=8.ckpt"))
    assert resumed.stopped_epoch == 5 and t.current_epoch == 6


def test_resume_from_last_in_the_default_directory(tmp_path):
    def run(max_epochs, **fit_kwargs):
        saver = glt.ModelCheckpoint(save_last=True)
        t = trainer(max_epochs=max_epochs, default_root_dir=str(tmp_path), callbacks=[saver])
        t.fit(Regressor(), loader(64), **fit_kwargs)
        return t, saver

    _, saver = run(1)
    assert saver.last_model_path == str(tmp_path / "checkpoints" / "last.ckpt")
    t, _ = run(2, ckpt_path="last")
    assert (t.current_epoch, t.global_step) == (2, 8)
