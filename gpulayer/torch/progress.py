"""Progress output: a bar on a terminal, plain log lines otherwise.

It refreshes only at the Trainer's sync points (every `log_every_n_steps` optimizer steps and
at epoch ends), so it never forces a device sync of its own.
"""
from __future__ import annotations

import sys
from typing import TextIO

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional
    tqdm = None


def format_metrics(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


class TrainerProgress:
    """The Trainer's progress output, silent; the base of the visible kinds (LogLines, Bar)."""

    def start_epoch(self, epoch: int, total: int | None) -> None: ...
    def update(self, batches_done: int, step: int, metrics: dict[str, float]) -> None: ...
    def end_epoch(self, batches_done: int, step: int, metrics: dict[str, float]) -> None: ...
    def report(self, stage: str, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class LogLines(TrainerProgress):
    """One line per sync point: `epoch 2 step 40 train_loss=0.1234 val_loss=0.1201`."""

    def __init__(self, stream: TextIO):
        self.stream, self.epoch = stream, 0

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start_epoch(self, epoch, total):
        self.epoch = epoch

    def update(self, batches_done, step, metrics):
        self._line(f"epoch {self.epoch} step {step} {format_metrics(metrics)}".rstrip())

    def end_epoch(self, batches_done, step, metrics):
        self.update(batches_done, step, metrics)

    def report(self, stage, metrics):
        self._line(f"{stage} {format_metrics(metrics)}".rstrip())


class Bar(LogLines):
    """A one-line bar per epoch: tqdm when installed, else a small built-in one."""

    WIDTH = 24

    def __init__(self, stream: TextIO):
        super().__init__(stream)
        self.total: int | None = None
        self.bar = None

    def start_epoch(self, epoch, total):
        self.epoch, self.total = epoch, total
        if tqdm is not None:
            self.bar = tqdm(total=total, desc=f"epoch {epoch}", file=self.stream, leave=True, dynamic_ncols=True)

    def update(self, batches_done, step, metrics):
        if self.bar is not None:
            self.bar.update(batches_done - self.bar.n)
            self.bar.set_postfix_str(format_metrics(metrics))
            return
        if self.total:
            filled = self.WIDTH * batches_done // self.total
            where = f"|{'#' * filled}{'.' * (self.WIDTH - filled)}| {batches_done}/{self.total}"
        else:
            where = f"{batches_done} batches"
        self.stream.write(f"\repoch {self.epoch} {where} step {step} {format_metrics(metrics)}\x1b[K")
        self.stream.flush()

    def end_epoch(self, batches_done, step, metrics):
        self.update(batches_done, step, metrics)
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        else:
            self.stream.write("\n")

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def make_progress(enabled: bool, stream: TextIO | None = None) -> TrainerProgress:
    stream = stream or sys.stderr
    if not enabled:
        return TrainerProgress()
    return Bar(stream) if stream.isatty() else LogLines(stream)
