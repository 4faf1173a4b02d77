"""Loggers: CSVLogger (metrics.csv and hparams.yaml, as Lightning writes them) and TensorBoardLogger
(where `tensorboard` is installed), in `<save_dir>/<name>/version_<N>/`.

The Trainer hands a logger python floats at its sync points only, so logging adds no device sync.
"""
from __future__ import annotations

import csv
import json
import os
from typing import Any

DEFAULT_NAME = "lightning_logs"


def _next_version(root: str) -> int:
    """One more than the highest `version_<N>` folder under `root` (0 for none)."""
    if not os.path.isdir(root):
        return 0
    found = [int(d[len("version_"):]) for d in os.listdir(root)
             if d.startswith("version_") and d[len("version_"):].isdigit() and os.path.isdir(os.path.join(root, d))]
    return max(found) + 1 if found else 0


def write_hparams(path: str, hparams: dict[str, Any]) -> None:
    """YAML with PyYAML when installed, else JSON (which YAML reads too)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        import yaml
    except ImportError:
        text = json.dumps(hparams, indent=2, default=str) + "\n"
    else:
        text = yaml.safe_dump({k: v if isinstance(v, (int, float, str, bool, list, dict, type(None))) else str(v)
                               for k, v in hparams.items()})
    with open(path, "w") as f:
        f.write(text)


def _ensure_hparams_file(log_dir: str) -> None:
    """Lightning leaves an hparams.yaml in every version folder, `{}` when nothing was saved."""
    path = os.path.join(log_dir, "hparams.yaml")
    if not os.path.exists(path):
        write_hparams(path, {})


class Logger:
    """The interface the Trainer calls. `log_dir` is `<save_dir>/<name>/version_<version>`."""

    def __init__(self, save_dir: str, name: str | None = DEFAULT_NAME, version: int | str | None = None):
        self._save_dir, self._name, self._version = os.fspath(save_dir), name or "", version

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def root_dir(self) -> str:
        return os.path.join(self._save_dir, self._name)

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = _next_version(self.root_dir)
        return self._version

    @property
    def log_dir(self) -> str:
        version = self.version
        return os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")

    def log_hyperparams(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def save(self) -> None: ...

    def finalize(self, status: str) -> None:
        self.save()


class CSVLogger(Logger):
    """`metrics.csv`: one row per log call (its metrics, `epoch` and `step`), columns sorted, the header
    rewritten when new names appear; `hparams.yaml`: the hyperparameters. Rows reach the file every
    `flush_logs_every_n_steps` logged steps and when the run ends."""

    def __init__(self, save_dir: str, name: str | None = DEFAULT_NAME, version: int | str | None = None,
                 prefix: str = "", flush_logs_every_n_steps: int = 100):
        super().__init__(save_dir, name, version)
        self.prefix, self.flush_every = prefix, flush_logs_every_n_steps
        self.hparams: dict[str, Any] = {}
        self._rows: list[dict[str, Any]] = []
        self._keys: list[str] = []
        self._last_flush = 0

    @property
    def metrics_file_path(self) -> str:
        return os.path.join(self.log_dir, "metrics.csv")

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        write_hparams(os.path.join(self.log_dir, "hparams.yaml"), self.hparams)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        prefix = f"{self.prefix}-" if self.prefix else ""
        self._rows.append({**{prefix + k: v for k, v in metrics.items()}, "step": step})
        if step - self._last_flush >= self.flush_every:
            self._last_flush = step
            self.save()

    def save(self) -> None:
        if not self._rows:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        path = self.metrics_file_path
        new = set().union(*self._rows) - set(self._keys)
        exists = os.path.isfile(path)
        self._keys = sorted([*self._keys, *new])
        if new and exists:  # the header changes: rewrite what is there
            with open(path, newline="") as f:
                old = list(csv.DictReader(f))
            self._write(path, "w", old)
            exists = True
        self._write(path, "a" if exists else "w", self._rows, header=not exists)
        self._rows = []

    def _write(self, path: str, mode: str, rows: list[dict], header: bool = True) -> None:
        with open(path, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._keys)
            if mode == "w" and header:
                writer.writeheader()
            writer.writerows(rows)

    def finalize(self, status: str) -> None:
        _ensure_hparams_file(self.log_dir)
        self.save()


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardLogger(Logger):
    """Scalars through `torch.utils.tensorboard.SummaryWriter` (needs the `tensorboard` package), and
    `hparams.yaml` beside the event files."""

    def __init__(self, save_dir: str, name: str | None = DEFAULT_NAME, version: int | str | None = None,
                 prefix: str = ""):
        if not tensorboard_available():
            raise ModuleNotFoundError("TensorBoardLogger needs the tensorboard package (pip install tensorboard); "
                                      "CSVLogger needs nothing")
        super().__init__(save_dir, name, version)
        self.prefix = prefix
        self.hparams: dict[str, Any] = {}
        self._writer = None

    @property
    def experiment(self):
        """The SummaryWriter."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir)
        return self._writer

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        write_hparams(os.path.join(self.log_dir, "hparams.yaml"), self.hparams)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        prefix = f"{self.prefix}-" if self.prefix else ""
        for key, value in metrics.items():
            self.experiment.add_scalar(prefix + key, value, step)

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        _ensure_hparams_file(self.log_dir)
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def resolve(logger: Any, default_root_dir: str) -> list[Logger]:
    """The Trainer's `logger=` argument: True (TensorBoard where installed, else CSV, in
    `default_root_dir/lightning_logs`), False/None (none), a Logger, or a list of Loggers."""
    if logger is True:
        return [TensorBoardLogger(default_root_dir) if tensorboard_available() else CSVLogger(default_root_dir)]
    if logger is False or logger is None:
        return []
    loggers = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    for one in loggers:
        if not isinstance(one, Logger):
            raise TypeError(f"logger={one!r}: pass True, False, a glt logger (CSVLogger, TensorBoardLogger) or a "
                            f"list of them")
    return loggers
