"""How long a gang takes to start (ADR 0018), on one machine: from gl.submit(fn, nodes=N) to every
rank running, against torchrun's static rendezvous starting the same N processes.

    python bench/gangs.py [--nodes 2 4] [--repeats 3] [--json bench/results/gangs.json]

N local one-slot CPU peers on loopback (a fresh cluster key); each rank notes time.time() as it
starts. torchrun (`--nnodes 1 --nproc-per-node N`, static rendezvous on a fixed port) runs a script
that does the same. Medians of `--repeats` runs; figures from one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RANK_SCRIPT = "import os, time; open(os.path.join({folder!r}, os.environ['RANK']), 'w').write(repr(time.time()))\n"


def started() -> float:
    """In a rank: when it started."""
    return time.time()


def torchrun(nodes: int, folder: Path) -> float:
    """Seconds from starting torchrun to its last rank running."""
    script = folder / "rank.py"
    script.write_text(RANK_SCRIPT.format(folder=str(folder)))
    began = time.time()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nodes),
                    "--master-addr", "127.0.0.1", "--master-port", str(29500 + nodes), str(script)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    return max(float((folder / str(rank)).read_text()) for rank in range(nodes)) - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=str(RESULTS / "gangs.json"))
    args = parser.parse_args(argv)
    from gpulayer.client import Client
    from gpulayer.demo import local_peer
    from gpulayer.matching import Requirements

    key = secrets.token_hex(16)
    result: dict = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "repeats": args.repeats, "nodes": {}}
    env = {**os.environ, "GPULAYER_KEY": key, "GPULAYER_CACHE": "0", "GPULAYER_INTERFACES": "127.0.0.1"}
    with ExitStack() as stack:
        for i in range(max(args.nodes)):
            stack.enter_context(local_peer(env, name=f"gang-{i}", extra_args=("--concurrency", "1")))
        client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
        stack.callback(client.close)
        client.start()
        client.directory.wait_for(lambda records: len(records) == max(args.nodes), 30)
        cpu = Requirements.build(accelerator="cpu")
        for nodes in args.nodes:
            ours, theirs = [], []
            for _ in range(args.repeats):
                began = time.time()
                ours.append(max(client.submit_gang(started, (), {}, req=cpu, nodes=nodes).result(120)) - began)
                with tempfile.TemporaryDirectory(prefix="gpulayer-torchrun-") as folder:
                    theirs.append(torchrun(nodes, Path(folder)))
            result["nodes"][nodes] = {"gpulayer_s": round(statistics.median(ours), 3),
                                      "torchrun_static_s": round(statistics.median(theirs), 3)}
    print(json.dumps(result, indent=2))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
