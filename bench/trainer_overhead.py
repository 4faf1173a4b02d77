"""Per-step overhead of glt.Trainer against a hand-written loop and Lightning's Trainer.

The same MLP (same initial weights), the same optimizer and the same batches, pre-generated on
the device, trained three ways. Each way logs the loss the same way: the step value every
`--log-every` steps and the epoch mean (the raw loop with `.item()` on a running list, the
trainers through `self.log`). One epoch = `--steps` steps; each way trains `--warmup` untimed
then `--repeats` timed epochs (device synchronized before each timer read), in two passes
(raw, glt, lightning, then the reverse order); the median per-step time is reported.

    python bench/trainer_overhead.py --device cuda
    python bench/trainer_overhead.py --device cpu --json /tmp/out.json
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import socket
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

import gpulayer.torch as glt

try:
    import lightning.pytorch as L
except ImportError:
    try:
        import pytorch_lightning as L
    except ImportError:
        L = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def make_mlp(features: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 1))


def make_optimizer(params):
    return torch.optim.Adam(params, lr=1e-4)


class Batches:
    """The pre-generated batches as one iterable with a length (Lightning reads a plain list as many loaders)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


class EpochTimer:
    """The time of each training epoch, the device synchronized at both ends."""

    def __init__(self, device: torch.device, clock=time.perf_counter):
        self.device, self.clock, self.times, self._start = device, clock, [], 0.0

    def start(self) -> None:
        synchronize(self.device)
        self._start = self.clock()

    def stop(self) -> None:
        synchronize(self.device)
        self.times.append(self.clock() - self._start)


def run_raw(net, batches, epochs, log_every, timer) -> None:
    opt = make_optimizer(net.parameters())
    net.train()
    for _ in range(epochs):
        timer.start()
        losses = []
        for step, (x, y) in enumerate(batches, 1):
            loss = F.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if step % log_every == 0:
                losses[-1].item()
        torch.stack(losses).mean().item()
        timer.stop()


class GltMLP(glt.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return make_optimizer(self.parameters())


def run_glt(net, batches, epochs, log_every, timer, device) -> None:
    class Timing(glt.Callback):
        def on_train_epoch_start(self, trainer, module):
            timer.start()

        def on_train_epoch_end(self, trainer, module):
            timer.stop()

    trainer = glt.Trainer(max_epochs=epochs, accelerator=device.type, log_every_n_steps=log_every,
                          enable_progress_bar=False, callbacks=[Timing()])
    trainer.fit(GltMLP(net), batches)


def run_lightning(net, batches, epochs, log_every, timer, device) -> None:
    class LitMLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def configure_optimizers(self):
            return make_optimizer(self.parameters())

    class Timing(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            timer.start()

        def on_train_epoch_end(self, trainer, module):
            timer.stop()

    trainer = L.Trainer(max_epochs=epochs, accelerator="gpu" if device.type == "cuda" else device.type, devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=log_every, num_sanity_val_steps=0,
                        callbacks=[Timing()])
    trainer.fit(LitMLP(), train_dataloaders=batches)


def machine_info(device: torch.device) -> dict:
    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": L.__version__ if L is not None else None,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_1m": os.getloadavg()[0],  # at the end of the run: other work skews CPU timings
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    parser.add_argument("--steps", type=int, default=None, help="steps per epoch (default: 300 on cuda, 40 on cpu)")
    parser.add_argument("--repeats", type=int, default=5, help="timed epochs per way and pass")
    parser.add_argument("--warmup", type=int, default=2, help="untimed epochs per way")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--clock", choices=["wall", "process"], default="wall",
                        help="process: this process's CPU time, for a CPU run on a machine busy with other work")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--json", default=None, help="default: bench/results/trainer_overhead_<device>.json")
    args = parser.parse_args(argv)

    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.clock == "process" and kind != "cpu":
        parser.error("--clock process measures CPU work only: use it with --device cpu")
    device = torch.device(kind)
    steps = args.steps or (300 if kind == "cuda" else 40)
    if args.threads:
        torch.set_num_threads(args.threads)
    epochs = args.warmup + args.repeats

    torch.manual_seed(0)
    net = make_mlp(args.features, args.hidden)
    batches = Batches([(torch.randn(args.batch_size, args.features, device=device),
                        torch.randn(args.batch_size, 1, device=device)) for _ in range(steps)])

    ways = {"raw": lambda n, t: run_raw(n.to(device), batches, epochs, args.log_every, t),
            "glt": lambda n, t: run_glt(n, batches, epochs, args.log_every, t, device)}
    if L is not None:
        ways["lightning"] = lambda n, t: run_lightning(n, batches, epochs, args.log_every, t, device)
    per_step = {name: [] for name in ways}
    for order in (list(ways), list(reversed(ways))):  # two passes, A-B-C then C-B-A, against drift
        for name in order:
            timer = EpochTimer(device, time.perf_counter if args.clock == "wall" else time.process_time)
            ways[name](copy.deepcopy(net), timer)
            per_step[name] += [1e3 * t / steps for t in timer.times[args.warmup:]]
    results = {}
    for name, times in per_step.items():
        results[name] = {"ms_per_step_median": statistics.median(times), "ms_per_step_min": min(times),
                         "ms_per_step_all": times}
        print(f"{name:>9}: {results[name]['ms_per_step_median']:.4f} ms/step (median of {len(times)})", flush=True)
    if L is None:
        results["lightning"] = {"skipped": "neither lightning nor pytorch_lightning is importable"}
        print("lightning: skipped (not installed)")

    median = {k: v["ms_per_step_median"] for k, v in results.items() if "ms_per_step_median" in v}
    ratios = {"glt_over_raw": median["glt"] / median["raw"],
              "glt_minus_raw_us_per_step": 1e3 * (median["glt"] - median["raw"])}
    if "lightning" in median:
        ratios["lightning_over_glt"] = median["lightning"] / median["glt"]
    print("  ".join(f"{k}={v:.3f}" for k, v in ratios.items()))

    report = {"device": kind, "machine": machine_info(device),
              "config": {"model": f"MLP {args.features}-{args.hidden}-{args.hidden}-1 (3 Linear, ReLU)",
                         "optimizer": "Adam(lr=1e-4), foreach default", "batch_size": args.batch_size,
                         "steps_per_epoch": steps, "warmup_epochs": args.warmup, "timed_epochs": 2 * args.repeats,
                         "log_every_n_steps": args.log_every, "precision": "32-true", "clock": args.clock,
                         "cpu_threads": torch.get_num_threads(),
                         "data": "pre-generated batches on the device, the same ones for all three",
                         "order": "two passes: raw, glt, lightning, then the reverse"},
              "results": results, "ratios": ratios}
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                     f"trainer_overhead_{kind}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
