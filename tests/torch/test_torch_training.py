"""The training loop on CPU: learning, metrics, validate/test, schedulers, clipping, accumulation."""
import io

import pytest
import torch
from torch.nn import functional as F

import gpulayer.torch as glt
from glt_models import Regressor, loader, regression_data, trainer
from gpulayer.torch import progress


def test_loss_falls_on_a_learnable_problem():
    glt.seed_everything(0)
    model = Regressor()
    epoch_losses = []

    class Record(glt.Callback):
        def on_train_epoch_end(self, trainer, module):
            epoch_losses.append(trainer.callback_metrics["train_loss"])

    trainer(max_epochs=6, callbacks=[Record()]).fit(model, loader(shuffle=True), loader(64, seed=1))
    assert len(epoch_losses) == 6
    assert epoch_losses[-1] < 0.2 * epoch_losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_metrics_are_tensors_and_epoch_means_weighted_by_batch_size():
    glt.seed_everything(0)
    model = Regressor()
    val = loader(100, batch_size=32, seed=1)  # last batch holds 4 samples
    t = trainer(max_epochs=2)
    t.fit(model, loader(), val)
    # train_loss is on_step only (Lightning's training default): 32 steps never reach a log point
    # (every 50), so it is the last step's value in callback_metrics and was never sent to a logger
    assert set(t.callback_metrics) == {"train_loss", "val_loss"} and set(t.logged_metrics) == {"val_loss"}
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu"
               for v in [*t.callback_metrics.values(), *t.logged_metrics.values()])
    assert t.progress_bar_metrics.keys() == {"train_loss", "val_loss"}
    assert all(type(v) is float for v in t.progress_bar_metrics.values())
    x, y = regression_data(100, seed=1).tensors
    with torch.no_grad():
        full = F.mse_loss(model(x), y).item()
    assert t.callback_metrics["val_loss"].item() == pytest.approx(full, rel=1e-6)
    assert t.validate(model, val) == [pytest.approx({"val_loss": full}, rel=1e-6)]
    assert t.test(model, val) == [pytest.approx({"test_loss": full}, rel=1e-6)]
    assert t.callback_metrics["test_loss"] == t.logged_metrics["test_loss"]
    assert (t.current_epoch, t.global_step) == (2, 32)
    assert model.trainer is t and model.current_epoch == 2 and model.global_step == 32


class StepAndEpoch(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss


def test_step_values_at_log_points_and_epoch_means_at_epoch_end():
    losses, seen = [], {}

    class Spy(glt.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())
            seen[batch_idx] = trainer.logged_metrics.get("train_loss_step")

    t = trainer(max_epochs=1, log_every_n_steps=4, callbacks=[Spy()])
    t.fit(StepAndEpoch(), loader(128))  # 8 batches of 16: log points after batches 3 and 7
    assert seen[3] is None and seen[4] == losses[3] and seen[7] == losses[3]
    assert t.logged_metrics["train_loss_step"] == losses[7]
    assert t.logged_metrics["train_loss_epoch"].item() == pytest.approx(sum(losses) / 8, rel=1e-6)
    # the plain name holds the epoch value once the epoch ended, as in Lightning
    assert t.callback_metrics["train_loss"] == t.callback_metrics["train_loss_epoch"]


def test_plain_log_lines_when_not_a_terminal(capsys):
    glt.seed_everything(0)
    glt.Trainer(accelerator="cpu", max_epochs=2, log_every_n_steps=8, enable_model_summary=False).fit(
        Regressor(), loader(), loader(64))
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("epoch 0 step 8 train_loss=")
    assert lines[2].startswith("epoch 0 step 16 train_loss=") and " val_loss=" in lines[2]
    assert len(lines) == 6 and lines[-1].startswith("epoch 1 step 32 train_loss=")


def test_builtin_bar_on_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(progress, "tqdm", None)
    stream = Tty()
    bar = progress.make_progress(True, stream)
    bar.start_epoch(3, 10)
    bar.update(5, 40, {"train_loss": 0.5})
    bar.end_epoch(10, 42, {"train_loss": 0.25, "val_loss": 0.3})
    out = stream.getvalue()
    assert "\repoch 3 |############............| 5/10 step 40 train_loss=0.5" in out
    assert out.endswith("| 10/10 step 42 train_loss=0.25 val_loss=0.3\x1b[K\n")
    assert isinstance(progress.make_progress(False, stream), progress.TrainerProgress)


def test_gradient_accumulation_equals_the_larger_batch():
    def one_step(batch_size, accumulate):
        torch.manual_seed(0)
        model = Regressor(optimizer="sgd", lr=0.1)
        trainer(max_steps=1, accumulate_grad_batches=accumulate).fit(model, loader(32, batch_size=batch_size))
        return [p.detach().clone() for p in model.parameters()]

    big = one_step(16, 1)
    for got, want in zip(one_step(4, 4), big):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not all(torch.allclose(a, b) for a, b in zip(one_step(4, 1), big))


def test_gradient_accumulation_steps_on_a_partial_last_group():
    t = trainer(max_epochs=1, accumulate_grad_batches=3)
    t.fit(Regressor(), loader(64))  # 4 batches: one step after 3, one after the 4th
    assert t.global_step == 2


def test_gradient_clipping_bounds_the_update():
    def update_norm(clip):
        torch.manual_seed(0)
        model = Regressor(optimizer="sgd", lr=1.0)
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        trainer(max_steps=1, gradient_clip_val=clip).fit(model, loader(16))
        return (torch.cat([p.detach().flatten() for p in model.parameters()]) - before).norm().item()

    assert update_norm(None) > 0.1
    assert update_norm(0.01) == pytest.approx(0.01, rel=1e-4)


@pytest.mark.parametrize("interval, expected_lr", [("epoch", 0.1 * 0.5 ** 3), ("step", 0.1 * 0.5 ** 12)])
def test_scheduler_steps_per_epoch_or_per_step(interval, expected_lr):
    def sched(opt):
        return {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), "interval": interval}

    model = Regressor(lr=0.1, scheduler=sched)
    t = trainer(max_epochs=3)
    t.fit(model, loader(64))  # 4 steps per epoch
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr)


def test_plateau_scheduler_reads_its_monitor():
    def sched(opt):
        return {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0), "monitor": "val_loss"}

    class Frozen(Regressor):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", 1.0)

    t = trainer(max_epochs=3)
    t.fit(Frozen(lr=0.1, scheduler=sched), loader(64), loader(32))
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1 ** 2)


def test_limits_and_max_steps():
    t = trainer(max_epochs=3, limit_train_batches=2, limit_val_batches=0.5)
    t.fit(Regressor(), loader(64), loader(64))
    assert t.global_step == 6
    t = trainer(max_steps=5)
    t.fit(Regressor(), loader(64), loader(32))
    assert (t.global_step, t.current_epoch) == (5, 2) and "val_loss" in t.callback_metrics


def test_float64_precision_trains_in_float64():
    seen = []

    class Dtypes(Regressor):
        def training_step(self, batch, batch_idx):
            seen.append((batch[0].dtype, self.net[0].weight.dtype))
            return super().training_step(batch, batch_idx)

    trainer(max_steps=1, precision="64-true").fit(Dtypes(), loader(16))
    assert seen == [(torch.float64, torch.float64)]


def test_bf16_mixed_runs_under_cpu_autocast():
    glt.seed_everything(0)
    model = Regressor()
    t = trainer(max_epochs=3, precision="bf16-mixed")
    t.fit(model, loader(), loader(64))
    assert t.callback_metrics["val_loss"] < 1.0
    assert model.net[0].weight.dtype == torch.float32


class Unsized:
    """An iterable of batches without a length."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_any_iterable_of_batches_is_accepted():
    batches = [(torch.randn(8, 2), torch.randn(8, 1)) for _ in range(5)]
    t = trainer(max_epochs=2, accumulate_grad_batches=2)
    t.fit(Regressor(), Unsized(batches))
    assert t.global_step == 6  # 3 steps per epoch, the last on a partial group


def test_clear_errors():
    with pytest.raises(TypeError, match="glt.Module .*got Linear. Subclass gpulayer.torch.LightningModule"):
        trainer().fit(torch.nn.Linear(2, 1), loader())

    class NoVal(glt.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.w(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.warns(UserWarning, match="has no validation_step: validation is skipped"):
        trainer(max_steps=1).fit(NoVal(), loader(), loader())
    with pytest.raises(ValueError, match="no test_step"):
        trainer().test(NoVal(), loader())

    class NoLoss(Regressor):
        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(ValueError, match="must return the loss"):
        trainer(max_steps=1).fit(NoLoss(), loader())

    class VectorLog(Regressor):
        def training_step(self, batch, batch_idx):
            self.log("vector", batch[0][0])
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="needs a scalar"):
        trainer(max_steps=1).fit(VectorLog(), loader())


def test_log_outside_a_loop_warns_or_raises():
    model = Regressor()
    with pytest.warns(UserWarning, match="outside a glt.Trainer run records nothing"):
        model.log("x", 1.0)  # no trainer, as when a step is called by hand
    t = trainer(max_steps=1)
    t.fit(model, loader(16))
    with pytest.raises(RuntimeError, match="where nothing is collected"):
        model.log("x", 1.0)  # after fit
    assert "x" not in t.callback_metrics
