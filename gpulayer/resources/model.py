"""What a machine offers: plain dataclasses, to and from dicts (JSON) and mDNS TXT records."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from ..accelerators import DEDICATED, HOST_MEMORY, KINDS, UNIFIED, UNSUPPORTED, is_gpu, machine_accelerator
from ..protocol.messages import FEATURES
from ..protocol.messages import PROTOCOL_VERSION as PROTOCOL_VERSION  # re-exported: adverts carry it

TXT_VALUE_MAX = 255  # bytes in one TXT string, key and '=' included
# The frameworks that the probe examines (version and capabilities) and every advert lists.
PROBED_FRAMEWORKS = frozenset({"torch", "mlx"})


def distribution_key(name: str) -> str:
    """A distribution's name as PEP 503 compares names: "Scikit_Learn" -> "scikit-learn"."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Device:
    """One accelerator: a CUDA GPU or an Apple GPU.

    `validation` says how far single-device tasks were proven on it: "hardware-validated"
    (a tensor op ran on it when the peer started), "detected" (seen in system facts only) or
    "override" (declared by an --advertise-override file); adverts carry it as
    `Advert.validation`, and the report and the JSON of `gpulayer resources detect` as
    "independent" (their format, kept stable). `distributed` names the multi-device backend
    ("nccl") or "unsupported".
    """

    index: int
    kind: str
    name: str
    memory_gb: float
    memory_kind: str
    validation: str = "detected"
    distributed: str = UNSUPPORTED

    def describe(self) -> str:
        return (
            f"[{self.index}] {self.kind} {self.name} ({self.memory_gb:.1f} GB {self.memory_kind}) "
            f"independent={self.validation} distributed={self.distributed}"
        )


@dataclass(frozen=True)
class Framework:
    """An installed framework in the job interpreter and what it can use, e.g. torch.cuda."""

    name: str
    version: str
    capabilities: tuple[str, ...] = ()


@dataclass
class Resources:
    """Everything one machine offers to tasks."""

    host: str
    system: str
    machine: str
    cpu_name: str
    cpu_count: int
    memory_gb: float
    python: str
    devices: list[Device] = field(default_factory=list)
    frameworks: list[Framework] = field(default_factory=list)
    source: str = "detected"
    distributions: dict[str, str] | None = None  # every installed one, name -> version; None: not probed

    @property
    def accelerator(self) -> str:
        """The peer's accelerator: cuda or mps when it has such a device, else cpu."""
        return machine_accelerator({d.kind for d in self.devices})

    @property
    def memory_kind(self) -> str:
        return self.devices[0].memory_kind if self.devices else HOST_MEMORY

    def framework(self, name: str) -> Framework | None:
        return next((f for f in self.frameworks if f.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; each device's `validation` is under its reported name "independent"."""
        data = asdict(self)
        data["devices"] = [{("independent" if k == "validation" else k): v for k, v in d.items()}
                           for d in data["devices"]]
        return data



@dataclass(frozen=True)
class Advert:
    """A peer as the submitter sees it: identity, resources summary and capacity.

    This is what the TXT record carries; matching works on it alone. `frameworks` lists the
    probed ones (torch, mlx) and those an override declares. Every other installed distribution
    is in `distributions`, which only the peer's own advert holds (the TXT record has no room for
    them): an advert from TXT has None there, and the peer answers for those names when it admits
    a task.
    """

    peer_id: str
    name: str
    cluster: str
    accelerator: str
    memory_kind: str
    device_memory_gb: tuple[float, ...]
    device_name: str
    distributed: str
    ram_gb: float
    cpu_count: int
    frameworks: tuple[tuple[str, str], ...]
    capabilities: frozenset[str]
    slots: int
    python: str
    version: int = PROTOCOL_VERSION
    validation: str = "detected"
    features: frozenset[str] = FEATURES  # the optional parts of the protocol it speaks (`features_of`)
    # (distribution_key(name), version) pairs; not part of the advert's identity, which is its TXT form
    distributions: frozenset[tuple[str, str]] | None = field(default=None, compare=False)

    @property
    def device_count(self) -> int:
        return len(self.device_memory_gb)

    @property
    def has_gpu(self) -> bool:
        return is_gpu(self.accelerator)

    def knows(self, name: str) -> bool:
        """Whether this advert can tell if `name` is installed: always on the peer itself, else
        only for the frameworks it lists and the probed ones."""
        return self.distributions is not None or name in PROBED_FRAMEWORKS or name in dict(self.frameworks)

    def framework_version(self, name: str) -> str | None:
        """The installed version of a framework or any distribution, None when unknown or absent."""
        version = dict(self.frameworks).get(name)
        if version is None and self.distributions is not None and name not in PROBED_FRAMEWORKS:
            version = dict(self.distributions).get(distribution_key(name))
        return version

    @classmethod
    def from_resources(cls, res: Resources, *, peer_id: str, name: str, cluster: str, slots: int) -> Advert:
        gpus = [d for d in res.devices if d.kind == res.accelerator]
        return cls(
            peer_id=peer_id,
            name=name,
            cluster=cluster,
            accelerator=res.accelerator,
            memory_kind=res.memory_kind,
            device_memory_gb=tuple(round(d.memory_gb, 1) for d in gpus),
            device_name=gpus[0].name if gpus else res.cpu_name,
            distributed=gpus[0].distributed if gpus else UNSUPPORTED,
            ram_gb=round(res.memory_gb, 1),
            cpu_count=res.cpu_count,
            frameworks=tuple(sorted((f.name, f.version) for f in res.frameworks)),
            capabilities=frozenset(c for f in res.frameworks for c in f.capabilities),
            slots=slots,
            python=res.python,
            validation=gpus[0].validation if gpus else "detected",
            distributions=None if res.distributions is None else
            frozenset((distribution_key(n), v) for n, v in res.distributions.items()),
        )

    def to_txt(self) -> dict[str, str]:
        """Compact TXT properties; every entry fits one 255-byte TXT string."""
        txt = {
            "v": str(self.version),
            "id": self.peer_id,
            "cl": self.cluster,
            "n": self.name,
            "acc": self.accelerator,
            "mk": self.memory_kind,
            "gm": ",".join(f"{m:g}" for m in self.device_memory_gb),
            "dn": self.device_name,
            "dist": self.distributed,
            "ind": self.validation,
            "ram": f"{self.ram_gb:g}",
            "cpu": str(self.cpu_count),
            "fw": ",".join(f"{k}/{v}" for k, v in self.frameworks),
            "cap": ",".join(sorted(self.capabilities)),
            "sl": str(self.slots),
            "py": self.python,
            "ft": ",".join(sorted(self.features)),
        }
        return {k: _fit_txt(k, v) for k, v in txt.items()}

    @classmethod
    def from_txt(cls, txt: Mapping[Any, Any]) -> Advert:
        """Parse TXT properties (str or bytes keys/values) from an untrusted source.

        Every value is checked: numbers finite, non-negative and bounded, names from the known
        vocabularies, text printable (control characters are removed) and short. Raises
        ValueError naming the first value that fails.
        """
        if not isinstance(txt, Mapping):
            raise ValueError(f"malformed GPUlayer TXT record: a {type(txt).__name__}, not a map")
        t = {_text(k): _text(v) for k, v in txt.items() if v is not None}
        try:
            peer_id = _token(t, "id")
            return cls(
                version=_number(t, "v", int, 1 << 16),
                peer_id=peer_id,
                cluster=_token(t, "cl"),
                name=_printable(t.get("n", peer_id)) or peer_id,
                accelerator=_choice(t, "acc", KINDS, None),
                memory_kind=_choice(t, "mk", MEMORY_KINDS, HOST_MEMORY),
                device_memory_gb=tuple(_bounded(float(m), "gm", MAX_MEMORY_GB) for m in t.get("gm", "").split(",") if m),
                device_name=_printable(t.get("dn", "")),
                distributed=_printable(t.get("dist", UNSUPPORTED)),
                validation=_printable(t.get("ind", "detected")),
                ram_gb=_number(t, "ram", float, MAX_MEMORY_GB, 0.0),
                cpu_count=_number(t, "cpu", int, MAX_COUNT, 0),
                frameworks=tuple(sorted((_printable(n), _printable(v)) for n, v in
                                        (item.split("/", 1) for item in t.get("fw", "").split(",") if "/" in item))),
                capabilities=frozenset(_printable(c) for c in t.get("cap", "").split(",") if c),
                slots=max(1, _number(t, "sl", int, MAX_COUNT, 1)),
                python=_printable(t.get("py", "")),
                features=features_of(t),
            )
        except KeyError as exc:
            raise ValueError(f"malformed GPUlayer TXT record: {exc.args[0]!r} is missing") from None
        except ValueError as exc:
            raise ValueError(f"malformed GPUlayer TXT record: {exc}") from None


MAX_MEMORY_GB = 1 << 20  # bounds on advertised numbers: beyond any machine, far below overflow
MAX_COUNT = 1 << 16
MEMORY_KINDS = (DEDICATED, UNIFIED, HOST_MEMORY)


def features_of(txt: Mapping[Any, Any]) -> frozenset[str]:
    """The features a TXT record (an advert, or the one in a HELLO) names in "ft": those of FEATURES only.
    An older peer names none: it answers no PEERS (and closes a connection that sends one)."""
    value = txt.get("ft", txt.get(b"ft", "")) if isinstance(txt, Mapping) else ""
    return FEATURES & set(_text(value or "").split(","))
_TOKEN = re.compile(r"[0-9A-Za-z_-]{1,64}")
_N = TypeVar("_N", int, float)


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _printable(value: str, limit: int = TXT_VALUE_MAX) -> str:
    """The value without control or other non-printable characters, at most `limit` characters."""
    return "".join(ch for ch in value if ch.isprintable())[:limit]


def _token(t: dict[str, str], key: str) -> str:
    value = t[key]
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"{key}={value[:40]!r} is not an id")
    return value


def _choice(t: dict[str, str], key: str, choices: tuple[str, ...], default: str | None) -> str:
    value = t.get(key, default)
    if value not in choices:
        raise ValueError(f"{key}={(value or '')[:40]!r} is not one of {', '.join(choices)}")
    return value


def _bounded(value: _N, key: str, limit: int) -> _N:
    if not 0 <= value <= limit:  # NaN fails too
        raise ValueError(f"{key}={value!r} is not between 0 and {limit}")
    return value


def _number(t: dict[str, str], key: str, kind: type[_N], limit: int, default: _N | None = None) -> _N:
    raw = t.get(key)
    if raw is None:
        if default is None:
            raise KeyError(key)
        return default
    return _bounded(kind(raw), key, limit)


def _fit_txt(key: str, value: str) -> str:
    """Truncate a value so that 'key=value' fits one TXT string (UTF-8 safe)."""
    room = TXT_VALUE_MAX - len(key) - 1
    data = value.encode("utf-8")
    return value if len(data) <= room else data[:room].decode("utf-8", "ignore")
