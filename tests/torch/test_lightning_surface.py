"""The Lightning surface of gpulayer.torch, used as a Lightning user would (`import gpulayer.torch as L`):
self.log keywords, log_dict, hyperparameters, checkpoints, loggers, Trainer arguments, and the clear
errors and warnings for what is not supported."""
import csv
import datetime
import os
import warnings

import pytest
import torch
from torch.nn import functional as F

import gpulayer.torch as L
from glt_models import Regressor, loader, regression_data, trainer


class Logs(Regressor):
    """Logs with each keyword Lightning documents."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("loss", loss)  # on_step only
        self.log("both", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("epoch_only", loss, on_step=False, on_epoch=True)
        self.log("summed", 1.0, on_epoch=True, on_step=False, reduce_fx="sum")
        self.log("peak", loss, on_epoch=True, on_step=False, reduce_fx=torch.max)
        self.log("hidden", loss, logger=False, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log_dict({"val_loss": F.mse_loss(self(x), y), "val_weighted": float(batch_idx)}, batch_size=1 + batch_idx)

    def on_train_epoch_end(self):
        self.log("from_epoch_end", 2.0 * self.current_epoch)


def test_log_keywords_have_lightnings_meaning():
    losses = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    t = trainer(max_epochs=1, log_every_n_steps=2, callbacks=[Spy()])
    t.fit(Logs(), loader(64), loader(48, batch_size=16))  # 4 training batches, 3 validation batches
    m = {k: v.item() for k, v in t.callback_metrics.items()}
    assert m["loss"] == losses[-1]
    assert m["both_step"] == losses[-1] and m["both_epoch"] == pytest.approx(sum(losses) / 4, rel=1e-6)
    assert m["both"] == m["both_epoch"] and m["epoch_only"] == m["both_epoch"]
    assert m["summed"] == 4.0 and m["peak"] == pytest.approx(max(losses), rel=1e-6)
    assert m["val_weighted"] == pytest.approx((0 * 1 + 1 * 2 + 2 * 3) / 6)  # weighted by batch_size=
    assert m["from_epoch_end"] == 0.0
    assert "hidden" in t.callback_metrics and "hidden" not in t.logged_metrics  # logger=False
    assert "loss" in t.logged_metrics and "both" not in t.logged_metrics  # loggers get the forked names
    assert set(t.progress_bar_metrics) == {"both_step", "both_epoch"}


def test_log_errors_name_the_problem():
    class Bad(Regressor):
        def __init__(self, **log_kwargs):
            super().__init__()
            self.log_kwargs = log_kwargs

        def training_step(self, batch, batch_idx):
            self.log("x", 1.0, **self.log_kwargs)
            return super().training_step(batch, batch_idx)

    for kwargs, error, match in [({"on_step": False, "on_epoch": False}, ValueError, "records nothing"),
                                 ({"reduce_fx": "median"}, ValueError, "reduce_fx='median'"),
                                 ({"sync_dist_group": object()}, ValueError, "sync_dist_group")]:
        with pytest.raises(error, match=match):
            trainer(max_steps=1).fit(Bad(**kwargs), loader(16))

    class StepInEpochHook(Regressor):
        def on_train_epoch_end(self):
            self.log("x", 1.0, on_step=True)

    with pytest.raises(ValueError, match="on_step=True.*epoch-level hook"):
        trainer(max_steps=1).fit(StepInEpochHook(), loader(16))

    class InPredict(Regressor):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("x", 1.0)

    with pytest.raises(RuntimeError, match="nothing is collected"):
        trainer().predict(InPredict(), loader(16))


def test_prog_bar_adds_no_host_sync():
    def syncs(prog_bar):
        class M(Regressor):
            def training_step(self, batch, batch_idx):
                loss = F.mse_loss(self(batch[0]), batch[1])
                self.log("train_loss", loss, prog_bar=prog_bar, on_epoch=True)
                return loss

        before = L.host_transfer_count()
        trainer(max_epochs=2, log_every_n_steps=3, enable_progress_bar=True).fit(M(), loader(128), loader(32))
        return L.host_transfer_count() - before

    assert syncs(True) == syncs(False) == 16 // 3 + 2 + 2  # log points + validations + epoch ends


class WithHparams(L.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.05, note: str = "x", **extra):
        super().__init__()
        self.save_hyperparameters(ignore="note")
        self.net = torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        self.loaded = None

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["extra"] = "kept"

    def on_load_checkpoint(self, checkpoint):
        self.loaded = checkpoint["extra"]


def test_hyperparameters_checkpoints_and_load_from_checkpoint(tmp_path):
    model = WithHparams(hidden=4, depth=3)
    assert model.hparams == {"hidden": 4, "lr": 0.05, "depth": 3} and model.hparams.hidden == 4
    t = L.Trainer(max_epochs=2, accelerator="cpu", default_root_dir=tmp_path, enable_progress_bar=False,
                  enable_model_summary=False)
    t.fit(model, loader(32))
    ckpt_dir = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert os.listdir(ckpt_dir) == ["epoch=1-step=4.ckpt"]  # the default ModelCheckpoint keeps the latest
    assert t.checkpoint_callback.best_model_path == str(ckpt_dir / "epoch=1-step=4.ckpt")
    with open(tmp_path / "lightning_logs" / "version_0" / "hparams.yaml") as f:
        assert f.read() == "depth: 3\nhidden: 4\nlr: 0.05\n"
    restored = WithHparams.load_from_checkpoint(t.checkpoint_callback.best_model_path, lr=0.5)
    assert restored.hparams == {"hidden": 4, "lr": 0.5, "depth": 3} and restored.loaded == "kept"
    for a, b in zip(restored.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    # a second run writes version_1; the trainer can resume from the file
    t2 = L.Trainer(max_epochs=3, accelerator="cpu", default_root_dir=tmp_path, enable_progress_bar=False,
                   enable_model_summary=False)
    t2.fit(WithHparams(hidden=4), loader(32), ckpt_path=t.checkpoint_callback.best_model_path)
    assert t2.global_step == 6 and t2.log_dir == str(tmp_path / "lightning_logs" / "version_1")


def test_csv_logger_writes_what_lightning_writes(tmp_path):
    logger = L.CSVLogger(save_dir=tmp_path, name="exp")
    t = trainer(max_epochs=2, log_every_n_steps=2, logger=logger)
    t.fit(Logs(), loader(64), loader(32, batch_size=16))
    t.test(Regressor(), loader(32), verbose=False)
    assert t.logger is logger and logger.log_dir == str(tmp_path / "exp" / "version_0")
    with open(logger.metrics_file_path, newline="") as f:
        rows = list(csv.DictReader(f))
    header = list(rows[0])
    assert header == sorted(header) and {"epoch", "step", "loss", "both_step", "both_epoch", "test_loss"} <= set(header)
    assert "hidden" not in header
    steps = [(r["epoch"], r["step"]) for r in rows if r["loss"]]
    assert steps == [("0", "1"), ("0", "3"), ("1", "5"), ("1", "7")]  # Lightning's step: global_step - 1
    val_rows = [r for r in rows if r["val_loss"]]
    assert [(r["epoch"], r["step"]) for r in val_rows] == [("0", "3"), ("1", "7")]
    assert rows[-1]["test_loss"] and rows[-1]["step"] == "8"  # test after fit: the steps done


def test_logger_argument_forms(tmp_path):
    assert trainer(logger=False).loggers == [] and trainer(logger=False).logger is None
    both = [L.CSVLogger(tmp_path, name="a"), L.CSVLogger(tmp_path, name="b")]
    t = trainer(max_epochs=1, logger=both, log_every_n_steps=1)
    t.fit(Regressor(), loader(32))
    assert t.loggers == both and all(os.path.isfile(lg.metrics_file_path) for lg in both)
    default = L.Trainer(accelerator="cpu", default_root_dir=tmp_path).logger
    expected = L.TensorBoardLogger if L.loggers.tensorboard_available() else L.CSVLogger
    assert type(default) is expected and default.root_dir == str(tmp_path / "lightning_logs")
    with pytest.raises(TypeError, match="logger="):
        trainer(logger="wandb")


def test_tensorboard_logger(tmp_path):
    if not L.loggers.tensorboard_available():
        with pytest.raises(ModuleNotFoundError, match="tensorboard"):
            L.TensorBoardLogger(tmp_path)
        pytest.skip("tensorboard is not installed: the clear error is tested")
    logger = L.TensorBoardLogger(tmp_path)
    trainer(max_epochs=1, logger=logger, log_every_n_steps=1).fit(Regressor(), loader(32), loader(16))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logger.log_dir))


def test_trainer_arguments():
    t = trainer(fast_dev_run=True)
    t.fit(Regressor(), loader(64), loader(64))
    assert (t.global_step, t.current_epoch) == (1, 1) and t.loggers == []
    t = trainer(fast_dev_run=3, enable_checkpointing=True)
    t.fit(Regressor(), loader(64))
    assert t.global_step == 3 and not os.path.exists("checkpoints")  # nothing is saved in a fast_dev_run

    validations = []

    class CountVal(L.Callback):
        def on_validation_end(self, trainer, module):
            validations.append((trainer.sanity_checking, trainer.current_epoch))

    trainer(max_epochs=4, check_val_every_n_epoch=2, num_sanity_val_steps=1, callbacks=[CountVal()]).fit(
        Regressor(), loader(32), loader(32))
    assert validations == [(True, 0), (False, 1), (False, 3)]

    class StopAtOnce(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            trainer.should_stop = True

    t = trainer(max_epochs=5, callbacks=[StopAtOnce()])
    t.fit(Regressor(), loader(64))
    assert (t.current_epoch, t.global_step) == (1, 1)  # should_stop ends training after the current batch
    t = trainer(max_epochs=5, min_epochs=2, callbacks=[StopAtOnce()])
    t.fit(Regressor(), loader(64))
    assert (t.current_epoch, t.global_step) == (2, 8)  # but not before min_epochs are done

    t = trainer(max_epochs=100, max_time=datetime.timedelta(0))
    t.fit(Regressor(), loader(64))
    assert t.global_step == 1
    t = trainer(max_epochs=-1, max_steps=9)  # -1: no epoch limit
    t.fit(Regressor(), loader(32))
    assert (t.max_epochs, t.global_step, t.current_epoch) == (None, 9, 5)
    assert trainer(max_time="00:01:30:00")._max_seconds == 5400
    assert trainer(max_time={"minutes": 2})._max_seconds == 120
    assert trainer(devices="auto").num_devices == 1 and trainer(strategy="single_device").num_devices == 1
    assert trainer(strategy="ddp").num_devices == 1


def test_unsupported_trainer_arguments_are_named():
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['no_such_option'\\]"):
        trainer(no_such_option=1)
    with pytest.raises(L.UnsupportedConfiguration, match="overfit_batches"):
        trainer(overfit_batches=10)
    assert trainer(overfit_batches=0.0, barebones=False).num_devices == 1  # Lightning's defaults are accepted
    with pytest.raises(L.UnsupportedConfiguration, match="strategy='fsdp'"):
        trainer(strategy="fsdp")
    with pytest.raises(ValueError, match="profiler='advanced'"):
        trainer(profiler="advanced")
    with pytest.raises(L.UnsupportedConfiguration, match="devices=\\[0, 1\\]"):
        trainer(devices=[0, 1])
    with pytest.raises(ValueError, match="max_time="):
        trainer(max_time="1 hour")
    with pytest.raises(TypeError, match="glt.Callback"):
        trainer(callbacks=[object()])


def test_simple_profiler_and_model_summary(capsys):
    L.Trainer(accelerator="cpu", max_epochs=1, profiler="simple", logger=False, enable_checkpointing=False,
              enable_progress_bar=False).fit(Regressor(), loader(32), loader(16))
    out = capsys.readouterr().out
    assert "| net  | Sequential | 65" in out and "65  Total params" in out
    assert "Profiler report" in out and "run_training_batch" in out and "run_validation_loop" in out


class Unsupported(Regressor):
    def optimizer_step(self, *args, **kwargs): ...

    def training_epoch_end(self, outputs): ...


def test_a_hook_glt_never_calls_warns_once():
    with pytest.warns(UserWarning) as record:
        trainer(max_steps=1).fit(Unsupported(), loader(16))
    messages = [str(w.message) for w in record]
    assert any("Unsupported.optimizer_step is defined but glt.Trainer never calls it" in m for m in messages)
    assert any("Unsupported.training_epoch_end" in m and "on_train_epoch_end" in m for m in messages)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer(max_steps=1).fit(Unsupported(), loader(16))  # once per class


def test_manual_optimization_is_refused():
    class Manual(Regressor):
        automatic_optimization = False

    with pytest.raises(NotImplementedError, match="manual optimization"):
        trainer(max_steps=1).fit(Manual(), loader(16))
    with pytest.raises(NotImplementedError, match="manual optimization"):
        Regressor().automatic_optimization = False


def test_early_stopping_lightning_arguments(capsys):
    class Plateau(Regressor):
        def validation_step(self, batch, batch_idx):
            self.log("score", [5.0, 4.0, 4.0, 4.0, 4.0, float("nan")][self.current_epoch])

    stopper = L.EarlyStopping("score", 0.0, 2, verbose=True)  # Lightning's positional order
    t = trainer(max_epochs=6, callbacks=[stopper])
    t.fit(Plateau(), loader(32), loader(16))
    assert stopper.stopped_epoch == 3 and t.current_epoch == 4
    assert "did not improve in the last 2 records" in capsys.readouterr().out
    finite = L.EarlyStopping("score", patience=100)
    trainer(max_epochs=6, callbacks=[finite]).fit(Plateau(), loader(32), loader(16))
    assert finite.stopped_epoch == 5 and "not finite" in finite.stopping_reason_message
    with pytest.warns(UserWarning, match="'absent' was not logged"):
        trainer(max_epochs=1, callbacks=[L.EarlyStopping("absent", strict=False)]).fit(Plateau(), loader(32))


def test_scheduler_frequency_and_monitor_on_a_plain_scheduler():
    def sched(opt):
        return {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), "interval": "epoch",
                "frequency": 2, "monitor": "val_loss"}  # a monitor on a non-plateau scheduler is ignored, as there

    t = trainer(max_epochs=5)
    t.fit(Regressor(lr=0.1, scheduler=sched), loader(32), loader(16))
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)


def test_datamodule_and_module_loaders():
    class DM(L.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.stages = []

        def setup(self, stage):
            self.stages.append(stage)

        def train_dataloader(self):
            return loader(32)

        def val_dataloader(self):
            return loader(16)

        def test_dataloader(self):
            return loader(16)

    dm = DM()
    t = trainer(max_epochs=1)
    t.fit(Regressor(), datamodule=dm)
    assert t.datamodule is dm and dm.trainer is t and "val_loss" in t.callback_metrics
    assert t.test(datamodule=dm, verbose=False)[0].keys() == {"test_loss"}  # the fitted model
    assert dm.stages == ["fit", "test"]
    with pytest.raises(ValueError, match="either dataloaders or a datamodule"):
        t.fit(Regressor(), loader(16), datamodule=dm)
    with pytest.raises(ValueError, match="needs train_dataloaders, a datamodule"):
        trainer().fit(Regressor())
    with pytest.raises(ValueError, match="2 DataLoaders"):
        trainer().validate(Regressor(), [loader(16), loader(16)])


def test_predict_returns_the_outputs():
    model = Regressor()
    x = regression_data(40).tensors[0]
    out = trainer().predict(model, torch.utils.data.DataLoader(x, batch_size=16))  # the default: self(batch)
    assert [o.shape[0] for o in out] == [16, 16, 8]
    torch.testing.assert_close(torch.cat(out), model(x).detach())
    assert trainer().predict(model, torch.utils.data.DataLoader(x), return_predictions=False) is None


def test_seed_everything_workers_seeds_python_and_numpy_in_workers():
    import numpy as np

    class Draws(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.tensor([float(np.random.randint(1 << 30))])

    def draws():
        loader_ = torch.utils.data.DataLoader(Draws(), batch_size=2, num_workers=2)
        got = []

        class M(Regressor):
            def predict_step(self, batch, batch_idx, dataloader_idx=0):
                got.append(batch)

        trainer().predict(M(), loader_)
        return torch.cat(got).flatten().tolist(), loader_.worker_init_fn

    assert L.seed_everything(3, workers=True) == 3 and os.environ["PL_SEED_WORKERS"] == "1"
    first, init_fn = draws()
    L.seed_everything(3, workers=True)
    assert draws()[0] == first and init_fn is L.randomness.seed_worker
    L.seed_everything(3)
    assert draws()[1] is None


def classifier_with_metrics(framework, torchmetrics):
    class Classifier(framework.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)
            self.train_acc = torchmetrics.classification.BinaryAccuracy()
            self.val_acc = torchmetrics.classification.BinaryAccuracy()

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.layer(x)
            self.train_acc(logits.argmax(1), y)  # called: its batch value is what on_step logs
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
            return F.cross_entropy(logits, y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.val_acc.update(self.layer(x).argmax(1), y)
            self.log("val_acc", self.val_acc)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Classifier


def fit_with_metrics(framework, torchmetrics):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 2, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    framework.seed_everything(0)
    model = classifier_with_metrics(framework, torchmetrics)()
    t = framework.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    t.fit(model, torch.utils.data.DataLoader(data, batch_size=16), torch.utils.data.DataLoader(data, batch_size=25))
    return {k: float(v) for k, v in t.callback_metrics.items()}, model, data


def test_torchmetrics_objects_are_logged_as_in_lightning():
    torchmetrics = pytest.importorskip("torchmetrics")
    ours, model, data = fit_with_metrics(L, torchmetrics)
    assert set(ours) == {"train_acc", "train_acc_step", "train_acc_epoch", "val_acc"}
    with torch.no_grad():
        assert ours["val_acc"] == pytest.approx((model.layer(data.tensors[0]).argmax(1) == data.tensors[1]).float()
                                                .mean().item())  # compute() over the loop, reset each epoch
    try:
        import lightning.pytorch as pl
    except ImportError:
        return
    assert ours == pytest.approx(fit_with_metrics(pl, torchmetrics)[0], rel=1e-6)


def test_learning_rate_monitor(tmp_path):
    def sched(opt):
        return {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), "interval": "step", "name": "lr"}

    logger = L.CSVLogger(tmp_path)
    monitor = L.LearningRateMonitor(log_momentum=True)
    t = trainer(max_epochs=1, log_every_n_steps=2, logger=logger, callbacks=[monitor])
    t.fit(Regressor(lr=0.1, scheduler=sched), loader(64))  # 4 steps: logged before steps 2 and 4
    with open(logger.metrics_file_path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["lr"]]
    logged = [(r["step"], float(r["lr"]), float(r["lr-momentum"])) for r in rows]
    assert logged == [("1", 0.05, 0.9), ("3", 0.0125, 0.9)]
    assert t.callback_metrics["lr"].item() == pytest.approx(0.0125)
    with pytest.raises(ValueError, match="LearningRateMonitor needs a logger"):
        trainer(max_steps=1, callbacks=[L.LearningRateMonitor()]).fit(Regressor(), loader(16))


def test_estimated_stepping_batches_for_one_cycle():
    seen = []

    class OneCycle(Regressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            seen.append(self.trainer.estimated_stepping_batches)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=seen[-1])
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    trainer(max_epochs=3, accumulate_grad_batches=3).fit(OneCycle(), loader(64))  # 4 batches: 2 steps an epoch
    trainer(max_steps=5).fit(OneCycle(), loader(64))
    assert seen == [6, 5]


def test_transfer_hooks_of_the_datamodule_take_precedence():
    class DM(L.LightningDataModule):
        def train_dataloader(self):
            return loader(32)

        def on_before_batch_transfer(self, batch, dataloader_idx):
            x, y = batch
            return x, y * 0  # the module then learns y = 0

    class Doubles(Regressor):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            seen.append(float(batch[1].abs().sum()))
            return batch

    seen = []
    trainer(max_epochs=1).fit(Doubles(), datamodule=DM())
    assert seen == [0.0, 0.0]
