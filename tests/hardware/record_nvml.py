"""Record real NVML readings of this machine's GPUs, idle and busy, for tests/resources/facts/utilisation/.

Reads `NvmlReader().read()` and a `Sampler().sample()` a few times with the GPUs idle (before this
process touches CUDA), then again while a bf16 matmul loop keeps GPU 0 busy, and writes the raw
readings as JSON:

    python tests/hardware/record_nvml.py --out nvml_h200_recorded.json

Needs nvidia-ml-py (the gpulayer[nvidia] extra) and torch with CUDA.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import threading
import time

from gpulayer.resources.utilisation import NvmlReader, Sampler

READINGS = 3  # per state
GAP_S = 0.5  # between readings: NVML's utilisation is averaged over its own sample period


def readings(reader: NvmlReader, sampler: Sampler) -> list[dict]:
    """`READINGS` pairs of (NvmlReader.read(), Sampler.sample()), `GAP_S` apart."""
    out = []
    for _ in range(READINGS):
        out.append({"nvml": reader.read(), "sample": sampler.sample()})
        time.sleep(GAP_S)
    return out


def busy_loop(stop: threading.Event, started: threading.Event) -> None:
    """Back-to-back bf16 matmuls on GPU 0 until `stop` (synchronizing every 50, so the queue stays short)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(50):
            a @ b
        torch.cuda.synchronize()
        started.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--warm-s", type=float, default=2.0, help="seconds of load before the busy readings")
    args = parser.parse_args()

    reader = NvmlReader()
    if not reader.available:
        raise SystemExit("NVML reads no GPU here (nvidia-ml-py missing, or no NVIDIA GPU)")
    sampler = Sampler()
    sampler.sample()  # psutil's first cpu_percent is measured from this call on
    time.sleep(GAP_S)
    idle = readings(reader, sampler)

    stop, started = threading.Event(), threading.Event()
    thread = threading.Thread(target=busy_loop, args=(stop, started), daemon=True)
    thread.start()
    if not started.wait(60):
        raise SystemExit("the matmul loop did not start")
    time.sleep(args.warm_s)
    busy = readings(reader, sampler)
    stop.set()
    thread.join()

    import pynvml
    import torch

    record = {
        "what": "raw readings of gpulayer.resources.utilisation: NvmlReader().read() ('nvml') and "
                "Sampler().sample() ('sample'), idle and under a bf16 8192x8192 matmul loop on GPU 0",
        "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "gpu": torch.cuda.get_device_name(0),
                    "driver": pynvml.nvmlSystemGetDriverVersion(), "nvidia_ml_py": pynvml.__version__
                    if hasattr(pynvml, "__version__") else None, "torch": torch.__version__},
        "idle": idle,
        "busy": busy,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({state: [r["nvml"] for r in record[state]] for state in ("idle", "busy")}))


if __name__ == "__main__":
    main()
