"""Measured utilisation of a peer: its GPUs (NVML, ioreg), CPU and memory (psutil), sampled cheaply.

`read_nvml`, `read_ioreg` and `read_host` are the only code that touches the system; `parse_nvml`,
`parse_ioreg` and `parse_host` are pure, so recorded readings (tests/resources/facts/utilisation/)
replay any machine. `clean_sample` checks a sample that came from elsewhere (another peer's STATUS).

A sample is a plain dict, the `util` of a STATUS reply::

    {"t": unix time, "cpu_percent": 0..100, "ram_total_gb", "ram_available_gb",
     "source": "nvml" | "ioreg" | None,
     "gpus": [{"index", "util_percent" (or None), "memory_used_gb" (or None), "memory_total_gb" (or None)}]}

"GB" is 2**30 bytes, as in detect.py.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import threading
import time
from typing import Any, Callable


GB = 2**30
IOREG = ["ioreg", "-r", "-d", "1", "-w", "0", "-c", "IOAccelerator"]
IOREG_TIMEOUT_S = 5
MAX_GPUS = 64  # a sample from elsewhere lists at most this many devices
MAX_GB = 1 << 20  # memory figures above this (a PiB) are not believed

Sample = dict[str, Any]
log = logging.getLogger("gpulayer.utilisation")
_warned: set[str] = set()  # recorded-readings files already warned about

# One accelerator's statistics, as ioreg prints them on one line:
#   "PerformanceStatistics" = {"Device Utilization %"=41,...,"In use system memory"=626458624}
_STATS = re.compile(r'"PerformanceStatistics"\s*=\s*\{([^}]*)\}')
_ENTRY = re.compile(r'"([^"]+)"\s*=\s*(-?[0-9]+(?:\.[0-9]+)?)')


# ---- pure parsers over recorded readings ---------------------------------------------------------

def parse_ioreg(text: str) -> list[dict[str, Any]]:
    """The GPUs of `ioreg -r -d 1 -w 0 -c IOAccelerator` output: utilisation and memory in use.

    Each accelerator's "PerformanceStatistics" gives "Device Utilization %" and "In use system
    memory" (bytes of unified memory the GPU holds); an entry without them reads as None.
    """
    gpus = []
    for index, block in enumerate(_STATS.findall(text)):
        stats = {key: float(value) for key, value in _ENTRY.findall(block)}
        used = stats.get("In use system memory")
        gpus.append({"index": index, "util_percent": _percent(stats.get("Device Utilization %")),
                     "memory_used_gb": None if used is None else _gb(used), "memory_total_gb": None})
    return gpus


def parse_nvml(readings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPUs of NVML readings: [{"index", "util_gpu" (percent), "memory_used", "memory_total" (bytes)}].

    A field NVML could not read (None) stays None.
    """
    return [{"index": int(r["index"]), "util_percent": _percent(r.get("util_gpu")),
             "memory_used_gb": _gb(r["memory_used"]) if r.get("memory_used") is not None else None,
             "memory_total_gb": _gb(r["memory_total"]) if r.get("memory_total") is not None else None}
            for r in readings]


def parse_host(reading: dict[str, Any]) -> Sample:
    """The CPU and memory part of a sample from psutil's figures: cpu_percent, total and available bytes."""
    return {"cpu_percent": _percent(reading["cpu_percent"]), "ram_total_gb": _gb(reading["memory_total"]),
            "ram_available_gb": _gb(reading["memory_available"])}


def _percent(value: float | None) -> float | None:
    return None if value is None else round(min(max(float(value), 0.0), 100.0), 1)


def _gb(nbytes: float) -> float:
    return round(float(nbytes) / GB, 3)


# ---- readers (the only code that touches the system) ------------------------------------------

def read_host() -> dict[str, Any]:
    """psutil's CPU use since the last call (all cores, 0-100) and the memory figures, in bytes."""
    import psutil  # here: a submitter imports this module for its limits only

    memory = psutil.virtual_memory()
    return {"cpu_percent": psutil.cpu_percent(interval=None), "memory_total": memory.total,
            "memory_available": memory.available}


def read_ioreg() -> str | None:
    """ioreg's IOAccelerator output (macOS, no sudo), or None where ioreg is missing or fails."""
    import subprocess  # here: a submitter imports this module for its limits only

    try:
        done = subprocess.run(IOREG, capture_output=True, text=True, errors="replace", timeout=IOREG_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def read_recorded(path: str) -> Sample:
    """Readings recorded in a JSON file, parsed: "source", "gpus" and, where recorded, the host's figures.

    The file holds {"nvml": [NvmlReader.read() readings]} or {"ioreg": "ioreg output"}, and
    optionally "host": read_host()'s figures. It is read afresh each time, so a test can change
    it while the peer runs. A file that is missing or malformed reads as no GPUs, with a warning.
    """
    try:
        with open(path) as f:
            data = json.load(f)
        part: Sample = parse_host(data["host"]) if "host" in data else {}
        if "nvml" in data:
            return {**part, "source": "nvml", "gpus": parse_nvml(data["nvml"])}
        if "ioreg" in data:
            return {**part, "source": "ioreg", "gpus": parse_ioreg(str(data["ioreg"]))}
        return {**part, "source": None, "gpus": []}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        if path not in _warned:
            _warned.add(path)
            log.warning("measured readings %s are unusable (%s): no GPU readings", path, exc)
        return {"source": None, "gpus": []}


class NvmlReader:
    """NVML readings of every NVIDIA GPU, through nvidia-ml-py (the `gpulayer[nvidia]` extra).

    Imported and initialised on first use; without the package, the library or a GPU it reads
    nothing (`available` is False), which is not an error.
    """

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self.available = self._init()

    def _init(self) -> bool:
        try:
            import pynvml
        except ImportError:
            return False
        try:
            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError:
            return False
        self._nvml = pynvml
        return bool(self._handles)

    def read(self) -> list[dict[str, Any]]:
        return [self._read_one(index, handle) for index, handle in enumerate(self._handles)]

    def _read_one(self, index: int, handle: Any) -> dict[str, Any]:
        nvml = self._nvml
        reading: dict[str, Any] = {"index": index, "util_gpu": None, "memory_used": None, "memory_total": None}
        try:
            reading["util_gpu"] = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
        except nvml.NVMLError:
            pass
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            reading["memory_used"], reading["memory_total"] = memory.used, memory.total
        except nvml.NVMLError:
            pass
        return reading


class Sampler:
    """Samples this machine every `interval` seconds in a daemon thread; `latest()` is the last sample.

    The GPU source is chosen once: NVML where it reads a GPU, else ioreg where it exists (macOS),
    else none (CPU and memory only). With `recorded` (the peer's `--measured-from FILE`, the seam
    that tests and operators use, like `--advertise-override`), every sample reads that file
    instead of the system (`read_recorded`). `on_sample`, if given, is called from the sampling
    thread with each new sample.
    """

    def __init__(self, interval: float = 1.0, recorded: str | None = None,
                 on_sample: Callable[[Sample], None] | None = None):
        self.interval = interval
        self.recorded = recorded
        self.on_sample = on_sample
        self._nvml = NvmlReader() if recorded is None else None
        self._ioreg = self._nvml is not None and not self._nvml.available and shutil.which(IOREG[0]) is not None
        self.source = "nvml" if self._nvml and self._nvml.available else "ioreg" if self._ioreg else None
        self._latest: Sample | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> Sample:
        """Take one sample now."""
        if self.recorded is not None:
            recorded = clean_sample({"t": time.time(), **parse_host(read_host()), **read_recorded(self.recorded)})
            assert recorded is not None  # its time is now
            return recorded
        gpus: list[dict[str, Any]] = []
        if self._nvml is not None and self._nvml.available:
            gpus = parse_nvml(self._nvml.read())
        elif self._ioreg:
            gpus = parse_ioreg(read_ioreg() or "")
        return {"t": time.time(), **parse_host(read_host()), "source": self.source, "gpus": gpus}

    def latest(self) -> Sample | None:
        return self._latest

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpulayer-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while True:
            self._latest = self.sample()
            if self.on_sample is not None:
                self.on_sample(self._latest)
            if self._stop.wait(self.interval):
                return


# ---- checking a sample from elsewhere -----------------------------------------------------------

def clean_sample(value: Any) -> Sample | None:
    """A sample from another machine, checked: known fields only, finite numbers in range; None if unusable."""
    if not isinstance(value, dict):
        return None
    t = finite(value.get("t"), 0, 1e11)
    if t is None:
        return None
    source = value.get("source")
    gpus = value.get("gpus")
    return {"t": t, "cpu_percent": finite(value.get("cpu_percent"), 0, 100),
            "ram_total_gb": finite(value.get("ram_total_gb"), 0, MAX_GB),
            "ram_available_gb": finite(value.get("ram_available_gb"), 0, MAX_GB),
            "source": source if source in ("nvml", "ioreg") else None,
            "gpus": [_clean_gpu(g) for g in gpus[:MAX_GPUS] if isinstance(g, dict)] if isinstance(gpus, list) else []}


def _clean_gpu(gpu: dict[str, Any]) -> dict[str, Any]:
    index = finite(gpu.get("index"), 0, MAX_GPUS)
    return {"index": int(index) if index is not None else None,
            "util_percent": finite(gpu.get("util_percent"), 0, 100),
            "memory_used_gb": finite(gpu.get("memory_used_gb"), 0, MAX_GB),
            "memory_total_gb": finite(gpu.get("memory_total_gb"), 0, MAX_GB)}


def finite(value: Any, low: float, high: float) -> float | None:
    """A finite int or float within [low, high], else None (booleans are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and low <= value <= high else None
