"""Explicit override of the advertised resources: the peer's `--advertise-override FILE`.

For operators (declare what detection cannot see, hide a GPU) and for tests (advertise a Mac
from a Linux box). The file is one JSON object holding any subset of these fields; the fields
given replace the detected ones, the others stay as detected:

    host         non-empty string
    system       non-empty string            "Darwin", "Linux"
    machine      non-empty string            "arm64", "x86_64"
    cpu_name     non-empty string            "Apple M2 Max"
    cpu_count    integer >= 1                logical CPUs
    memory_gb    number >= 0                 system RAM (GB = 2**30 bytes)
    python       version string              the job interpreter's Python, "3.11.7"
    devices      list of objects; replaces the detected devices ([] advertises CPU only):
        kind         "cuda" or "mps"                 required
        name         non-empty string                required
        memory_gb    number >= 0                     required
        memory_kind  "dedicated" or "unified"        default: "unified" for mps, "dedicated" for cuda;
                                                     an mps device is always "unified"
        index        integer >= 0                    default: the position in the list
        distributed  "nccl" or "unsupported"         default: "unsupported" for mps, "nccl" for cuda
    frameworks   list of objects; replaces the detected frameworks:
        name          non-empty string               required
        version       version string, "2.13.0+cpu"   required
        capabilities  list of non-empty strings      default: []  ("torch.cpu", "torch.mps", "mlx.metal")

Devices from an override are advertised with validation="override" (reported as
independent=override), and the resources' source becomes "override:<file>". Anything else (an
unknown field, another device kind, a negative size, a wrong type, a bad version) is a
ValueError naming the file and the field.

Example, a 32 GB Apple M2 Max:

    {"system": "Darwin", "machine": "arm64", "cpu_name": "Apple M2 Max", "memory_gb": 32,
     "devices": [{"kind": "mps", "name": "Apple M2 Max GPU (MPS)", "memory_gb": 32}],
     "frameworks": [{"name": "torch", "version": "2.5.1", "capabilities": ["torch.cpu", "torch.mps"]}]}
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from packaging.version import InvalidVersion, Version

from gpulayer.accelerators import DEDICATED, DISTRIBUTED, GPU_KINDS, MEMORY_KIND, MPS, NCCL, UNIFIED, UNSUPPORTED
from gpulayer.resources.model import Device, Framework, Resources

# the defaults of a device's optional fields, per kind: {"cuda": {"memory_kind": "dedicated", ...}, "mps": ...}
DEVICE_DEFAULTS = {kind: {"memory_kind": MEMORY_KIND[kind], "distributed": DISTRIBUTED[kind]} for kind in GPU_KINDS}


class _Invalid(ValueError):
    """A field is wrong; the message starts with its path, e.g. "devices[0].memory_gb"."""


def _at(field: str) -> str:
    return f"{field}: " if field else ""


def _check(value, field: str, ok: bool, expected: str):
    if not ok:
        raise _Invalid(f"{_at(field)}expected {expected}, got {value!r}")
    return value


def _string(value, field: str) -> str:
    return _check(value, field, isinstance(value, str) and value != "", "a non-empty string")


def _choice(*choices: str):
    return lambda value, field: _check(value, field, value in choices, " or ".join(map(repr, choices)))


def _integer(minimum: int):
    expected = f"an integer >= {minimum}"
    return lambda value, field: _check(value, field, type(value) is int and value >= minimum, expected)


def _size(value, field: str) -> float:
    ok = type(value) in (int, float) and math.isfinite(value) and value >= 0
    return float(_check(value, field, ok, "a number >= 0"))


def _version(value, field: str) -> str:
    try:
        Version(_string(value, field))
    except InvalidVersion:
        _check(value, field, False, "a version like '2.13.0'")
    return value


def _list(value, field: str) -> list:
    return _check(value, field, isinstance(value, list), "a list")


def _object(value, field: str, schema: dict, required: tuple[str, ...] = ()) -> dict:
    """The checked fields of a JSON object: no unknown fields, the required ones present."""
    _check(value, field, isinstance(value, dict), "a JSON object")
    for key in value:
        if key not in schema:
            raise _Invalid(f"{_at(field)}unknown field {key!r} (known: {', '.join(schema)})")
    for key in required:
        if key not in value:
            raise _Invalid(f"{_at(field)}missing required field {key!r}")
    return {key: schema[key](v, f"{field}.{key}" if field else key) for key, v in value.items()}


def _device(value, field: str, position: int) -> Device:
    checked = _object(value, field, DEVICE_FIELDS, ("kind", "name", "memory_gb"))
    if checked["kind"] == MPS and checked.get("memory_kind", UNIFIED) != UNIFIED:
        raise _Invalid(f"{field}.memory_kind: an mps device shares the Mac's unified memory; "
                       f"{checked['memory_kind']!r} is only for cuda")
    return Device(**{"index": position, **DEVICE_DEFAULTS[checked["kind"]], **checked, "validation": "override"})


def _devices(value, field: str) -> list[Device]:
    return [_device(d, f"{field}[{i}]", i) for i, d in enumerate(_list(value, field))]


def _framework(value, field: str) -> Framework:
    return Framework(**{"capabilities": (), **_object(value, field, FRAMEWORK_FIELDS, ("name", "version"))})


def _frameworks(value, field: str) -> list[Framework]:
    return [_framework(f, f"{field}[{i}]") for i, f in enumerate(_list(value, field))]


def _capabilities(value, field: str) -> tuple[str, ...]:
    return tuple(_string(c, f"{field}[{i}]") for i, c in enumerate(_list(value, field)))


DEVICE_FIELDS = {
    "kind": _choice(*DEVICE_DEFAULTS),
    "name": _string,
    "memory_gb": _size,
    "memory_kind": _choice(DEDICATED, UNIFIED),
    "index": _integer(0),
    "distributed": _choice(NCCL, UNSUPPORTED),
}
FRAMEWORK_FIELDS = {"name": _string, "version": _version, "capabilities": _capabilities}
FIELDS = {
    "host": _string,
    "system": _string,
    "machine": _string,
    "cpu_name": _string,
    "cpu_count": _integer(1),
    "memory_gb": _size,
    "python": _version,
    "devices": _devices,
    "frameworks": _frameworks,
}


def _parse(data, source: str) -> dict:
    try:
        return _object(data, "", FIELDS)
    except _Invalid as exc:
        raise ValueError(f"advertise override {source}: {exc}") from None


def load_override(path: str | Path) -> dict:
    """The override file's JSON object, checked; ValueError naming the file when it is bad."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"advertise override {path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"advertise override {path}: not valid JSON: {exc}") from None
    _parse(data, str(path))
    return data


def apply_override(res: Resources, data: dict, source: str) -> Resources:
    """`res` with the fields of the override `data` replaced; source becomes "override:<path>".

    `source` is the file's path, with or without the "override:" prefix.
    """
    path = source.removeprefix("override:")
    return dataclasses.replace(res, **_parse(data, path), source=f"override:{path}")
