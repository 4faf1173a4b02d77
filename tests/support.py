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


class PeerProcess:
    """`python -m gpulayer.peer` bound to 127.0.0.1, with its log in a file."""

    def __init__(self, workdir: Path, key: str, name: str, *args: str, env: dict | None = None):
        self.workdir = workdir
        self.name = name
        self.key = key
        self.ready_file = workdir / f"{name}.ready.json"
        self.log_file = workdir / f"{name}.log"
        self.args = ["--interfaces", "127.0.0.1", "--name", name, "--ready-file", str(self.ready_file),
                     "--log-level", "INFO", *args]
        self.env = {**os.environ, "GPULAYER_KEY": key, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def start(self, wait: bool = True) -> PeerProcess:
        self.ready_file.unlink(missing_ok=True)
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "gpulayer.peer", *self.args], env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"peer {self.name} exited ({self.proc.returncode}):\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer {self.name} not ready in {timeout} s:\n{self.log()}")
            time.sleep(0.02)
        time.sleep(0.01)  # the file is written in one go, but let the writer close it
        self.info = json.loads(self.ready_file.read_text())

    @property
    def port(self) -> int:
        return self.info["port"]

    @property
    def peer_id(self) -> str:
        return self.info["peer_id"]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait (SIGKILL after `timeout`)."""
        if not self.alive():
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        """SIGKILL the peer; its workers are reaped too."""
        if self.alive():
            worker_pids = _children(self.proc.pid)
            self.proc.kill()
            self.proc.wait()
            for pid in worker_pids:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


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
