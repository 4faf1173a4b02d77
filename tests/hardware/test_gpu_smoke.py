"""glt.Trainer on a real GPU: CUDA (three precisions, no host syncs on the hot path, 2-GPU DDP,
a CUDA checkpoint resumed on the CPU) or Apple MPS. Every test skips, with its reason, elsewhere."""
import pytest
import torch

import gpulayer.torch as glt
from glt_models import Regressor, loader

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
mps = pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs Apple MPS; not present")


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """The Trainers' default logs and checkpoints (lightning_logs/) go to the test's folder."""
    monkeypatch.chdir(tmp_path)


class EpochLosses(glt.Callback):
    """Keeps each epoch's last training loss (Regressor logs it on_step, as Lightning's default);
    its state comes back from DDP rank 0 like any callback's."""

    def __init__(self):
        self.losses = []

    def on_train_epoch_end(self, trainer, module):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def state_dict(self):
        return {"losses": list(self.losses)}

    def load_state_dict(self, state):
        self.losses = list(state["losses"])


def fit(accelerator, precision="32-true", optimizer="adam", epochs=5, callbacks=(), ckpt_path=None, **kwargs):
    glt.seed_everything(0)
    model = Regressor(hidden=64, lr=0.01, optimizer=optimizer)
    record = EpochLosses()
    trainer = glt.Trainer(accelerator=accelerator, precision=precision, max_epochs=epochs,
                          enable_progress_bar=False, callbacks=[record, *callbacks], **kwargs)
    trainer.fit(model, loader(256, shuffle=True), loader(64, seed=1), ckpt_path=ckpt_path)
    return model, trainer, record.losses


def assert_learned(model, losses, device_type):
    assert losses[-1] < 0.3 * losses[0], losses
    for p in model.parameters():
        assert p.device.type == device_type and p.dtype == torch.float32 and torch.isfinite(p).all()


@cuda
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_cuda_fit(precision):
    model, trainer, losses = fit("cuda", precision)
    assert trainer.device.type == "cuda"
    assert (trainer.precision.scaler is not None) == (precision == "16-mixed")
    assert_learned(model, losses, "cuda")


class SyncGuard(glt.Callback):
    """Any CUDA host sync during a training epoch raises, except in metrics.to_host, which allows its own."""

    def on_train_epoch_start(self, trainer, module):
        torch.cuda.set_sync_debug_mode("error")

    def on_train_epoch_end(self, trainer, module):
        torch.cuda.set_sync_debug_mode(0)


@cuda
@pytest.mark.parametrize("precision, optimizer", [
    ("32-true", "adam"), ("bf16-mixed", "adam"),
    ("16-mixed", "adam-fused"),  # GradScaler syncs every step unless the optimizer is fused
])
def test_cuda_hot_path_never_syncs(precision, optimizer):
    before = glt.host_transfer_count()
    try:
        model, _, losses = fit("cuda", precision, optimizer, epochs=2, callbacks=[SyncGuard()],
                               log_every_n_steps=4, gradient_clip_val=1.0, logger=False,
                               enable_checkpointing=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # 16 steps an epoch: log points + one validation and one training-epoch transfer per epoch
    assert glt.host_transfer_count() - before == 32 // 4 + 2 + 2
    assert losses[-1] < losses[0]


@cuda
def test_cuda_checkpoint_resumes_on_cpu(tmp_path):
    saver = glt.ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    _, trainer, _ = fit("cuda", epochs=2, callbacks=[saver])
    cpu_model = Regressor(hidden=64)
    [metrics] = glt.Trainer(accelerator="cpu", enable_progress_bar=False).validate(
        cpu_model, loader(64, seed=1), ckpt_path=saver.last_model_path)
    assert float(metrics["val_loss"]) == pytest.approx(float(trainer.callback_metrics["val_loss"]), rel=1e-4)
    resumed, cpu_trainer, _ = fit("cpu", epochs=3, ckpt_path=saver.last_model_path)
    assert cpu_trainer.global_step == 48 and next(resumed.parameters()).device.type == "cpu"


@cuda
def test_cuda_gpulayer_device(monkeypatch):
    index = torch.cuda.device_count() - 1
    monkeypatch.setenv("GPULAYER_DEVICE", f"cuda:{index}")
    model, trainer, _ = fit("auto", epochs=1)
    assert trainer.device == torch.device("cuda", index) and next(model.parameters()).device == trainer.device


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP needs 2 CUDA GPUs; fewer are present")
def test_cuda_ddp_two_gpus():
    model, trainer, losses = fit("cuda", epochs=4, devices=2)
    assert trainer.global_step == 4 * 8  # each rank takes half of the 16 batches
    assert_learned(model, losses, "cpu")  # the parent's model stays where it was and gets the weights


@mps
def test_mps_fit_32_true():
    model, trainer, losses = fit("mps")
    assert trainer.device.type == "mps"
    assert_learned(model, losses, "mps")


@mps
def test_mps_refuses_bf16():
    with pytest.raises(glt.UnsupportedConfiguration, match="only '32-true' is supported on MPS"):
        glt.Trainer(accelerator="mps", precision="bf16-mixed")
