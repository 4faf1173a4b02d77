"""examples/lightning_port: Lightning's documented examples, written as in Lightning's docs with the import
swapped, run to completion on CPU; where lightning is installed, the same files under Lightning give the
same metrics for the same seed."""
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples" / "lightning_port"))
from frameworks import EXAMPLES, SWAPS, load, source  # noqa: E402


def test_the_examples_differ_from_lightnings_only_in_the_imports():
    for name in EXAMPLES:
        ours, theirs = source(name, "glt").splitlines(), source(name, "lightning").splitlines()
        changed = [(a, b) for a, b in zip(ours, theirs) if a != b]
        assert changed and all(a.startswith(("import gpulayer.torch", "from gpulayer.torch")) for a, _ in changed)
        assert len(changed) <= len(SWAPS["lightning"])


def test_autoencoder_quick_start(tmp_path, capsys):
    out = load("autoencoder.py", "glt").main(str(tmp_path), max_epochs=2)
    assert out["fit"]["val_loss"] < 0.25 and out["test"]["test_loss"] < 0.25  # from about 0.4
    assert out["checkpoint"] == "lightning_logs/version_0/checkpoints/epoch=1-step=32.ckpt"
    assert out["restored_equal"] and out["hparams"] == {"hidden": 64, "latent": 3, "lr": 1e-3}
    assert out["embeddings_shape"] == [4, 3] and out["global_step"] == 32
    written = {p.name for p in (tmp_path / out["log_dir"]).iterdir()}
    # the default logger: TensorBoard where installed, else CSV
    tensorboard = {p for p in written if p.startswith("events.out.tfevents.")}
    assert written - tensorboard == {"checkpoints", "hparams.yaml"} | (set() if tensorboard else {"metrics.csv"})
    assert "Total params" in capsys.readouterr().out


def test_datamodule_classifier_with_callbacks_loggers_and_predict(tmp_path, capsys):
    out = load("classifier.py", "glt").main(str(tmp_path), max_epochs=4)
    assert out["fit"]["val_acc"] > 0.3 and out["test"]["test_acc"] > 0.3  # 10 classes: chance is 0.1
    assert set(out["fit"]) == {"train_loss", "train_loss_step", "train_loss_epoch", "val_loss", "val_acc", "lr-Adam"}
    assert out["fit"]["train_loss"] == out["fit"]["train_loss_epoch"]
    assert set(out["test"]) == {"test_acc", "test_worst_batch_loss"}
    assert out["predicted"] == 256 and out["epochs_seen"] == [0, 1, 2, 3]
    assert out["best_checkpoint"].startswith("csv/version_0/checkpoints/epoch=") and out["best_hidden_dim"] == 64
    assert out["lr"] == pytest.approx(2e-3 * 0.7 ** 2)  # StepLR every 2nd epoch (frequency=2)
    assert out["fit"]["lr-Adam"] == pytest.approx(2e-3 * 0.7)  # LearningRateMonitor, at the last epoch start
    assert out["global_step"] == 80 and out["log_dir"] == "csv/version_0"
    printed = capsys.readouterr().out
    assert "Training is starting" in printed and "Metric val_loss improved" in printed


def close(a, b, rel=1e-5):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], rel) for k in a)
    if isinstance(a, float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)
    return a == b


@pytest.mark.parametrize("name", EXAMPLES)
def test_same_metrics_as_lightning(tmp_path, name):
    pytest.importorskip("lightning.pytorch")
    ours = load(name, "glt").main(str(tmp_path / "glt"))
    theirs = load(name, "lightning").main(str(tmp_path / "lightning"))
    assert close(ours, theirs), (ours, theirs)
