"""What a task needs beyond its options, read from the function and its pickles.

Two requirements are inferred when a task is submitted (`with_inferred`):

- `code_python`: a pickle that holds a code object (a function shipped by value: defined in the
  submitter's script or its own modules, a lambda, a nested function, the methods of such a
  class) loads only in the Python major.minor that made it. The rule is conservative: any code
  object anywhere in the function's or the arguments' pickle counts. Functions of installed
  modules are pickled by reference (their module and name) and run on any Python.
- `uses`: the GPU frameworks (torch, mlx) the function uses, found the way cloudpickle sees it:
  the modules and objects its code names in its globals, its closures, defaults and local
  imports, followed into the functions and classes shipped by value with it, and the module of
  each object pickled by reference. On a GPU the peer must then offer that framework's backend
  (torch.mps, torch.cuda, mlx.metal). Explicit `frameworks=` wins: when given, nothing is inferred.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from .. import serialization
from ..matching import Requirements
from ..resources.model import PROBED_FRAMEWORKS

PYTHON = "%d.%d" % sys.version_info[:2]


def with_inferred(req: Requirements, fn: Callable[..., Any], *pickles: bytes) -> Requirements:
    """`req` with `code_python` set when one of `pickles` holds code, and `uses` when the function
    uses a GPU framework and no `frameworks=` were given."""
    code_python = PYTHON if any(serialization.CODE_MARKER in p for p in pickles) else req.code_python
    uses = req.uses if req.frameworks else frameworks_used(fn)
    if (code_python, uses) == (req.code_python, req.uses):
        return req
    return _replaced(req, code_python, uses)


@functools.lru_cache(maxsize=256)
def _replaced(req: Requirements, code_python: str | None, uses: tuple[str, ...]) -> Requirements:
    """`req` with these two fields: made once, since a loop of submits infers the same every time."""
    return dataclasses.replace(req, code_python=code_python, uses=uses)


def frameworks_used(fn: object) -> tuple[str, ...]:
    """The GPU frameworks `fn` uses, sorted; computed once per function object."""
    try:
        return _cached_frameworks(fn)
    except TypeError:  # an unhashable callable
        return _frameworks(fn)


@functools.lru_cache(maxsize=1024)
def _cached_frameworks(fn: object) -> tuple[str, ...]:
    return _frameworks(fn)


def _frameworks(fn: object) -> tuple[str, ...]:
    found: set[str] = set()
    seen: dict[int, object] = {}  # holding each object keeps its id unique during the walk
    todo = [fn]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen[id(obj)] = obj
        if isinstance(obj, types.ModuleType):
            found.add(_root(obj.__name__))
        elif isinstance(obj, (types.FunctionType, type)) and serialization.ships_by_value(obj):
            todo += _referenced(obj)
        elif isinstance(obj, types.MethodType):
            todo += [obj.__func__, obj.__self__]
        elif isinstance(obj, functools.partial):
            todo += [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, (staticmethod, classmethod)):
            todo.append(obj.__func__)
        elif isinstance(obj, property):
            todo += [obj.fget, obj.fset, obj.fdel]
        else:  # pickled by reference, or an instance: where it and its class come from
            found.add(_root(serialization.module_of(obj)))
            todo.append(type(obj))
    return tuple(sorted(found & PROBED_FRAMEWORKS))


def _root(module: str) -> str:
    return module.partition(".")[0]


def _referenced(obj: types.FunctionType | type) -> Iterator[object]:
    """What a function or class shipped by value takes along: globals named by its code, closure
    cells, defaults and locally imported modules; for a class, its bases and attributes."""
    if isinstance(obj, type):
        yield from obj.__bases__
        yield from vars(obj).values()
        return
    namespace = obj.__globals__
    for code in _codes(obj.__code__):
        for name in code.co_names:
            if name in namespace:
                yield namespace[name]
        for instruction in dis.get_instructions(code):
            if instruction.opname == "IMPORT_NAME":  # a module not imported here counts by its name
                name = str(instruction.argval)
                yield sys.modules.get(name) or types.ModuleType(name)
    for cell in obj.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            pass
    yield from obj.__defaults__ or ()
    yield from (obj.__kwdefaults__ or {}).values()


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """A code object and those nested in it (inner functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)
