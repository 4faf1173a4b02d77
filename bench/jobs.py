"""Jobs (issue 27): a job's working folder up and its artifact down, side by side with a raw socket.

    python bench/jobs.py [--quick] [--only SECTION] [--link-rate RATE] [--json bench/results/jobs.json]
                         [--plot bench/results/jobs.png]

Two network namespaces on a bridge (tests/lan/lanlab.py; root only), a "peer" process in one and a
"submitter" process in the other, one TCP connection per measurement:

1. Upload of a fresh working folder (200 MB: 8 data files of 20 MiB and 1,600 source files of 25 KiB,
   random bytes). GPUlayer: the real handshake, then the manifest, the peer's answer (the digests its
   BlobStore lacks: all of them, a fresh store each round) and the blobs over the secure channel, each
   checked against its digest and stored (gpulayer/jobs/transfer.py), until the peer says all are in.
   Raw: the same files' bytes over a plain TCP socket, written to files on the other side, until it
   says all are in (it removes them before the next way starts, as GPUlayer's store is dropped). For
   both, how many of the machine's cores were busy meanwhile (/proc/stat: both ends, the kernel's
   network work included), beside the CPU seconds of the two processes. The submitter's digests are
   cached (it scanned the folder before), as for a folder one works in; the scan itself is measured
   apart, cold (hashing everything) and warm.
2. Resubmit unchanged: the same upload to the same store; the bytes its cable carried both ways
   (the namespace's eth0 counters, TCP and the handshake included) against the folder's size.
3. Fetch of a 1 GiB artifact from the job's folder: GPUlayer's FILE stream against the raw socket,
   each written to a file on the submitter's side.
4. The same fetch on one host (`one_host_fetch`, no namespaces): the local way (the file's descriptor
   on a local link, copied in the kernel) against the FILE stream over loopback TCP and a raw
   copy_file_range of the file.
5. `gpulayer submit -f` of a cached working folder (52 files, 2.3 MB) to the job's first output line,
   through a peer on loopback, against `ray job submit` to a local Ray head: with the peer cache on,
   as by default (the submitter ran before), and off (a first run: the static peer probed first),
   alternated round by round; "install" says whether gpulayer is an editable (development) install,
   whose import finder every interpreter start pays, or a regular one, as `pip install .` gives.

The files (the folder, the artifact, the peer's store, what is fetched) live in memory, on tmpfs
(/dev/shm; `--dir` chooses another place): on the shared test VM, writes to its disk stalled for
seconds at random (dirty-page throttling under the other tests' load), which measured the disk, not
the transfer. Both ways write the same files to the same place.

The "gpulayer" way calls the transfer functions directly over a `blocking.BlockingConnection` at both
ends (the job messages stood in for by SUBMIT/ACCEPT maps): the transfer alone. The "peer" way is a
real submit to a real peer (`python -m gpulayer.peer` in the peer's namespace): JOB_SUBMIT, JOB_NEED,
the blobs into the peer's event loop and its disk thread, the job's folder built from them and the job
recorded, until its JOB_INFO; the peer's retention (a tiny --job-retention-gb) then drops the ended job
and its blobs, so each round's store is fresh. The "peer_probed" way is the same submit while another
process asks the peer for its job list every 20 ms (`probe`): the longest answer says how long the
upload held the peer's event loop, and the way's time what the asking costs the upload (the raw socket
has no such load, so the ratio to it is the "peer" way's). Rounds alternate the ways compared; medians
are given with their min and max.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import secrets
import shlex
import shutil
import socket
import subprocess
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[1:1] = [str(ROOT / "tests"), str(ROOT / "tests" / "lan")]  # after bench/; no gpulayer in either

import msgpack  # noqa: E402
from data_plane import Deadline, rotated, spread, wait_for_file  # noqa: E402  this folder's
from lanlab import Lan, why_unavailable  # noqa: E402
from output import PLOT_HELP  # noqa: E402
from overhead import machine, write_results  # noqa: E402

from gpulayer import security  # noqa: E402
from gpulayer.jobs import transfer  # noqa: E402
from gpulayer.protocol import handshake, messages  # noqa: E402
from gpulayer.transport import blocking, sockets  # noqa: E402
from gpulayer.jobs.folder import BlobStore, DigestCache, Manifest, scan  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
PIECE = transfer.CHUNK  # the raw socket's read and write size: the same as GPUlayer's chunks
KEY_ENV = "JOBS_BENCH_KEY"  # the driver's random cluster key, handed to the two processes
TARGETS = {"upload_over_raw": 0.8, "resubmit_bytes_over_folder": 0.01, "fetch_over_raw": 0.8,
           "submit_first_line_ms": 150.0}
LENGTH = struct.Struct(">Q")
CPU = struct.Struct(">d")
TIMEOUT = 600.0
SECTIONS = ("namespaces", "submit", "one-host-fetch")  # what --only may choose


def make_folder(root: Path, data_files: int, data_mib: int, sources: int, source_kib: int) -> int:
    """A working folder of random bytes; returns its size."""
    for i in range(data_files):
        path = root / "data" / f"shard_{i:02d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(data_mib * MIB))
    for i in range(sources):
        path = root / "src" / f"pkg_{i // 100:02d}" / f"module_{i:04d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(source_kib << 10))
    (root / ".gitignore").write_text("__pycache__/\n")
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def make_artifact(path: Path, mib: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 * MIB)
    with open(path, "wb") as f:
        for i in range(0, mib, 64):
            f.write(block[:min(64, mib - i) * MIB])


# ---- the peer's side ---------------------------------------------------------------------------------

def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("closed")
        got += k
    return bytes(data)


def receive_to_file(sock: socket.socket, path: Path, size: int, buf: bytearray) -> None:
    """Raw: `size` bytes from the socket into a new file, through one reused buffer."""
    view = memoryview(buf)
    with open(path, "wb", buffering=0) as f:
        left = size
        while left:
            k = sock.recv_into(view[:min(left, len(buf))])
            if not k:
                raise ConnectionError("closed")
            f.write(view[:k])
            left -= k


def send_from_file(sock: socket.socket, path: Path | str, size: int, buf: bytearray) -> None:
    """Raw: a file's bytes to the socket, read into one reused buffer."""
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            sock.sendall(view[:n])


def serve(workdir: Path, bind: str) -> None:
    """The peer's end: one connection at a time, each a raw upload ("R"), a raw fetch ("F") or GPUlayer ("G")."""
    listener = socket.create_server((bind, 0))
    (workdir / "port").write_text(str(listener.getsockname()[1]))
    buf = bytearray(PIECE)
    while True:
        sock, _ = listener.accept()
        sockets.tune(sock)
        mode = recv_exactly(sock, 1)
        if mode == b"Q":
            return
        started = cpu_seconds()
        if mode == b"R":
            (length,) = LENGTH.unpack(recv_exactly(sock, 8))
            files = msgpack.unpackb(recv_exactly(sock, length))
            dest = workdir / "raw" / secrets.token_hex(4)
            for rel, size in files:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                receive_to_file(sock, dest / rel, size, buf)
            sock.sendall(CPU.pack(cpu_seconds() - started))
            recv_exactly(sock, 1)
            shutil.rmtree(dest)
            sock.sendall(b"c")  # cleaned up: the next measurement does not share the CPU with this removal
        elif mode == b"F":
            (length,) = LENGTH.unpack(recv_exactly(sock, 8))
            path = recv_exactly(sock, length).decode()
            size = os.stat(path).st_size
            sock.sendall(LENGTH.pack(size))
            send_from_file(sock, path, size, buf)
            spent = cpu_seconds() - started
            recv_exactly(sock, 1)
            sock.sendall(CPU.pack(spent))
        else:
            serve_gpulayer(blocking.BlockingConnection(sock), workdir)
        sock.close()


def cpu_seconds() -> float:
    """CPU time of this process so far, all its threads, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of the machine's CPUs so far (/proc/stat: user to steal)."""
    ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def cores_busy(since: tuple[int, int]) -> float:
    """How many of the machine's cores were busy on average since `since` (`machine_ticks()`): every process's
    and the kernel's work, both ends of the veth and their network included."""
    busy, total = machine_ticks()
    return (os.cpu_count() or 1) * (busy - since[0]) / max(total - since[1], 1)


def key() -> bytes:
    return bytes.fromhex(os.environ[KEY_ENV])


def serve_gpulayer(conn: blocking.BlockingConnection, workdir: Path) -> None:
    hello = handshake.hello(security.new_nonce(), "bench-peer", security.cluster_id(key()), {})
    conn.send(hello)
    msg, _ = conn.recv()
    checked = handshake.check_auth(msg, key(), hello)
    if checked is None:
        return
    conn.send(checked[0])
    conn.secure(*checked[1])
    spent = 0.0
    while True:
        try:
            msg, _ = conn.recv()
        except ConnectionError:
            return
        started = cpu_seconds()
        if msg.get("op") == "upload":
            manifest = Manifest.from_wire(msg["manifest"])
            store = BlobStore(workdir / "stores" / msg["store"])
            blobs = manifest.blobs()
            missing = store.missing(blobs)
            conn.send({"t": messages.ACCEPT, "id": msg["id"], "missing": missing})
            transfer.receive_blobs(conn, store, {d: blobs[d] for d in missing}, TIMEOUT)
            conn.send({"t": messages.ACCEPT, "id": msg["id"], "cpu": cpu_seconds() - started})
        elif msg.get("op") == "fetch":
            transfer.send_files(conn, msg["root"], msg["paths"], msg["id"])
            spent = cpu_seconds() - started
        elif msg.get("op") == "cpu":  # what the last fetch cost this side
            conn.send({"t": messages.ACCEPT, "id": msg["id"], "cpu": spent})
        elif msg.get("op") == "drop":
            shutil.rmtree(workdir / "stores" / msg["store"], ignore_errors=True)
            conn.send({"t": messages.ACCEPT, "id": msg["id"]})


# ---- the submitter's side -----------------------------------------------------------------------------

def key_holder(submitter_id: str) -> SimpleNamespace:
    """What a JobLink needs of its client: the run's cluster key (as GPULAYER_KEY) and a submitter id."""
    return SimpleNamespace(key=os.environ[KEY_ENV].encode(), submitter_id=submitter_id)


def cable_bytes() -> int:
    """Bytes through this namespace's eth0, both ways."""
    stats = Path("/sys/class/net/eth0/statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


class Submitter:
    def __init__(self, host: str, port: int, folder: Path, artifact: str, workdir: Path):
        self.address, self.folder, self.artifact, self.workdir = (host, port), folder, artifact, workdir
        self.cache = DigestCache(workdir / "digests.json")
        self.manifest = scan(folder, cache=self.cache)  # the folder was scanned before: its digests are cached
        self.buf = bytearray(PIECE)
        self.busy = 0.0  # the machine's busy cores during the last upload (`cores_busy`)

    def connect(self, mode: bytes) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=TIMEOUT)
        sockets.tune(sock)
        sock.sendall(mode)
        return sock

    def gpulayer(self) -> blocking.BlockingConnection:
        conn = blocking.BlockingConnection(self.connect(b"G"))
        handshake.client_handshake(conn, key(), "bench-submitter")
        return conn

    def raw_upload(self) -> tuple[float, float]:
        """(seconds, CPU seconds of both sides); the machine's busy cores meanwhile in `busy`."""
        started, cpu, ticks = time.perf_counter(), cpu_seconds(), machine_ticks()
        sock = self.connect(b"R")
        entries = self.manifest.entries
        header = msgpack.packb([[e.path, e.size] for e in entries])
        sock.sendall(LENGTH.pack(len(header)) + header)
        for e in entries:
            send_from_file(sock, self.manifest.sources[e.path], e.size, self.buf)
        (peer_cpu,) = CPU.unpack(recv_exactly(sock, CPU.size))
        seconds, cpu, self.busy = time.perf_counter() - started, cpu_seconds() - cpu, cores_busy(ticks)
        sock.sendall(b"k")
        recv_exactly(sock, 1)  # the peer removed the files, as `drop` does for GPUlayer's store
        sock.close()
        return seconds, cpu + peer_cpu

    def upload(self, store: str) -> tuple[float, int, int, float]:
        """(seconds, content bytes sent, bytes through the cable, CPU seconds of both sides) of one upload:
        scan (cached), connect, send; the machine's busy cores meanwhile in `busy`."""
        cable = cable_bytes()
        started, cpu, ticks = time.perf_counter(), cpu_seconds(), machine_ticks()
        manifest = scan(self.folder, cache=self.cache)
        conn = self.gpulayer()
        conn.send({"t": messages.SUBMIT, "id": 1, "op": "upload", "store": store, "manifest": manifest.to_wire()})
        reply, _ = conn.recv()
        sent = transfer.push_blobs(conn, manifest, reply["missing"], 1)
        done, _ = conn.recv()
        assert done["t"] == messages.ACCEPT
        seconds, cpu, self.busy = time.perf_counter() - started, cpu_seconds() - cpu, cores_busy(ticks)
        conn.close()
        return seconds, sent, cable_bytes() - cable, cpu + done["cpu"]

    def drop(self, store: str) -> None:
        conn = self.gpulayer()
        conn.send({"t": messages.SUBMIT, "id": 2, "op": "drop", "store": store})
        conn.recv()
        conn.close()

    def raw_fetch(self) -> tuple[float, float]:
        dest = self.workdir / "raw-fetched.bin"
        started, cpu = time.perf_counter(), cpu_seconds()
        sock = self.connect(b"F")
        path = self.artifact.encode()
        sock.sendall(LENGTH.pack(len(path)) + path)
        (size,) = LENGTH.unpack(recv_exactly(sock, 8))
        receive_to_file(sock, dest, size, self.buf)
        seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
        sock.sendall(b"k")
        (peer_cpu,) = CPU.unpack(recv_exactly(sock, CPU.size))
        sock.close()
        dest.unlink()
        return seconds, cpu + peer_cpu

    def fetch(self) -> tuple[float, float]:
        dest = self.workdir / "fetched"
        started, cpu = time.perf_counter(), cpu_seconds()
        conn = self.gpulayer()
        root, name = os.path.split(self.artifact)
        conn.send({"t": messages.SUBMIT, "id": 3, "op": "fetch", "root": root, "paths": [name]})
        transfer.receive_files(conn, dest, idle_timeout=TIMEOUT)
        seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
        conn.send({"t": messages.SUBMIT, "id": 4, "op": "cpu"})
        reply, _ = conn.recv()
        conn.close()
        shutil.rmtree(dest)
        return seconds, cpu + reply["cpu"]

    def close(self) -> None:
        self.connect(b"Q").close()


    def peer_upload(self, address: tuple[str, int], state_dir: Path, probed: bool) -> tuple[float, float | None]:
        """Seconds of a real submit of the folder (scanned: its digests cached) to the real peer at `address`,
        to its JOB_INFO, and if `probed` the longest answer (s) to the JOB_LISTs a prober process (`probe`) sent
        meanwhile (how long the peer's event loop was held); then the job is waited for, and the peer's removal
        of it and of its blobs (the tiny retention's work, on the peer's janitor thread, off the event loop: it
        would load the next round)."""
        from gpulayer.client.jobs import JobError, JobLink, _submit_over
        from gpulayer.jobs.store import JobSpec
        from gpulayer.protocol import jobs as job_protocol

        client = key_holder("bench-submitter")
        with prober(address) if probed else contextlib.nullcontext() as asking:
            started = time.perf_counter()
            manifest = scan(self.folder, cache=self.cache)
            with JobLink(client, [address]) as link:  # type: ignore[arg-type]
                info = _submit_over(link, JobSpec(["true"]), manifest, None)
            seconds = time.perf_counter() - started
            longest = float(asking.communicate("", timeout=60)[0]) if asking is not None else None
        with JobLink(client, [address]) as link:  # type: ignore[arg-type]
            try:
                ended = link.ask(job_protocol.request(messages.JOB_WAIT, 0, info["job"]["id"], timeout=120.0))
            except JobError as exc:  # it ended, and the tiny retention dropped it, before the wait came
                if exc.code != "no-job":
                    raise
                ended = {"job": None}
        assert ended["job"] is None or ended["job"]["state"] == "succeeded", ended
        deadline = time.monotonic() + 60
        while any((state_dir / "trash").iterdir()) or any((state_dir / "blobs").glob("??/*")):
            if time.monotonic() > deadline:
                raise RuntimeError("the peer did not remove the ended job and its blobs in 60 s")
            time.sleep(0.02)
        return seconds, longest


    def peer_artifact(self, address: tuple[str, int], state_dir: Path) -> str:
        """A job on the real peer whose command copies the artifact into its folder and then waits (so that
        the tiny retention keeps it); its id, once the copy is complete."""
        from gpulayer.client.jobs import JobLink, _submit_over
        from gpulayer.jobs.store import JobSpec
        from gpulayer.protocol import jobs as job_protocol

        empty = self.workdir / "empty"
        empty.mkdir(exist_ok=True)
        command = ["sh", "-c", f"cp {shlex.quote(self.artifact)} model.bin && touch ready && exec sleep {TIMEOUT:.0f}"]
        client = key_holder("bench-submitter")
        with JobLink(client, [address]) as link:  # type: ignore[arg-type]
            job_id = _submit_over(link, JobSpec(command), scan(empty, cache=DigestCache(None)), None)["job"]["id"]
            deadline = time.monotonic() + 120
            while not (state_dir / "jobs" / job_id / "work" / "ready").exists():
                job = link.ask(job_protocol.request(messages.JOB_WAIT, 0, job_id, timeout=0.2))["job"]
                if job["state"] not in ("queued", "running") or time.monotonic() > deadline:
                    raise RuntimeError(f"the artifact's job is {job['state']}: {job.get('reason')}")
        return job_id

    def peer_fetch(self, address: tuple[str, int], job_id: str) -> float:
        """Seconds of a real fetch of the artifact from the real peer's job: `Job.fetch` (JOB_FETCH, the peer's
        FILE stream from its event loop, the submitter's receiver)."""
        from gpulayer.client.jobs import Job, JobLink

        client = key_holder("bench-submitter")
        jobs = SimpleNamespace(link=lambda holder: JobLink(client, holder.addresses))  # type: ignore[arg-type]
        job = Job(jobs, SimpleNamespace(name="bench-peer", addresses=[address]), {"id": job_id})  # type: ignore[arg-type]
        dest = self.workdir / "peer-fetched"
        started = time.perf_counter()
        job.fetch(["model.bin"], dest)
        seconds = time.perf_counter() - started
        assert (dest / "model.bin").stat().st_size == os.stat(self.artifact).st_size
        shutil.rmtree(dest)
        return seconds

    def peer_stop(self, address: tuple[str, int], job_id: str) -> None:
        from gpulayer.client.jobs import JobLink
        from gpulayer.protocol import jobs as job_protocol

        client = key_holder("bench-submitter")
        with JobLink(client, [address]) as link:  # type: ignore[arg-type]
            link.ask(job_protocol.request(messages.JOB_STOP, 0, job_id, grace=1.0))


@contextlib.contextmanager
def prober(address: tuple[str, int]) -> Iterator[subprocess.Popen]:
    """A prober process (`probe`) asking the peer at `address`, started (its start is not timed) and killed
    after; its stdin's end stops it, and then it prints the longest answer."""
    proc = subprocess.Popen([sys.executable, __file__, "--probe", "--host", address[0], "--port", str(address[1])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "probing":  # type: ignore[union-attr]
            raise RuntimeError("the prober did not start")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def probe(host: str, port: int) -> None:
    """The prober of a real submit (`Submitter.peer_upload`), in a process of its own as a dashboard would be,
    not beside the submitter's upload in its process: a JOB_LIST to the peer every 20 ms, one at a time, until
    its stdin ends (at most TIMEOUT s); prints "probing" once the first is answered, then the longest answer (s)."""
    import select

    from gpulayer.client.jobs import JobLink
    from gpulayer.protocol import jobs as job_protocol

    client = key_holder("bench-prober")
    answers = []
    with JobLink(client, [(host, port)]) as link:  # type: ignore[arg-type]
        link.ask(job_protocol.request(messages.JOB_LIST, 0), timeout=60.0)  # the first: not counted
        print("probing", flush=True)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0.02)[0]:  # till stdin ends
            asked = time.perf_counter()
            link.ask(job_protocol.request(messages.JOB_LIST, 0), timeout=60.0)
            answers.append(time.perf_counter() - asked)
    print(max(answers, default=0.0), flush=True)


def run_submitter(args: argparse.Namespace) -> None:
    workdir = Path(args.workdir)
    folder = Path(args.folder)
    cold = time.perf_counter()
    scan(folder, cache=DigestCache(None))
    cold = time.perf_counter() - cold
    sub = Submitter(args.host, args.port, folder, args.artifact, workdir)
    warm = time.perf_counter()
    scan(folder, cache=sub.cache)
    warm = time.perf_counter() - warm
    deadline = Deadline(args.max_minutes)
    sub.upload("warm-up")
    sub.drop("warm-up")
    up: dict[str, list[float]] = {"raw": [], "gpulayer": [], "peer": [], "peer_probed": []}
    up_cpu: dict[str, list[float]] = {"raw": [], "gpulayer": []}
    up_busy: dict[str, list[float]] = {"raw": [], "gpulayer": []}
    peer_stall: list[float] = []
    resubmit: list[dict] = []
    for i in deadline.rounds(args.rounds):
        store = f"round-{i}"
        for way in rotated(list(up), i):
            if way.startswith("peer"):
                seconds, stall = sub.peer_upload((args.host, int(args.peer_port)), Path(args.peer_state),
                                                 probed=way == "peer_probed")
                up[way].append(seconds)
                if stall is not None:
                    peer_stall.append(stall)
                continue
            if way == "raw":
                seconds, cpu = sub.raw_upload()
            else:
                seconds, sent, _, cpu = sub.upload(store)
                assert sent == sub.manifest.total_bytes, (sent, sub.manifest.total_bytes)
            up[way].append(seconds)
            up_cpu[way].append(cpu)
            up_busy[way].append(sub.busy)
        seconds, sent, cable, _ = sub.upload(store)
        resubmit.append({"seconds": seconds, "content_bytes": sent, "cable_bytes": cable})
        sub.drop(store)
    down: dict[str, list[float]] = {"raw": [], "gpulayer": [], "peer": []}
    down_cpu: dict[str, list[float]] = {"raw": [], "gpulayer": []}
    peer = (args.host, int(args.peer_port))
    job_id = sub.peer_artifact(peer, Path(args.peer_state))
    for i in deadline.rounds(args.rounds):
        for way in rotated(list(down), i):
            if way == "peer":
                down[way].append(sub.peer_fetch(peer, job_id))
                continue
            seconds, cpu = sub.raw_fetch() if way == "raw" else sub.fetch()
            down[way].append(seconds)
            down_cpu[way].append(cpu)
    sub.peer_stop(peer, job_id)
    sub.close()
    print(json.dumps({"upload_s": up, "upload_cpu_s": up_cpu, "upload_cores_busy": up_busy,
                      "peer_upload_longest_answer_s": peer_stall, "resubmit": resubmit, "fetch_s": down,
                      "fetch_cpu_s": down_cpu, "scan_cold_s": cold, "scan_warm_s": warm,
                      "files": len(sub.manifest.entries), "folder_bytes": sub.manifest.total_bytes}))


# ---- the driver ---------------------------------------------------------------------------------------

def across_namespaces(workdir: Path, quick: bool, rounds: int, max_minutes: float, link_rate: str | None = None) -> dict:
    """Sections 1 to 3; with `link_rate` (tc's words, e.g. "1gbit"), each host's veth is limited to it both
    ways (a token bucket on what the bridge sends it), as a LAN's link would be."""
    folder = workdir / "project"
    shape = (4, 4, 160, 25) if quick else (8, 20, 1600, 25)
    size = make_folder(folder, *shape)
    artifact = workdir / "job" / "ckpt" / "model.bin"
    make_artifact(artifact, 64 if quick else 1024)
    os.environ[KEY_ENV] = secrets.token_hex(32)
    lan = Lan(workdir / "lan")
    try:
        peer_host, submitter_host = lan.add_host("peer"), lan.add_host("submitter")
        if link_rate:
            for host in (peer_host, submitter_host):  # a burst of 4 ms at that rate: tbf needs one of a tick's
                host.rate_limit(link_rate, burst=f"{max(_bits(link_rate) // 250 // 8, 64 << 10)}b", latency="50ms")
        peer_dir = workdir / "peer"
        peer_dir.mkdir()
        peer_host.popen([sys.executable, __file__, "--serve", str(peer_dir), "--bind", peer_host.ip], os.environ)
        ready = workdir / "peer.ready.json"
        peer_host.popen([sys.executable, "-m", "gpulayer.peer", "--interfaces", peer_host.ip, "--name", "bench-peer",
                         "--concurrency", "1", "--state-dir", str(workdir / "peer-state"), "--job-retention-gb",
                         "0.000001", "--ready-file", str(ready)],
                        {**os.environ, "GPULAYER_KEY": os.environ[KEY_ENV], "GPULAYER_SHM": "0"},
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_file(peer_dir / "port", 30)
        wait_for_file(ready, 60)
        sub_dir = workdir / "submitter"
        sub_dir.mkdir()
        out = submitter_host.run([sys.executable, __file__, "--submit", "--host", peer_host.ip,
                                  "--port", (peer_dir / "port").read_text(), "--workdir", str(sub_dir),
                                  "--folder", str(folder), "--artifact", str(artifact), "--rounds", str(rounds),
                                  "--peer-port", str(json.loads(ready.read_text())["port"]),
                                  "--peer-state", str(workdir / "peer-state"),
                                  "--max-minutes", str(max_minutes)], timeout=60 * max_minutes + 600,
                                 env=os.environ.copy())
        if out.returncode != 0:
            raise RuntimeError(f"the submitter failed ({out.returncode}): {out.stderr[-3000:]}")
        measured = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        lan.close()
    measured["shape"] = {"data_files": shape[0], "data_mib": shape[1], "sources": shape[2], "source_kib": shape[3],
                         "bytes": size, "artifact_bytes": artifact.stat().st_size}
    return measured


def _bits(rate: str) -> int:
    """Bits per second of a tc rate such as "1gbit", "500mbit" or "20kbit"."""
    for suffix, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if rate.endswith(suffix):
            return int(float(rate[:-len(suffix)]) * scale)
    raise ValueError(f"{rate!r} is not a rate such as 1gbit or 500mbit")


# ---- 4. submit of a cached folder to the job's first output line, on one host --------------------------

MARKER = "jobs-bench-first-line"
FIRST_LINE = ["python", "-c", f"print({MARKER!r}, flush=True)"]


def time_to_line(argv: list[str], env: dict, timeout: float = 120.0) -> float:
    """Seconds from starting `argv` to the line MARKER on its output; the process is then left to end."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == MARKER:
                seen = time.perf_counter() - started
                break
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if seen is None:
        raise RuntimeError(f"{shlex.join(argv)} never printed its first line (exit {proc.returncode})")
    return seen


def ray_head(env: dict, port: int) -> tuple[subprocess.Popen, str | None]:
    """A local Ray head with its job server (the dashboard) on 127.0.0.1:`port`, held by a driver process
    that ends it when its stdin closes (never `ray stop`, which would end other users' Ray too); the
    process, and why it failed, or None."""
    script = ("import sys, ray; ray.init(include_dashboard=True, dashboard_host='127.0.0.1', "
              f"dashboard_port={port}, _node_ip_address='127.0.0.1', num_cpus=2, logging_level='ERROR'); "
              "print('ready', flush=True); sys.stdin.read(); ray.shutdown()")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    output = []
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc, None
        output.append(line)
    proc.wait()
    return proc, "the Ray head did not start: " + " ".join(output[-3:]).strip()[-400:]


def install_kind() -> str:
    """How gpulayer is installed here: "editable" (a development checkout: each interpreter start also
    runs the editable install's import finder, ~10 ms here), else "regular", as `pip install .` gives."""
    import gpulayer

    dist = Path(gpulayer.__file__).resolve().parent.parent
    return "editable" if (dist / "pyproject.toml").is_file() else "regular"


def submit_latency(workdir: Path, rounds: int) -> dict:
    """`gpulayer submit -f` of a cached working folder to the job's first output line, through a peer on
    loopback, against `ray job submit` of the same folder to a local Ray head bound to 127.0.0.1."""
    if importlib.util.find_spec("gpulayer.jobs_cli") is None:
        return {"skipped": "this tree has no `gpulayer submit` (the jobs of issue 27 are not merged)"}
    from support import PeerProcess

    folder = workdir / "small-project"
    make_folder(folder, 2, 1, 50, 4)
    key = secrets.token_hex(16)
    # bytecode cached (in the bench's own folder), as an installed package has it: without, each start
    # compiles gpulayer from source (PYTHONDONTWRITEBYTECODE, set in CI and on the test VM: +0.15 s)
    # the peer cache on, as by default: a submitter that ran before tries the cached peer first
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "GPULAYER_CACHE")},
           "GPULAYER_KEY": key, "GPULAYER_INTERFACES": "127.0.0.1", "XDG_STATE_HOME": str(workdir / "state"),
           "XDG_CACHE_HOME": str(workdir / "cache"), "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPYCACHEPREFIX": str(workdir / "bytecode"),
           # Ray's token authentication, with a token of this run's (a token file of another Ray in ~/.ray
           # would otherwise switch it on without a token for `ray job submit`)
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    peer = PeerProcess(workdir, key, "jobs-bench", env=env).start()
    out: dict = {"folder_bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
                 "install": install_kind()}
    try:
        env["GPULAYER_PEERS"] = peer.address
        submit = [sys.executable, "-m", "gpulayer", "submit", "-f", "--accelerator", "cpu",
                  "--working-dir", str(folder), "--", *FIRST_LINE]
        out["gpulayer_first_s"] = time_to_line(submit, env)  # the folder goes up; later submits find it cached
        no_cache = {**env, "GPULAYER_CACHE": "0"}  # as a submitter's first run: the static peer probed first
        runs: dict[str, list[float]] = {"gpulayer_s": [], "gpulayer_no_peer_cache_s": []}
        for _ in range(rounds):  # alternated, so that both see the same moments of the machine
            runs["gpulayer_s"].append(time_to_line(submit, env))
            runs["gpulayer_no_peer_cache_s"].append(time_to_line(submit, no_cache))
        out.update({name: spread(times) for name, times in runs.items()})
    finally:
        peer.stop()
    port = 18265 + secrets.randbelow(1000)
    # Ray's processes keep their own bytecode: a straggler of the head writing into the run's folder as it
    # is removed left it behind
    ray_env = {k: v for k, v in env.items() if k != "PYTHONPYCACHEPREFIX"}
    head, problem = ray_head(ray_env, port)
    try:
        if problem is not None:
            out["ray"] = {"skipped": problem}
        else:
            ray_submit = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address",
                          f"http://127.0.0.1:{port}", "--working-dir", str(folder), "--", *FIRST_LINE]
            out["ray_first_s"] = time_to_line(ray_submit, ray_env)
            out["ray_s"] = spread([time_to_line(ray_submit, ray_env) for _ in range(rounds)])
    finally:
        if head.poll() is None:
            head.communicate(timeout=60)
    return out


def one_host_fetch(workdir: Path, mib: int, rounds: int) -> dict:
    """A fetch of a `mib` MiB artifact on one host: the local way (its descriptor on a local link, copied in
    the kernel: jobs/local_fetch.py), the FILE stream over the secure channel on loopback TCP, and a raw
    kernel copy of the same file (copy_file_range), side by side; seconds per way, rounds alternated.
    Both ends in this process (the peer's on a thread), with the transfer functions of the two sides."""
    import threading
    from functools import partial

    from gpulayer.jobs import local_fetch
    from gpulayer.jobs.folder import copy_fd
    from gpulayer.transport import shm

    if not shm.SUPPORTED:
        return {"skipped": "no memfd or SCM_RIGHTS here"}
    root = workdir / "one-host-job"
    make_artifact(root / "artifact.bin", mib)
    size = (root / "artifact.bin").stat().st_size

    def gpulayer(local: bool) -> float:
        server, client = socket.create_server(("127.0.0.1", 0)), None
        peer_link, submitter_link = shm.link_pair()
        try:
            client = socket.create_connection(server.getsockname())
            sock, _ = server.accept()
            keys = secrets.token_bytes(32), secrets.token_bytes(32)
            peer, submitter = blocking.BlockingConnection(sock), blocking.BlockingConnection(client)
            peer.secure(*keys)
            submitter.secure(keys[1], keys[0])
            receiver = local_fetch.Receiver(workdir / "one-host-fetched")
            if local:
                receiver.use(submitter_link)
            handover = partial(local_fetch.pass_file, peer_link) if local else None
            started = time.perf_counter()
            sender = threading.Thread(target=lambda: [peer.send(*m) for m in transfer.file_messages(
                root, transfer.listing(root, ["artifact.bin"]), 1, handover=handover)])
            sender.start()
            while not receiver.feed(*submitter.recv(time.monotonic() + TIMEOUT)):
                pass
            receiver.finish()
            seconds = time.perf_counter() - started
            sender.join()
            receiver.abort()
            return seconds
        finally:
            for end in (server, client, peer_link, submitter_link):
                if end is not None:
                    end.close()
            shutil.rmtree(workdir / "one-host-fetched", ignore_errors=True)

    def raw() -> float:
        started = time.perf_counter()
        src = os.open(root / "artifact.bin", os.O_RDONLY)
        dst = os.open(workdir / "raw-copy.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            copy_fd(src, dst, size)
        finally:
            os.close(src)
            os.close(dst)
        seconds = time.perf_counter() - started
        os.unlink(workdir / "raw-copy.bin")
        return seconds

    ways = {"local": partial(gpulayer, True), "tcp": partial(gpulayer, False), "raw_copy": raw}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for round_ in range(rounds):
        for way in rotated(list(ways), round_):
            seconds[way].append(ways[way]())
    shutil.rmtree(root)
    return {"artifact_bytes": size, "gb_per_s": {way: gb_per_s(size, s) for way, s in seconds.items()}}


def gb_per_s(nbytes: int, seconds: list[float]) -> dict:
    return spread([nbytes / s / 1e9 for s in seconds])


def over_raw(seconds: dict[str, list[float]], way: str) -> dict | None:
    """The spread of the raw socket's time over `way`'s, round by round; None where `way` was not run."""
    return spread([r / g for g, r in zip(seconds[way], seconds["raw"])]) if seconds.get(way) else None


def summarize(m: dict) -> dict:
    folder, artifact = m["shape"]["bytes"], m["shape"]["artifact_bytes"]
    up = {way: gb_per_s(folder, s) for way, s in m["upload_s"].items()}
    down = {way: gb_per_s(artifact, s) for way, s in m["fetch_s"].items()}
    up_ratio, peer_ratio, probed_ratio = (over_raw(m["upload_s"], w) for w in ("gpulayer", "peer", "peer_probed"))
    down_ratio, peer_down = (over_raw(m["fetch_s"], w) for w in ("gpulayer", "peer"))
    cable = spread([r["cable_bytes"] / folder for r in m["resubmit"]])
    s = {
        "folder_mb": folder / 1e6, "folder_files": m["files"], "artifact_mib": artifact / MIB,
        "upload_gb_per_s": {w: [v["median"], v["min"], v["max"]] for w, v in up.items()},
        "upload_over_raw": up_ratio["median"], "upload_over_raw_range": [up_ratio["min"], up_ratio["max"]],
        # a real submit to a real peer (its event loop, its disk thread, the job's folder built and recorded)
        "upload_peer_over_raw": peer_ratio and peer_ratio["median"],
        "upload_peer_over_raw_range": peer_ratio and [peer_ratio["min"], peer_ratio["max"]],
        # the same while another process asks the peer for its job list every 20 ms
        "upload_peer_probed_over_raw": probed_ratio and probed_ratio["median"],
        "upload_peer_probed_over_raw_range": probed_ratio and [probed_ratio["min"], probed_ratio["max"]],
        # the longest a JOB_LIST waited for its answer while the peer received an upload (its event loop held)
        "upload_peer_longest_answer_ms": m.get("peer_upload_longest_answer_s") and
        1e3 * spread(m["peer_upload_longest_answer_s"])["median"],
        "resubmit_content_bytes": max(r["content_bytes"] for r in m["resubmit"]),
        "resubmit_cable_bytes_over_folder": cable["median"],
        "resubmit_seconds": spread([r["seconds"] for r in m["resubmit"]])["median"],
        "fetch_gb_per_s": {w: [v["median"], v["min"], v["max"]] for w, v in down.items()},
        "fetch_over_raw": down_ratio["median"], "fetch_over_raw_range": [down_ratio["min"], down_ratio["max"]],
        # a real fetch from a real peer's job (its event loop sends; the receiver of `Job.fetch`)
        "fetch_peer_over_raw": peer_down and peer_down["median"],
        "fetch_peer_over_raw_range": peer_down and [peer_down["min"], peer_down["max"]],
        "scan_cold_s": m["scan_cold_s"], "scan_warm_s": m["scan_warm_s"],
        # CPU seconds both processes spent per GB moved: what a CPU-starved machine's wall time follows
        "upload_cpu_s_per_gb": {w: spread([c / folder * 1e9 for c in v])["median"] for w, v in m["upload_cpu_s"].items()},
        "upload_cores_busy": {w: spread(v)["median"] for w, v in m["upload_cores_busy"].items()},
        "fetch_cpu_s_per_gb": {w: spread([c / artifact * 1e9 for c in v])["median"] for w, v in m["fetch_cpu_s"].items()},
    }
    s["targets_met"] = {
        "upload >= 0.8 x raw": s["upload_over_raw"] >= TARGETS["upload_over_raw"],
        "resubmit unchanged: cable bytes <= 1% of the folder":
            cable["max"] <= TARGETS["resubmit_bytes_over_folder"] and s["resubmit_content_bytes"] == 0,
        "fetch >= 0.8 x raw": s["fetch_over_raw"] >= TARGETS["fetch_over_raw"],
    }
    return s


def summarize_submit(m: dict) -> dict:
    if "gpulayer_s" not in m:
        return {"submit": m.get("skipped", "skipped")}
    s = {"submit_first_line_ms": 1e3 * m["gpulayer_s"]["median"],
         "submit_first_line_ms_range": [1e3 * m["gpulayer_s"]["min"], 1e3 * m["gpulayer_s"]["max"]],
         "install": m.get("install")}
    if "gpulayer_no_peer_cache_s" in m:
        s["submit_first_line_ms_no_peer_cache"] = 1e3 * m["gpulayer_no_peer_cache_s"]["median"]
    if "ray_s" in m:
        s["ray_job_submit_first_line_ms"] = 1e3 * m["ray_s"]["median"]
    else:
        s["ray_job_submit"] = m.get("ray", {}).get("skipped", "skipped")
    s["submit_target_met"] = s["submit_first_line_ms"] <= TARGETS["submit_first_line_ms"]
    return s


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    if "skipped" in result["namespaces"]:
        axes[0].text(0.5, 0.5, f"skipped: {result['namespaces']['skipped']}", ha="center", va="center")
        fig.savefig(path, dpi=100)
        return
    s = result["summary"]
    for ax, key, title, target in ((axes[0], "upload_gb_per_s", f"Upload, fresh {s['folder_mb']:.0f} MB folder "
                                    f"({s['folder_files']} files)", "upload_over_raw"),
                                   (axes[1], "fetch_gb_per_s", f"Fetch, {s['artifact_mib']:.0f} MiB artifact",
                                    "fetch_over_raw")):
        rows = s[key]
        labels = {"raw": "raw socket", "gpulayer": "GPUlayer, the transfer\n(secure channel, verified)",
                  "peer": "GPUlayer, a real peer\n" + ("(submit to job recorded)" if key.startswith("upload")
                                                       else "(Job.fetch)"),
                  "peer_probed": "the same, its job list\nasked every 20 ms meanwhile"}
        names = [n for n in labels if n in rows]
        medians = [rows[n][0] for n in names]
        errors = [[rows[n][0] - rows[n][1] for n in names], [rows[n][2] - rows[n][0] for n in names]]
        ax.barh([labels[n] for n in names], medians, xerr=errors,
                color=["tab:gray", "tab:green", "tab:olive", "tab:brown"][:len(names)], capsize=4)
        for y, (name, m) in enumerate(zip(names, medians)):
            ax.text(rows[name][2], y, f"  {m:.2f} GB/s", va="center")
        ax.axvline(TARGETS[target] * rows["raw"][0], color="k", linestyle="--", label="target: 0.8 x raw")
        ax.invert_yaxis()
        ax.set_xlim(0, max(r[2] for r in rows.values()) * 1.5)
        ax.legend(loc="lower right")
        cpu = s[key.replace("gb_per_s", "cpu_s_per_gb")]
        peer = target.replace("_over_raw", "_peer_over_raw")
        busy = s.get(key.replace("gb_per_s", "cores_busy"))  # the upload's only
        ax.set_title(f"{title}\nGPUlayer / raw = {s[target]:.2f}" + (f", real peer {s[peer]:.2f}" if peer in s else "")
                     + (f" ({s[probed]:.2f} probed)" if s.get(probed := peer.replace("_over", "_probed_over")) else "")
                     + f"\n(GB/s, across the veth); CPU s per GB, both sides\n(the transfer): raw {cpu['raw']:.2f}, "
                     f"GPUlayer {cpu['gpulayer']:.2f}"
                     + (f"\ncores busy meanwhile (of {result['machine']['cpus']}): raw {busy['raw']:.2f}, "
                        f"GPUlayer {busy['gpulayer']:.2f}" if busy else ""))
    ax = axes[2]
    ax.bar(["folder", "resubmit:\ncable bytes"], [s["folder_mb"], s["resubmit_cable_bytes_over_folder"] *
                                                  s["folder_mb"]], color=["tab:gray", "tab:green"])
    ax.axhline(TARGETS["resubmit_bytes_over_folder"] * s["folder_mb"], color="k", linestyle="--",
               label="target: 1% of the folder")
    ax.set_yscale("log")
    ax.set_ylabel("MB")
    ax.legend()
    ax.set_title(f"Resubmit unchanged: on the wire,\n{100 * s['resubmit_cable_bytes_over_folder']:.3f}% "
                 f"of the folder, in {s['resubmit_seconds'] * 1e3:.0f} ms\n(scan: warm {s['scan_warm_s'] * 1e3:.0f} ms, "
                 f"cold {s['scan_cold_s']:.2f} s)")
    fig.text(0.5, 0.01, "submit of a cached folder to the job's first output line, one host: " + (
        f"gpulayer submit -f {s['submit_first_line_ms']:.0f} ms (target {TARGETS['submit_first_line_ms']:.0f}"
        + (f"; {s['submit_first_line_ms_no_peer_cache']:.0f} ms without the peer cache"
           if "submit_first_line_ms_no_peer_cache" in s else "") + f"; {s.get('install')} install); "
        + (f"ray job submit {s['ray_job_submit_first_line_ms']:.0f} ms" if "ray_job_submit_first_line_ms" in s
           else f"ray job submit: {s.get('ray_job_submit')}")
        if "submit_first_line_ms" in s else str(s.get("submit"))), ha="center", fontsize=9)
    m = result["machine"]
    rate = result["settings"].get("link_rate")
    fig.suptitle(f"GPUlayer jobs' folder transfer on {m['host']} ({m['cpus']} CPUs, load {m['load_before'][0]:.1f}"
                 + (f", each link limited to {rate}" if rate else "") + "), "
                 f"{m['date'][:10]}; bars: median of rounds, whiskers: min-max")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds (a smoke run)")
    parser.add_argument("--json", default=str(RESULTS / "jobs.json"))
    parser.add_argument("--plot", default=None, help=PLOT_HELP)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=SECTIONS, help="run this section alone (default: all of them)")
    parser.add_argument("--max-minutes", type=float, default=20.0, help="rounds stop early past this")
    parser.add_argument("--link-rate", help="limit each namespace's link to this rate, as a LAN's (tc's words: 1gbit)")
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where the files live (default: /dev/shm, tmpfs)")
    for hidden in ("--serve", "--bind", "--host", "--port", "--peer-port", "--workdir", "--folder", "--artifact",
                   "--peer-state"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--submit", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        probe(args.host, int(args.port))
        return 0
    if args.serve:
        serve(Path(args.serve), args.bind)
        return 0
    if args.submit:
        args.port = int(args.port)
        run_submitter(args)
        return 0
    rounds = 2 if args.quick else args.rounds
    result = {"machine": {**machine(), "load_before": os.getloadavg()},
              "settings": {"quick": args.quick, "rounds": rounds, "chunk_mib": transfer.CHUNK / MIB, "link_rate": args.link_rate,
                           "files_in": args.dir or tempfile.gettempdir()},
              "targets": TARGETS}
    reason = why_unavailable() if args.only in (None, "namespaces") else "not asked for (--only)"
    skipped = {"skipped": "not asked for (--only)"}
    with tempfile.TemporaryDirectory(prefix="jobs-bench-", dir=args.dir) as tmp:
        result["namespaces"] = ({"skipped": reason} if reason else
                                across_namespaces(Path(tmp), args.quick, rounds, args.max_minutes, args.link_rate))
        result["submit"] = submit_latency(Path(tmp), rounds) if args.only in (None, "submit") else skipped
        result["one_host_fetch"] = one_host_fetch(Path(tmp), 256 if args.quick else 1024, rounds) \
            if args.only in (None, "one-host-fetch") else skipped
    result["machine"]["load_after"] = os.getloadavg()
    result["summary"] = {"skipped": reason} if reason else summarize(result["namespaces"])
    result["summary"].update(summarize_submit(result["submit"]))
    write_results(result, args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
