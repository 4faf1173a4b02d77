"""The task options: one table that `run`, `submit`, `map`, `@remote` and `.options()` all use.

A new option is one row here (and, when it is a requirement, a field of Requirements).
Every value is checked when it is given, so `@gl.remote(timeout=float("nan"))` fails at
decoration time, not at the first call.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .matching import Requirements
from .wire import check_env, check_timeout

# The requirements a peer must meet (checked together by Requirements.build), with defaults.
REQUIREMENTS: dict[str, Any] = {"accelerator": None, "gpu_memory_gb": None, "frameworks": None,
                                "capabilities": None, "peer": None, "devices": 1, "python": None}
# How the submitter runs the task, with defaults.
EXECUTION: dict[str, Any] = {"timeout": None, "retries": 0, "env": None, "keep": False}
NAMES = frozenset(REQUIREMENTS) | frozenset(EXECUTION)


def check_keep(keep: Any) -> bool:
    """True or False: whether the result stays on its peer (docs/data.md)."""
    if not isinstance(keep, bool):
        raise TypeError(f"keep must be True or False, not {keep!r}")
    return keep


def no_keep(options: TaskOptions, where: str) -> None:
    """Refuse keep=True where the value itself is returned (run, map, calling a remote function)."""
    if options.keep:
        raise ValueError(f"keep=True makes no sense for {where}, which returns the value itself: use "
                         "gl.submit(..., keep=True) (or f.submit) for a future whose result stays on its peer")


def check_retries(retries: Any) -> int:
    """A non-negative integer."""
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be a non-negative integer, not {retries!r}")
    return retries


@dataclass(frozen=True)
class TaskOptions:
    """Validated task options: what a peer must offer, how long and how often to try, and the task's env."""

    requirements: Requirements
    timeout: float | None = None
    retries: int = 0
    env: dict[str, str] = field(default_factory=dict)  # variables the task runs with (wire.check_env)
    keep: bool = False  # the result stays on its peer until asked for (docs/data.md)

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> TaskOptions:
        """Validate a mapping of option names to values; unknown names raise TypeError."""
        unknown = set(options) - NAMES
        if unknown:
            raise TypeError(f"unknown remote option(s): {', '.join(sorted(unknown))}; "
                            f"the options are {', '.join(sorted(NAMES))}")
        req = Requirements.build(**{name: options.get(name, default) for name, default in REQUIREMENTS.items()})
        return cls(req, check_timeout(options.get("timeout")), check_retries(options.get("retries", 0)),
                   check_env(options.get("env")), check_keep(options.get("keep", False)))


def split_call(kwargs: dict[str, Any]) -> tuple[TaskOptions, dict[str, Any]]:
    """Separate the task options of a `run`/`submit` call from the function's own keyword arguments."""
    options = {name: kwargs.pop(name) for name in NAMES & kwargs.keys()}
    return (TaskOptions.parse(options) if options else _defaults()), kwargs


@functools.cache
def _defaults() -> TaskOptions:
    """The options of a call that gives none (made once: a loop of plain calls parses nothing)."""
    return TaskOptions.parse({})
