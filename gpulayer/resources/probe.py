"""Probe the job interpreter: Python, torch and mlx, with a tiny validation op on each device, and
the versions of all its installed distributions (importlib.metadata).

Runs INSIDE the job interpreter, which may lack GPUlayer and every third-party package, so only
the standard library is imported at module level and it is run by file path:

    python /path/to/probe.py      # prints one JSON object on stdout
    python /path/to/probe.py distributions   # only "python", "distributions" and "paths": no import

Output (a framework is null when not installed, {"error": "..."} when its import fails; a
section that raised has an "error" string; "ok" is null when no op was tried):

    {"python": {"version": "3.11.7", "executable": "/usr/bin/python3"},
     "torch": {"version": "2.4.1+cu121",
               "cuda": {"available": true, "nccl": true,
                        "devices": [{"index": 0, "name": "NVIDIA H100 80GB HBM3",
                                     "memory_bytes": 85029158912, "ok": true, "error": null}]},
               "mps": {"built": false, "available": false, "ok": null, "error": null}},
     "mlx": {"version": "0.32.4",
             "backends": {"cpu": {"available": true, "ok": true, "error": null},
                          "metal": {"available": false, "ok": null, "error": null},
                          "cuda": {"available": false, "ok": null, "error": null}}},
     "distributions": {"msgpack": "1.1.0", "torch": "2.4.1+cu121", ...},
     "paths": ["/usr/lib/python311.zip", ...]}

"paths" is sys.path: a new probe is worth it once one of them changed (a pip install).
"""

import importlib.metadata
import json
import os
import platform
import sys


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _validate(op) -> dict:
    """Run a tiny op that must give 14.0 (sum of squares of 0..3): {"ok": bool, "error": None or "..."}."""
    try:
        value = float(op())
        if value != 14.0:
            raise RuntimeError(f"tiny op gave {value}, expected 14.0")
    except Exception as exc:
        return {"ok": False, "error": _error(exc)}
    return {"ok": True, "error": None}


def _torch_op(torch, device: str):
    return lambda: (torch.arange(4.0, device=device) ** 2).sum().item()


def _import(name: str):
    """(module, None), or (None, what to report: None when not installed, else {"error": ...})."""
    try:
        module = __import__(name, fromlist=["_"])
    except ModuleNotFoundError as exc:
        return None, (None if exc.name == name.split(".")[0] else {"error": _error(exc)})
    except Exception as exc:  # a broken install can raise anything
        return None, {"error": _error(exc)}
    if not hasattr(module, "__version__"):  # e.g. a stray directory of that name
        return None, {"error": f"{name} from {getattr(module, '__path__', '?')} has no __version__"}
    return module, None


def _torch_cuda(torch) -> dict:
    info = {"available": False, "nccl": False, "devices": []}
    try:
        info["available"] = bool(torch.cuda.is_available())
        dist = torch.distributed
        info["nccl"] = bool(dist.is_available() and dist.is_nccl_available())
        for i in range(torch.cuda.device_count() if info["available"] else 0):
            props = torch.cuda.get_device_properties(i)
            device = {"index": i, "name": props.name, "memory_bytes": int(props.total_memory)}
            device.update(_validate(_torch_op(torch, f"cuda:{i}")))
            info["devices"].append(device)
    except Exception as exc:
        info["error"] = _error(exc)
    return info


def _torch_mps(torch) -> dict:
    info = {"built": False, "available": False, "ok": None, "error": None}
    try:
        mps = getattr(torch.backends, "mps", None)  # absent before torch 1.12
        info["built"] = bool(mps and mps.is_built())
        info["available"] = bool(mps and mps.is_available())
        if info["available"]:
            info.update(_validate(_torch_op(torch, "mps")))
    except Exception as exc:
        info["error"] = _error(exc)
    return info


def _torch():
    torch, missing = _import("torch")
    if torch is None:
        return missing
    return {"version": str(torch.__version__), "cuda": _torch_cuda(torch), "mps": _torch_mps(torch)}


def _mlx_backend(available, op) -> dict:
    """A backend record; the op runs only on an available backend."""
    try:
        available = bool(available())
    except Exception as exc:
        return {"available": False, "ok": None, "error": _error(exc)}
    return {"available": available, **(_validate(op) if available else {"ok": None, "error": None})}


def _mlx():
    mx, missing = _import("mlx.core")
    if mx is None:
        return missing

    def op(device):
        return lambda: mx.sum(mx.arange(4.0, stream=device) ** 2, stream=device).item()

    cuda = getattr(getattr(mx, "cuda", None), "is_available", lambda: False)  # mlx >= 0.26
    cpu = _validate(op(mx.cpu))
    return {
        "version": str(mx.__version__),
        "backends": {
            "cpu": {"available": cpu["ok"], **cpu},
            "metal": _mlx_backend(lambda: mx.metal.is_available(), op(mx.gpu)),
            "cuda": _mlx_backend(cuda, op(mx.gpu)),
        },
    }


def _distributions() -> dict:
    """{name: version} of the installed distributions; the first on sys.path wins, as for imports."""
    found = {}
    for dist in importlib.metadata.distributions():
        try:
            name, version = dist.metadata["Name"], dist.version
        except Exception:  # unreadable metadata of a broken install
            continue
        if name and version:
            found.setdefault(name, version)
    return found


def probe(frameworks: bool = True) -> dict:
    """What this interpreter offers; never raises for a missing or broken framework. Without
    `frameworks`, only its distributions (no import: fast)."""
    found = {"python": {"version": platform.python_version(), "executable": sys.executable}}
    if frameworks:
        found.update(torch=_torch(), mlx=_mlx())
    return {**found, "distributions": _distributions(), "paths": [p for p in sys.path if p]}


def main() -> None:
    # Frameworks may print (even from C); keep stdout for the JSON alone.
    stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        result = probe(frameworks=sys.argv[1:] != ["distributions"])
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
