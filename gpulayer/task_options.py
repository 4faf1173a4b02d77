"""The task options: one table that `run`, `submit`, `map`, `@remote` and `.options()` all use.

A new option is one row here (and, when it is a requirement, a field of Requirements).
Every value is checked when it is given, so `@gl.remote(timeout=float("nan"))` fails at
decoration time, not at the first call.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .checks import check_priority, check_timeout
from .matching import Requirements
from .taskenv import check_env

# The requirements a peer must meet (checked together by Requirements.build), with defaults.
REQUIREMENTS: dict[str, Any] = {"accelerator": None, "gpu_memory_gb": None, "frameworks": None,
                                "capabilities": None, "peer": None, "devices": 1, "python": None}
# How the submitter runs the task, with defaults.
EXECUTION: dict[str, Any] = {"timeout": None, "retries": 0, "env": None, "keep": False, "nodes": None,
                             "priority": 0}
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


def check_nodes(nodes: Any) -> int | None:
    """None (one task), or a positive integer: a gang of that many ranks on distinct peers (docs/gangs.md)."""
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
        raise ValueError(f"nodes must be a positive integer (the ranks of a gang), not {nodes!r}")
    return nodes


@dataclass(frozen=True)
class TaskOptions:
    """Validated task options: what a peer must offer, how long and how often to try, and the task's env."""

    requirements: Requirements
    timeout: float | None = None
    retries: int = 0
    env: dict[str, str] = field(default_factory=dict)  # variables the task runs with (taskenv.check_env)
    keep: bool = False  # the result stays on its peer until asked for (docs/data.md)
    nodes: int | None = None  # a gang of this many ranks on distinct peers (docs/gangs.md)
    priority: int = 0  # its place in its peer's queue, higher first (docs/jobs.md, "The queue")

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> TaskOptions:
        """Validate a mapping of option names to values; unknown names raise TypeError."""
        unknown = set(options) - NAMES
        if unknown:
            raise TypeError(f"unknown remote option(s): {', '.join(sorted(unknown))}; "
                            f"the options are {', '.join(sorted(NAMES))}")
        req = Requirements.build(**{name: options.get(name, default) for name, default in REQUIREMENTS.items()})
        parsed = cls(req, check_timeout(options.get("timeout")), check_retries(options.get("retries", 0)),
                     check_env(options.get("env")), check_keep(options.get("keep", False)),
                     check_nodes(options.get("nodes")), check_priority(options.get("priority", 0)))
        if parsed.nodes is not None and (parsed.keep or req.peer is not None):
            raise ValueError("a gang (nodes=) returns its ranks' results and runs on several peers: "
                             "keep= and peer= do not apply to it")
        if parsed.nodes is not None and parsed.priority:
            raise ValueError("priority= orders tasks in a peer's queue; a gang (nodes=) takes its ranks' "
                             "slots together and has none")
        return parsed


def split_call(fn: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[TaskOptions, dict[str, Any]]:
    """Separate the task options of a `run`/`submit` call from fn's own keyword arguments, and check
    the call against fn's signature here, before anything is sent.

    A keyword that fn names as a parameter of its own and that is also a task option is refused as
    ambiguous; the unambiguous forms are `gl.options(...).run(fn, ...)` and `f.options(...)`.
    """
    given = NAMES & kwargs.keys()
    if given:
        shape = _shape(fn)
        ambiguous = sorted(given & shape.keywords) if shape else []
        if ambiguous:
            raise TypeError(_ambiguous(_name(fn), ambiguous))
    options = {name: kwargs.pop(name) for name in given}
    check_arguments(fn, args, kwargs, suggest_options=True)
    return (TaskOptions.parse(options) if options else _defaults()), kwargs


def check_arguments(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                    suggest_options: bool = False) -> None:
    """Raise Python's own TypeError here when fn(*args, **kwargs) could not be called (a wrong count,
    an unknown keyword), with "did you mean" for a keyword that is a near-miss of a task option.

    With `suggest_options`, a near-miss that fn would swallow in its **kwargs is refused too: a typo
    of `accelerator=` must not run the task anywhere.
    """
    shape = _shape(fn)
    if shape is None:
        return  # a builtin without a signature: the call on the peer says what is wrong
    try:
        shape.signature.bind(*args, **kwargs)
    except TypeError as exc:
        _, near = _near_option(kwargs.keys() - shape.keywords)
        hint = f"; did you mean the task option {near}=?" if near else ""
        raise TypeError(f"{_name(fn)}(): {exc}{hint}") from None
    if suggest_options and shape.var_keyword:
        typo, near = _near_option(kwargs.keys() - shape.keywords)
        if near:
            raise TypeError(f"{typo}= is not a task option and would go to {_name(fn)}'s **kwargs: did you mean "
                            f"the task option {near}=? To pass {typo}= to {_name(fn)}, use "
                            f"gl.options().run({_name(fn)}, ..., {typo}=...)")


@dataclass(frozen=True)
class _Shape:
    """What a call of a function is checked against: its signature and the names it takes by keyword."""

    signature: inspect.Signature
    keywords: frozenset[str]  # parameters that a keyword can name (not **kwargs)
    var_keyword: bool  # it has **kwargs


def _shape(fn: Callable[..., Any]) -> _Shape | None:
    """fn's call shape (cached per function: a loop of calls inspects it once), or None without a signature."""
    try:
        return _cached_shape(fn)
    except TypeError:  # an unhashable callable
        return _read_shape(fn)


@functools.lru_cache(maxsize=512)
def _cached_shape(fn: Callable[..., Any]) -> _Shape | None:
    return _read_shape(fn)


def _read_shape(fn: Callable[..., Any]) -> _Shape | None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = {name: p.kind for name, p in signature.parameters.items()}
    keywords = frozenset(n for n, k in kinds.items() if k in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                              inspect.Parameter.KEYWORD_ONLY))
    return _Shape(signature, keywords, inspect.Parameter.VAR_KEYWORD in kinds.values())


def _near_option(names: Iterable[str]) -> tuple[str, str] | tuple[None, None]:
    """(name, option) for the first of `names` that misspells a task option, else (None, None)."""
    for name in sorted(names):
        near = _misspelt(name)
        if near is not None:
            return name, near
    return None, None


@functools.lru_cache(maxsize=1024)
def _misspelt(name: str) -> str | None:
    """The task option that `name` is a near-miss of (cached: a loop of calls with the same keywords of
    a **kwargs function compares them once)."""
    import difflib  # here: only a misspelt option needs it

    close = difflib.get_close_matches(name, NAMES, n=1, cutoff=0.75)
    return close[0] if close else None


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _ambiguous(fn_name: str, names: list[str]) -> str:
    """The error for a call whose keywords could be task options or fn's own arguments."""
    listed = ", ".join(f"{name}=" for name in names)
    first = names[0]
    return (f"{fn_name}() takes {listed} itself, which is also the name of a task option: say which you mean. "
            f"The task option: gl.options({first}=...).run({fn_name}, ...); {fn_name}'s own argument: "
            f"gl.options().run({fn_name}, ..., {first}=...) (every keyword of gl.options(...).run, .submit and "
            f".map, and of a remote function's call, goes to the function)")


@functools.cache
def _defaults() -> TaskOptions:
    """The options of a call that gives none (made once: a loop of plain calls parses nothing)."""
    return TaskOptions.parse({})
