"""What a task needs, whether a peer fits it, and which fitting peer to prefer.

The rules (ADR-0006): a cuda task runs only where there is a CUDA device and an mps task only
on an Apple GPU, never the other way round. `gpu_memory_gb` is compared with a device's
dedicated memory, or with the unified memory of a Mac. Framework versions are PEP 440
specifiers; a framework used on an accelerator needs that backend (torch on mps needs
torch.mps), and so does one the function uses on a GPU (`uses`, inferred by the submitter).
Multi-device tasks are refused on MPS. `python` is a PEP 440 specifier for the peer's job
interpreter; a task whose pickles hold code (functions shipped by value) needs the Python
major.minor that pickled it (`code_python`), since code objects do not load across versions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any
from functools import lru_cache

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

from .accelerators import CPU, CUDA, GPU, GPU_KINDS, MPS, MPS_MAX_DEVICES, TASK_CHOICES, UNSUPPORTED, is_gpu
from .protocol.messages import PROTOCOL_VERSION
from .resources.model import Advert

ACCELERATOR_CHOICES = TASK_CHOICES
# The capability a framework needs to use an accelerator, e.g. ("torch", "mps") -> "torch.mps".
_BACKENDS = {
    ("torch", CUDA): "torch.cuda",
    ("torch", MPS): "torch.mps",
    ("mlx", MPS): "mlx.metal",
    ("mlx", CUDA): "mlx.cuda",
    ("mlx", CPU): "mlx.cpu",
}
MEMORY_SLACK_GB = 1e-9  # rounding of sums of memory figures
_NAMES = ", ".join(c for c in ACCELERATOR_CHOICES if c)  # "cpu, cuda, mps, gpu"
_GPU_NAMES = " or ".join(GPU_KINDS)  # "cuda or mps"


@dataclass(frozen=True)
class Requirements:
    """A task's needs. Build it with `Requirements.build(...)`, which validates."""

    accelerator: str | None = None
    gpu_memory_gb: float | None = None
    frameworks: tuple[tuple[str, str], ...] = ()
    capabilities: frozenset[str] = field(default_factory=frozenset)
    peer: str | None = None
    devices: int = 1
    python: str | None = None  # a PEP 440 specifier for the job interpreter's Python, ">=3.11"
    code_python: str | None = None  # "3.11": the task ships code by value, pickled by this Python
    uses: tuple[str, ...] = ()  # frameworks the function uses (inferred), which need their GPU backend

    @classmethod
    def build(cls, accelerator: str | None = None, gpu_memory_gb: float | None = None,
              frameworks: Mapping[str, str] | Iterable[str] | None = None, capabilities: Iterable[str] | str | None = None,
              peer: str | None = None, devices: int = 1, python: str | None = None, *,
              code_python: str | None = None, uses: Iterable[str] = ()) -> Requirements:
        """Validate and normalise; bad input raises ValueError naming the argument."""
        if accelerator not in ACCELERATOR_CHOICES:
            raise ValueError(f"accelerator must be one of {_NAMES} or None, not {accelerator!r}")
        if gpu_memory_gb is not None:
            if isinstance(gpu_memory_gb, bool) or not isinstance(gpu_memory_gb, (int, float)) \
                    or not 0 <= gpu_memory_gb < math.inf:
                raise ValueError(f"gpu_memory_gb must be a non-negative number, not {gpu_memory_gb!r}")
            if accelerator == CPU:
                raise ValueError("gpu_memory_gb asks for a GPU, but accelerator='cpu'")
            accelerator = accelerator or GPU
            gpu_memory_gb = float(gpu_memory_gb)
        pairs: Mapping[Any, Any]
        if isinstance(frameworks, Mapping):
            pairs = frameworks
        elif isinstance(frameworks, (list, tuple, set, frozenset)):
            pairs = {name: "" for name in frameworks}
        elif frameworks is None:
            pairs = {}
        else:
            raise ValueError(f"frameworks must map names to PEP 440 specifiers, not {frameworks!r}")
        specs = []
        for name, spec in pairs.items():
            if not isinstance(name, str) or not isinstance(spec, str):
                raise ValueError(f"frameworks maps names to PEP 440 specifiers, got {name!r}: {spec!r}")
            _specifier(spec)
            specs.append((name, spec))
        if isinstance(capabilities, str):
            capabilities = [capabilities]
        if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
            raise ValueError(f"devices must be a positive integer, not {devices!r}")
        if peer is not None and not isinstance(peer, str):
            raise ValueError(f"peer must be a peer name or peer id, not {peer!r}")
        if code_python is not None and not (isinstance(code_python, str) and _MAJOR_MINOR.fullmatch(code_python)):
            raise ValueError(f"code_python must be a Python major.minor such as '3.11', not {code_python!r}")
        names = tuple(uses)
        if isinstance(uses, str) or not all(isinstance(name, str) for name in names):
            raise ValueError(f"uses must be a collection of framework names, not {uses!r}")
        return cls(accelerator, gpu_memory_gb, tuple(sorted(specs)), frozenset(capabilities or ()), peer, devices,
                   _python_specifier(python), code_python, tuple(sorted(set(names))))

    def to_wire(self) -> dict[str, Any]:
        return {"acc": self.accelerator, "mem": self.gpu_memory_gb, "fw": [list(p) for p in self.frameworks],
                "cap": sorted(self.capabilities), "dev": self.devices, "py": self.python, "pc": self.code_python,
                "use": list(self.uses)}

    @classmethod
    def from_wire(cls, data: object) -> Requirements:
        if not isinstance(data, dict):
            raise ValueError("requirements must be a map")
        fw = data.get("fw") or []
        if not isinstance(fw, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                                               for p in fw):
            raise ValueError("requirements 'fw' must be a list of [name, specifier] pairs")
        cap, uses = data.get("cap") or [], data.get("use") or []
        if not all(isinstance(x, list) and all(isinstance(c, str) for c in x) for x in (cap, uses)):
            raise ValueError("requirements 'cap' and 'use' must be lists of strings")
        return cls.build(data.get("acc"), data.get("mem"), dict(map(tuple, fw)), cap, None, data.get("dev", 1),
                         data.get("py"), code_python=data.get("pc"), uses=uses)

    def __str__(self) -> str:
        parts = [f"accelerator={self.accelerator or 'any'}"]
        if self.gpu_memory_gb is not None:
            parts.append(f"gpu_memory_gb={self.gpu_memory_gb:g}")
        parts += [f"{name}{spec or ' (any version)'}" for name, spec in self.frameworks]
        if self.capabilities:
            parts.append("capabilities=" + ",".join(sorted(self.capabilities)))
        if self.devices > 1:
            parts.append(f"devices={self.devices}")
        if self.python:
            parts.append(f"python{self.python}")
        if self.code_python:
            parts.append(f"code pickled by Python {self.code_python}")
        if self.uses:
            parts.append("uses " + ",".join(self.uses))
        if self.peer:
            parts.append(f"peer={self.peer}")
        return "{" + ", ".join(parts) + "}"


_MAJOR_MINOR = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}")


@lru_cache(maxsize=256)
def _specifier(spec: str) -> SpecifierSet:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet  # here: a submitter that names no version never pays for it

    try:
        return SpecifierSet(spec)
    except InvalidSpecifier:
        raise ValueError(f"{spec!r} is not a PEP 440 version specifier (try '>=2.4')") from None


def _python_specifier(python: object) -> str | None:
    """The `python=` requirement checked: a PEP 440 specifier, or None (also for "") for any Python."""
    if python is None or python == "":
        return None
    if isinstance(python, str):
        try:
            _specifier(python)
            return python
        except ValueError:
            pass
    raise ValueError(f"python must be a PEP 440 specifier such as '>=3.11,<3.12', not {python!r}")


def _major_minor(version: str) -> str:
    """'3.12.1' -> '3.12'."""
    return ".".join(version.split(".")[:2])


def _backend(req: Requirements, advert: Advert) -> str:
    """The accelerator the task will use on this peer."""
    if req.accelerator in (None, GPU):
        return advert.accelerator if req.accelerator == GPU else CPU
    return req.accelerator


def _inferred_capabilities(req: Requirements, advert: Advert) -> dict[str, str]:
    """The GPU backend of each framework the function uses: {"torch.mps": "torch"}; none off a GPU."""
    backend = _backend(req, advert)
    if not is_gpu(backend):
        return {}
    return {cap: name for name in req.uses if (cap := _BACKENDS.get((name, backend)))}


def needed_capabilities(req: Requirements, advert: Advert) -> set[str]:
    """Explicit capabilities plus those implied by each framework on the task's accelerator, and
    the GPU backends of the frameworks the function uses."""
    backend = _backend(req, advert)
    needed = set(req.capabilities) | set(_inferred_capabilities(req, advert))
    for name, _ in req.frameworks:
        cap = _BACKENDS.get((name, backend))
        if cap:
            needed.add(cap)
    return needed


def _python_reasons(req: Requirements, python: str) -> list[str]:
    """Why a job interpreter running `python` cannot run the task."""
    why = []
    if req.python and not _version_ok(python, req.python):
        why.append(f"its job interpreter runs Python {python or '(unknown)'}, not python{req.python}")
    code = req.code_python
    if code and _major_minor(python) != code:
        why.append(f"its job interpreter runs Python {python or '(unknown)'}, but the task ships functions by "
                   f"value as Python {code} code, which only Python {code} can load: start the peer with --python "
                   f"pointing to a Python {code} interpreter, or a matching venv (or install the functions' module "
                   f"on both sides, so that they are pickled by reference)")
    return why


def match(req: Requirements, advert: Advert) -> tuple[str, ...]:
    """Why `advert` cannot run a task with `req`: an empty tuple means it can."""
    return _match(req, advert, advert.distributions)


@lru_cache(maxsize=4096)
def _match(req: Requirements, advert: Advert, _distributions: object) -> tuple[str, ...]:
    """match(), cached; the distributions are part of the key, since adverts compare without them."""
    why = []
    if advert.version != PROTOCOL_VERSION:
        why.append(f"speaks protocol v{advert.version}, this submitter v{PROTOCOL_VERSION}")
    if req.peer and req.peer not in (advert.name, advert.peer_id):
        why.append(f"not the requested peer {req.peer!r}")
    acc = req.accelerator
    if acc == GPU and not advert.has_gpu:
        why.append(f"task needs a GPU ({_GPU_NAMES}); peer offers {advert.accelerator}")
    elif is_gpu(acc) and advert.accelerator != acc:
        why.append(f"task needs {acc}; peer offers {advert.accelerator}")
    elif req.gpu_memory_gb is not None and advert.has_gpu:
        best = max(advert.device_memory_gb, default=0.0)
        if best < req.gpu_memory_gb:
            why.append(f"needs {req.gpu_memory_gb:g} GB of GPU memory; peer has {best:g} GB {advert.memory_kind}")
    if req.devices > 1:
        if not (acc == GPU or is_gpu(acc)):
            why.append(f"devices={req.devices} needs a GPU accelerator")
        elif advert.distributed == UNSUPPORTED or advert.accelerator == MPS and req.devices > MPS_MAX_DEVICES:
            why.append(f"devices={req.devices}: multi-device runs are unsupported on {advert.accelerator}")
        elif advert.device_count < req.devices:
            why.append(f"devices={req.devices}; peer has {advert.device_count}")
    why += _python_reasons(req, advert.python)
    for name, spec in req.frameworks:
        if not advert.knows(name):
            continue  # only the peer knows its other distributions: it checks them when it admits the task
        version = advert.framework_version(name)
        if version is None:
            why.append(f"{name} is not installed in the job interpreter")
        elif spec and not _version_ok(version, spec):
            why.append(f"{name} {version} does not satisfy {spec}")
    if not why:
        missing = sorted(needed_capabilities(req, advert) - advert.capabilities)
        inferred = _inferred_capabilities(req, advert)
        if missing:
            why.append("lacks capability " + ", ".join(
                f"{cap} (the function uses {inferred[cap]})" if cap in inferred else cap for cap in missing))
    return tuple(why)


def missing_software(req: Requirements, advert: Advert) -> frozenset[str]:
    """The frameworks (absent, or of another version) and capabilities that the task asks for and the
    advert lacks, when nothing else keeps the task off the peer: what another probe of its job
    interpreter may find (a pip install needs no restart). Empty otherwise."""
    if match(replace(req, frameworks=(), capabilities=frozenset(), uses=()), advert):
        return frozenset()
    lacking = {name for name, spec in req.frameworks if advert.knows(name)
               and ((version := advert.framework_version(name)) is None or spec and not _version_ok(version, spec))}
    return frozenset(lacking | (needed_capabilities(req, advert) - advert.capabilities))


def _version_ok(version: str, spec: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return _specifier(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def rank_key(req: Requirements, advert: Advert, load: float, latency: float = 0.0,
             verified: bool = True, free_gb: float | None = None) -> tuple[Any, ...]:
    """Sort key among matching peers; smaller is better.

    GPU tasks: a peer where the task's `gpu_memory_gb` is free now (by the peer's last report,
    `free_gb`; unknown counts as free), then the least loaded (busy + queued per slot), then the
    smallest memory that fits, then a verified advert, then the lowest latency. CPU and unplaced
    tasks: a free slot first, then a peer without a GPU (so GPUs stay free), then the least
    loaded, then a verified advert, then the lowest latency. A verified advert came through a
    handshake; an unverified one (mDNS, the cache) is a hint that the handshake checks before any task.
    """
    ratio = load / max(advert.slots, 1)
    if is_gpu(_backend(req, advert)):
        need = req.gpu_memory_gb or 0.0
        waits = free_gb is not None and free_gb + MEMORY_SLACK_GB < need
        fits = [m for m in advert.device_memory_gb if m >= need]
        return (waits, ratio, min(fits, default=0.0), not verified, latency)
    return (load >= advert.slots, advert.has_gpu, ratio, not verified, latency)
