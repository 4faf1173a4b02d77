"""CPU per GiB of each stage a job's upload goes through, one stage at a time, in this process.

    python bench/jobs_stages.py [--mib 256] [--dir /dev/shm]

Stages, each over `--mib` MiB in 1 MiB pieces (the size of a record and of a blob's chunk): reading a
file into one reused buffer, writing it, sealing records (`records.Sealer.stream`), opening them
(`records.Opener.feed_bytes_into`, which copies the ciphertext in as a receive would), SHA-256 (the
content digest of protocol 2) and BLAKE3 (protocol 3's), a socketpair's send and receive (the kernel's
part, no TCP stack), and the digests and AES-GCM sealing on two threads at once (whether they let go of
the GIL: two threads' wall time against one's). Then a peer's work for a fresh folder of `--mib` MiB
shaped as bench/jobs.py's (a fifth in files of 25 KiB, the rest in 8 large ones), from blobs in memory:
each blob checked and stored, and the job's folder built, by copies out of the store (the way before
ADR 0025, still a resubmit's) or with each blob written as its first file, which the store links to (ADRs
0025 and 0027). Prints CPU seconds per GiB (process time, all threads) and the wall time; ADRs 0016, 0023,
0025 and 0027 use these figures.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulayer.jobs.folder import BlobStore, Builder, Entry, Manifest, new_digest  # noqa: E402
from gpulayer.protocol import records  # noqa: E402

MiB = 1 << 20


class _Sink:
    """A MessageReader stand-in that drops the plaintext: only the opening is measured."""

    def __init__(self) -> None:
        self._buf = memoryview(bytearray(2 * MiB))

    def buffer(self) -> memoryview:
        return self._buf

    def feed(self, n: int) -> None:
        pass


def stages(folder: str, pieces: int) -> list[tuple[str, Callable[[], None], int]]:
    """(name, the stage over `pieces` MiB, how many times it handles those MiB)."""
    piece = memoryview(bytearray(os.urandom(MiB)))
    src, dst = os.path.join(folder, "src"), os.path.join(folder, "dst")
    with open(src, "wb") as f:
        for _ in range(pieces):
            f.write(piece)
    key = os.urandom(records.KEY_BYTES)
    sealed = [bytes(r) for r in records.Sealer(key).stream([piece] * 8)]
    aead = records.AEAD(key)
    out = bytearray(MiB + records.TAG)

    def read() -> None:
        fd = os.open(src, os.O_RDONLY)
        while os.readv(fd, [piece]):
            pass
        os.close(fd)

    def write() -> None:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for _ in range(pieces):
            os.write(fd, piece)
        os.close(fd)
        os.unlink(dst)

    def seal() -> None:
        for _ in records.Sealer(key).stream([piece] * pieces):
            pass

    def open_() -> None:
        sink = _Sink()
        for _ in range(pieces // len(sealed)):
            opener = records.Opener(key)
            for record in sealed:
                opener.feed_bytes_into(record, sink)

    def sha256() -> None:
        digest = hashlib.sha256()
        for _ in range(pieces):
            digest.update(piece)

    def blake3() -> None:
        digest = new_digest()
        for _ in range(pieces):
            digest.update(piece)

    def seal_only() -> None:
        for i in range(pieces):
            aead.encrypt_into(i.to_bytes(12, "big"), piece, b"", out)

    def send_receive() -> None:
        a, b = socket.socketpair()

        def receive() -> None:
            into, got = bytearray(MiB), 0
            while got < pieces * MiB:
                got += b.recv_into(into)

        thread = threading.Thread(target=receive)
        thread.start()
        for _ in range(pieces):
            a.sendall(piece)
        thread.join()
        a.close()
        b.close()

    def store_and_build(written_there: bool) -> Callable[[], None]:
        """Store the folder's blobs in a fresh store, and build a job's folder from them: each blob written as
        the job's file and linked into the store (an upload's way), or stored and then copied out."""
        blobs, manifest = _folder(pieces)

        def run() -> None:
            where = tempfile.mkdtemp(dir=folder)
            store = BlobStore(os.path.join(where, "store"))
            builder = Builder(manifest, store, lambda: [Path(where, "job")])
            for digest, data in blobs:
                store.put(digest, data, builder.first(digest) if written_there else None)
                builder.stored(digest)
            builder.finish()
            store.close()
        return run

    def two(fn: Callable[[], None]) -> Callable[[], None]:
        def both() -> None:
            threads = [threading.Thread(target=fn) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return both

    return [("read (readv, one buffer)", read, 1), ("write", write, 1), ("seal (Sealer.stream)", seal, 1),
            ("open (Opener.feed_bytes_into)", open_, 1), ("sha256 (protocol 2's digest)", sha256, 1),
            ("blake3 (the content digest)", blake3, 1), ("send+receive (socketpair)", send_receive, 1),
            ("sha256, 2 threads", two(sha256), 2), ("blake3, 2 threads", two(blake3), 2),
            ("AES-GCM seal, 2 threads", two(seal_only), 2), ("AES-GCM seal, 1 thread", seal_only, 1),
            ("store, copy into the job folder", store_and_build(written_there=False), 1),
            ("write as the job's file, link into the store", store_and_build(written_there=True), 1)]


def _folder(mib: int) -> tuple[list[tuple[str, memoryview]], Manifest]:
    """A fresh folder's blobs ((digest, bytes), all distinct) and manifest: a fifth of `mib` MiB in files of
    25 KiB, the rest in 8 large files."""
    sizes = [25 << 10] * (mib * MiB // 5 // (25 << 10)) + [mib * MiB * 4 // 5 // 8] * 8
    blobs, entries = [], []
    for i, size in enumerate(sizes):
        data = memoryview(os.urandom(size))
        digest = new_digest()
        digest.update(data)
        blobs.append((digest.hexdigest(), data))
        entries.append(Entry(f"src/{i // 100}/f{i}.py" if size == 25 << 10 else f"data/{i}.bin", size, False,
                             blobs[-1][0]))
    return blobs, Manifest(tuple(sorted(entries, key=lambda e: e.path)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB per stage (a multiple of 8)")
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(dir=args.dir)
    try:
        print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
        for name, fn, times in stages(folder, args.mib):
            cpu, wall = time.process_time(), time.perf_counter()
            fn()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            gib = times * args.mib / 1024
            print(f"{name:44s} {cpu / gib:5.2f} CPU-s/GiB   {gib / wall:5.2f} GiB/s wall")
    finally:
        shutil.rmtree(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
