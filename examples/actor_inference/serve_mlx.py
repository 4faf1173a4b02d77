"""The MLX variant, for Macs: an MLX model kept in unified memory by an actor on a Mac peer.

    python examples/actor_inference/serve_mlx.py                    # a Mac peer's GPU (Metal)
    python examples/actor_inference/serve_mlx.py --accelerator cpu  # any peer with mlx (its CPU backend)

Runs where mlx is installed on the peer (a Mac; mlx[cpu] elsewhere with --accelerator cpu).
"""

from __future__ import annotations

import argparse
import os
import time

import gpulayer as gl

FEATURES, HIDDEN, CLASSES = 64, 1024, 10


class MLXClassifier:
    """An MLX MLP built once on the actor's device (Metal when the peer has it)."""

    def __init__(self, seed: int = 0):
        import mlx.core as mx
        import mlx.nn as nn

        mx.random.seed(seed)
        self.device = mx.gpu if mx.metal.is_available() else mx.cpu
        mx.set_default_device(self.device)
        self.model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                   nn.Linear(HIDDEN, CLASSES))
        mx.eval(self.model.parameters())
        self.served = 0

    def classify(self, rows: list[list[float]]) -> list[int]:
        import mlx.core as mx

        self.served += 1
        return mx.argmax(self.model(mx.array(rows)), axis=1).tolist()

    def info(self) -> dict:
        return {"device": str(self.device), "served": self.served, "peer": os.environ.get("GPULAYER_PEER_NAME")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="mps", choices=["cpu", "mps"])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    rows = [[(i * j % 7) / 7.0 for j in range(FEATURES)] for i in range(8)]
    remote_classifier = gl.remote(MLXClassifier).options(accelerator=args.accelerator, frameworks={"mlx": ">=0.10"})
    with remote_classifier() as classifier:
        first = classifier.classify(rows)
        started = time.perf_counter()
        for _ in range(args.calls - 1):
            assert classifier.classify(rows) == first
        per_call = 1e3 * (time.perf_counter() - started) / max(1, args.calls - 1)
        info = classifier.info()
    print(f"MLX actor on peer {info['peer']} ({info['device']}): {info['served']} calls served, "
          f"{per_call:.2f} ms per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
