"""Pickling of functions, arguments and results: cloudpickle with protocol-5 out-of-band buffers.

Functions and classes from the submitter's own modules (e.g. `myproject/tasks.py`: a module that
no installed distribution provides, or one installed in editable mode, outside the standard
library and site-packages) are shipped by value, since a peer does not have them; installed
packages are pickled by reference and must be installed on the peer, wherever they lie here
(site-packages, PYTHONPATH, `pip install --target`).

Buffers of 64 KiB or more (numpy arrays, CPU torch tensors, pickle.PickleBuffer objects) are
handed back separately so that the wire sends them from their own memory, and the receiver
rebuilds the objects on top of the received, writable buffers without another copy. Plain
bytes and bytearray objects are copied into the pickle once (pickle offers no hook for them):
wrap a large one in pickle.PickleBuffer, or use a numpy array, to avoid that copy. Torch tensors on a GPU are
moved to the CPU: a result that holds a CUDA or MPS tensor arrives as a CPU tensor.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import site
import sys
import types
from pathlib import Path
from typing import Any

OUT_OF_BAND_MIN = 64 * 1024
_OPEN_FILES = (io.FileIO, io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)


@functools.lru_cache(maxsize=None)
def _pickler() -> Any:
    """cloudpickle's Pickler with GPUlayer's reductions, made on first use: a process that pickles only
    plain values, or nothing (`gpulayer submit`), does not import cloudpickle (5 ms)."""
    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            torch = sys.modules.get("torch")
            if torch is not None and type(obj) is torch.Tensor:
                reduced = _reduce_tensor(torch, obj)
                if reduced is not None:
                    return reduced
            if isinstance(obj, (types.FunctionType, type)):
                _ship_local_module(getattr(obj, "__module__", None))
            elif isinstance(obj, _OPEN_FILES):  # cloudpickle would send a read file's content as a StringIO
                raise TypeError(f"an open file ({getattr(obj, 'name', '?')!r}) cannot travel to a peer: pass its "
                                "path, for a file that exists on the peer, or its content (f.read())")
            elif isinstance(obj, types.CodeType) and (code_reduce := _code_reduce()) is not None:
                return _code_with_filename, (code_reduce(obj)[1], obj.co_filename)
            return super().reducer_override(obj)

    return Pickler


@functools.lru_cache(maxsize=None)
def _code_reduce() -> Any:
    """cloudpickle's reduction of code objects, or None. cloudpickle blanks the file name of code it ships
    by value; the Pickler keeps it, so that a remote traceback names the submitter's file and its lines
    (the submitter fills in the source)."""
    import cloudpickle

    return getattr(cloudpickle.cloudpickle, "_code_reduce", None)


def _code_with_filename(args: tuple, filename: str) -> types.CodeType:
    return types.CodeType(*args).replace(co_filename=filename)


CODE_MARKER = _code_with_filename.__name__.encode()  # in every pickle that ships code by value (_Pickler)


@functools.lru_cache(maxsize=None)
def _installed_dirs() -> tuple[str, ...]:
    import sysconfig

    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages() + [site.getusersitepackages(), sys.prefix, sys.base_prefix])
    return tuple(os.path.realpath(p) + os.sep for p in paths if p)


def _provided(top: str) -> bool:
    """Whether an installed distribution provides top-level module `top`: one whose metadata lies in the
    folder that `top` was imported from (a PYTHONPATH entry, a `pip install --target` folder). Only that
    folder is read, not every distribution of the interpreter (a scan of 100 costs a fresh process
    about 0.2 s); an editable install keeps its metadata elsewhere, so the user's own code is not."""
    module = sys.modules.get(top)
    origin = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", None) or ()), None)
    if not origin:
        return False
    folder = os.path.dirname(origin)
    if hasattr(module, "__path__"):  # a package: its folder's parent is where it was found
        folder = os.path.dirname(folder)
    return top in _tops_in(folder)


@functools.lru_cache(maxsize=64)
def _tops_in(folder: str) -> frozenset[str]:
    """The top-level modules of the distributions installed in `folder` (pip's `.dist-info`; a project's
    own `.egg-info`, which `pip install -e` leaves in its source folder, does not count)."""
    import importlib.metadata  # here: the job commands import this module but never pickle a local module

    try:
        entries = [entry for entry in os.listdir(folder) if entry.endswith(".dist-info")]
    except OSError:
        return frozenset()
    names: set[str] = set()
    for entry in entries:
        dist = importlib.metadata.PathDistribution(Path(folder, entry))
        declared = (dist.read_text("top_level.txt") or "").split()
        names.update(declared or {f.parts[0].partition(".")[0] for f in dist.files or ()
                                  if f.parts and not f.parts[0].endswith(".dist-info")})
    return frozenset(names)


@functools.lru_cache(maxsize=1024)
def _ship_local_module(name: str | None) -> None:
    """Have cloudpickle pickle a module's functions by value when the module is the user's own code:
    neither in the interpreter's own folders nor provided by an installed distribution."""
    module = sys.modules.get(name or "")
    top = (name or "").partition(".")[0]
    if module is None or name == "__main__" or top in ("gpulayer", *sys.stdlib_module_names):
        return
    path = getattr(module, "__file__", None)
    if path and not os.path.realpath(path).startswith(_installed_dirs()) and not _provided(top):
        import cloudpickle

        cloudpickle.register_pickle_by_value(module)


def module_of(obj: object) -> str:
    """The name of the module `obj` says it comes from, or "" (none, not a str, or a `__getattr__` that raises)."""
    try:
        module = getattr(obj, "__module__", None)
    except Exception:  # an object whose __getattr__ raises anything
        return ""
    return module if isinstance(module, str) else ""


def ships_by_value(obj: types.FunctionType | type) -> bool:
    """Whether pickling ships a function or class by value (its code), not by reference (its module and
    name): the submitter's own modules go by value (`_ship_local_module`), and cloudpickle decides the rest."""
    import cloudpickle

    _ship_local_module(module_of(obj))
    return not cloudpickle.cloudpickle._should_pickle_by_reference(obj)


_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})
_PLAIN_MAX = 64  # items a container may hold to count as plain


def _plain(obj, depth: int = 0) -> bool:
    """Whether `obj` is built-in scalars, alone or in small tuples, lists and dicts (str keys): what
    pickle itself makes exactly as cloudpickle would, only faster (no Pickler to set up)."""
    kind = type(obj)
    if kind in _SCALARS:
        return kind is not bytes or len(obj) < OUT_OF_BAND_MIN
    if depth > 2 or kind not in (tuple, list, dict) or len(obj) > _PLAIN_MAX:
        return False
    if kind is dict:
        return all(type(k) is str and _plain(v, depth + 1) for k, v in obj.items())
    return all(_plain(item, depth + 1) for item in obj)


def dumps(obj) -> tuple[bytes, list[memoryview]]:
    """Pickle `obj`; return the pickle and its out-of-band buffers."""
    if _plain(obj):  # arguments and results of small tasks, most often
        return pickle.dumps(obj, protocol=5), []
    buffers: list[memoryview] = []

    def keep_large(pickle_buffer: pickle.PickleBuffer) -> bool:
        try:
            raw = pickle_buffer.raw()
        except BufferError:  # not contiguous: let pickle copy it in-band
            return True
        if raw.nbytes < OUT_OF_BAND_MIN:
            return True
        buffers.append(raw)
        return False

    out = io.BytesIO()
    _pickler()(out, protocol=5, buffer_callback=keep_large).dump(obj)
    return out.getvalue(), buffers


def dumps_function(fn) -> bytes:
    """Pickle a task's function; on failure, a note on the error names the global or closure variable
    of the function that could not be pickled."""
    try:
        return dumps(fn)[0]
    except Exception as exc:
        code = getattr(fn, "__code__", None)
        namespace = getattr(fn, "__globals__", {})
        parts = [(f"its global {name!r}", namespace[name]) for name in getattr(code, "co_names", ()) if name in namespace]
        cells = zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ())
        parts += [(f"the variable {name!r} of its closure", cell.cell_contents) for name, cell in cells]
        _name_the_culprit(exc, _called(fn), parts)
        raise


def dumps_call(fn, args: tuple, kwargs: dict) -> tuple[bytes, list[memoryview]]:
    """Pickle a task's (args, kwargs); on failure, a note on the error names the argument that could not be."""
    try:
        return dumps((args, kwargs))
    except Exception as exc:
        parts = [(f"argument {i}", value) for i, value in enumerate(args)]
        parts += [(f"argument {name}=", value) for name, value in kwargs.items()]
        _name_the_culprit(exc, _called(fn), parts)
        raise


def _called(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _name_the_culprit(exc: Exception, fn_name: str, parts: list[tuple[str, object]]) -> None:
    """Add a note to `exc` naming the first of `parts` that does not pickle alone (Python 3.11+ notes)."""
    for label, value in parts:
        try:
            dumps(value)
        except Exception:
            if hasattr(exc, "add_note"):
                exc.add_note(f"gpulayer: {label} of {fn_name} (a {type(value).__qualname__}) could not be pickled, "
                             "so the task cannot travel to a peer")
            return


def loads(data: bytes, buffers=()):
    """Rebuild an object from `dumps` output; large arrays are views of `buffers`."""
    return pickle.loads(data, buffers=buffers)


def _reduce_tensor(torch, tensor):
    """Reduce a dense tensor to a numpy array (zero-copy on the CPU), or None to fall back."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        return None
    t = tensor.detach()
    if t.device.type == "cuda":
        t = _to_pinned_host(torch, t)
    elif t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    try:
        array = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    except (RuntimeError, TypeError):  # numpy missing, or a dtype numpy has no twin for
        return None
    return _rebuild_tensor, (array, dtype, tensor.requires_grad)


def _to_pinned_host(torch, t):
    """A CUDA tensor copied once into pinned host memory (torch's caching host allocator keeps the
    pages for the next result): 50 GB/s on an H100 against 1.1 for `.cpu()` into fresh pageable
    memory (bench/results/device_to_host.json). `.cpu()` where pinning fails."""
    try:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    except RuntimeError:
        return t.cpu()


def _rebuild_tensor(array, dtype: str, requires_grad: bool):
    import torch

    t = torch.from_numpy(array)
    if dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    return t.requires_grad_(requires_grad) if requires_grad else t
