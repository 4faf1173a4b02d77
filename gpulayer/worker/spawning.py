"""Lets the children that a task starts with multiprocessing (spawn, forkserver) unpickle its code.

A task's own classes and functions arrive by value: they live in no module that a fresh
interpreter could import (the submitter's `__main__`, or a module of the submitter's that the
peer lacks). multiprocessing pickles a child's target and arguments (a DataLoader's Dataset) and
whatever crosses its queues with its ForkingPickler, which pickles classes and functions by
reference, so a spawned child could not find them. `install()` makes ForkingPickler pickle those,
and only those, by value; the child rebuilds them with `load_by_value`, which installs the same
rule there, for the objects it sends back and for its own children.
"""

from __future__ import annotations

import pickle
import sys
import types
from typing import Any

from .. import serialization


def install() -> None:
    """From now on, multiprocessing pickles the classes and functions that are not importable by value."""
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.reducer_override = _reducer_override  # type: ignore[method-assign]


def load_by_value(data: bytes, buffers: list[bytearray]) -> Any:
    """Rebuild a class or function pickled by `install`'s rule, in a child process."""
    install()
    return serialization.loads(data, buffers)


def _reducer_override(pickler: pickle.Pickler, obj: object) -> Any:
    """ForkingPickler's hook: a class or function that is not importable goes as a gpulayer pickle."""
    if isinstance(obj, (type, types.FunctionType)) and not _importable(obj):
        data, buffers = serialization.dumps(obj)
        return load_by_value, (data, [bytearray(b) for b in buffers])
    return NotImplemented


def _importable(obj: type | types.FunctionType) -> bool:
    """Whether pickle's by-reference lookup (the module, then the qualified name) finds this very object."""
    found: object = sys.modules.get(obj.__module__)
    for name in obj.__qualname__.split("."):
        found = getattr(found, name, None)
    return found is obj
