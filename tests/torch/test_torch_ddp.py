"""DDP through spawned processes, on CPU with gloo (the CUDA/NCCL run is in tests/hardware)."""
import os

import torch

import gpulayer.torch as glt
from glt_models import Regressor, loader, trainer


def test_two_process_ddp_matches_one_process_with_twice_the_batch(tmp_path):
    """Each rank takes every other sample, so one DDP step averages the same 2b samples as one
    single-process step on a batch of 2b: the weights must agree."""
    torch.manual_seed(0)
    ddp_model = Regressor(optimizer="sgd", lr=0.1)
    single_model = Regressor(optimizer="sgd", lr=0.1)
    single_model.load_state_dict(ddp_model.state_dict())

    saver = glt.ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    logger = glt.CSVLogger(tmp_path / "logs")
    t = trainer(max_epochs=2, devices=2, callbacks=[saver], logger=logger, log_every_n_steps=2)
    t.fit(ddp_model, loader(64, batch_size=8), loader(32, batch_size=8))
    trainer(max_epochs=2).fit(single_model, loader(64, batch_size=16))

    for a, b in zip(ddp_model.parameters(), single_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (t.current_epoch, t.global_step) == (2, 8)
    assert set(t.callback_metrics) == {"train_loss", "val_loss"}
    assert sorted(os.listdir(tmp_path)) == ["epoch=1-step=8.ckpt", "last.ckpt", "logs"]  # written once, by rank 0
    assert saver.best_model_path.endswith("epoch=1-step=8.ckpt")  # the parent's callback got rank 0's state
    with open(logger.metrics_file_path) as f:  # rank 0 logged, in the version folder the parent chose
        assert f.readline().strip() == "epoch,step,train_loss,val_loss" and len(f.readlines()) == 4 + 2
    assert sorted(os.listdir(tmp_path / "logs")) == ["lightning_logs"]


# A DDP worker's life, in a fresh interpreter as spawn gives it: gpulayer.torch.distributed is imported (to
# unpickle _fit_worker), then the group is made, DDP wraps a model and is dropped, and the group is destroyed. Prints the
# process's threads before the group and after its teardown.
WORKER = """
import gc, os, socket, sys
import torch
import torch.distributed as dist
from gpulayer.torch import distributed

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(1)
torch.ones(2).sum()
before = threads()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
ddp = distributed.wrap(torch.nn.Linear(2, 1), torch.device("cpu"))
dist.all_reduce(torch.ones(3))
del ddp  # as the trainer drops it at the end of fit, before the barrier and the destroy
dist.barrier()
dist.destroy_process_group()
gc.collect()
print(before, threads())
"""


def test_a_destroyed_process_group_leaves_no_gloo_thread_for_the_interpreter_exit(tmp_path):
    """destroy_process_group ends gloo's threads: none is left for the interpreter's exit to tear down (which
    aborted a rank now and then: 'terminate called without an active exception'). torch.distributed.nn
    .functional, which DDP imports, used to keep the group alive when first imported after the group was made."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = map(int, out.stdout.split())
    assert after == before, f"{after - before} threads of the destroyed group still run"
