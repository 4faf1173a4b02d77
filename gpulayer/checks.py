"""Checks of values that a user gives as options and that travel in messages: a timeout, an actor's
max_concurrency. A leaf module: the option table (task_options, actor_class), the wire and the
peer check with the same function, and the option table needs no transport for it.
"""

from __future__ import annotations

import functools
import getpass
import math
import os
from typing import Any

from .errors import ConfigError

MAX_CONCURRENCY = 64  # the most calls one actor may run at once (threads in its worker)
MAX_PRIORITY = 1_000_000  # a task's or a job's priority is a whole number from -MAX_PRIORITY to MAX_PRIORITY


def check_timeout(timeout: Any) -> float | None:
    """None, or a finite positive number of seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive, finite number of seconds, not {timeout!r}")
    return float(timeout)


def seconds_from_env(name: str, default: float) -> float:
    """The positive, finite number of seconds in the environment variable `name` (`default` when unset);
    ConfigError for any other value."""
    value = os.environ.get(name, str(default))
    try:
        seconds = check_timeout(float(value))
    except ValueError:
        seconds = None
    if seconds is None:
        raise ConfigError(f"{name} must be a positive number of seconds, not {value!r}")
    return seconds


def check_priority(value: Any) -> int:
    """A priority (docs/jobs.md, "The queue"): a whole number from -MAX_PRIORITY to MAX_PRIORITY; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_PRIORITY:
        raise ValueError(f"priority must be a whole number from -{MAX_PRIORITY} to {MAX_PRIORITY}, not {value!r}")
    return value


def check_user(value: Any) -> str:
    """The user a submitter names (its tasks' and jobs' user@host: their turn and their quota of a peer's
    slots): printable text of at most 64 characters, without @; ValueError otherwise."""
    if not isinstance(value, str) or len(value) > 64 or not value.isprintable() or "@" in value:
        raise ValueError("a user is printable text of at most 64 characters, without @")
    return value


@functools.cache
def login_user() -> str:
    """This process's login name, as the user of its tasks and jobs ("" when it has none); read once
    (getpass reads four environment variables: 10 us, which every task and actor call paid)."""
    try:
        name = getpass.getuser().replace("@", "_")[:64]
    except (KeyError, OSError):
        return ""
    return name if name.isprintable() else ""


def check_concurrency(value: Any) -> int:
    """max_concurrency: an integer from 1 to MAX_CONCURRENCY; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY:
        raise ValueError(f"max_concurrency must be an integer from 1 to {MAX_CONCURRENCY}, not {value!r}")
    return value
