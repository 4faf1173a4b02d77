"""The resume checkpoint: a fit that is stopped at a step boundary resumes there, to the batch.

A single-process fit keeps one (docs/trainer.md, "Preemption and resuming"): written every
`resume_every_n_steps` optimizer steps, and, when the Trainer runs as a GPUlayer job
(GPULAYER_JOB_ID set), at the first step boundary after a SIGTERM, after which fit() raises
SIGTERMException so that the job ends within its grace. A fit run as a job resumes from it by itself;
elsewhere `fit(ckpt_path="last")` does. It holds, besides a full checkpoint, the loop's position:
the batches done in the epoch and the RNG states at the two points where that epoch's loader drew
its seeds (making its iterator, then its first batch), so the resumed epoch replays the same batches.
"""
from __future__ import annotations

import itertools
import os
import signal
import threading
from typing import Any

ENV_JOB, ENV_RESTARTS = "GPULAYER_JOB_ID", "GPULAYER_RESTARTS"
EXIT_CODE = 128 + signal.SIGTERM  # a process ended by SIGTERM exits with this, as the shell reports it

_numbers = itertools.count(1)  # the fits of this process that keep a resume checkpoint


class SIGTERMException(SystemExit):
    """Raised out of `fit` once the resume checkpoint is written after a SIGTERM (Lightning's name):
    the script ends there, with exit code 143, unless it catches it."""


def in_job() -> bool:
    return bool(os.environ.get(ENV_JOB))


def restarts() -> int:
    """How often the job was preempted and started again (GPULAYER_RESTARTS; 0 outside a job)."""
    try:
        return int(os.environ.get(ENV_RESTARTS, "0"))
    except ValueError:
        return 0


def checkpoint_path(root: str, number: int) -> str:
    """The resume checkpoint of the `number`-th such fit of a process (each fit of a script keeps its own)."""
    name = "resume.ckpt" if number == 1 else f"resume-{number}.ckpt"
    return os.path.join(root, "checkpoints", name)


def check_interval(value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"resume_every_n_steps must be a positive int (optimizer steps) or None, got {value!r}")


class Resume:
    """One fit's resume checkpoint: where it is, when it is due, and the RNG states of the epoch's start."""

    def __init__(self, path: str, every_n_steps: int | None, on_sigterm: bool):
        self.path, self.every_n_steps, self.on_sigterm = path, every_n_steps, on_sigterm
        self.requested = False  # a SIGTERM came: save at the next step boundary and stop
        self.rng_iter: dict | None = None  # the RNG states before this epoch's iterator was made
        self.rng_first: dict | None = None  # and before its first batch
        self._previous: Any = None

    @classmethod
    def for_fit(cls, root: str, every_n_steps: int | None) -> Resume | None:
        """The resume checkpoint of a fit starting now, or None when it keeps none (not a job, no interval)."""
        job = in_job()
        if not job and every_n_steps is None:
            return None
        return cls(checkpoint_path(root, next(_numbers)), every_n_steps, job)

    def found(self) -> str | None:
        return self.path if os.path.isfile(self.path) else None

    def due(self, global_step: int) -> bool:
        """At a step boundary: whether to write the checkpoint now."""
        return self.requested or bool(self.every_n_steps and global_step % self.every_n_steps == 0)

    def install(self) -> None:
        """As a job, a SIGTERM asks for a save and a stop (a handler can be set in the main thread only)."""
        if self.on_sigterm and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._sigterm)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _sigterm(self, signum: int, frame: Any) -> None:
        self.requested = True

    def discard(self) -> None:
        """The fit ended: its resume checkpoint goes (a later run of the script trains it again)."""
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass


class _IgnoreSigterm:
    """A DataLoader worker's init: SIGTERM is ignored there (the job's whole tree gets one; the worker
    ends with its loader, or with the main process), then the loader's own worker_init_fn."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)


def shield_workers(loader: Any) -> None:
    """In a job, a DataLoader's workers outlive a SIGTERM, so that the fit reaches its step boundary."""
    from torch.utils.data import DataLoader

    if in_job() and isinstance(loader, DataLoader) and loader.num_workers > 0 \
            and not isinstance(loader.worker_init_fn, _IgnoreSigterm):
        loader.worker_init_fn = _IgnoreSigterm(loader.worker_init_fn)
