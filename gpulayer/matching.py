"""What a task needs, whether a peer fits it, and which fitting peer to prefer.

The rules (ADR-0006): a cuda task runs only where there is a CUDA device and an mps task only
on an Apple GPU, never the other way round. `gpu_memory_gb` is compared with a device's
dedicated memory, or with the unified memory of a Mac. Framework versions are PEP 440
specifiers; a framework used on an accelerator needs that backend (torch on mps needs
torch.mps). Multi-device tasks are refused on MPS.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from functools import lru_cache

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from .accelerators import CPU, CUDA, GPU, GPU_KINDS, MPS, MPS_MAX_DEVICES, TASK_CHOICES, UNSUPPORTED, is_gpu
from .resources.model import Advert
from .wire import PROTOCOL_VERSION

ACCELERATOR_CHOICES = TASK_CHOICES
# The capability a framework needs to use an accelerator, e.g. ("torch", "mps") -> "torch.mps".
_BACKENDS = {
    ("torch", CUDA): "torch.cuda",
    ("torch", MPS): "torch.mps",
    ("mlx", MPS): "mlx.metal",
    ("mlx", CUDA): "mlx.cuda",
    ("mlx", CPU): "mlx.cpu",
}
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

    @classmethod
    def build(cls, accelerator: str | None = None, gpu_memory_gb: float | None = None,
              frameworks: Mapping[str, str] | Iterable[str] | None = None, capabilities: Iterable[str] | str | None = None,
              peer: str | None = None, devices: int = 1) -> Requirements:
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
        return cls(accelerator, gpu_memory_gb, tuple(sorted(specs)), frozenset(capabilities or ()), peer, devices)

    def to_wire(self) -> dict[str, Any]:
        return {"acc": self.accelerator, "mem": self.gpu_memory_gb, "fw": [list(p) for p in self.frameworks],
                "cap": sorted(self.capabilities), "dev": self.devices}

    @classmethod
    def from_wire(cls, data: object) -> Requirements:
        if not isinstance(data, dict):
            raise ValueError("requirements must be a map")
        fw = data.get("fw") or []
        if not isinstance(fw, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                                               for p in fw):
            raise ValueError("requirements 'fw' must be a list of [name, specifier] pairs")
        cap = data.get("cap") or []
        if not isinstance(cap, list) or not all(isinstance(c, str) for c in cap):
            raise ValueError("requirements 'cap' must be a list of strings")
        return cls.build(data.get("acc"), data.get("mem"), dict(map(tuple, fw)), cap, None, data.get("dev", 1))

    def __str__(self) -> str:
        parts = [f"accelerator={self.accelerator or 'any'}"]
        if self.gpu_memory_gb is not None:
            parts.append(f"gpu_memory_gb={self.gpu_memory_gb:g}")
        parts += [f"{name}{spec or ' (any version)'}" for name, spec in self.frameworks]
        if self.capabilities:
            parts.append("capabilities=" + ",".join(sorted(self.capabilities)))
        if self.devices > 1:
            parts.append(f"devices={self.devices}")
        if self.peer:
            parts.append(f"peer={self.peer}")
        return "{" + ", ".join(parts) + "}"


@lru_cache(maxsize=256)
def _specifier(spec: str) -> SpecifierSet:
    try:
        return SpecifierSet(spec)
    except InvalidSpecifier:
        raise ValueError(f"{spec!r} is not a PEP 440 version specifier (try '>=2.4')") from None


def _backend(req: Requirements, advert: Advert) -> str:
    """The accelerator the task will use on this peer."""
    if req.accelerator in (None, GPU):
        return advert.accelerator if req.accelerator == GPU else CPU
    return req.accelerator


def needed_capabilities(req: Requirements, advert: Advert) -> set[str]:
    """Explicit capabilities plus those implied by each framework on the task's accelerator."""
    backend = _backend(req, advert)
    needed = set(req.capabilities)
    for name, _ in req.frameworks:
        cap = _BACKENDS.get((name, backend))
        if cap:
            needed.add(cap)
    return needed


@lru_cache(maxsize=4096)
def match(req: Requirements, advert: Advert) -> tuple[str, ...]:
    """Why `advert` cannot run a task with `req`: an empty tuple means it can."""
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
    for name, spec in req.frameworks:
        version = advert.framework_version(name)
        if version is None:
            why.append(f"{name} is not installed in the job interpreter")
        elif spec and not _version_ok(version, spec):
            why.append(f"{name} {version} does not satisfy {spec}")
    if not why:
        missing = sorted(needed_capabilities(req, advert) - advert.capabilities)
        if missing:
            why.append("lacks capability " + ", ".join(missing))
    return tuple(why)


def _version_ok(version: str, spec: str) -> bool:
    try:
        return _specifier(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def rank_key(req: Requirements, advert: Advert, load: float, latency: float = 0.0,
             verified: bool = True) -> tuple[Any, ...]:
    """Sort key among matching peers; smaller is better.

    GPU tasks: least loaded (busy + queued per slot), then the smallest memory that fits,
    then a verified advert, then the lowest latency. CPU and unplaced tasks: a free slot
    first, then a peer without a GPU (so GPUs stay free), then the least loaded, then a
    verified advert, then the lowest latency. A verified advert came through a handshake;
    an unverified one (mDNS, the cache) is a hint that the handshake checks before any task.
    """
    ratio = load / max(advert.slots, 1)
    if is_gpu(_backend(req, advert)):
        fits = [m for m in advert.device_memory_gb if m >= (req.gpu_memory_gb or 0.0)]
        return (ratio, min(fits, default=0.0), not verified, latency)
    return (load >= advert.slots, advert.has_gpu, ratio, not verified, latency)
