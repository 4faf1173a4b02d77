"""A task's environment: what its `env` may change in a warm worker and what needs a fresh one, and
the task's own folder (`gl.task_folder()`).

A leaf module: the submitter, the peer and every worker (in a job interpreter that has only
msgpack, cloudpickle and cryptography) import it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TASK_FOLDER_ENV = "GPULAYER_TASK_FOLDER"  # set by the worker while a task runs: the folder it started in
kept_folders: set[str] = set()  # task folders that asked to be kept; the worker leaves them in place

# What the peer sets for a task's slot, so that tasks on different devices stay apart: a task's env may
# not change these. CUDA_DEVICE_ORDER renumbers the GPUs that CUDA_VISIBLE_DEVICES names.
SLOT_ENV_PREFIX = "GPULAYER_"
SLOT_ENV_NAMES = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"})


def check_env(env: Any) -> dict[str, str]:
    """A task's environment variables (the `env` option and the SUBMIT field), checked; None is {}.

    Names are non-empty str without "=" or NUL, values str without NUL. The names the peer sets for
    the slot (GPULAYER_*, CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER) are refused, except
    CUDA_VISIBLE_DEVICES="" (hide every GPU), which cannot reach another slot's device.
    Raises ValueError (TypeError for a value that is not a dict) naming the variable.
    """
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise TypeError(f"env must be a dict of variable names to str values, not {type(env).__name__}")
    for name, value in env.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ValueError(f"env: {name!r} is not a variable name (a non-empty str without '=' or NUL)")
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"env[{name!r}] must be a str without NUL, not {value!r}")
        if (name.startswith(SLOT_ENV_PREFIX) or name in SLOT_ENV_NAMES) and \
                not (name == "CUDA_VISIBLE_DEVICES" and value == ""):
            raise ValueError(f"env[{name!r}]: the peer sets {name} for the task's slot (device isolation); "
                             "a task may not change it (CUDA_VISIBLE_DEVICES='' to hide every GPU is allowed)")
    return dict(env)


# Variables that the interpreter reads when it starts, or a library (torch, mlx, Metal, CUDA, the
# math and thread libraries) when it loads or initialises: setting one in a warm worker, where torch
# may already be loaded, would come too late. A task whose env sets one runs in a fresh worker.
READ_AT_LOAD_PREFIXES = ("PYTORCH_", "TORCH_", "CUDA_", "MLX_", "METAL_", "MTL_", "OMP_", "MKL_", "OPENBLAS_",
                         "KMP_", "VECLIB_", "XLA_", "JAX_", "TF_", "HF_", "PYTHON", "LD_", "DYLD_", "MALLOC_")


def read_at_load(name: str) -> bool:
    """Whether variable `name` takes effect only in a process started with it (READ_AT_LOAD_PREFIXES)."""
    return name.startswith(READ_AT_LOAD_PREFIXES)


def task_folder(keep: bool = False) -> Path:
    """Inside a task, the folder of its own that it started in (its working folder, empty at its start).

    The folder is removed when the task ends, with what the task wrote there, unless `keep=True`:
    then it stays, under the peer's `--workdir`, and a later task gets another one.
    """
    folder = os.environ.get(TASK_FOLDER_ENV)
    if not folder:
        raise RuntimeError("gl.task_folder() is for code that runs as a task on a peer")
    if keep:
        kept_folders.add(folder)
    return Path(folder)


class CleanRoom:
    """What every task in a warm worker starts from: a folder of its own, empty, as its working folder,
    and the `sys.argv`, `sys.path` and `os.environ` that the worker had when it became ready.

    `restore()`, after each task, puts back what the task changed. On the path of every task it costs
    a few comparisons and one stat: a task folder is made with an mtime of 0, so any entry made in it
    shows, and only a folder that was used is replaced, and removed unless it is kept (`keep`: the
    peer's own --workdir keeps them all; `gl.task_folder(keep=True)` one). What stays warm on
    purpose: imported modules (the frameworks, CUDA's context, caches).
    """

    def __init__(self, root: str, keep: bool = False):
        self.root = os.path.join(root, "tasks")
        self.keep = keep
        self._made = 0
        self.folder = self._new_folder()
        self.argv = list(sys.argv)
        self.path = list(sys.path)
        self.environ = dict(os.environ)
        self._environ_bytes = dict(os.environ._data)  # type: ignore[attr-defined]  # compared at C speed

    def _new_folder(self) -> str:
        self._made += 1
        folder = os.path.join(self.root, f"{os.getpid()}-{self._made}")
        os.makedirs(folder)
        os.utime(folder, ns=(0, 0))
        os.chdir(folder)
        os.environ[TASK_FOLDER_ENV] = folder
        return folder

    def restore(self) -> None:
        """Undo what the last task changed: its folder, working folder, arguments, path and variables."""
        try:
            used = os.stat(self.folder).st_mtime_ns != 0 or self.folder in kept_folders
        except FileNotFoundError:
            used = True
        if used:
            if not self.keep and self.folder not in kept_folders:
                shutil.rmtree(self.folder, ignore_errors=True)
            kept_folders.discard(self.folder)
            self.folder = self._new_folder()
            self.environ[TASK_FOLDER_ENV] = self.folder
        elif working_folder() != self.folder:
            os.chdir(self.folder)
        if sys.argv != self.argv:
            sys.argv[:] = self.argv
        if sys.path != self.path:
            sys.path[:] = self.path
        if os.environ._data != self._environ_bytes:  # type: ignore[attr-defined]
            for name in set(os.environ) - set(self.environ):
                del os.environ[name]
            os.environ.update(self.environ)
            self._environ_bytes = dict(os.environ._data)  # type: ignore[attr-defined]


def working_folder() -> str | None:
    """The working folder, or None where the task removed it."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        return None


_room: CleanRoom | None = None  # the worker's, once it is ready


def open_clean_room(root: str, keep: bool = False) -> None:
    """In a worker that is ready: what each task starts from, from now on (CleanRoom)."""
    global _room
    _room = CleanRoom(root, keep)


def restore_clean_room() -> None:
    """After a task: put back what it changed (nothing outside a worker)."""
    if _room is not None:
        _room.restore()


@contextlib.contextmanager
def task_environment(env: dict[str, str] | None) -> Iterator[None]:
    """A task's environment variables (the SUBMIT's "env") set while it runs; after it, everything the
    task changed of the worker's state is put back (CleanRoom)."""
    os.environ.update(env or {})
    try:
        yield
    finally:
        restore_clean_room()
