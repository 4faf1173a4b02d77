"""A PyTorch model kept on a peer's device by an actor, serving many calls.

    python examples/actor_inference/serve.py                      # any peer with torch (cpu here)
    python examples/actor_inference/serve.py --accelerator mps    # a Mac peer's GPU
    python examples/actor_inference/serve.py --accelerator cuda   # an NVIDIA peer

The actor's constructor builds the model (in a real service: loads its weights) once, on the device
the peer gave its slot; every `classify` call then runs on it, without loading anything again.
A task would rebuild the model in every call; the script times both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import gpulayer as gl

FEATURES, HIDDEN, CLASSES = 64, 1024, 10


def build_model(seed: int):
    """The model: a small MLP with fixed weights (a stand-in for loading a checkpoint)."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, CLASSES)).eval()


class Classifier:
    """The model on the peer's device, and a count of the calls it served."""

    def __init__(self, seed: int = 0):
        self.device = gl.device()
        self.model = build_model(seed).to(self.device)
        self.served = 0

    def classify(self, rows: list[list[float]]) -> list[int]:
        import torch

        with torch.inference_mode():
            batch = torch.tensor(rows, dtype=torch.float32, device=self.device)
            self.served += 1
            return self.model(batch).argmax(dim=1).tolist()

    def info(self) -> dict:
        return {"device": str(self.device), "served": self.served, "peer": os.environ.get("GPULAYER_PEER_NAME"),
                "pid": os.getpid()}


def classify_in_a_task(rows: list[list[float]], seed: int = 0) -> list[int]:
    """The same call as a stateless task: it builds the model every time."""
    return Classifier(seed).classify(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda", "mps", "gpu"])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    import random

    rng = random.Random(1)
    batches = [[[rng.gauss(0, 1) for _ in range(FEATURES)] for _ in range(args.batch)] for _ in range(args.calls)]
    remote_classifier = gl.remote(Classifier).options(accelerator=args.accelerator, frameworks={"torch": ">=2.0"})
    with remote_classifier(seed=0) as classifier:
        started = time.perf_counter()
        answers = [classifier.classify(batch) for batch in batches]
        actor_ms = 1e3 * (time.perf_counter() - started) / args.calls
        pipelined = [f.result() for f in [classifier.classify.submit(batch) for batch in batches]]
        assert pipelined == answers
        info = classifier.info()
    task_times = []
    for batch in batches[:5]:
        started = time.perf_counter()
        assert gl.run(classify_in_a_task, batch, accelerator=args.accelerator) == answers[batches.index(batch)]
        task_times.append(time.perf_counter() - started)
    local = Classifier(0)
    assert [local.classify(b) for b in batches[:5]] == answers[:5]  # the same model, the same answers
    print(f"actor on peer {info['peer']} ({info['device']}): {info['served']} calls served, "
          f"{actor_ms:.2f} ms per call; as a task that builds the model each time: "
          f"{1e3 * statistics.median(task_times):.2f} ms per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
