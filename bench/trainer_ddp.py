"""Per-step time of glt.Trainer against Lightning's Trainer, both with DDP over `--devices` devices.

The models, losses and optimizers are those of `trainer_overhead.py` (mlp: launch-bound, resnet18:
compute-bound). Each way is one fit in processes its trainer spawns: glt's `devices=N` (its DDP
is always spawned) and Lightning's `strategy="ddp_spawn"`, so both pay the same kind of start.
The data is a map-style dataset on the host, `--steps` global batches of `--batch-size` samples,
each process taking its share through the DistributedSampler that both trainers insert, and
moving its batches to its device in the training step (the same for both). The loss is logged as in
`trainer_overhead.py`; Lightning keeps its default `sync_dist=False` (rank 0's own value, no
collective per step), while glt reduces logged values across ranks at each point where it prints
them: the comparison gives Lightning the cheaper of its two ways.

Rank 0 times each training epoch (the device synchronized at both ends) and writes the times to a
file. A pass fits each way once (`--warmup` untimed then `--repeats` timed epochs); passes alternate
the order of the ways. A round is one timed epoch of each way at the same index within a pass;
the ratio is taken per round and reported as the median over rounds with quartiles and range.
The whole fit (spawn, rendezvous, teardown) is reported too.

    python bench/trainer_ddp.py --device cuda --devices 2          # issue 31's run on 2 GPUs
    python bench/trainer_ddp.py --device cpu --devices 2 --quick   # checks that it runs (gloo)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Callable, NamedTuple

import torch
from torch.utils.data import DataLoader, TensorDataset

import gpulayer.torch as glt
from trainer_overhead import (L, LOG_KW, adam, cross_entropy, machine_info, make_mlp, make_resnet18, model_arguments,
                              mse, plot_steps, sgd, spread, synchronize)

class Model(NamedTuple):
    description: str
    make_net: Callable  # (args) -> nn.Module
    loss: Callable  # (net, batch) -> loss
    optimizer: Callable  # (params) -> Optimizer
    precision: str
    make_inputs: Callable  # (n, args) -> tensors of n samples


MODELS = {
    "mlp": Model("MLP (3 Linear, ReLU)", lambda a: make_mlp(a.features, a.hidden), mse, adam, "32-true",
                 lambda n, a: (torch.randn(n, a.features), torch.randn(n, 1))),
    "resnet18": Model("ResNet-18 (CIFAR-style), 32x32 synthetic images, 10 classes",
                      lambda a: make_resnet18(width=16 if a.quick else 64), cross_entropy, sgd, "bf16-mixed",
                      lambda n, a: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))),
}


class EpochFile:
    """Rank 0's time of each training epoch, written to `path` as a JSON list after every epoch."""

    def __init__(self, path: str):
        self.path, self.times, self._start = path, [], 0.0

    def on_train_epoch_start(self, trainer, module):
        synchronize(module.device)
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer, module):
        synchronize(module.device)
        self.times.append(time.perf_counter() - self._start)
        if trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump(self.times, f)


class GltEpochs(EpochFile, glt.Callback):
    pass


class GltModel(glt.Module):
    def __init__(self, net, loss, make_optimizer):
        super().__init__()
        self.net, self.loss_fn, self.make_optimizer = net, loss, make_optimizer

    def training_step(self, batch, batch_idx):
        loss = self.loss_fn(self.net, batch)
        self.log("train_loss", loss, **LOG_KW)
        return loss

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


if L is not None:
    class LitEpochs(EpochFile, L.Callback):
        pass

    class LitModel(L.LightningModule):
        def __init__(self, net, loss, make_optimizer):
            super().__init__()
            self.net, self.loss_fn, self.make_optimizer = net, loss, make_optimizer

        def training_step(self, batch, batch_idx):
            loss = self.loss_fn(self.net, batch)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def configure_optimizers(self):
            return self.make_optimizer(self.parameters())


# the trainers' options that keep file writes and printing out of the loop, as in trainer_overhead.py
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
             num_sanity_val_steps=0)


def fit_glt(net, model: Model, loader, args, kind, epochs, times_path) -> None:
    glt.Trainer(accelerator=kind, devices=args.devices, strategy="ddp", max_epochs=epochs,
                precision=model.precision, log_every_n_steps=args.log_every, callbacks=[GltEpochs(times_path)],
                **QUIET).fit(GltModel(net, model.loss, model.optimizer), loader)


def fit_lightning(net, model: Model, loader, args, kind, epochs, times_path) -> None:
    L.Trainer(accelerator="gpu" if kind == "cuda" else kind, devices=args.devices, strategy="ddp_spawn",
              max_epochs=epochs, precision=model.precision, log_every_n_steps=args.log_every,
              callbacks=[LitEpochs(times_path)], **QUIET
              ).fit(LitModel(net, model.loss, model.optimizer), train_dataloaders=loader)


def measure(name: str, args, kind: str, ways: dict, scratch: str) -> dict:
    model = MODELS[name]
    torch.manual_seed(0)
    net = model.make_net(args)
    inputs = model.make_inputs(args.steps * args.batch_size, args)
    loader = DataLoader(TensorDataset(*inputs), batch_size=args.batch_size // args.devices)
    epochs = args.warmup + args.repeats
    per_step: dict[str, list[float]] = {w: [] for w in ways}
    fit_s: dict[str, list[float]] = {w: [] for w in ways}
    rounds: list[dict[str, float]] = []
    for p in range(args.passes):
        order = list(ways) if p % 2 == 0 else list(ways)[::-1]
        this_pass = {}
        for way in order:
            times_path = os.path.join(scratch, f"{name}-{way}-{p}.json")
            start = time.perf_counter()
            ways[way](net, model, loader, args, kind, epochs, times_path)
            fit_s[way].append(time.perf_counter() - start)
            with open(times_path) as f:
                this_pass[way] = [1e3 * t / args.steps for t in json.load(f)[args.warmup:]]
            per_step[way] += this_pass[way]
        rounds += [{w: this_pass[w][r] for w in ways} for r in range(args.repeats)]
        print(f"  {name} pass {p + 1}/{args.passes}: " + "  ".join(
            f"{w} {statistics.median(this_pass[w]):.3f}" for w in ways) + " ms/step", flush=True)
    results = {w: {**{f"ms_per_step_{k}": v for k, v in spread(per_step[w]).items()},
                   "ms_per_step_all": per_step[w], "fit_s": fit_s[w]} for w in ways}
    ratios = {}
    if {"glt", "lightning"} <= set(ways):
        s = spread([r["lightning"] / r["glt"] for r in rounds])
        ratios = {"lightning_over_glt": s["median"], "lightning_over_glt_quartiles": [s["p25"], s["p75"]],
                  "lightning_over_glt_range": [s["min"], s["max"]],
                  "fit_s_lightning_over_glt": statistics.median(fit_s["lightning"]) / statistics.median(fit_s["glt"])}
        print("  " + "  ".join(f"{k}={v:.3f}" for k, v in ratios.items() if isinstance(v, float)), flush=True)
    return {"config": {"model": model.description, "optimizer": model.optimizer.__name__, "precision": model.precision,
                       "global_batch_size": args.batch_size, "steps_per_epoch": args.steps},
            "results": results, "ratios": ratios}


def plot(report: dict, path: str) -> None:
    plot_steps([(section["results"], f"{name}, DDP on {report['devices']} x {report['device']}")
                for name, section in report["models"].items()],
               report["machine"], report["device"], "DDP trainer overhead", path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--devices", type=int, default=2, help="processes, one device each (CPU: gloo)")
    parser.add_argument("--steps", type=int, default=60, help="global steps per epoch")
    parser.add_argument("--passes", type=int, default=4, help="fits of each way, in alternating order")
    parser.add_argument("--repeats", type=int, default=8, help="timed epochs per fit")
    parser.add_argument("--warmup", type=int, default=1, help="untimed epochs per fit")
    parser.add_argument("--batch-size", type=int, default=256, help="the global batch (split over the devices)")
    parser.add_argument("--json", default=None, help="default: bench/results/trainer_ddp_<device>.json")
    parser.add_argument("--plot", default=None, help="default: the --json path with .png")
    args = parser.parse_args(argv)

    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.devices < 2:
        parser.error("--devices: 2 or more (one device is trainer_overhead.py's run)")
    if kind == "cuda" and torch.cuda.device_count() < args.devices:
        parser.error(f"--devices {args.devices}: this machine has {torch.cuda.device_count()} CUDA GPUs")
    if args.batch_size % args.devices:
        parser.error("--batch-size must be a multiple of --devices")
    if args.quick:
        args.passes, args.repeats, args.warmup = 2, 2, 1
        args.steps, args.hidden, args.features, args.batch_size = 4, 64, 32, 8 * args.devices
    models = args.models.split(",")
    if not models or not set(models) <= set(MODELS):
        parser.error(f"--models {args.models!r}: choose from {', '.join(MODELS)}")
    ways = {"glt": fit_glt}
    skipped = {}
    if L is not None:
        ways["lightning"] = fit_lightning
    else:
        skipped["lightning"] = "neither lightning nor pytorch_lightning is importable"

    with tempfile.TemporaryDirectory(prefix="trainer-ddp-") as scratch:
        sections = {name: measure(name, args, kind, ways, scratch) for name in models}
    report = {"what": f"ms per training step of DDP over {args.devices} devices: glt.Trainer against "
                      "Lightning (ddp_spawn), the same models, data and global batch",
              "device": kind, "devices": args.devices, "machine": machine_info(torch.device(kind)),
              "config": {"passes": args.passes, "warmup_epochs": args.warmup, "timed_epochs": args.repeats,
                         "log_every_n_steps": args.log_every, "cpu_threads": torch.get_num_threads(),
                         "data": "a map-style dataset on the host, split by each trainer's DistributedSampler",
                         "order": "one fit per way and pass; passes alternate glt, lightning and the reverse",
                         "spread": "per way: median, quartiles and range over all timed epochs; ratios: median, "
                                   "quartiles and range over rounds (the same epoch index of each way in a pass)"},
              "skipped": skipped, "models": sections}
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                     f"trainer_ddp_{kind}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
    plot(report, args.plot or os.path.splitext(path)[0] + ".png")
    return report


if __name__ == "__main__":
    main()
