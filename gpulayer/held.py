"""Held results as task arguments: how a future pickles, and how a worker gets the value back.

A future of `gl.submit(..., keep=True)` names a result that stays on the peer that made it, under
an unguessable id (RESULT_ID_HEX random hex digits, chosen by the submitter). Pickled into another
task's arguments while `collecting()`, it becomes `resolve(id)`: the submitter lists the ids it
met, the peer puts each held pickle beside the task's own (from its table, or fetched from the
holder peer), and the worker rebuilds the value when it unpickles the arguments, inside
`provided()`. Nothing here imports the submitter's stack: workers import it (any Python >= 3.8).
"""

from __future__ import annotations

import secrets
import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Tuple

RESULT_ID_HEX = 32  # 16 random bytes in hex

_local = threading.local()


def new_result_id() -> str:
    return secrets.token_hex(RESULT_ID_HEX // 2)


@contextmanager
def collecting() -> Iterator[List[Any]]:
    """While pickling a task's arguments: the list that the futures met (`met`) are added to."""
    previous = getattr(_local, "met", None)
    _local.met = []
    try:
        yield _local.met
    finally:
        _local.met = previous


def met(future: Any) -> bool:
    """Note a future met while `collecting()`; False when nothing collects (plain pickling)."""
    found = getattr(_local, "met", None)
    if found is None:
        return False
    found.append(future)
    return True


def passthrough(value: Any) -> Any:
    """What a future whose value the submitter has pickles as: the value itself."""
    return value


@contextmanager
def provided(values: Dict[str, Tuple[bytes, List[Any]]]) -> Iterator[None]:
    """In a worker, while a task's arguments are unpickled: the held pickles (data, buffers) by id."""
    previous = getattr(_local, "provided", None)
    _local.provided, _local.rebuilt = values, {}
    try:
        yield
    finally:
        _local.provided, _local.rebuilt = previous, {}


def resolve(result_id: str) -> Any:
    """The value of a held result (rebuilt once per task, however often it is passed)."""
    from . import serialization

    rebuilt = getattr(_local, "rebuilt", {})
    if result_id not in rebuilt:
        values = getattr(_local, "provided", None) or {}
        if result_id not in values:
            raise LookupError(f"held result {result_id[:8]}... was not provided with this task: a future of "
                              "keep=True is an argument of gl.submit/run/map, not of other pickles")
        data, buffers = values[result_id]
        rebuilt[result_id] = serialization.loads(data, buffers)
    return rebuilt[result_id]
