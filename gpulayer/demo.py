"""`gpulayer demo`: a real round trip on an embedded local peer, bound to loopback only."""

from __future__ import annotations

import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path


def whoami() -> dict:
    """Runs on the peer: where am I?"""
    return {"pid": os.getpid(), "host": platform.node(), "python": platform.python_version(),
            "device": os.environ.get("GPULAYER_DEVICE", "?")}


def collatz_steps(n: int) -> int:
    """Runs on the peer: a little CPU work with a checkable answer."""
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


@contextmanager
def local_peer(env: dict, name: str = "demo-peer", extra_args=(), timeout: float = 120.0):
    """Start `python -m gpulayer.peer` on 127.0.0.1 and yield (process, ready info); stop it after."""
    with tempfile.TemporaryDirectory(prefix="gpulayer-demo-") as tmp:
        ready_file = Path(tmp) / "ready.json"
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpulayer.peer", "--interfaces", "127.0.0.1", "--name", name,
             "--ready-file", str(ready_file), "--log-level", "WARNING", *extra_args],
            env=env, stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while not ready_file.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"the local peer exited with code {proc.returncode} before it was ready")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the local peer was not ready within {timeout:.0f} s")
                time.sleep(0.02)
            yield proc, json.loads(ready_file.read_text())
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def run_demo(tasks: int = 16) -> int:
    import gpulayer as gl
    from .peer_table import format_peers

    key = secrets.token_hex(16)
    os.environ.update(GPULAYER_KEY=key, GPULAYER_INTERFACES="127.0.0.1", GPULAYER_CACHE="0")
    client = gl.configure(key=key.encode(), interfaces=["127.0.0.1"])
    client.start()  # browse first, so the peer's announcement is seen the moment it is sent
    print("starting a local peer on 127.0.0.1 (mDNS and TCP on loopback only, a fresh cluster key) ...")
    with local_peer(dict(os.environ)) as (_, info):
        print(f"peer {info['name']} ({info['peer_id']}) is serving on 127.0.0.1:{info['port']}")
        started = time.perf_counter()
        where = gl.run(whoami)
        first = time.perf_counter() - started
        warm = []
        for _ in range(20):
            started = time.perf_counter()
            gl.run(whoami)
            warm.append(time.perf_counter() - started)
        print(f"gl.run(whoami) -> {where}")
        print(f"  first call {first * 1e3:.1f} ms (discovery, connect, authenticate); "
              f"warm calls median {statistics.median(warm) * 1e3:.2f} ms")
        numbers = list(range(1, tasks + 1))
        started = time.perf_counter()
        steps = gl.map(collatz_steps, numbers)
        took = time.perf_counter() - started
        expected = [collatz_steps(n) for n in numbers]
        verdict = "all correct" if steps == expected else "WRONG RESULTS"
        print(f"gl.map(collatz_steps, 1..{tasks}) -> {steps}  ({verdict}, {took * 1e3:.1f} ms)")
        print()
        print(format_peers(gl.peers(wait=0)))
        print()
        gl.api.shutdown()
        print("stopping the local peer ...")
    print("done: the peer withdrew its mDNS record and stopped.")
    return 0 if steps == expected else 1
