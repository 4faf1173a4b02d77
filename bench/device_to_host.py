"""How a GPU tensor in a result best reaches host memory: pageable `.cpu()` against a pinned copy.

A task's CUDA tensor is copied to the host once when its result is pickled (docs/data.md). This
times, side by side and interleaved, for a few sizes:
- `pageable`: `t.cpu()` (what GPUlayer does);
- `pinned_fresh`: a new pinned buffer for each copy, then `copy_` (pinning is part of the cost);
- `pinned_kept`: one pinned buffer allocated beforehand and reused (the best case for pinning).

Needs torch with CUDA; writes bench/results/device_to_host.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MIB = 1 << 20


def timed(fn, torch) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(torch, nbytes: int, rounds: int) -> dict:
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    kept = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    ways = {"pageable": lambda: t.cpu(),
            "pinned_fresh": lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).copy_(t),
            "pinned_kept": lambda: kept.copy_(t)}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for name in ways:  # warm
        ways[name]()
    for i in range(rounds):
        names = list(ways)
        for name in names[i % 3:] + names[:i % 3]:
            seconds[name].append(timed(ways[name], torch))
    assert torch.equal(ways["pageable"](), kept)
    return {name: {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s),
                   "gb_per_s": nbytes / statistics.median(s) / 1e9} for name, s in seconds.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="1,16,256,1024")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", default=str(RESULTS / "device_to_host.json"))
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("device_to_host needs a CUDA device")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "sizes": {f"{int(m)} MiB": measure(torch, int(m) * MIB, args.rounds)
                        for m in args.sizes_mib.split(",")}}
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
