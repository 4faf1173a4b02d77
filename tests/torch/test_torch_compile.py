"""Trainer(compile=...): torch.compile of the training step, and the whole step as a CUDA graph.

The CPU tests run everywhere (torch.compile with Inductor needs a C++ compiler; the test skips
without one). The CUDA-graph tests need a CUDA device.
"""
import shutil

import pytest
import torch
from torch import nn

import gpulayer.torch as glt
from glt_models import Regressor, loader, trainer
from gpulayer.torch import compiled

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def fit(model, **kwargs):
    t = trainer(**kwargs)
    t.fit(model, loader(n=64), loader(n=32, seed=1))
    return t


def same_training(a: glt.Trainer, b: glt.Trainer, model_a, model_b, rtol=1e-4, atol=1e-5):
    assert a.callback_metrics.keys() == b.callback_metrics.keys()
    for key in a.callback_metrics:
        assert float(a.callback_metrics[key]) == pytest.approx(float(b.callback_metrics[key]), rel=rtol, abs=atol), key
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol)


def test_bad_compile_values_raise_clear_errors():
    with pytest.raises(ValueError, match="compile='fast'; use True, False, 'cudagraphs'"):
        trainer(compile="fast")
    with pytest.raises(TypeError, match="compile= takes a bool, a str or a dict, got int"):
        trainer(compile=1)
    with pytest.raises(ValueError, match="keys torch.compile does not take: 'modee'"):
        trainer(compile={"modee": "default"})
    with pytest.raises(TypeError, match="takes True or False, got 'yes'"):
        trainer(compile={"cudagraphs": "yes"})
    with pytest.raises(glt.UnsupportedConfiguration, match="needs accelerator='cuda' .*not 'cpu'"):
        trainer(compile="cudagraphs")
    with pytest.raises(glt.UnsupportedConfiguration, match="trains on one device; devices=2"):
        trainer(compile=True, devices=2)
    # the rules that need a CUDA Trainer, checked on the parser itself
    rules = {"cudagraphs with reduce-overhead": ({"cudagraphs": True, "mode": "reduce-overhead"}, "32-true", 1,
                                                 "makes CUDA graphs of its own"),
             "accumulation": ("cudagraphs", "32-true", 2, "accumulate_grad_batches must be 1"),
             "fp16": ("cudagraphs", "16-mixed", 1, "use 'bf16-mixed'")}
    for value, precision, accumulate, message in rules.values():
        with pytest.raises(glt.UnsupportedConfiguration, match=message):
            compiled.parse(value, "cuda", 1, 1, precision, accumulate)
    assert compiled.parse(False, "cpu", 1, 1, "32-true", 1) is None


def test_logs_inside_a_compiled_step_reach_the_trainer_with_no_extra_sync():
    """aot_eager: torch.compile's tracing and autograd without code generation (cheap on CPU)."""
    runs = {}
    for value in (False, {"backend": "aot_eager"}):
        glt.seed_everything(0)
        model = Regressor()
        before = glt.host_transfer_count()
        t = fit(model, compile=value, max_epochs=2, log_every_n_steps=2)
        runs[str(value)] = (t, model, glt.host_transfer_count() - before)
    (eager, eager_model, eager_syncs), (comp, comp_model, comp_syncs) = runs.values()
    assert set(comp.callback_metrics) == {"train_loss", "val_loss"}
    same_training(eager, comp, eager_model, comp_model)
    assert comp_syncs == eager_syncs
    assert "log" not in comp_model.__dict__  # the recorder is gone after the step


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                    reason="torch.compile's Inductor builds C++ on CPU and finds no C++ compiler here")
def test_compile_true_on_cpu_trains_like_eager():
    runs = []
    for value in (False, True):
        glt.seed_everything(0)
        model = Regressor()
        runs.append((fit(model, compile=value, max_epochs=1), model))
    (eager, eager_model), (comp, comp_model) = runs
    same_training(eager, comp, eager_model, comp_model)


# ---------------------------------------------------------------- CUDA graphs


class BatchNormNet(Regressor):
    """With a BatchNorm layer: its running statistics are updated inside the graph."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(2, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def cuda_fit(model, **kwargs):
    graphs = []

    class CountGraphs(glt.Callback):
        def on_train_epoch_end(self, trainer, module):
            graphs.append(len(trainer._compiled_step.graphs) if trainer._compiled_step is not None else 0)

    t = glt.Trainer(accelerator="cuda", enable_progress_bar=False, callbacks=[CountGraphs()], **kwargs)
    t.fit(model, loader(n=100, batch_size=16), loader(n=32, seed=1))  # a last batch of 4: a second graph
    return t, graphs


@cuda
@pytest.mark.parametrize("net, optimizer", [(Regressor, "adam"), (Regressor, "adam-fused"), (BatchNormNet, "sgd")])
def test_cudagraphs_train_like_eager(net, optimizer):
    """Adam reads the scheduled rate from a device tensor, SGD captures again when it changes.
    (SGD's graphs match eager to the bit; capturable Adam rounds its bias correction on the
    device, which BatchNorm on batches of 16 amplifies past these tolerances, so Adam trains
    the plain MLP here.)"""
    runs = []
    for value in (False, "cudagraphs"):
        glt.seed_everything(0)
        model = net(optimizer=optimizer, lr=0.02,
                    scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
        t, graphs = cuda_fit(model, compile=value, max_epochs=4, gradient_clip_val=1.0, log_every_n_steps=3)
        runs.append((t, model, graphs))
    (eager, eager_model, _), (graphed, graphed_model, graphs) = runs
    assert graphs == [1, 1, 2, 2]  # the last batch's signature: eager twice, then captured
    same_training(eager, graphed, eager_model, graphed_model)
    assert graphed.optimizer.param_groups[0]["lr"] == pytest.approx(0.02 / 16)


@cuda
def test_cudagraphs_bf16_mixed_trains_like_eager():
    runs = []
    for value in (False, "cudagraphs"):
        glt.seed_everything(0)
        model = Regressor()
        runs.append((cuda_fit(model, compile=value, max_epochs=3, precision="bf16-mixed")[0], model))
    (eager, eager_model), (graphed, graphed_model) = runs
    same_training(eager, graphed, eager_model, graphed_model, rtol=2e-2, atol=2e-3)


@cuda
def test_cudagraphs_refuse_what_a_replay_would_skip():
    class ChangesWeightDecay(glt.Callback):
        def on_train_epoch_end(self, trainer, module):
            trainer.optimizer.param_groups[0]["weight_decay"] = 0.1

    with pytest.raises(RuntimeError, match="hyperparameters changed after the capture.*only 'lr' may change"):
        glt.Trainer(accelerator="cuda", enable_progress_bar=False, compile="cudagraphs", max_epochs=2,
                    callbacks=[ChangesWeightDecay()]).fit(Regressor(), loader())

    class WithHook(Regressor):
        def on_after_backward(self):
            pass

    with pytest.raises(glt.UnsupportedConfiguration, match="WithHook.on_after_backward would run once"):
        glt.Trainer(accelerator="cuda", enable_progress_bar=False, compile="cudagraphs",
                    max_epochs=1).fit(WithHook(), loader())


@cuda
def test_cudagraphs_name_a_host_sync_in_the_step():
    class Syncs(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if loss.item() < 0:  # a host sync: not capturable
                raise AssertionError
            return loss

    with pytest.raises(RuntimeError, match="(?s)could not capture the training step.*without host syncs"):
        glt.Trainer(accelerator="cuda", enable_progress_bar=False, compile="cudagraphs",
                    max_epochs=1).fit(Syncs(), loader())


@cuda
def test_cudagraphs_refuse_a_logged_metric_object():
    class LogsAModule(Regressor):
        def __init__(self):
            super().__init__()
            self.stand_in = nn.Identity()  # what a torchmetrics Metric is to the recorder: an nn.Module

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log_dict({"acc": self.stand_in})
            return loss

    with pytest.raises(glt.UnsupportedConfiguration, match="cannot replay the update of a logged metric object"):
        glt.Trainer(accelerator="cuda", enable_progress_bar=False, compile="cudagraphs",
                    max_epochs=1).fit(LogsAModule(), loader())
