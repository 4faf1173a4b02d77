"""`Trainer(compile=...)`: the training step through torch.compile, or replayed as one CUDA graph.

    compile=False                 eager, the default
    compile=True                  torch.compile(training_step) with torch's defaults (Inductor)
    compile="max-autotune"        a torch.compile mode ("default", "reduce-overhead", "max-autotune",
                                  "max-autotune-no-cudagraphs")
    compile={"backend": ...}      torch.compile keyword arguments
    compile="cudagraphs"          forward, backward, gradient clipping, optimizer step and zero_grad
                                  captured as one CUDA graph per batch shape and replayed (CUDA only)
    compile={"cudagraphs": True, "mode": "max-autotune-no-cudagraphs"}   both: the compiled step in the graph

`self.log` calls made inside the compiled or captured step are recorded and handed to the real
`Module.log` after it, so logging keeps its meaning (and its device-side values) in every mode.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from ..accelerators import CUDA
from .accelerators import UnsupportedConfiguration
from .module import Module

TORCH_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPHS = "cudagraphs"
_TORCH_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile's own CUDA graphs
_COMPILE_KEYS = tuple(name for name in inspect.signature(torch.compile).parameters if name != "model")
_LOG_METHODS = ("log", "log_dict")  # recorded inside the step, replayed after it
# hooks that run inside a step: a CUDA graph replays the device work without running them again
_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


@dataclass(frozen=True)
class CompileConfig:
    """What `compile=` asked for: torch.compile keyword arguments (None: no torch.compile) and CUDA graphs."""

    torch_compile: dict | None = None
    cudagraphs: bool = False
    uses_graphs: bool = field(init=False)

    def __post_init__(self):
        mode = (self.torch_compile or {}).get("mode")
        object.__setattr__(self, "uses_graphs", self.cudagraphs or mode in _TORCH_GRAPH_MODES)


def parse(value: Any, kind: str, devices: int, num_nodes: int, precision: str,
          accumulate_grad_batches: int) -> CompileConfig | None:
    """Validate a Trainer's `compile=` against its other options; None for the eager default."""
    if value is False:
        return None
    if value is True:
        config = CompileConfig({})
    elif isinstance(value, str):
        if value == CUDAGRAPHS:
            config = CompileConfig(None, True)
        elif value in TORCH_MODES:
            config = CompileConfig({"mode": value})
        else:
            raise ValueError(f"compile={value!r}; use True, False, {CUDAGRAPHS!r}, one of the torch.compile modes "
                             f"{', '.join(map(repr, TORCH_MODES))}, or a dict of torch.compile arguments")
    elif isinstance(value, dict):
        kwargs = dict(value)
        graphs = kwargs.pop(CUDAGRAPHS, False)
        if not isinstance(graphs, bool):
            raise TypeError(f"compile={{'cudagraphs': ...}} takes True or False, got {graphs!r}")
        unknown = sorted(set(kwargs) - set(_COMPILE_KEYS))
        if unknown:
            raise ValueError(f"compile= has keys torch.compile does not take: {', '.join(map(repr, unknown))}; "
                             f"it takes {', '.join(map(repr, _COMPILE_KEYS))} and 'cudagraphs'")
        config = CompileConfig(kwargs if kwargs or not graphs else None, graphs)
    else:
        raise TypeError(f"compile= takes a bool, a str or a dict, got {type(value).__name__}")

    if devices > 1 or num_nodes > 1:
        raise UnsupportedConfiguration(f"compile={value!r} trains on one device; devices={devices}, "
                                       f"num_nodes={num_nodes} is not supported with it")
    if config.cudagraphs:
        mode = (config.torch_compile or {}).get("mode")
        problem = (f"needs accelerator='cuda' (CUDA graphs), not {kind!r}" if kind != CUDA else
                   f"cannot hold torch.compile mode {mode!r}, which makes CUDA graphs of its own; "
                   f"use 'max-autotune-no-cudagraphs' or 'default'" if mode in _TORCH_GRAPH_MODES else
                   "replays one optimizer step per batch: accumulate_grad_batches must be 1"
                   if accumulate_grad_batches != 1 else
                   "cannot skip steps on the host as '16-mixed''s GradScaler does: use 'bf16-mixed'"
                   if precision == "16-mixed" else None)
        if problem:
            raise UnsupportedConfiguration(f"compile={value!r} {problem}")
    return config


class _LogRecorder:
    """Takes a module's `self.log`/`self.log_dict` calls while the step runs compiled or captured."""

    def __init__(self, module: Module, clone: bool):
        self.module, self.clone = module, clone
        self.calls: list[tuple[str, tuple, dict]] = []
        self._methods = {name: self._recorder(name) for name in _LOG_METHODS if hasattr(type(module), name)}

    def _recorder(self, name: str) -> Callable:
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
        return record

    @contextlib.contextmanager
    def recording(self):
        """Route the module's log methods here (instance attributes shadow the class's methods)."""
        self.calls.clear()  # the same list: compiled code guards on it
        self.module.__dict__.update(self._methods)
        try:
            yield
        finally:
            for name in self._methods:
                self.module.__dict__.pop(name, None)

    def logged_modules(self) -> list[str]:
        """The names under which the recorded calls log an nn.Module (a torchmetrics Metric)."""
        out = []
        for method, args, kwargs in self.calls:
            if method == "log":
                values = {args[0] if args else kwargs.get("name"): args[1] if len(args) > 1 else kwargs.get("value")}
            else:
                values = args[0] if args else kwargs.get("dictionary", {})
            out += [str(name) for name, value in values.items() if isinstance(value, torch.nn.Module)]
        return out

    def replay(self, calls: list[tuple[str, tuple, dict]]) -> None:
        """Hand the recorded calls to the module's real log methods; a CUDA graph's outputs are
        overwritten by its next replay, so those values are cloned first (no sync)."""
        for name, args, kwargs in calls:
            if self.clone:
                args, kwargs = _cloned(args), _cloned(kwargs)
            getattr(type(self.module), name)(self.module, *args, **kwargs)


class CompiledTrainingStep:
    """`training_step` through torch.compile; its log calls are recorded and replayed after it,
    unless `recorder` is None (inside a CudaGraphStep, which records them itself)."""

    def __init__(self, module: Module, kwargs: dict, recorder: _LogRecorder | None):
        self.recorder = recorder
        self.compiled = torch.compile(module.training_step, **kwargs)
        self.device_type = module.device.type
        self._built = False

    def __call__(self, batch: Any, batch_idx: int) -> Any:
        if self.recorder is None:
            return self._compiled_call(batch, batch_idx)
        with self.recorder.recording():
            output = self._compiled_call(batch, batch_idx)
        self.recorder.replay(self.recorder.calls)
        return output

    def _compiled_call(self, batch: Any, batch_idx: int) -> Any:
        if self._built:
            return self.compiled(batch, batch_idx)
        try:
            output = self.compiled(batch, batch_idx)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            hint = (" On CPU, Inductor builds C++: it needs a working C++ compiler (g++ or clang++) on PATH."
                    if self.device_type == "cpu" else "")
            raise RuntimeError(f"compile=: torch.compile could not build the training step for "
                               f"{self.device_type!r}: {exc.inner_exception!r}.{hint} Use compile=False, or "
                               f"compile={{'backend': 'aot_eager'}} (no code generation).") from exc
        self._built = True
        return output


class _Graph:
    """One captured step: its static inputs, outputs and recorded log calls."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list[Tensor], output: Any, logs: list):
        self.graph, self.inputs, self.output, self.logs = graph, inputs, output, logs


def _flatten(obj: Any, tensors: list[Tensor]) -> Any:
    """The signature a captured graph depends on (structure, tensor shapes and dtypes, other values);
    appends the batch's tensors to `tensors` in a fixed order."""
    if isinstance(obj, Tensor):
        tensors.append(obj)
        return obj.shape, obj.dtype
    if isinstance(obj, (list, tuple)):
        return type(obj), *(_flatten(x, tensors) for x in obj)
    if isinstance(obj, dict):
        return type(obj), *((k, _flatten(v, tensors)) for k, v in obj.items())
    return type(obj), repr(obj)


class CudaGraphStep:
    """Forward, backward, clipping, optimizer step and zero_grad, replayed as one CUDA graph.

    Each batch signature (shapes, dtypes) runs `WARMUP` times eagerly, then is captured; the
    last, smaller batch of an epoch gets a graph of its own. Past `MAX_GRAPHS` signatures the
    step stays eager. The step must do the same device work every time: no Python branches on
    `batch_idx`, the epoch or tensor values, no host syncs (`.item()` fails the capture).
    Schedulers work: with an optimizer that has a `capturable` option (Adam, AdamW, RMSprop, ...)
    the graphs read the learning rate from a device tensor that follows `param_groups[i]["lr"]`;
    with others (SGD) a new rate captures the graphs again (fine once an epoch, slow every step).
    Other hyperparameters are fixed at the capture, and changing them raises.
    """

    WARMUP = 2
    MAX_GRAPHS = 8

    def __init__(self, trainer, module: Module, step_fn: Callable, recorder: _LogRecorder):
        overridden = [getattr(fn, "func", fn).__qualname__ for name in _STEP_HOOKS for fn in trainer.hooks.calls(name)]
        if overridden:
            raise UnsupportedConfiguration(
                f"compile='cudagraphs' replays the step's device work without running Python: "
                f"{', '.join(overridden)} would run once, at the capture. Use compile=True or compile=False")
        self.trainer, self.module, self.step_fn, self.recorder = trainer, module, step_fn, recorder
        self.optimizer = trainer.optimizer
        self.device = trainer.device
        mixed = trainer.precision.autocast
        # autocast's weight-cast cache must be off in a capture (torch.cuda.graphs docs)
        self.autocast = (torch.autocast(CUDA, dtype=mixed.fast_dtype, cache_enabled=False)
                         if isinstance(mixed, torch.autocast) else contextlib.nullcontext())
        self.stream = torch.cuda.Stream(self.device)
        self.graphs: dict[tuple, _Graph] = {}
        self.seen: collections.Counter = collections.Counter()
        self._prepared = False
        self._lr: list[Tensor | float] = []  # the learning rate the graphs read, per param group
        self._lr_host: list[float] = []
        self._fixed: list[dict] = []  # the other hyperparameters, as captured
        self._too_many_warned = False

    def __call__(self, batch: Any, batch_idx: int) -> Any:
        if not self._prepared:
            self._prepare()
        self._follow_hyperparameters()
        tensors: list[Tensor] = []
        key = _flatten(batch, tensors)
        graph = self.graphs.get(key)
        if graph is None:
            self.seen[key] += 1
            if self.seen[key] <= self.WARMUP or len(self.graphs) >= self.MAX_GRAPHS:
                self._warn_if_too_many()
                return self._eager(batch, batch_idx)
            graph = self.graphs[key] = self._capture(batch, batch_idx)
        else:
            for static, x in zip(graph.inputs, tensors):
                static.copy_(x, non_blocking=True)
        graph.graph.replay()
        self.recorder.replay(graph.logs)
        return graph.output

    def _body(self, batch: Any, batch_idx: int) -> Any:
        with self.recorder.recording():
            with self.autocast:
                output = self.step_fn(batch, batch_idx)
        loss = output["loss"] if isinstance(output, dict) else output
        if loss is None:
            raise ValueError("training_step must return the loss tensor (or a dict with 'loss')")
        loss.backward()
        clip = self.trainer.gradient_clip_val
        if clip:
            by_value = self.trainer.gradient_clip_algorithm == "value"
            (torch.nn.utils.clip_grad_value_ if by_value else torch.nn.utils.clip_grad_norm_)(self.trainer.clip_params, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return output

    def _eager(self, batch: Any, batch_idx: int) -> Any:
        """A step as the default path runs it, on the capture stream (as torch.cuda.graphs asks of warm-up)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*capturable=True.*")  # eager warm-up of a capturable optimizer
            output = self._body(batch, batch_idx)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        metrics = self.recorder.logged_modules()
        if metrics:  # torchmetrics reassign their state tensors: a replay would not accumulate
            raise UnsupportedConfiguration(
                f"compile='cudagraphs' cannot replay the update of a logged metric object ({', '.join(metrics)}): "
                f"log a tensor (e.g. metric(preds, target)'s result), or use compile=True or compile=False")
        self.recorder.replay(self.recorder.calls)
        return output

    def _capture(self, batch: Any, batch_idx: int) -> _Graph:
        """Capture this step into a graph (the graph's inputs hold this batch; the caller replays it)."""
        static = _cloned(batch)
        groups = self.optimizer.param_groups
        floats = [group["lr"] for group in groups]
        for group, lr in zip(groups, self._lr):
            group["lr"] = lr
        graph = torch.cuda.CUDAGraph()
        try:  # thread_local: a DataLoader's pin-memory thread may call CUDA meanwhile
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                output = self._body(static, batch_idx)
        except RuntimeError as exc:
            raise RuntimeError(f"compile='cudagraphs' could not capture the training step: {exc}. The step must "
                               f"run without host syncs (no .item(), .cpu(), printing tensors or data-dependent "
                               f"shapes) with a capturable optimizer (Adam, AdamW, SGD, ...); or use "
                               f"compile=True or compile=False") from exc
        finally:
            for group, lr in zip(groups, floats):
                group["lr"] = lr
        inputs: list[Tensor] = []
        _flatten(static, inputs)
        return _Graph(graph, inputs, output, list(self.recorder.calls))

    def _prepare(self) -> None:
        """Before the first step: capturable optimizer state on the device and, where the optimizer
        takes one (those with a `capturable` option), a device tensor per learning rate."""
        capturable = all("capturable" in group for group in self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            if capturable:
                group["capturable"] = True
        for param, state in self.optimizer.state.items():  # a restored checkpoint keeps Adam's step on the host
            step = state.get("step")
            if isinstance(step, Tensor) and step.device != param.device:
                state["step"] = step.to(param.device, torch.float32)
        groups = self.optimizer.param_groups
        self._lr_host = [float(group["lr"]) for group in groups]
        # a tensor learning rate is read as it is; a float one through a device copy the graphs read,
        # or, for an optimizer that takes no tensor (SGD), as the float captured
        self._lr = [group["lr"] if isinstance(group["lr"], Tensor) or not capturable else
                    torch.tensor(lr, dtype=torch.float32, device=self.device)
                    for group, lr in zip(groups, self._lr_host)]
        self._fixed = [_hyperparameters(group) for group in groups]
        self._prepared = True

    def _follow_hyperparameters(self) -> None:
        """Copy a changed learning rate to the graphs' tensor, or capture again where the graphs hold
        the float; refuse other changes (the graphs hold them)."""
        for i, group in enumerate(self.optimizer.param_groups):
            lr = group["lr"]
            read = self._lr[i]
            if lr is not read and lr != self._lr_host[i]:
                if isinstance(read, Tensor):
                    read.fill_(float(lr))
                else:
                    self._lr[i] = lr
                    self.graphs.clear()  # each signature is captured again at its next step
                self._lr_host[i] = lr
            if _hyperparameters(group) != self._fixed[i]:
                raise RuntimeError(
                    f"compile='cudagraphs': param group {i}'s hyperparameters changed after the capture "
                    f"({self._fixed[i]} -> {_hyperparameters(group)}); only 'lr' may change during training "
                    f"(a scheduler that cycles momentum, like OneCycleLR's default, needs compile=False)")

    def _warn_if_too_many(self) -> None:
        if len(self.graphs) >= self.MAX_GRAPHS and not self._too_many_warned:
            self._too_many_warned = True
            warnings.warn(f"compile='cudagraphs': more than {self.MAX_GRAPHS} batch shapes; steps of new "
                          f"shapes run eagerly", stacklevel=3)


def _cloned(obj: Any) -> Any:
    """`obj` with its tensors (in nested tuples, lists, dicts) cloned."""
    if isinstance(obj, Tensor):
        return obj.clone()
    if isinstance(obj, (list, tuple)):
        items = [_cloned(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return type(obj)((k, _cloned(v)) for k, v in obj.items())
    return obj


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}


def build(config: CompileConfig | None, trainer, module: Module) -> Callable | None:
    """The step function for this fit: a compiled `training_step` (the trainer runs backward and
    the optimizer), or a `CudaGraphStep` (it runs them itself); None for the eager default."""
    if config is None:
        return None
    recorder = _LogRecorder(module, clone=config.uses_graphs)
    if config.torch_compile is None:
        return CudaGraphStep(trainer, module, module.training_step, recorder)
    if not config.cudagraphs:
        return CompiledTrainingStep(module, config.torch_compile, recorder)
    return CudaGraphStep(trainer, module, CompiledTrainingStep(module, config.torch_compile, None), recorder)
