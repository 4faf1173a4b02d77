"""Test support: real peer subprocesses on loopback, and advertise-override files."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

READY_TIMEOUT = 90.0


def new_key() -> str:
    return "test-" + secrets.token_hex(16)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02):
    """Poll until predicate() is truthy and return its value; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


class PeerProcess:
    """`python -m gpulayer.peer` (bound to `interfaces`, loopback by default), with its log in a file."""

    host_address = "127.0.0.1"

    def __init__(self, workdir: Path, key: str, name: str, *args: str, env: dict | None = None,
                 interfaces: str | None = "127.0.0.1"):
        self.workdir = workdir
        self.name = name
        self.key = key
        self.ready_file = workdir / f"{name}.ready.json"
        self.log_file = workdir / f"{name}.log"
        where = ["--interfaces", interfaces] if interfaces else []
        self.argv = [sys.executable, "-m", "gpulayer.peer", *where, "--name", name,
                     "--ready-file", str(self.ready_file), "--log-level", "INFO", *args]
        self.env = {**os.environ, "GPULAYER_KEY": key, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self.started_at = self.ready_at = 0.0

    def _popen(self, log) -> subprocess.Popen:
        return subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)

    def start(self, wait: bool = True) -> PeerProcess:
        self.ready_file.unlink(missing_ok=True)
        self.info = {}
        with open(self.log_file, "ab") as log:
            self.proc = self._popen(log)
        self.started_at = time.monotonic()
        return self.wait_ready() if wait else self

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> PeerProcess:
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"peer {self.name} exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer {self.name} not ready in {timeout} s:\n{self.log()[-4000:]}")
            time.sleep(0.02)
        for _ in range(50):  # written in one go, but it may be read before the writer closes it
            try:
                self.info = json.loads(self.ready_file.read_text())
                break
            except ValueError:
                time.sleep(0.02)
        self.ready_at = time.monotonic()
        return self

    @property
    def port(self) -> int:
        return self.info["port"]

    @property
    def peer_id(self) -> str:
        return self.info["peer_id"]

    @property
    def address(self) -> str:
        return f"{self.host_address}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def workers(self) -> list[int]:
        """The peer's worker processes (and their children)."""
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def rss(self) -> int:
        """Resident memory of the peer daemon itself, in bytes (0 when it is gone)."""
        import psutil

        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except psutil.NoSuchProcess:
            return 0

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a clean stop: goodbye, drain) and wait; SIGKILL after `timeout`."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        """kill -9 of the peer and of its workers (as when its machine dies)."""
        if self.proc is None:
            return
        workers = self.workers()
        if self.alive():
            self.proc.kill()
        for pid in workers:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def write_override(path: Path, accelerator: str, memory_gb: float = 32.0, frameworks: list | None = None,
                   count: int = 1) -> Path:
    """An --advertise-override file for a fake Mac (mps) or NVIDIA (cuda) peer."""
    if accelerator == "mps":
        devices = [{"kind": "mps", "name": "Apple M2 Max GPU (MPS)", "memory_gb": memory_gb}]
        data = {"system": "Darwin", "machine": "arm64", "cpu_name": "Apple M2 Max", "memory_gb": memory_gb}
    elif accelerator == "cuda":
        devices = [{"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "memory_gb": memory_gb} for _ in range(count)]
        data = {}
    else:
        devices, data = [], {}
    data["devices"] = devices
    if frameworks is not None:
        data["frameworks"] = frameworks
    path.write_text(json.dumps(data))
    return path


def solo_peer(peer_factory, name: str, *args: str):
    """For a fixture to `yield from`: (peer, client), one single-slot peer of a fresh cluster (started
    with GPULAYER_KEY in its environment, as PeerProcess does) and a submitter of that cluster,
    which is closed at teardown."""
    from gpulayer.client import Client

    key = new_key()
    peer = peer_factory(name, "--concurrency", "1", *args, key=key)
    client = Client(key=key.encode(), echo_output=False)
    try:
        yield peer, client
    finally:
        client.close()


def authenticated(peer: PeerProcess, client_id: str = "tester"):
    """A raw connection to `peer` on loopback, past the handshake with its cluster key."""
    import socket

    from gpulayer import wire

    conn = wire.BlockingConnection(socket.create_connection(("127.0.0.1", peer.port), timeout=10))
    wire.client_handshake(conn, peer.key.encode(), client_id)
    return conn


def job_venv(folder: Path, *flags: str) -> str:
    """A venv made the ordinary way (`python -m venv`, with `flags`) with what a worker imports besides
    gpulayer; returns its python."""
    import importlib.metadata

    subprocess.run([sys.executable, "-m", "venv", *flags, str(folder)], check=True, capture_output=True, timeout=120)
    python = str(folder / "bin" / "python")
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in ("msgpack", "cloudpickle", "cryptography")]
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-cache-dir", *pins], check=True, capture_output=True,
                   timeout=240)
    return python
