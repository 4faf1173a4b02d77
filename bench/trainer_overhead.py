"""Per-step time of glt.Trainer against a hand-written loop and Lightning's Trainer, on two models.

- mlp: a tiny MLP (256-1024-1024-1, Adam, 32-true, batch 256): launch-bound, where a trainer's
  own per-step work shows.
- resnet18: a CIFAR-style ResNet-18 (3x3 stem, no max-pool) on synthetic 32x32 images,
  bf16-mixed, SGD with momentum (batch 256): compute-bound, the realistic case.

Ways: `raw` (a hand-written loop), `glt` (the default path), `glt_compile` (`compile=`,
"cudagraphs" unless --compile says otherwise; CUDA only) and `lightning` when it is installed.
Each way starts from the same initial weights, trains on the same batches pre-generated on the
device and logs the loss the same way: the step value every `--log-every` steps and the epoch
mean (the raw loop with `.item()` on a running list, the trainers through `self.log`).

One epoch = `--steps` steps. A pass trains every way, each in a thread, `--warmup` untimed then
`--repeats` timed epochs (device synchronized at each timer read), the ways taking turns epoch
by epoch (see `Turns`): host noise and drift fall on neighbouring epochs of all ways alike.
`glt_compile` trains alone in the main thread (its CUDA graphs are captured there), before the
eager ways in even passes and after them in odd ones; the eager ways' order alternates too. Per way: the
median ms/step over all timed epochs with its quartiles and range. A ratio is taken per round
(one timed epoch of each way, side by side) and reported as the median over the rounds with
their quartiles and range.

    python bench/trainer_overhead.py --device cuda --json bench/results/trainer_overhead.json
    python bench/trainer_overhead.py --device cpu --quick --json /tmp/out.json
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import inspect
import json
import logging
import os
import platform
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

import gpulayer.torch as glt

for _name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):  # its per-fit banners
    logging.getLogger(_name).setLevel(logging.WARNING)

try:
    import lightning.pytorch as L
except ImportError:
    try:
        import pytorch_lightning as L
    except ImportError:
        L = None

# the epoch mean as well as the step value (the default of the trainers that take these keywords)
LOG_KW = {"on_step": True, "on_epoch": True} if "on_epoch" in inspect.signature(glt.Module.log).parameters else {}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# ---------------------------------------------------------------- the models


def make_mlp(features: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 1))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def make_resnet18(classes: int = 10, width: int = 64) -> nn.Module:
    """ResNet-18 for 32x32 inputs: 3x3 stem, four stages of two basic blocks, global pooling."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for stage, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        layers += [BasicBlock(cin, cout, 1 if stage == 0 else 2), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


@dataclass
class Workload:
    name: str
    description: str
    net: nn.Module
    make_optimizer: Callable
    loss: Callable  # (net, batch) -> loss
    precision: str
    batches: "Batches"
    batch_size: int


def mse(net, batch):
    x, y = batch
    return F.mse_loss(net(x), y)


def cross_entropy(net, batch):
    x, y = batch
    return F.cross_entropy(net(x), y)


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=5e-4)


class Batches:
    """The pre-generated batches as one iterable with a length (Lightning reads a plain list as many loaders)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


# ---------------------------------------------------------------- the ways


class Turns:
    """The ways of a pass, each in a thread, take turns epoch by epoch, in a fixed order.

    A way holds the turn from the start of one epoch to the start of its next (its own work
    between epochs included), so no two ways run at once, and the host's bursts of noise fall on
    neighbouring epochs of all ways alike. The first turn waits until every way has set up.
    """

    def __init__(self, names: list[str]):
        self.cond = threading.Condition()
        self.active, self.ready, self.turn, self.holder = list(names), set(), 0, None

    def begin_epoch(self, name: str) -> None:
        with self.cond:
            if self.holder == name:
                self.turn, self.holder = (self.turn + 1) % len(self.active), None
            self.ready.add(name)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.ready >= set(self.active) and self.active[self.turn] == name)
            self.holder = name

    def finish(self, name: str) -> None:
        """`name` has trained (or failed): the others go on without it."""
        with self.cond:
            i = self.active.index(name)
            del self.active[i]
            if i < self.turn:
                self.turn -= 1
            if self.holder == name:
                self.holder = None
            if self.active:
                self.turn %= len(self.active)
            self.cond.notify_all()


class EpochTimer:
    """The time of each training epoch, the device synchronized at both ends; an epoch starts on its turn."""

    def __init__(self, device: torch.device, turns: Turns, name: str, clock=time.perf_counter):
        self.device, self.turns, self.name, self.clock, self.times, self._start = device, turns, name, clock, [], 0.0

    def start(self) -> None:
        self.turns.begin_epoch(self.name)
        synchronize(self.device)
        self._start = self.clock()

    def stop(self) -> None:
        synchronize(self.device)
        self.times.append(self.clock() - self._start)


def run_raw(w: Workload, net, epochs, log_every, timer, device, compile=False) -> None:
    opt = w.make_optimizer(net.parameters())
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if w.precision == "bf16-mixed"
                else contextlib.nullcontext())
    net.to(device).train()
    for _ in range(epochs):
        timer.start()
        losses = []
        for step, batch in enumerate(w.batches, 1):
            with autocast:
                loss = w.loss(net, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if step % log_every == 0:
                losses[-1].item()
        torch.stack(losses).mean().item()
        timer.stop()


class GltModel(glt.Module):
    def __init__(self, w: Workload, net):
        super().__init__()
        self.net, self.loss_fn, self.make_optimizer = net, w.loss, w.make_optimizer

    def training_step(self, batch, batch_idx):
        loss = self.loss_fn(self.net, batch)
        self.log("train_loss", loss, **LOG_KW)
        return loss

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def run_glt(w: Workload, net, epochs, log_every, timer, device, compile) -> None:
    class Timing(glt.Callback):
        def on_train_epoch_start(self, trainer, module):
            timer.start()

        def on_train_epoch_end(self, trainer, module):
            timer.stop()

    # as Lightning's below: no logger, checkpoint or summary (their file writes are not the loop's cost)
    trainer = glt.Trainer(max_epochs=epochs, accelerator=device.type, precision=w.precision,
                          log_every_n_steps=log_every, enable_progress_bar=False, callbacks=[Timing()],
                          compile=compile, logger=False, enable_checkpointing=False, enable_model_summary=False,
                          num_sanity_val_steps=0)
    trainer.fit(GltModel(w, net), w.batches)


def run_lightning(w: Workload, net, epochs, log_every, timer, device, compile=False) -> None:
    class LitModel(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            loss = w.loss(self.net, batch)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def configure_optimizers(self):
            return w.make_optimizer(self.parameters())

    class Timing(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            timer.start()

        def on_train_epoch_end(self, trainer, module):
            timer.stop()

    trainer = L.Trainer(max_epochs=epochs, accelerator="gpu" if device.type == "cuda" else device.type, devices=1,
                        precision=w.precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=log_every, num_sanity_val_steps=0,
                        callbacks=[Timing()])
    trainer.fit(LitModel(), train_dataloaders=w.batches)


# ---------------------------------------------------------------- measuring


def spread(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2], "min": min(values), "max": max(values)}


def measure(w: Workload, ways: dict, args, device: torch.device) -> dict:
    epochs = args.warmup + args.repeats
    names = list(ways)
    per_pass: list[dict[str, float]] = []
    per_step: dict[str, list[float]] = {name: [] for name in names}
    rounds: list[dict[str, float]] = []  # one timed epoch of each way, side by side
    for p in range(args.passes):
        order = names if p % 2 == 0 else names[::-1]
        # CUDA graphs are captured in the main thread, before or after the eager ways take turns
        eager = [name for name in order if ways[name][1] is False]
        alone = [name for name in order if name not in eager]
        turns = Turns(eager)
        clock = time.perf_counter if args.clock == "wall" else time.process_time
        timers = {name: EpochTimer(device, turns if name in eager else Turns([name]), name, clock) for name in order}
        errors = {}

        def train(name):
            run, compile = ways[name]
            try:
                run(w, copy.deepcopy(w.net), epochs, args.log_every, timers[name], device, compile)
            except BaseException as exc:  # the other ways go on; raised below
                errors[name] = exc
            finally:
                timers[name].turns.finish(name)

        for name in alone if p % 2 == 0 else []:
            train(name)
        threads = [threading.Thread(target=train, args=(name,), name=name) for name in eager]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for name in alone if p % 2 == 1 else []:
            train(name)
        if errors:
            raise next(iter(errors.values()))
        medians = {}
        for name in names:
            times = [1e3 * t / len(w.batches) for t in timers[name].times[args.warmup:]]
            per_step[name] += times
            medians[name] = statistics.median(times)
        rounds += [{name: per_step[name][-args.repeats + r] for name in names} for r in range(args.repeats)]
        per_pass.append(medians)
        print(f"  {w.name} pass {p + 1}/{args.passes}: " +
              "  ".join(f"{n} {medians[n]:.4f}" for n in names) + " ms/step", flush=True)
    results = {}
    for name, times in per_step.items():
        s = spread(times)
        results[name] = {"ms_per_step_median": s["median"], "ms_per_step_p25": s["p25"], "ms_per_step_p75": s["p75"],
                         "ms_per_step_min": s["min"], "ms_per_step_max": s["max"], "ms_per_step_all": times,
                         "ms_per_step_per_pass": [m[name] for m in per_pass]}
    ratios = {}
    for a, b in (("glt", "raw"), ("glt_compile", "raw"), ("lightning", "glt"), ("lightning", "glt_compile")):
        if a in names and b in names:
            s = spread([r[a] / r[b] for r in rounds])
            ratios[f"{a}_over_{b}"] = s["median"]
            ratios[f"{a}_over_{b}_quartiles"] = [s["p25"], s["p75"]]
            ratios[f"{a}_over_{b}_range"] = [s["min"], s["max"]]
    if "glt" in names:
        ratios["glt_minus_raw_us_per_step"] = 1e3 * (results["glt"]["ms_per_step_median"] -
                                                     results["raw"]["ms_per_step_median"])
    for name in names:
        r = results[name]
        print(f"{w.name:>9} {name:>12}: {r['ms_per_step_median']:.4f} ms/step "
              f"(quartiles {r['ms_per_step_p25']:.4f}-{r['ms_per_step_p75']:.4f}, {len(per_step[name])} epochs)")
    print("  ".join(f"{k}={v:.3f}" for k, v in ratios.items() if isinstance(v, float)), flush=True)
    return {"config": {"model": w.description, "optimizer": w.make_optimizer.__name__, "batch_size": w.batch_size,
                       "steps_per_epoch": len(w.batches), "precision": w.precision},
            "results": results, "ratios": ratios}


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
        "load_average_1m": os.getloadavg()[0],  # at the end of the run: other work skews timings
    }


def plot_steps(panels: list[tuple[dict, str]], machine: dict, device: str, what: str, path: str) -> None:
    """Box plots of the ms per step of each way, a panel per (results, title), the medians written beside."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (res, title) in zip(axes[0], panels):
        names = list(res)
        ax.boxplot([res[n]["ms_per_step_all"] for n in names], tick_labels=names, showfliers=True)
        for i, n in enumerate(names, 1):
            ax.annotate(f"{res[n]['ms_per_step_median']:.3f}", (i, res[n]["ms_per_step_median"]),
                        textcoords="offset points", xytext=(18, 0), fontsize=8, va="center")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("ms per training step (per timed epoch)")
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{what} on {machine['gpu'] or device} (torch {machine['torch']}, "
                 f"lightning {machine['lightning']}), {machine['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def plot(report: dict, path: str) -> None:
    sections = [("mlp", report)] + ([("resnet18", report["resnet18"])] if "resnet18" in report else [])
    plot_steps([(section["results"], f"{name}: {section['config']['model']}\n{section['config']['precision']}, "
                                     f"batch {section['config']['batch_size']}") for name, section in sections],
               report["machine"], report["device"], "trainer overhead", path)


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options this script and trainer_ddp.py share: the device and the models' sizes."""
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    parser.add_argument("--quick", action="store_true", help="a few small steps: checks that the script runs")
    parser.add_argument("--models", default="mlp,resnet18", help="comma-separated: mlp, resnet18")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--log-every", type=int, default=50)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--steps", type=int, default=60, help="MLP steps per epoch")
    parser.add_argument("--resnet-steps", type=int, default=30, help="ResNet-18 steps per epoch")
    parser.add_argument("--passes", type=int, default=4, help="passes over all ways, in alternating order")
    parser.add_argument("--repeats", type=int, default=10, help="timed epochs per way and pass")
    parser.add_argument("--warmup", type=int, default=1, help="untimed epochs per way and pass")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--compile", default="cudagraphs",
                        help="the compile= of the glt_compile way: a string, or JSON (true, {\"backend\": ...})")
    parser.add_argument("--clock", choices=["wall", "process"], default="wall",
                        help="process: this process's CPU time (all threads), for a CPU run on a machine busy "
                             "with other work")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--ways", default="raw,glt,glt_compile,lightning",
                        help="comma-separated, of raw, glt, glt_compile, lightning (e.g. raw,glt to profile)")
    parser.add_argument("--json", default=None, help="default: bench/results/trainer_overhead_<device>.json")
    parser.add_argument("--plot", default=None, help="default: the --json path with .png")
    args = parser.parse_args(argv)

    kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.clock == "process" and kind != "cpu":
        parser.error("--clock process measures CPU work only: use it with --device cpu")
    if args.compile in ("true", "false") or args.compile.startswith("{"):
        args.compile = json.loads(args.compile)
    device = torch.device(kind)
    if args.quick:
        args.passes, args.repeats, args.warmup = 2, 1, 1
        args.steps, args.resnet_steps, args.hidden, args.features, args.batch_size = 6, 3, 64, 32, 16
    steps = args.steps
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cudnn.benchmark = True

    ways = {"raw": (run_raw, False), "glt": (run_glt, False)}  # name: (run, compile=)
    skipped = {}
    if kind == "cuda" or args.compile != "cudagraphs":
        ways["glt_compile"] = (run_glt, args.compile)
    else:
        skipped["glt_compile"] = "compile='cudagraphs' needs CUDA"
    if L is not None:
        ways["lightning"] = (run_lightning, False)
    else:
        skipped["lightning"] = "neither lightning nor pytorch_lightning is importable"

    torch.manual_seed(0)
    workloads = []
    models = args.models.split(",")
    if "mlp" in models:
        batches = Batches([(torch.randn(args.batch_size, args.features, device=device),
                            torch.randn(args.batch_size, 1, device=device)) for _ in range(steps)])
        workloads.append(Workload("mlp", f"MLP {args.features}-{args.hidden}-{args.hidden}-1 (3 Linear, ReLU)",
                                  make_mlp(args.features, args.hidden), adam, mse, "32-true", batches,
                                  args.batch_size))
    if "resnet18" in models:
        n = args.resnet_steps
        bs = args.batch_size
        batches = Batches([(torch.randn(bs, 3, 32, 32, device=device), torch.randint(0, 10, (bs,), device=device))
                           for _ in range(n)])
        workloads.append(Workload("resnet18", "ResNet-18 (CIFAR-style), 32x32 synthetic images, 10 classes",
                                  make_resnet18(width=16 if args.quick else 64), sgd, cross_entropy,
                                  "bf16-mixed", batches, bs))
    if not workloads:
        parser.error(f"--models {args.models!r}: choose from mlp, resnet18")
    chosen = args.ways.split(",")
    if not {"raw"} <= set(chosen) <= {"raw", "glt", "glt_compile", "lightning"}:
        parser.error(f"--ways {args.ways!r}: raw and any of glt, glt_compile, lightning")
    ways = {name: way for name, way in ways.items() if name in chosen}

    sections = {w.name: measure(w, ways, args, device) for w in workloads}
    first = sections[workloads[0].name]
    report = {"what": "ms per training step: hand-written loop, glt.Trainer (default and compile=), Lightning",
              "device": kind, "machine": machine_info(device),
              "config": {**first["config"], "optimizer": f"{first['config']['optimizer']}, foreach default",
                         "passes": args.passes, "warmup_epochs": args.warmup, "timed_epochs": args.repeats,
                         "log_every_n_steps": args.log_every, "compile": args.compile, "clock": args.clock,
                         "cpu_threads": torch.get_num_threads(),
                         "data": "pre-generated batches on the device, the same ones for all ways",
                         "order": "ways take turns epoch by epoch; passes alternate raw, glt, glt_compile, lightning "
                                  "and the reverse",
                         "spread": "per way: median, quartiles and range over all timed epochs; ratios: median, "
                                   "quartiles and range over rounds (one timed epoch of each way, side by side)"},
              "results": {**first["results"], **{k: {"skipped": v} for k, v in skipped.items()}},
              "ratios": first["ratios"]}
    for name, section in sections.items():
        if section is not first:
            report[name] = section
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                     f"trainer_overhead_{kind}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
    plot({**report, "results": first["results"]}, args.plot or os.path.splitext(path)[0] + ".png")
    return report


if __name__ == "__main__":
    main()
