"""Detect what this machine offers: raw system facts in, Resources out.

`collect_facts` is the only code that touches the system; `parse_facts` is pure, so recorded
facts (tests/resources/facts/*.json) replay any machine.

"GB" means 2**30 bytes throughout, as Apple and NVIDIA label memory: a 32 GB Mac has
hw.memsize 34359738368 (32.0 GB), an "H100 80GB" has 81559 MiB in nvidia-smi (79.6 GB).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from gpulayer.accelerators import CPU, CUDA, DISTRIBUTED, GPU_KINDS, MEMORY_KIND, MPS, UNIFIED, UNSUPPORTED
from gpulayer.errors import ConfigError
from gpulayer.resources.model import Device, Framework, Resources
from gpulayer.security import cache_home, write_private_file

log = logging.getLogger(__name__)

PROBE = Path(__file__).with_name("probe.py")
PROBE_TIMEOUT_S = 60
PYTHON_VERSION_TIMEOUT_S = 30  # a bare interpreter start, when the probe failed
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
NVIDIA_SMI_TIMEOUT_S = 10
GB = 2**30
MIB = 2**20


def _run(args: list[str], timeout: float) -> dict:
    """Run a command: {"stdout": ..., "error": None or "..."}; never raises."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"stdout": "", "error": f"{type(exc).__name__}: {exc}"}
    error = None if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-500:]}"
    return {"stdout": done.stdout, "error": error}


def _sysctl(key: str) -> str | None:
    return _run(["sysctl", "-n", key], 5)["stdout"].strip() or None


def _cpu_brand(system: str) -> str | None:
    if system == "Darwin":
        return _sysctl("machdep.cpu.brand_string")
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _probe(python: str, *args: str) -> dict:
    """The probe's JSON from running probe.py in `python` (with `args`), or {"error": "..."} with at
    least the interpreter's version when it can still be had (a probe that timed out on a loaded
    machine must not leave the peer with an unknown Python, which no task shipped by value matches)."""
    done = _run([python, str(PROBE), *args], PROBE_TIMEOUT_S)
    if done["error"]:
        version = _run([python, "-I", "-S", "-c", "import platform; print(platform.python_version())"],
                       PYTHON_VERSION_TIMEOUT_S)
        failed: dict = {"error": done["error"]}
        if not version["error"] and version["stdout"].strip():
            failed["python"] = {"version": version["stdout"].strip()[:40], "executable": python}
        return failed
    try:
        return json.loads(done["stdout"])
    except ValueError:
        return {"error": f"probe printed no JSON: {done['stdout'][-500:]!r}"}


PROBE_CACHE_ENV = "GPULAYER_PROBE_CACHE"
# the variables that change what the probe sees (the interpreter's search path, the libraries torch loads,
# the devices CUDA shows): a probe is only reused under the same values
PROBE_ENV_PREFIXES = ("PYTHON", "LD_", "DYLD_", "CUDA_", "NVIDIA_", "PYTORCH_", "MLX_", "METAL_", "HIP_", "ROCR_")


def _stamp(path: str) -> list | None:
    """What changes when something is installed into `path` or the file is replaced: its mtime, size, inode."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size, st.st_ino]


def _probe_cache_path(python: str) -> Path | None:
    """The cache file of the full probe of `python` under this boot, environment and probe.py; None when
    GPULAYER_PROBE_CACHE is 0."""
    value = os.environ.get(PROBE_CACHE_ENV, "1")
    if value not in ("0", "1"):
        raise ConfigError(f"{PROBE_CACHE_ENV}={value!r}: must be 1 (reuse an unchanged probe) or 0")
    if value == "0":
        return None
    where = os.path.abspath(python)  # not its real path: a venv's python is a link to the one it was made from
    key = json.dumps([where, _stamp(where), psutil.boot_time(), hashlib.sha256(PROBE.read_bytes()).hexdigest(),
                      sorted((k, v) for k, v in os.environ.items() if k.startswith(PROBE_ENV_PREFIXES))])
    return cache_home() / "probes" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _full_probe(python: str) -> dict:
    """The full probe of `python` (frameworks imported and tried on each device: seconds), reused from
    the cache while nothing it depends on changed: the interpreter, this boot, the variables of
    PROBE_ENV_PREFIXES, probe.py, and each folder of the interpreter's sys.path (a pip install
    changes its site-packages). A probe that failed is never kept."""
    path = _probe_cache_path(python)
    try:
        cached = json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        cached = None
    if (isinstance(cached, dict) and isinstance(cached.get("stamps"), list) and isinstance(cached.get("probe"), dict)
            and all(isinstance(p, str) and _stamp(p) == stamp for p, stamp in cached["stamps"])):
        return cached["probe"]
    probe = _probe(python)
    if path and not probe.get("error"):
        stamps = [[p, _stamp(p)] for p in probe.get("paths") or [] if isinstance(p, str)]
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_private_file(path, json.dumps({"stamps": stamps, "probe": probe}))
        except OSError as exc:
            log.debug("could not keep the probe in %s: %s", path, exc)
    return probe


def collect_facts(python: str | None = None) -> dict:
    """Gather raw facts about this machine and the job interpreter `python`; never raises.

    Keys (JSON-serializable, so they can be recorded and replayed):
      hostname       socket.gethostname()
      system         platform.system(): "Linux", "Darwin", "Windows"
      machine        platform.machine(): "x86_64", "arm64", "aarch64"
      release        platform.release(): the kernel release
      mac_ver        platform.mac_ver()[0]: "14.4.1" on macOS, "" elsewhere
      cpu_count      logical CPUs (psutil)
      memory_bytes   total RAM (psutil)
      cpu_brand      /proc/cpuinfo "model name" on Linux, `sysctl -n machdep.cpu.brand_string`
                     on macOS, else platform.processor(); None when unknown
      sysctl         on macOS {"hw.memsize": "34359738368", "hw.model": "Mac14,6"} (raw strings,
                     None when unreadable); {} elsewhere
      nvidia_smi     None without nvidia-smi on PATH, else {"stdout", "error"} of
                     `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`
      probe_python   the job interpreter that was probed (default sys.executable)
      probe          probe.py's JSON (see gpulayer.resources.probe), or {"error": "..."}; an earlier
                     probe of the same interpreter while nothing it depends on changed (_full_probe)
    """
    python = python or sys.executable
    system = platform.system()
    facts = {
        "hostname": socket.gethostname(),
        "system": system,
        "machine": platform.machine(),
        "release": platform.release(),
        "mac_ver": platform.mac_ver()[0],
        "cpu_count": psutil.cpu_count() or 1,
        "memory_bytes": psutil.virtual_memory().total,
        "cpu_brand": _cpu_brand(system),
        "sysctl": {key: _sysctl(key) for key in ("hw.memsize", "hw.model")} if system == "Darwin" else {},
        "nvidia_smi": _run(NVIDIA_SMI, NVIDIA_SMI_TIMEOUT_S) if shutil.which("nvidia-smi") else None,
        "probe_python": python,
        "probe": _full_probe(python),
    }
    for where, error in _errors(facts):  # detection goes on without what failed
        log.warning("resource detection (job python %s): %s: %s", python, where, error)
    return facts


def _errors(record, where: str = ""):
    """(where, error) for every "error" recorded in facts, e.g. ("probe.torch.cuda.devices[1]", "...")."""
    if isinstance(record, dict):
        if record.get("error"):
            yield where, record["error"]
        for key, value in record.items():
            yield from _errors(value, f"{where}.{key}" if where else key)
    elif isinstance(record, list):
        for i, value in enumerate(record):
            yield from _errors(value, f"{where}[{i}]")


def _gb(nbytes: float) -> float:
    return round(nbytes / GB, 1)


def _installed(probe: dict, name: str) -> dict:
    """The probe's record of a framework when it imported, else {}."""
    record = probe.get(name)
    return record if isinstance(record, dict) and "version" in record else {}


def _smi_rows(smi: dict | None) -> list[tuple[int, str, int | None]]:
    """(index, name, MiB or None) per GPU line of nvidia-smi's CSV; other lines are skipped."""
    rows = []
    for line in (smi or {}).get("stdout", "").splitlines():
        index, _, rest = line.partition(",")
        name, _, mib = rest.rpartition(",")
        if index.strip().isdigit() and name.strip():
            rows.append((int(index), name.strip(), int(mib) if mib.strip().isdigit() else None))
    return rows


def _cuda_devices(facts: dict, torch: dict) -> list[Device]:
    """From torch when it sees CUDA, else from nvidia-smi ("detected" only).

    nvidia-smi reports "[N/A]" memory for integrated GPUs (GB10, Jetson): those share system RAM.
    """
    cuda = torch.get(CUDA) or {}
    distributed = DISTRIBUTED[CUDA] if cuda.get("nccl") else UNSUPPORTED
    if cuda.get("available"):
        found = [(d["index"], d["name"], d["memory_bytes"], d.get("ok") is True) for d in cuda.get("devices", [])]
    else:
        rows = _smi_rows(facts.get("nvidia_smi"))
        found = [(i, name, None if mib is None else mib * MIB, False) for i, name, mib in rows]
    return [
        Device(
            index=index,
            kind=CUDA,
            name=name,
            memory_gb=_gb(facts["memory_bytes"] if nbytes is None else nbytes),
            memory_kind=UNIFIED if nbytes is None else MEMORY_KIND[CUDA],
            validation="hardware-validated" if ok else "detected",
            distributed=distributed,
        )
        for index, name, nbytes, ok in found
    ]


def _mps_devices(facts: dict, torch: dict, mlx: dict) -> list[Device]:
    """One unified-memory GPU on Apple Silicon (Darwin arm64); none on Intel Macs."""
    if (facts["system"], facts["machine"]) != ("Darwin", "arm64"):
        return []
    chip = (facts.get("cpu_brand") or "").removeprefix("Apple ") or "arm64"
    memsize = (facts.get("sysctl") or {}).get("hw.memsize") or ""
    validated = (torch.get(MPS) or {}).get("ok") or ((mlx.get("backends") or {}).get("metal") or {}).get("ok")
    return [
        Device(
            index=0,
            kind=MPS,
            name=f"Apple {chip} GPU (MPS)",
            memory_gb=_gb(int(memsize) if memsize.isdigit() else facts["memory_bytes"]),
            memory_kind=MEMORY_KIND[MPS],
            validation="hardware-validated" if validated else "detected",
            distributed=DISTRIBUTED[MPS],
        )
    ]


def _frameworks(torch: dict, mlx: dict) -> list[Framework]:
    frameworks = []
    if torch:
        available = {CPU: True, **{k: (torch.get(k) or {}).get("available") for k in GPU_KINDS}}
        frameworks.append(Framework("torch", torch["version"], tuple(f"torch.{k}" for k, v in available.items() if v)))
    if mlx:
        backends = mlx.get("backends") or {}
        caps = tuple(f"mlx.{k}" for k in ("cpu", "metal", "cuda") if (backends.get(k) or {}).get("available"))
        frameworks.append(Framework("mlx", mlx["version"], caps))
    return frameworks


def parse_facts(facts: dict) -> Resources:
    """Resources from `collect_facts` output (pure: same facts, same Resources).

    CUDA devices come from torch when it sees CUDA, else from nvidia-smi; Apple Silicon has one
    MPS device. A device is "hardware-validated" when the probe's tiny op ran on it (for MPS: in
    torch or in mlx on Metal), else "detected".
    """
    probe = facts.get("probe") or {}
    torch, mlx = _installed(probe, "torch"), _installed(probe, "mlx")
    return Resources(
        host=facts["hostname"],
        system=facts["system"],
        machine=facts["machine"],
        cpu_name=facts.get("cpu_brand") or facts["machine"],
        cpu_count=int(facts["cpu_count"]),
        memory_gb=_gb(facts["memory_bytes"]),
        python=(probe.get("python") or {}).get("version", ""),
        devices=_cuda_devices(facts, torch) + _mps_devices(facts, torch, mlx),
        frameworks=_frameworks(torch, mlx),
        source="detected",
        distributions=probe.get("distributions"),
    )


def look_again(res: Resources, python: str, frameworks: bool) -> tuple[Resources, list[str]]:
    """`res` with the distributions of the job interpreter `python` probed again, and with
    `frameworks` its frameworks too (which imports them: seconds), unless an override declares
    them; and the interpreter's sys.path. The devices stay as they were. A probe that fails
    changes nothing (its error is logged)."""
    probe = _probe(python, *([] if frameworks else ["distributions"]))
    if probe.get("error"):
        log.warning("probing the job interpreter %s again failed: %s", python, probe["error"])
        return res, []
    changes: dict = {"distributions": probe.get("distributions")}
    if frameworks and res.source == "detected":
        changes["frameworks"] = _frameworks(_installed(probe, "torch"), _installed(probe, "mlx"))
    return dataclasses.replace(res, **changes), [p for p in probe.get("paths") or [] if isinstance(p, str)]


def detect(python: str | None = None) -> Resources:
    """Resources of this machine, with frameworks as seen by the job interpreter `python`."""
    return parse_facts(collect_facts(python))


def format_resources(res: Resources, *, python_path: str | None = None) -> str:
    """The human report of `gpulayer resources detect`: one "label     value" line each."""
    devices = [d.describe() for d in res.devices] or ["none (CPU only)"]
    frameworks = [f"{f.name} {f.version}: {', '.join(f.capabilities) or 'none'}" for f in res.frameworks]
    lines = [
        ("host", f"{res.host} ({res.system} {res.machine})"),
        ("cpu", f"{res.cpu_count} x {res.cpu_name}"),
        ("memory", f"{res.memory_gb:.1f} GB"),
        ("python", (res.python or "unknown") + (f" ({python_path})" if python_path else "")),
        *(("device", d) for d in devices),
        *(("framework", f) for f in frameworks or ["none"]),
        ("source", res.source),
    ]
    return "\n".join(f"{label:<10}{value}" for label, value in lines)
