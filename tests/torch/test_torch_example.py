"""examples/trainer_regression/train.py: the local run, and the shape of its --remote call."""
import importlib.util
import pathlib
import sys

import pytest

import gpulayer

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "trainer_regression" / "train.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("trainer_regression_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_local_run_loss_falls(example, capsys):
    result = example.train_fn("cpu", epochs=2)
    assert result["device"] == "cpu"
    assert result["epoch_losses"][1] < 0.2 * result["epoch_losses"][0]
    assert "epoch 1: train_loss=" in capsys.readouterr().out


def test_remote_branch_runs_train_fn_with_task_options_given_apart(example, monkeypatch, capsys):
    """train_fn takes an accelerator of its own, so the example gives the task's through gl.options."""
    calls = []

    class FakeOptions:
        def __init__(self, **options):
            self.options = options

        def run(self, fn, *args, **kwargs):
            calls.append((fn, args, self.options))
            return fn(*args, **kwargs)

    monkeypatch.setitem(vars(gpulayer), "options", FakeOptions)  # not setattr: that would load the real API first
    monkeypatch.setenv("GPULAYER_DEVICE", "cpu")  # what the peer sets in the task; "auto" must follow it
    monkeypatch.setattr(sys, "argv", ["train.py", "--remote", "--accelerator", "cpu", "--epochs", "1"])
    example.main()
    assert calls == [(example.train_fn, ("auto", 1), {"accelerator": "cpu", "frameworks": {"torch": ">=2.3"}})]
    assert "remote run on cpu" in capsys.readouterr().out
