"""GPUlayer's overhead on one machine, measured side by side with raw sockets (and Ray, if installed).

    python bench/overhead.py [--quick] [--json bench/results/overhead.json] [--plot bench/results/overhead.png]

Everything runs on loopback: a local peer subprocess (mDNS bound to 127.0.0.1), and a raw
msgpack-over-TCP server subprocess that does the same job with nothing else (cloudpickle the
call, one frame each way, plain blocking sockets). Reported: trivial round trip p50/p99 and
tasks/s for 2,000 submits, in interleaved rounds of the raw socket, GPUlayer as it is (tasks on a
lease, ADR 0013) and GPUlayer with every task through its peer (GPULAYER_LEASES=0), each round's
ratio to the raw floor of the same round, in two CPU layouts (LAYOUTS); a 256 MiB argument round
trip against raw socket throughput, and discovery / fresh-process times; the secure channel's AEAD
timed alone on the same frames (its share of the round trip, its rate on 256 MiB); and Ray on the
same machine, bound to loopback. Repeated measurements give their spread (min and max). Figures
are ratios from one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing, contextmanager
from datetime import datetime, timezone
from pathlib import Path

import cloudpickle
import msgpack
import numpy as np
from output import PLOT_HELP, draw_beside  # this folder's

try:
    from gpulayer.protocol.framing import receive_buffer
except ImportError:  # bench/data_plane.py imports this file under its "before" tree, older than protocol/
    from gpulayer.wire import receive_buffer  # type: ignore[no-redef]

HEADER = struct.Struct(">I")
RESULTS = Path(__file__).resolve().parent / "results"
# The budget of the secure channel (issue 9): p50 within 3x the raw floor of the same run,
# 9,000 tasks/s, a 256 MiB round trip no slower than 0.50 GB/s; and a fresh process under 0.6 s.
TARGETS = {"p50_over_raw": 3.0, "tasks_per_s": 9000, "bulk_gb_per_s": 0.5, "fresh_process_s": 0.6}


def trivial():
    return 1


def echo(array):
    return array


# ---- the raw floor: msgpack frames over a plain TCP socket -------------------------------------

def _recv_exact(sock: socket.socket, n: int):
    buf = receive_buffer(n)  # the same huge-page buffers GPUlayer uses, so the floor is as fast as it can be
    view = memoryview(buf)
    while view:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("closed")
        view = view[got:]
    return buf


def _recv_frame(sock: socket.socket):
    (n,) = HEADER.unpack(_recv_exact(sock, 4))
    return _recv_exact(sock, n)


def raw_server(port_file: str, host: str = "127.0.0.1") -> None:
    """Serve calls and echoes: frame {"fn", "args"} -> frame {"r"}; frame "bulk" N -> N raw bytes back."""
    server = socket.create_server((host, 0))
    Path(port_file).write_text(str(server.getsockname()[1]))
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        try:
            msg = msgpack.unpackb(_recv_frame(conn))
        except ConnectionError:
            return
        if "bulk" in msg:
            data = _recv_exact(conn, msg["bulk"])
            conn.sendall(HEADER.pack(len(data)))
            conn.sendall(data)
            continue
        fn = cloudpickle.loads(msg["fn"])
        args = cloudpickle.loads(msg["args"])
        body = msgpack.packb({"r": cloudpickle.dumps(fn(*args), protocol=5)})
        conn.sendall(HEADER.pack(len(body)) + body)


class RawClient:
    """A client of raw_server: a server subprocess of its own, or the one listening at `address`."""

    def __init__(self, address: tuple[str, int] | None = None):
        self.tmp = self.proc = None
        if address is None:
            self.tmp = tempfile.TemporaryDirectory()
            port_file = Path(self.tmp.name) / "port"
            self.proc = subprocess.Popen([sys.executable, __file__, "--raw-server", str(port_file)])
            while not port_file.exists() or not port_file.read_text():
                time.sleep(0.01)
            address = ("127.0.0.1", int(port_file.read_text()))
        self.sock = socket.create_connection(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def call(self, fn, *args):
        body = msgpack.packb({"fn": cloudpickle.dumps(fn, protocol=5), "args": cloudpickle.dumps(args, protocol=5)})
        self.sock.sendall(HEADER.pack(len(body)) + body)
        return cloudpickle.loads(msgpack.unpackb(_recv_frame(self.sock))["r"])

    def bulk(self, data: memoryview):
        body = msgpack.packb({"bulk": data.nbytes})
        self.sock.sendall(HEADER.pack(len(body)) + body)
        self.sock.sendall(data)
        return _recv_frame(self.sock)

    def close(self):
        self.sock.close()
        if self.proc is not None:
            self.proc.wait(10)
            self.tmp.cleanup()


# ---- measurement helpers ----------------------------------------------------------------------------

def latencies(call, n: int, warmup: int) -> dict:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    times.sort()
    return {"n": n, "p50_ms": 1e3 * times[n // 2], "p99_ms": 1e3 * times[int(n * 0.99)],
            "mean_ms": 1e3 * statistics.fmean(times)}


def runs(repeats: int, fn) -> list[float]:
    return [fn() for _ in range(repeats)]


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# ---- the runs -----------------------------------------------------------------------------------------

def measure_raw(big: np.ndarray, repeats: int) -> dict:
    raw = RawClient()
    try:
        view = memoryview(big).cast("B")
        seconds = runs(repeats, lambda: timed(lambda: raw.bulk(view)))
    finally:
        raw.close()
    return _bulk(seconds, big)


WAYS = {"gpulayer": "1", "through_peer": "0"}  # GPULAYER_LEASES of each way of running GPUlayer
WARM_S = 0.5  # calls before each measurement for at least this long (a lease comes in the background)
# Where the small-task rounds run. "split": the submitter alone on the first CPU, the serving side (the
# raw server; the peer and its workers) on the others, as on two hosts of a LAN. "free": where the OS
# puts them; on a small VM it sometimes runs both ends of the raw socket on one CPU, with no
# cross-CPU wake-up in its round trip (a floor that no LAN has).
LAYOUTS = ("split", "free")


def layouts_here() -> list[str]:
    """The layouts of LAYOUTS that this machine can run, the judged one first ("split" needs two CPUs)."""
    return list(LAYOUTS) if len(os.sched_getaffinity(0)) >= 2 else ["free"]


def layout_cpus(layout: str) -> tuple[set[int] | None, set[int] | None]:
    """The CPUs of (the submitter, the serving side) in `layout`; None: any."""
    if layout == "free":
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    return {cpus[0]}, set(cpus[1:])


@contextmanager
def on_cpus(cpus: set[int] | None):
    """Run the calling thread on `cpus` meanwhile (the threads and processes it starts keep them)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def measure_small(rounds: int, n: int, submits: int, layout: str) -> dict:
    """Trivial round trips (p50, p99) and bursts of `submits` tasks, in `rounds` interleaved rounds of
    the raw socket and of each way of GPUlayer (WAYS), against one local peer, in a CPU layout of
    LAYOUTS. The raw floor moves between rounds when the OS places the processes (free): each
    round's ratio to the floor of that same round is the figure."""
    import gpulayer as gl
    from gpulayer.demo import local_peer

    submitter, serving = layout_cpus(layout)
    per_round: dict[str, list[dict]] = {"raw": [], **{way: [] for way in WAYS}}
    try:
        with ExitStack() as stack:
            with on_cpus(serving):
                raw = stack.enter_context(closing(RawClient()))
                stack.enter_context(local_peer(dict(os.environ), name="bench-peer"))
            stack.enter_context(on_cpus(submitter))
            for _ in range(rounds):
                per_round["raw"].append(latencies(lambda: raw.call(trivial), n, n // 10))
                for way, leases in WAYS.items():
                    os.environ["GPULAYER_LEASES"] = leases
                    gl.configure(interfaces=["127.0.0.1"], echo_output=False)
                    warm_until = time.monotonic() + WARM_S
                    while time.monotonic() < warm_until:
                        gl.run(trivial)
                    lat = latencies(lambda: gl.run(trivial), n, 0)

                    def burst():
                        futures = [gl.submit(trivial) for _ in range(submits)]
                        for f in futures:
                            f.result()

                    per_round[way].append({**lat, "tasks_per_s": submits / timed(burst)})
            gl.api.shutdown()
    finally:
        os.environ.pop("GPULAYER_LEASES", None)
    result: dict = {way: _over_rounds(rows) for way, rows in per_round.items()}
    for way in WAYS:
        ratios = p50_over_raw_by_round(per_round, way)
        result[way]["p50_over_raw"] = statistics.median(ratios)
        result[way]["p50_over_raw_range"] = [min(ratios), max(ratios)]
        result[way]["submits"] = submits
    result["rounds"] = per_round
    return result


def p50_over_raw_by_round(rounds: dict[str, list[dict]], way: str) -> list[float]:
    """Each round's p50 of `way` over the raw floor of that same round."""
    return [g["p50_ms"] / r["p50_ms"] for g, r in zip(rounds[way], rounds["raw"])]


def _over_rounds(rows: list[dict]) -> dict:
    """Medians over the rounds, with their ranges: `latency` (p50, p99) and, where measured, tasks/s."""
    out = {"latency": {"n": rows[0]["n"] * len(rows), "p50_ms": statistics.median(r["p50_ms"] for r in rows),
                       "p99_ms": statistics.median(r["p99_ms"] for r in rows),
                       "p50_ms_range": [min(r["p50_ms"] for r in rows), max(r["p50_ms"] for r in rows)]}}
    if "tasks_per_s" in rows[0]:
        rates = [r["tasks_per_s"] for r in rows]
        out["tasks_per_s"], out["tasks_per_s_range"] = statistics.median(rates), [min(rates), max(rates)]
    return out


def _bulk(seconds: list[float], big: np.ndarray) -> dict:
    """A round trip of `big` (there and back): the best run, and the spread of the runs."""
    return {"bulk_seconds": min(seconds), "bulk_gb_per_s": 2 * big.nbytes / min(seconds) / 1e9,
            "bulk_gb_per_s_range": [2 * big.nbytes / max(seconds) / 1e9, 2 * big.nbytes / min(seconds) / 1e9]}


def measure_bulk(big: np.ndarray, repeats: int) -> dict:
    """The 256 MiB echo through a local peer, and discovery / fresh-process times."""
    import gpulayer as gl
    from gpulayer.demo import local_peer

    with local_peer(dict(os.environ), name="bench-peer"):
        gl.configure(interfaces=["127.0.0.1"], echo_output=False)
        check = gl.run(echo, big)
        assert np.array_equal(check, big)
        seconds = runs(repeats, lambda: timed(lambda: gl.run(echo, big)))
        discovery = measure_discovery()
        gl.api.shutdown()
    return {**_bulk(seconds, big), "discovery": discovery}


def measure_aead(n: int, big: np.ndarray, repeats: int) -> dict:
    """The secure channel's records alone, on the frames of one trivial task and of the 256 MiB echo.

    A task crosses the channel twice (SUBMIT there, RESULT back): each is sealed on one side and
    opened on the other. The worker link is host-local and carries no records.
    """
    from gpulayer import serialization
    from gpulayer.protocol import framing, messages, records

    fn, args = serialization.dumps(trivial)[0], serialization.dumps(((), {}))[0]
    ends = {}  # one sealer, opener and reader per direction, as on a connection

    def crossing(direction: str, msg: dict, buffers=()) -> None:
        if direction not in ends:
            key = secrets.token_bytes(32)
            ends[direction] = records.Sealer(key), records.Opener(key), framing.MessageReader(framing.max_message_bytes())
        sealer, opener, reader = ends[direction]
        for record in sealer.stream(framing.encode(dict(msg), buffers)):
            opener.feed_bytes_into(record, reader)
        reader.messages.popleft()

    def task() -> None:
        crossing("up", messages.submit(1, fn, args, {"acc": None}, None, "trivial"))
        crossing("down", {"t": messages.RESULT, "id": 1, "data": serialization.dumps(1)[0]})

    for _ in range(n // 10):
        task()
    started = time.perf_counter()
    for _ in range(n):
        task()
    per_task = (time.perf_counter() - started) / n
    view = memoryview(big).cast("B")
    bulk = runs(repeats, lambda: timed(lambda: [crossing(way, {"t": messages.RESULT, "id": 1}, [view])
                                                for way in ("up", "down")]))
    return {"per_task_us": 1e6 * per_task, "bulk_seconds": min(bulk), "bulk_gb_per_s": 2 * big.nbytes / min(bulk) / 1e9,
            "aead": records.AEAD.__name__, "record_max": records.RECORD_MAX}


FRESH = ("import time; t0 = time.perf_counter(); import gpulayer as gl; gl.run(abs, -1); "
         "print(time.perf_counter() - t0)")


def measure_discovery() -> dict:
    """A browsing client sees a new peer (both from the peer's start command: the peer advertises
    before it reports ready); fresh submitter processes get their first result."""
    from gpulayer.client import Client
    from gpulayer.demo import local_peer

    watcher = Client(interfaces=["127.0.0.1"], echo_output=False)
    watcher.start()

    def when_seen() -> float:
        if not watcher.directory.wait_for(lambda recs: any(r.advert.name == "newcomer" for r in recs), 30):
            raise RuntimeError("the browsing client did not see the new peer within 30 s")
        return time.monotonic()

    try:
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(1) as pool:
            seen = pool.submit(when_seen)
            started = time.monotonic()
            with local_peer(dict(os.environ), name="newcomer"):
                ready_after = time.monotonic() - started
                seen_after = seen.result(30) - started
            fresh = {}
            time.sleep(1.2)  # let the bench peer's last announcement age past mDNS's one-second rate limit
            for label, cache in (("mdns", "0"), ("cache", "1")):
                env = {**os.environ, "GPULAYER_CACHE": cache, "XDG_CACHE_HOME": tmp}
                if cache == "1":  # a first process fills the cache
                    subprocess.run([sys.executable, "-c", FRESH], env=env, check=True, capture_output=True)
                runs = []
                for _ in range(5):
                    started = time.perf_counter()
                    out = subprocess.run([sys.executable, "-c", FRESH], env=env, check=True, capture_output=True,
                                         text=True)
                    runs.append({"process_s": time.perf_counter() - started, "in_process_s": float(out.stdout)})
                fresh[label] = {"median_process_s": statistics.median(r["process_s"] for r in runs),
                                "median_in_process_s": statistics.median(r["in_process_s"] for r in runs)}
    finally:
        watcher.close()
    return {"peer_ready_s": ready_after, "browser_sees_new_peer_s": seen_after, "fresh_submitter": fresh}


def measure_ray(n: int, submits: int, repeats: int) -> dict | None:
    try:
        import ray
    except ImportError:
        return None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", _node_ip_address="127.0.0.1")
    init_s = time.perf_counter() - started
    task = ray.remote(trivial)
    try:
        lat = latencies(lambda: ray.get(task.remote()), n, n // 10)
        bursts = runs(repeats, lambda: timed(lambda: ray.get([task.remote() for _ in range(submits)])))
    finally:
        ray.shutdown()
    return {"version": ray.__version__, "init_s": init_s, "latency": lat, "tasks_per_s": submits / min(bursts),
            "tasks_per_s_range": [submits / max(bursts), submits / min(bursts)]}


def machine() -> dict:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def summarize(result: dict, aead: dict, ray: dict | None) -> dict:
    raw, glr, through_peer, free = result["raw"], result["gpulayer"], result["through_peer"], result["free"]
    fresh = glr["discovery"]["fresh_submitter"]
    summary = {
        "layout": result["layout"],
        "gpulayer_p50_ms": glr["latency"]["p50_ms"],
        "gpulayer_p50_ms_range": glr["latency"]["p50_ms_range"],
        "gpulayer_p99_ms": glr["latency"]["p99_ms"],
        "raw_p50_ms": raw["latency"]["p50_ms"],
        "raw_p50_ms_range": raw["latency"]["p50_ms_range"],
        "p50_over_raw": glr["p50_over_raw"],
        "p50_over_raw_range": glr["p50_over_raw_range"],
        "tasks_per_s": glr["tasks_per_s"],
        "tasks_per_s_range": glr["tasks_per_s_range"],
        "through_peer_p50_ms": through_peer["latency"]["p50_ms"],
        "through_peer_p50_over_raw": through_peer["p50_over_raw"],
        "through_peer_tasks_per_s": through_peer["tasks_per_s"],
        "through_peer_tasks_per_s_range": through_peer["tasks_per_s_range"],
        "bulk_gb_per_s": glr["bulk_gb_per_s"],
        "bulk_gb_per_s_range": glr["bulk_gb_per_s_range"],
        "raw_bulk_gb_per_s": raw["bulk_gb_per_s"],
        "bandwidth_ratio": glr["bulk_gb_per_s"] / raw["bulk_gb_per_s"],
        "aead_share_of_p50": aead["per_task_us"] / 1e3 / glr["latency"]["p50_ms"],
        # the local echo goes by shared memory and seals nothing: the records' rate bounds one between hosts
        "aead_bulk_gb_per_s": aead["bulk_gb_per_s"],
        "fresh_process_s": {k: v["median_process_s"] for k, v in fresh.items()},
        "free_gpulayer_p50_ms": free["gpulayer"]["latency"]["p50_ms"],
        "free_raw_p50_ms_range": free["raw"]["latency"]["p50_ms_range"],
        "free_p50_over_raw": free["gpulayer"]["p50_over_raw"],
        "free_p50_over_raw_range": free["gpulayer"]["p50_over_raw_range"],
        "free_tasks_per_s": free["gpulayer"]["tasks_per_s"],
    }
    summary["targets"] = {
        "p50_over_raw<=3.0 (every round)": summary["p50_over_raw_range"][1] <= TARGETS["p50_over_raw"],
        "tasks_per_s>=9000 (every round)": summary["tasks_per_s_range"][0] >= TARGETS["tasks_per_s"],
        "bulk_gb_per_s>=0.5": summary["bulk_gb_per_s"] >= TARGETS["bulk_gb_per_s"],
        "fresh_process_s<=0.6 (mdns)": fresh["mdns"]["median_process_s"] <= TARGETS["fresh_process_s"],
        "fresh_process_s<=0.6 (cache)": fresh["cache"]["median_process_s"] <= TARGETS["fresh_process_s"],
    }
    if ray:
        summary["ray_p50_over_gpulayer"] = ray["latency"]["p50_ms"] / free["gpulayer"]["latency"]["p50_ms"]
        summary["ray_p50_ms"] = ray["latency"]["p50_ms"]
        summary["ray_tasks_per_s"] = ray["tasks_per_s"]
        summary["ray_tasks_per_s_range"] = ray["tasks_per_s_range"]
    return summary


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw, glr, peer, ray = result["raw"], result["gpulayer"], result["through_peer"], result.get("ray")
    layout, free = result["layout"], result["free"]
    calls = [(f"raw socket\n({layout})", raw), (f"GPUlayer\n({layout})", glr), (f"through\nthe peer\n({layout})", peer)]
    if layout != "free":
        calls += [("raw socket\n(free)", free["raw"]), ("GPUlayer\n(free)", free["gpulayer"])]
    calls += [("Ray\n(free)", ray)] if ray else []
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    axes = axes.flatten()
    xs = np.arange(len(calls))
    for offset, (pct, color) in zip((-0.2, 0.2), (("p50", "tab:blue"), ("p99", "tab:orange"))):
        axes[0].bar(xs + offset, [r["latency"][f"{pct}_ms"] for _, r in calls], width=0.4, color=color, label=pct)
    axes[0].set_xticks(xs, [name for name, _ in calls], fontsize=8)
    axes[0].set_ylabel("ms per trivial call (median of rounds)")
    axes[0].set_title("round trip, by CPU layout (lower is better)")
    axes[0].legend()
    tput = [(f"GPUlayer\n({layout})", glr["tasks_per_s"]), (f"through\nthe peer\n({layout})", peer["tasks_per_s"])]
    tput += [("GPUlayer\n(free)", free["gpulayer"]["tasks_per_s"])] if layout != "free" else []
    tput += [("Ray\n(free)", ray["tasks_per_s"])] if ray else []
    axes[1].bar([n for n, _ in tput], [v for _, v in tput], color="tab:green")
    axes[1].axhline(TARGETS["tasks_per_s"], color="gray", linestyle="--", label="target")
    axes[1].set_title(f"{glr['submits']} submits (tasks/s)")
    axes[1].legend()
    axes[2].bar(["raw socket", "GPUlayer"], [raw["bulk_gb_per_s"], glr["bulk_gb_per_s"]], color="tab:purple")
    axes[2].axhline(TARGETS["bulk_gb_per_s"], color="gray", linestyle="--", label="budget")
    axes[2].legend()
    axes[2].set_title("256 MiB argument round trip (GB/s)")
    for name, rounds in {layout: result["rounds"], "free": free["rounds"]}.items():
        ratios = p50_over_raw_by_round(rounds, "gpulayer")
        axes[3].plot(range(1, len(ratios) + 1), ratios, marker="o", label=f"{name} CPUs")
    axes[3].axhline(TARGETS["p50_over_raw"], color="gray", linestyle="--", label="budget")
    axes[3].set_ylim(bottom=0)
    axes[3].set_xlabel("round")
    axes[3].set_title("GPUlayer p50 / raw floor, by round")
    axes[3].legend()
    fig.suptitle(f"GPUlayer overhead on {result['machine']['host']} ({result['machine']['cpus']} CPUs), "
                 f"{result['machine']['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    parser.add_argument("--json", default=str(RESULTS / "overhead.json"))
    parser.add_argument("--plot", default=None, help=PLOT_HELP)
    parser.add_argument("--raw-server", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_server:
        raw_server(args.raw_server)
        return 0
    os.environ.update(GPULAYER_KEY=secrets.token_hex(16), GPULAYER_INTERFACES="127.0.0.1", GPULAYER_CACHE="0")
    n, submits, repeats, rounds = (200, 500, 1, 1) if args.quick else (1000, 2000, 3, 7)
    big = np.random.default_rng(0).integers(0, 255, size=256 << 20, dtype=np.uint8)
    layouts = layouts_here()
    result = {"machine": machine(), "targets": TARGETS, "layout": layouts[0]}
    small = {layout: measure_small(rounds, n, submits, layout) for layout in layouts}
    judged = small[layouts[0]]
    result["raw"] = {**judged["raw"], **measure_raw(big, repeats)}
    result["gpulayer"] = {**judged["gpulayer"], **measure_bulk(big, repeats)}
    result["through_peer"] = judged["through_peer"]
    result["rounds"] = judged["rounds"]
    result["free"] = small["free"]  # the same rounds where the OS places the processes (Ray's layout too)
    result["aead"] = measure_aead(n, big, repeats)
    result["ray"] = measure_ray(n, submits, repeats)
    result["summary"] = summarize(result, result["aead"], result["ray"])
    write_results(result, args.json, args.plot, plot)
    return 0


def write_results(result: dict, json_path: str, plot: str | None, draw) -> None:
    """Write a benchmark's JSON, draw its plot (`draw(result, path)`, where `draw_beside` says), and print its
    summary."""
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(result, indent=2))
    draw_beside(draw, result, json_path, plot)
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    sys.exit(main())
