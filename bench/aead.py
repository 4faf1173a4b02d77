"""The secure channel's AEAD, measured: AES-256-GCM against ChaCha20-Poly1305, then the record layer.

    python bench/aead.py [--quick] [--json bench/results/aead.json]

1. The primitives alone (cryptography's encrypt_into / decrypt_into, no allocation per call),
   seal and open, on small frames (100 B, 1 KiB: calls/s) and big ones (1 MiB frames, 256 MiB
   in all: GB/s); and the allocating encrypt/decrypt for comparison.
2. The record layer (gpulayer.protocol.records) with the chosen AEAD: a small wire message sealed and
   opened (one AEAD call each way), and a 256 MiB buffer for each candidate record size, in
   one process (seal, open into a MessageReader) and across loopback TCP between two
   processes (the sender seals and sends, the receiver opens; beside the same path in clear).
Figures are from one run on one machine; the choice is written in ADR 0008.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import cryptography
from cryptography.hazmat.backends.openssl.backend import backend as openssl_backend
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from gpulayer.protocol import framing, messages, records
from gpulayer.transport import blocking

RESULTS = Path(__file__).resolve().parent / "results"
CIPHERS = {"aes-256-gcm": AESGCM, "chacha20-poly1305": ChaCha20Poly1305}
SMALL = (100, 1024)
BIG = 1 << 20
TOTAL = 256 << 20
RECORD_SIZES = (16 << 10, 64 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20)
AAD = b"\0\0\0\0"


def best_rate(fn, count: int, repeats: int) -> float:
    """The best of `repeats` runs of `count` calls of fn, in calls per second."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(count):
            fn()
        best = min(best, time.perf_counter() - started)
    return count / best


def measure_primitive(cls, size: int, count: int, repeats: int) -> dict:
    aead = cls(os.urandom(32))
    nonce = bytes(12)
    plain = os.urandom(size)
    sealed = bytearray(size + records.TAG)
    opened = bytearray(size)
    aead.encrypt_into(nonce, plain, AAD, sealed)
    seal = best_rate(lambda: aead.encrypt_into(nonce, plain, AAD, sealed), count, repeats)
    open_ = best_rate(lambda: aead.decrypt_into(nonce, sealed, AAD, opened), count, repeats)
    assert bytes(opened) == plain
    ciphertext = bytes(sealed)
    seal_alloc = best_rate(lambda: aead.encrypt(nonce, plain, AAD), count, repeats)
    open_alloc = best_rate(lambda: aead.decrypt(nonce, ciphertext, AAD), count, repeats)
    row = {"bytes": size, "calls": count}
    for name, rate in (("seal", seal), ("open", open_), ("seal_alloc", seal_alloc), ("open_alloc", open_alloc)):
        row[f"{name}_calls_per_s"] = rate
        row[f"{name}_us"] = 1e6 / rate
        row[f"{name}_gb_per_s"] = rate * size / 1e9
    return row


def measure_primitives(quick: bool) -> dict:
    repeats = 3 if quick else 5
    out = {}
    for name, cls in CIPHERS.items():
        rows = [measure_primitive(cls, size, 20_000 if quick else 100_000, repeats) for size in SMALL]
        rows.append(measure_primitive(cls, BIG, (TOTAL // BIG) // (4 if quick else 1), repeats))
        out[name] = rows
    return out


# ---- the record layer -----------------------------------------------------------------------------------

def keys() -> tuple[bytes, bytes]:
    from gpulayer import security

    transcript = security.handshake_transcript(2, os.urandom(32), os.urandom(32), "bench", bytes(32), "bench")
    return security.session_keys(b"bench-" + os.urandom(16).hex().encode(), transcript, security.SUBMITTER)


def measure_small_messages(count: int, repeats: int) -> list[dict]:
    """One wire message through Sealer.seal and Opener.feed_into, against the bare codec."""
    send, _ = keys()
    rows = []
    for label, msg, buffers in (("ping", {"t": messages.PING}, ()),
                                ("1 KiB buffer", {"t": messages.RESULT, "id": 7}, (os.urandom(1024),))):
        sealer, opener = records.Sealer(send), records.Opener(send)
        reader = framing.MessageReader(1 << 30)

        def through():
            for record in sealer.seal(framing.encode(dict(msg), buffers)):
                view = opener.buffer()
                view[:len(record)] = record
                opener.feed_into(len(record), reader)
            reader.messages.popleft()

        def clear():
            for part in framing.join_small(framing.encode(dict(msg), buffers)):
                view = reader.buffer()
                view[:len(part)] = part
                reader.feed(len(part))
            reader.messages.popleft()

        parts = framing.encode(dict(msg), buffers)
        sealed = records.Sealer(send).seal(parts)
        rate, base = best_rate(through, count, repeats), best_rate(clear, count, repeats)
        rows.append({"message": label, "plaintext_bytes": sum(map(len, parts)), "records": len(sealed),
                     "sealed_bytes": sum(map(len, sealed)), "sealed_us": 1e6 / rate, "clear_us": 1e6 / base,
                     "channel_us": 1e6 / rate - 1e6 / base})
    return rows


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure_record_sizes(buffer: memoryview, repeats: int) -> list[dict]:
    """A 256 MiB buffer sealed (Sealer.stream) and opened (into a MessageReader) in one process."""
    send, _ = keys()
    rows = []
    for size in RECORD_SIZES:
        seal_s, open_s, seal_each, open_each = [], [], [], []
        for _ in range(repeats):
            stream = records.Sealer(send, record_max=size).stream(framing.encode({"t": messages.RESULT}, [buffer]))
            started = last = time.perf_counter()
            for _record in stream:
                now = time.perf_counter()
                seal_each.append(now - last)
                last = now
            seal_s.append(time.perf_counter() - started)
            sealed = records.Sealer(send, record_max=size).seal(framing.encode({"t": messages.RESULT}, [buffer]))
            opener = records.Opener(send, max_record=size)
            reader = framing.MessageReader(TOTAL + (1 << 20))
            started = time.perf_counter()
            for record in sealed:
                t0 = time.perf_counter()
                opener.feed_bytes_into(record, reader)
                open_each.append(time.perf_counter() - t0)
            open_s.append(time.perf_counter() - started)
            _msg, bufs = reader.messages.popleft()
            assert bufs[0][:64] == buffer[:64] and len(bufs[0]) == TOTAL
            del sealed, opener, reader, bufs
        rows.append({"record_bytes": size, "records": len(seal_each) // repeats,
                     "seal_gb_per_s": TOTAL / min(seal_s) / 1e9, "open_gb_per_s": TOTAL / min(open_s) / 1e9,
                     "seal_record_p50_us": 1e6 * percentile(seal_each, 0.5),
                     "seal_record_p99_us": 1e6 * percentile(seal_each, 0.99),
                     "open_record_p50_us": 1e6 * percentile(open_each, 0.5),
                     "open_record_p99_us": 1e6 * percentile(open_each, 0.99)})
    return rows


def _receiver(sock: socket.socket, size: int, key: bytes | None, result_fd: int) -> None:
    """Child: receive one 256 MiB message (sealed or clear) and report when it was whole."""
    reader = framing.MessageReader(TOTAL + (1 << 20))
    opener = records.Opener(key, max_record=size) if key else None
    while not reader.messages:
        if opener is not None:
            view = opener.buffer()
            n = sock.recv_into(view, min(len(view), opener.remaining) if opener.remaining else len(view),
                               socket.MSG_WAITALL if opener.remaining > 4096 else 0)
            if not n:
                raise ConnectionError("closed")
            opener.feed_into(n, reader)
        else:
            view = reader.buffer()
            piece = min(len(view), reader.big_remaining or len(view), framing.BULK_PIECE)
            n = sock.recv_into(view, piece, socket.MSG_WAITALL if reader.big_remaining else 0)
            if not n:
                raise ConnectionError("closed")
            reader.feed(n)
    os.write(result_fd, repr(time.perf_counter()).encode())


def tcp_once(buffer: memoryview, size: int | None, key: bytes) -> float:
    """Seconds for one 256 MiB message over loopback TCP to another process; size None is in clear."""
    server = socket.create_server(("127.0.0.1", 0))
    address = server.getsockname()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:  # the child receives; whatever happens, it never returns into the parent's code
            server.close()
            os.close(read_fd)
            sock = socket.create_connection(address)
            _receiver(sock, size or 0, key if size else None, write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    conn, _ = server.accept()
    server.close()
    time.sleep(0.05)
    started = time.perf_counter()
    parts = framing.encode({"t": messages.RESULT}, [buffer])
    if size:
        for record in records.Sealer(key, record_max=size).stream(parts):
            conn.sendall(record)
    else:
        blocking.send_parts(conn, parts)
    done = float(os.read(read_fd, 64) or "nan")  # perf_counter is system-wide (CLOCK_MONOTONIC) on Linux
    os.waitpid(pid, 0)
    os.close(read_fd)
    conn.close()
    return done - started


def measure_tcp(buffer: memoryview, repeats: int) -> dict:
    """GB/s over loopback TCP, in clear and for each record size, interleaved run by run (this box is noisy)."""
    send, _ = keys()
    sizes = (None,) + RECORD_SIZES
    tcp_once(buffer, None, send)  # warm-up
    runs = {size: [] for size in sizes}
    for _ in range(repeats):
        for size in sizes:
            runs[size].append(TOTAL / tcp_once(buffer, size, send) / 1e9)
    return {size or "clear": {"best_gb_per_s": max(v), "median_gb_per_s": statistics.median(v), "runs": v}
            for size, v in runs.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and repeats")
    parser.add_argument("--json", default=str(RESULTS / "aead.json"))
    args = parser.parse_args(argv)
    repeats = 2 if args.quick else 3

    primitives = measure_primitives(args.quick)
    for name, rows in primitives.items():
        for row in rows:
            print(f"{name:18} {row['bytes']:>8} B  seal {row['seal_calls_per_s']:>11,.0f}/s {row['seal_gb_per_s']:6.2f} GB/s"
                  f"  open {row['open_calls_per_s']:>11,.0f}/s {row['open_gb_per_s']:6.2f} GB/s")
    aes, chacha = primitives["aes-256-gcm"], primitives["chacha20-poly1305"]
    ratios = {f"{row['bytes']}_B": {op: row[f"{op}_calls_per_s"] / other[f"{op}_calls_per_s"] for op in ("seal", "open")}
              for row, other in zip(aes, chacha)}
    chosen = "aes-256-gcm" if statistics.fmean(r["seal"] for r in ratios.values()) >= 1 else "chacha20-poly1305"
    print("aes/chacha ratios", json.dumps(ratios), "->", chosen)

    small = measure_small_messages(20_000 if args.quick else 100_000, repeats)
    for row in small:
        print(f"{row['message']:14} {row['records']} record(s): {row['sealed_us']:.2f} us sealed+opened,"
              f" {row['clear_us']:.2f} us in clear, channel {row['channel_us']:.2f} us")
    buffer = memoryview(bytearray(os.urandom(1 << 20)) * (TOTAL >> 20))
    sizes = measure_record_sizes(buffer, repeats)
    tcp = measure_tcp(buffer, 3 if args.quick else 7)
    clear = tcp["clear"]["median_gb_per_s"]
    for row in sizes:
        row["tcp"] = tcp[row["record_bytes"]]
        row["tcp_median_vs_clear"] = row["tcp"]["median_gb_per_s"] / clear
        print(f"records of {row['record_bytes'] >> 10:>5} KiB: seal {row['seal_gb_per_s']:.2f} GB/s"
              f" (p50 {row['seal_record_p50_us']:.0f} us, p99 {row['seal_record_p99_us']:.0f} us a record),"
              f" open {row['open_gb_per_s']:.2f} GB/s (p50 {row['open_record_p50_us']:.0f} us,"
              f" p99 {row['open_record_p99_us']:.0f} us); loopback TCP median {row['tcp']['median_gb_per_s']:.2f}"
              f" GB/s, best {row['tcp']['best_gb_per_s']:.2f} = {row['tcp_median_vs_clear']:.2f} x clear")
    print(f"loopback TCP in clear: median {clear:.2f} GB/s, best {tcp['clear']['best_gb_per_s']:.2f}")

    report = {
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "cpu": _cpu_name(), "python": platform.python_version(),
                    "platform": platform.platform(), "cryptography": cryptography.__version__,
                    "openssl": openssl_backend.openssl_version_text(),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        "quick": args.quick,
        "primitives": primitives,
        "aes_over_chacha": ratios,
        "chosen_aead": chosen,
        "record_layer": {"record_max": records.RECORD_MAX, "small_messages": small, "record_sizes": sizes,
                         "tcp_clear": tcp["clear"]},
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
