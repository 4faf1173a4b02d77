"""Matrix-multiply throughput of MLX on a GPUlayer peer, in TFLOPS.

    python examples/mlx_metal/matmul.py                          # a Mac peer's GPU (Metal)
    python examples/mlx_metal/matmul.py --accelerator cpu        # any peer with mlx's CPU backend
    python examples/mlx_metal/matmul.py --local --size 1024      # here, without a peer
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import gpulayer as gl


@gl.remote(accelerator="mps", frameworks={"mlx": ">=0.10"})
def matmul(size: int, repeats: int, dtype: str, use_gpu: bool = True) -> dict:
    """Time `repeats` products of two random size x size matrices, on Metal if asked and present."""
    import mlx.core as mx

    device = mx.gpu if use_gpu and mx.metal.is_available() else mx.cpu
    with mx.stream(device):
        a = mx.random.normal((size, size), dtype=getattr(mx, dtype))
        b = mx.random.normal((size, size), dtype=getattr(mx, dtype))
        mx.eval(a, b)  # the inputs exist before the clock starts
        mx.eval(a @ b)  # warm-up: kernel compilation, allocations
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            mx.eval(a @ b)  # mlx is lazy: eval waits for the product
            times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    return {"device": "metal" if device == mx.gpu else "cpu", "size": size, "dtype": dtype, "seconds": seconds,
            "tflops": 2 * size**3 / seconds / 1e12, "mlx": mx.__version__,
            "peer": os.environ.get("GPULAYER_PEER_NAME")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", choices=["mps", "cpu"], default="mps",
                        help="mps: a Mac peer's GPU (Metal); cpu: mlx's CPU backend on any peer")
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--local", action="store_true", help="run in this process instead of on a peer")
    args = parser.parse_args()
    call_args = (args.size, args.repeats, args.dtype, args.accelerator != "cpu")
    if args.local:
        r = matmul.local(*call_args)
    else:
        try:
            r = matmul.options(accelerator=args.accelerator)(*call_args)
        except gl.NoMatchingPeer as exc:
            sys.exit(f"{exc}\n(try --accelerator cpu for mlx's CPU backend, or --local)")
    where = f"on peer {r['peer']}" if r["peer"] else "locally"
    print(f"matmul {r['size']}x{r['size']} {r['dtype']} {where} (mlx {r['mlx']}, {r['device']}): "
          f"{r['seconds'] * 1e3:.2f} ms per product (median of {args.repeats}), {r['tflops']:.4f} TFLOPS")


if __name__ == "__main__":
    main()
