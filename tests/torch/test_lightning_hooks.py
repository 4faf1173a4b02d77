"""Hook order: a module and a callback that record every hook call, against Lightning's documented order
(the expected lists follow Lightning's own tests/tests_pytorch/models/test_hooks.py, less the internals
that are not hooks: zero_grad, forward, backward, optimizer_step...). Where Lightning is installed the
same recorders also run under lightning.pytorch and must record the same calls."""
import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpulayer.torch as glt

MODULE_HOOKS = [
    "configure_callbacks", "prepare_data", "setup", "teardown", "configure_model", "configure_optimizers",
    "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_train_batch_start", "on_train_batch_end", "training_step", "validation_step", "test_step", "predict_step",
    "on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_save_checkpoint", "on_load_checkpoint", "on_before_batch_transfer", "transfer_batch_to_device",
    "on_after_batch_transfer", "train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader",
    *(f"on_{stage}_{when}" for stage in ("validation", "test", "predict") for when in
      ("start", "end", "epoch_start", "epoch_end", "batch_start", "batch_end", "model_eval")),
    "on_validation_model_train", "on_test_model_train",
]
CALLBACK_HOOKS = [
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start",
    "on_train_batch_end", "on_before_zero_grad", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_save_checkpoint", "on_load_checkpoint",
    *(f"on_{stage}_{when}" for stage in ("validation", "test", "predict") for when in
      ("start", "end", "epoch_start", "epoch_end", "batch_start", "batch_end")),
]
DATA = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))


def module_class(L):
    """A small LightningModule of framework `L` with its own loaders."""
    class Base(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.layer(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

        test_step = validation_step

        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return self.layer(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(DATA, batch_size=4)

        val_dataloader = test_dataloader = predict_dataloader = train_dataloader

    return Base


def recorders(L):
    """A LightningModule and a Callback of framework `L` that append each hook's name to `called`."""
    called = []

    def record(name, prefix=""):
        def hook(self, *args, **kwargs):
            called.append(prefix + name)
            return getattr(super(type(self), self), name)(*args, **kwargs)
        return hook

    hooked = type("Hooked", (module_class(L),), {name: record(name) for name in MODULE_HOOKS})
    callback = type("HookedCallback", (L.Callback,), {name: record(name, "Callback.") for name in CALLBACK_HOOKS})
    torch.manual_seed(0)
    return called, hooked(), callback()


def batches(stage, n, step=None):
    out = []
    for _ in range(n):
        out += ["on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
                f"Callback.on_{stage}_batch_start", f"on_{stage}_batch_start", step or f"{stage}_step"]
        if stage == "train":
            out += ["Callback.on_before_zero_grad", "on_before_zero_grad", "Callback.on_before_backward",
                    "on_before_backward", "Callback.on_after_backward", "on_after_backward",
                    "Callback.on_before_optimizer_step", "on_before_optimizer_step"]
        out += [f"Callback.on_{stage}_batch_end", f"on_{stage}_batch_end"]
    return out


def evaluation(stage, n):
    return [f"on_{stage}_model_eval", f"Callback.on_{stage}_start", f"on_{stage}_start",
            f"Callback.on_{stage}_epoch_start", f"on_{stage}_epoch_start", *batches(stage, n),
            f"Callback.on_{stage}_epoch_end", f"on_{stage}_epoch_end", f"Callback.on_{stage}_end", f"on_{stage}_end"]


def start(stage):
    return ["configure_callbacks", "prepare_data", "Callback.setup", "setup", "configure_model"]


def end():
    return ["Callback.teardown", "teardown"]


FIT = [
    *start("fit"), "configure_optimizers", "Callback.on_fit_start", "on_fit_start",
    "Callback.on_sanity_check_start", "val_dataloader", *evaluation("validation", 2), "on_validation_model_train",
    "Callback.on_sanity_check_end", "train_dataloader", "Callback.on_train_start", "on_train_start",
    "Callback.on_train_epoch_start", "on_train_epoch_start", *batches("train", 2, "training_step"),
    *evaluation("validation", 2), "on_validation_model_train",
    "Callback.on_train_epoch_end", "on_train_epoch_end",  # before ModelCheckpoint, a monitoring callback
    "Callback.on_save_checkpoint", "on_save_checkpoint",
    "Callback.on_train_end", "on_train_end", "Callback.on_fit_end", "on_fit_end", *end(),
]
EVAL = {verb: [*start(verb), f"{loader}_dataloader", *evaluation(noun, 2), f"on_{noun}_model_train", *end()]
        for verb, noun, loader in (("validate", "validation", "val"), ("test", "test", "test"))}
PREDICT = [*start("predict"), "predict_dataloader", "on_predict_model_eval", "Callback.on_predict_start",
           "on_predict_start", "Callback.on_predict_epoch_start", "on_predict_epoch_start",
           *batches("predict", 2), "Callback.on_predict_epoch_end", "on_predict_epoch_end",
           "Callback.on_predict_end", "on_predict_end", *end()]


def run(L, tmp_path, verb):
    called, model, callback = recorders(L)
    trainer = L.Trainer(default_root_dir=tmp_path, max_epochs=1, accelerator="cpu", devices=1, callbacks=[callback],
                        enable_progress_bar=False, enable_model_summary=False, logger=False)
    result = getattr(trainer, verb)(model, **({} if verb in ("fit", "predict") else {"verbose": False}))
    return called, result


@pytest.mark.parametrize("verb, expected", [("fit", FIT), ("validate", EVAL["validate"]), ("test", EVAL["test"]),
                                            ("predict", PREDICT)])
def test_hook_order_is_lightnings(tmp_path, verb, expected):
    called, _ = run(glt, tmp_path, verb)
    assert called == expected


@pytest.mark.parametrize("verb", ["fit", "validate", "test", "predict"])
def test_same_calls_as_lightning(tmp_path, verb):
    pl = pytest.importorskip("lightning.pytorch")
    ours, our_result = run(glt, tmp_path / "glt", verb)
    theirs, their_result = run(pl, tmp_path / "pl", verb)
    assert ours == theirs
    if verb == "predict":
        assert all(torch.equal(a, b) for a, b in zip(our_result, their_result))


def test_batch_end_outputs_are_lightnings(tmp_path):
    seen = {}
    for name in ("glt", "lightning.pytorch"):
        framework = glt if name == "glt" else pytest.importorskip(name)

        class Spy(framework.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                seen.setdefault(name, []).append({k: float(v) for k, v in outputs.items()})

        class Extra(module_class(framework)):
            def training_step(self, batch, batch_idx):
                loss = super().training_step(batch, batch_idx)
                return {"loss": loss, "double": 2 * loss.detach()}

        torch.manual_seed(0)
        framework.Trainer(default_root_dir=tmp_path / name, max_epochs=1, accelerator="cpu", callbacks=[Spy()],
                          accumulate_grad_batches=2, enable_progress_bar=False, enable_model_summary=False,
                          logger=False, enable_checkpointing=False).fit(Extra())
    assert len(seen["glt"]) == 2 and seen["glt"][0]["double"] == pytest.approx(4 * seen["glt"][0]["loss"])
    assert seen["glt"] == seen["lightning.pytorch"]  # the loss divided by accumulate_grad_batches there too


def test_resume_calls_on_load_checkpoint(tmp_path):
    called, model, callback = recorders(glt)
    trainer = glt.Trainer(default_root_dir=tmp_path, max_epochs=1, accelerator="cpu", callbacks=[callback],
                          enable_progress_bar=False, enable_model_summary=False, logger=False)
    trainer.fit(model)
    path = trainer.checkpoint_callback.best_model_path
    called.clear()
    glt.Trainer(default_root_dir=tmp_path, max_epochs=2, accelerator="cpu", callbacks=[callback],
                enable_progress_bar=False, enable_model_summary=False, logger=False,
                num_sanity_val_steps=0).fit(model, ckpt_path=path)
    at = called.index("on_load_checkpoint")
    assert called[at - 2:at + 2] == ["Callback.on_fit_start", "on_fit_start", "on_load_checkpoint",
                                     "Callback.on_load_checkpoint"]
    assert called.count("on_train_epoch_start") == 1  # resumed at epoch 1 of 2
