"""The forms configure_optimizers may return."""
import pytest
import torch

from gpulayer.torch import optim

PARAMS = [torch.nn.Parameter(torch.zeros(2))]


def opt():
    return torch.optim.SGD(PARAMS, lr=0.1)


def test_accepted_forms():
    o = opt()
    s = torch.optim.lr_scheduler.StepLR(o, 1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(o)
    cases = [
        (o, None, None),
        ([o], None, None),
        ((o, s), s, "epoch"),
        (([o], [s]), s, "epoch"),
        (([o], []), None, None),
        ({"optimizer": o}, None, None),
        ({"optimizer": o, "lr_scheduler": s}, s, "epoch"),
        ({"optimizer": o, "lr_scheduler": {"scheduler": s, "interval": "step"}}, s, "step"),
        ({"optimizer": o, "lr_scheduler": plateau, "monitor": "val_loss"}, plateau, "epoch"),
    ]
    for config, scheduler, interval in cases:
        got_opt, got_sched = optim.parse(config)
        assert got_opt is o
        assert (got_sched and got_sched.scheduler, got_sched and got_sched.interval) == (scheduler, interval)


@pytest.mark.parametrize("config, error, match", [
    (lambda: [opt(), opt()], ValueError, "2 optimizers"),
    (lambda: "adam", TypeError, "must return a torch.optim.Optimizer"),
    (lambda: {"optimizer": opt(), "lr_scheduler": {"scheduler": None, "frequency": 0}}, ValueError, "frequency=0"),
    (lambda: {"optimizer": opt(), "lr_scheduler": {"scheduler": None, "reduce_on_plateau": True}}, ValueError,
     "unsupported lr_scheduler keys"),
    (lambda: {"optimizer": (o := opt()), "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(o, 1),
                                                          "interval": "batch"}}, ValueError, "interval='batch'"),
    (lambda: (o := opt(), torch.optim.lr_scheduler.ReduceLROnPlateau(o)), ValueError, "needs a metric"),
])
def test_rejected_forms(config, error, match):
    with pytest.raises(error, match=match):
        optim.parse(config())
