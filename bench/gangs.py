"""Gangs (ADR 0018) on one machine: how long a gang takes to start, and what it adds to the
collectives' own path (nothing, it should: the ranks talk to each other directly).

    python bench/gangs.py [--nodes 2 4 8] [--repeats 5] [--mib 256] [--rounds 5] [--skip-start]
                          [--skip-bandwidth] [--json bench/results/gangs.json] [--plot bench/results/gangs.png]

1. Start: from gl.submit(fn, nodes=N) to every rank running, on N local one-slot CPU peers on
   loopback (a fresh cluster key); each rank notes time.time() as it starts. torchrun
   (`--nnodes 1 --nproc-per-node N`, static rendezvous on a fixed port) runs a script that does
   the same. Medians of `--repeats` runs.
2. Bandwidth (root only: tests/lan/lanlab.py): a gang of 2 ranks in two network namespaces on a
   bridge, launched by a submitter in a third, times an all_reduce of `--mib` MiB of float32 with
   gloo (torch.distributed) and with MLX's ring, and a raw exchange of as many bytes over a plain
   TCP socket between the same two processes over the same veth (each rank sends all of it and
   receives all of it at once: what a 2-rank all_reduce must move at least). Per round, the slower
   rank's time; medians of `--rounds` after a warm-up. Bandwidth = bytes / time (for 2 ranks the
   ring's bus bandwidth equals this algorithm bandwidth). The same all_reduces in two processes
   started in the namespaces by hand (no peer, the variables set by this script) show what the
   gang adds to the collective's own path.

3. NCCL (`--nccl`, a host with 2 CUDA GPUs; issue 31): an all_reduce of `--mib` MiB (1024 there)
   on the GPUs, in a gang of 2 local peers given one GPU each (CUDA_VISIBLE_DEVICES) and in
   `torchrun --nproc-per-node 2` on the same 2 GPUs, in the same run; medians of `--rounds`. For 2
   ranks the bus bandwidth equals the algorithm bandwidth (bytes / time).

Figures from one run on one machine (the shared 2-core test box: noisy).
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

from output import PLOT_HELP, draw_beside  # this folder's

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
RANK_SCRIPT = "import os, time; open(os.path.join({folder!r}, os.environ['RANK']), 'w').write(repr(time.time()))\n"
MIB = 1 << 20
FRAMEWORKS = ("raw", "torch", "mlx")  # the raw socket first: the bound the other two are held to


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


def start_times(nodes_list: list[int], repeats: int) -> dict:
    """Medians of the seconds from submit to every rank running, ours and torchrun's, per N."""
    from gpulayer.client import Client
    from gpulayer.demo import local_peer
    from gpulayer.matching import Requirements

    key = secrets.token_hex(16)
    result = {}
    env = {**os.environ, "GPULAYER_KEY": key, "GPULAYER_CACHE": "0", "GPULAYER_INTERFACES": "127.0.0.1"}
    with ExitStack() as stack:
        for i in range(max(nodes_list)):
            stack.enter_context(local_peer(env, name=f"gang-{i}", extra_args=("--concurrency", "1")))
        client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
        stack.callback(client.close)
        client.start()
        client.directory.wait_for(lambda records: len(records) == max(nodes_list), 60)
        cpu = Requirements.build(accelerator="cpu")
        for nodes in nodes_list:
            ours, theirs = [], []
            for _ in range(repeats):
                began = time.time()
                ours.append(max(client.submit_gang(started, (), {}, req=cpu, nodes=nodes).result(120)) - began)
                with tempfile.TemporaryDirectory(prefix="gpulayer-torchrun-") as folder:
                    theirs.append(torchrun(nodes, Path(folder)))
            result[str(nodes)] = {"gpulayer_s": round(statistics.median(ours), 3),
                                  "gpulayer_s_range": [round(min(ours), 3), round(max(ours), 3)],
                                  "torchrun_static_s": round(statistics.median(theirs), 3)}
    return result


# ---- bandwidth: what the ranks run ------------------------------------------------------------------

def reduce_rounds(framework: str, size: int, rounds: int) -> list[float]:
    """In a rank of a gang of 2: the seconds of a warm-up and then `rounds` all_reduces of `size` bytes
    of float32 (framework "torch": gloo, "mlx": the ring), or raw exchanges of as many bytes ("raw")."""
    import time

    from gpulayer import distributed

    if framework == "raw":
        return raw_exchanges(size, rounds)
    count = size // 4
    times = []
    if framework in ("torch", "torchrun"):
        import os

        import torch
        import torch.distributed as dist

        import gpulayer as gl

        if framework == "torch":  # a gang's rank: gloo on the CPU, or NCCL on its peer's GPU
            distributed.init()
            device = gl.device()
        else:  # a rank torchrun started on this host's GPUs
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl")
        data = torch.ones(count, device=device)
        for _ in range(rounds + 1):
            dist.barrier()
            began = time.perf_counter()
            dist.all_reduce(data)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - began)
    else:
        import mlx.core as mx

        group = distributed.init("mlx")
        data = mx.ones(count)
        mx.eval(data)
        for _ in range(rounds + 1):
            mx.eval(mx.distributed.all_sum(mx.zeros(1), group=group))  # a barrier
            began = time.perf_counter()
            mx.eval(mx.distributed.all_sum(data, group=group))
            times.append(time.perf_counter() - began)
    return times[1:]


def raw_exchanges(size: int, rounds: int) -> list[float]:
    """Rank 0 listens on its ring port, rank 1 connects; each round both send `size` bytes and receive
    as many at once (after a one-byte barrier): the least a 2-rank all_reduce moves over the link."""
    import json
    import os
    import socket
    import threading
    import time

    rank = int(os.environ["RANK"])
    host, port = json.load(open(os.environ["MLX_HOSTFILE"]))[0][0].rsplit(":", 1)
    if rank == 0:
        with socket.create_server((host, int(port))) as listener:
            sock, _ = listener.accept()
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    sock.settimeout(120)
    out, into = bytes(size), bytearray(size)
    view = memoryview(into)
    times = []
    with sock:
        for _ in range(rounds + 1):
            sock.sendall(b"b")
            sock.recv(1)
            began = time.perf_counter()
            sender = threading.Thread(target=sock.sendall, args=(out,))
            sender.start()
            got = 0
            while got < size:
                got += sock.recv_into(view[got:])
            sender.join()
            times.append(time.perf_counter() - began)
    return times[1:]


def submitter(size: int, rounds: int) -> None:
    """In the submitter's namespace: each framework's rounds on a gang of 2, one JSON line each."""
    import gpulayer as gl

    for framework in FRAMEWORKS:
        ranks = gl.run(reduce_rounds, framework, size, rounds, nodes=2, accelerator="cpu")
        print(json.dumps({"framework": framework, "times": [max(pair) for pair in zip(*ranks)]}), flush=True)


def plain(framework: str, size: int, rounds: int) -> None:
    """A rank started without GPUlayer, its rendezvous variables set by the driver: its times, in JSON."""
    print(json.dumps(reduce_rounds(framework, size, rounds)), flush=True)


def plain_ranks(hosts: list, framework: str, size: int, rounds: int, workdir: Path) -> list[float]:
    """The same rounds in two processes started in the namespaces by hand (no peer, no gang): per
    round, the slower rank's seconds."""
    from lanlab import lan_env

    hostfile = workdir / "hostfile.json"
    hostfile.write_text(json.dumps([[f"{host.ip}:29600"] for host in hosts]))
    variables = {"WORLD_SIZE": "2", "MASTER_ADDR": hosts[0].ip, "MASTER_PORT": "29500", "MLX_HOSTFILE": str(hostfile)}
    procs = [host.popen([sys.executable, __file__, "--plain", framework, str(size), str(rounds)], stdout=subprocess.PIPE,
                        env=lan_env(None, RANK=str(i), MLX_RANK=str(i), GPULAYER_RANK_ADDR=host.ip, **variables))
             for i, host in enumerate(hosts)]
    outputs = [json.loads(proc.communicate(timeout=600)[0]) for proc in procs]
    return [max(pair) for pair in zip(*outputs)]


def bandwidth(mib: int, rounds: int) -> dict:
    """Each framework's median all_reduce seconds and GB/s across the namespaces' veth, in a gang and
    in two processes started by hand, and its ratio to the raw socket."""
    sys.path[1:1] = [str(ROOT / "tests"), str(ROOT / "tests" / "lan")]  # after bench/; no gpulayer in either
    from lanlab import Lan, lan_env, start_peers, why_unavailable

    reason = why_unavailable()
    if reason:
        return {"skipped": reason}
    key = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="gpulayer-gang-bench-") as workdir:
        lan = Lan(Path(workdir))
        try:
            hosts = [lan.add_host(f"rank{i}") for i in range(2)]
            start_peers([(host, host.label) for host in hosts], key, concurrency=1)
            done = lan.add_host("submitter").run([sys.executable, __file__, "--submitter", str(mib * MIB), str(rounds)],
                                                timeout=900, env=lan_env(key))
            if done.returncode != 0:
                raise RuntimeError(f"the submitter failed: {done.stderr[-3000:]}")
            times = {row["framework"]: row["times"] for row in map(json.loads, done.stdout.splitlines())}
            for framework in FRAMEWORKS[1:]:
                times[f"{framework}_plain"] = plain_ranks(hosts, framework, mib * MIB, rounds, Path(workdir))
        finally:
            lan.close()
    result: dict = {"mib": mib, "ranks": 2, "rounds": rounds}
    for name, rows in times.items():
        seconds = statistics.median(rows)
        gb_s = mib * MIB / seconds / 1e9
        result[name] = {"median_s": round(seconds, 4), "gb_s": round(gb_s, 3), "times_s": [round(t, 4) for t in rows]}
    for name in result.keys() - {"mib", "ranks", "rounds", "raw"}:
        result[name]["over_raw"] = round(result[name]["gb_s"] / result["raw"]["gb_s"], 3)
    return result


TORCHRUN_RANK = ("import json, sys; sys.path.insert(0, {bench!r}); from gangs import reduce_rounds; "
                 "print(json.dumps(reduce_rounds('torchrun', {size}, {rounds})), flush=True)\n")


def nccl_bandwidth(mib: int, rounds: int) -> dict:
    """On a host with 2 CUDA GPUs: the median NCCL all_reduce seconds and GB/s in a gang of 2 local peers
    (one GPU each) and in torchrun on the same 2 GPUs."""
    import torch

    if torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 CUDA GPUs; {torch.cuda.device_count()} present"}
    from gpulayer.client import Client
    from gpulayer.demo import local_peer
    from gpulayer.matching import Requirements

    size, key = mib * MIB, secrets.token_hex(16)
    env = {**os.environ, "GPULAYER_KEY": key, "GPULAYER_CACHE": "0", "GPULAYER_INTERFACES": "127.0.0.1"}
    times = {}
    with ExitStack() as stack:
        for index in (0, 1):
            stack.enter_context(local_peer({**env, "CUDA_VISIBLE_DEVICES": str(index)}, name=f"nccl-{index}"))
        client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
        stack.callback(client.close)
        client.start()
        client.directory.wait_for(lambda records: len(records) == 2, 60)
        ranks = client.submit_gang(reduce_rounds, ("torch", size, rounds), {}, req=Requirements.build(accelerator="cuda"),
                                   nodes=2).result(900)
        times["gang"] = [max(pair) for pair in zip(*ranks)]
    with tempfile.TemporaryDirectory(prefix="gpulayer-torchrun-") as folder:
        script = Path(folder) / "rank.py"
        script.write_text(TORCHRUN_RANK.format(bench=str(Path(__file__).parent), size=size, rounds=rounds))
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                               "--master-addr", "127.0.0.1", "--master-port", "29510", str(script)],
                              capture_output=True, text=True, check=True, timeout=900)
        outputs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
        times["torchrun"] = [max(pair) for pair in zip(*outputs)]
    result: dict = {"mib": mib, "ranks": 2, "rounds": rounds, "gpus": [torch.cuda.get_device_name(i) for i in (0, 1)]}
    for name, rows in times.items():
        seconds = statistics.median(rows)
        result[name] = {"median_s": round(seconds, 5), "bus_gb_s": round(size / seconds / 1e9, 2),
                        "range_bus_gb_s": [round(size / max(rows) / 1e9, 2), round(size / min(rows) / 1e9, 2)]}
    result["gang_over_torchrun"] = round(result["gang"]["bus_gb_s"] / result["torchrun"]["bus_gb_s"], 3)
    return result


def draw(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [name for name in ("start", "bandwidth", "nccl") if name in result and "skipped" not in result[name]]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, name in zip(axes[0], panels):
        if name == "start":
            nodes = list(result["start"])
            for label, key in (("GPUlayer gang", "gpulayer_s"), ("torchrun (static)", "torchrun_static_s")):
                ax.plot([int(n) for n in nodes], [result["start"][n][key] for n in nodes], "o-", label=label)
            ax.axhline(1.0, color="grey", linestyle=":", label="target for 4 ranks")
            ax.set(xlabel="ranks", ylabel="s from submit to every rank running", title="Gang start, one host")
            ax.legend()
        elif name == "nccl":
            nccl = result["nccl"]
            ax.bar(["GPUlayer gang\n(2 peers)", "torchrun"], [nccl["gang"]["bus_gb_s"], nccl["torchrun"]["bus_gb_s"]])
            ax.set(ylabel="bus GB/s", title=f"NCCL all_reduce of {nccl['mib']} MiB, 2 GPUs of one host")
        else:
            bw = result["bandwidth"]
            labels = {"raw": "raw socket", "torch": "gloo\ngang", "torch_plain": "gloo\nby hand",
                      "mlx": "MLX ring\ngang", "mlx_plain": "MLX ring\nby hand"}
            names = [name for name in labels if name in bw]
            ax.bar([labels[name] for name in names], [bw[name]["gb_s"] for name in names])
            ax.set(ylabel="GB/s", title=f"all_reduce of {bw['mib']} MiB, 2 ranks, over a veth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-start", action="store_true")
    parser.add_argument("--skip-bandwidth", action="store_true")
    parser.add_argument("--nccl", action="store_true", help="the NCCL comparison on this host's 2 GPUs (issue 31)")
    parser.add_argument("--json", default=str(RESULTS / "gangs.json"))
    parser.add_argument("--plot", default=None, help=PLOT_HELP)
    parser.add_argument("--submitter", nargs=2, type=int, help=argparse.SUPPRESS)  # size, rounds: inside the LAN
    parser.add_argument("--plain", nargs=3, help=argparse.SUPPRESS)  # framework, size, rounds: a rank by hand
    args = parser.parse_args(argv)
    if args.submitter:
        submitter(*args.submitter)
        return 0
    if args.plain:
        plain(args.plain[0], int(args.plain[1]), int(args.plain[2]))
        return 0
    result: dict = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
    if not args.skip_start:
        result["repeats"] = args.repeats
        result["start"] = start_times(args.nodes, args.repeats)
    if not args.skip_bandwidth:
        result["bandwidth"] = bandwidth(args.mib, args.rounds)
    if args.nccl:
        result["nccl"] = nccl_bandwidth(args.mib, args.rounds)
    print(json.dumps(result, indent=2))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    draw_beside(draw, result, args.json, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
