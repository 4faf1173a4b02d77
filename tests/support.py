"""Test support: real peer subprocesses on loopback, and advertise-override files."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

READY_TIMEOUT = 90.0


# In CI (CI=true) a skip is an error, unless its reason is one of these: what CI's machine (Linux, root,
# network namespaces, pyenv and the network, no GPU) cannot have. Everything else it can run, so it must.
CI_SKIPS = {
    r"CUDA|GPU": "CI has no GPU: tests/hardware runs on GPU machines",
    r"\bMPS\b|macos|Linux-only|Linux's": "CI is Linux",
    r"^needs (lan|root|systemd|network|cuda|mps|macos)": "docs blocks for hardware CI lacks, that address a real "
    "LAN host (192.168.1.20), change the host's firewall, or need systemd as PID 1 (CI runs in a container)",
    r"^not-run: ": "docs blocks that run nowhere (shown output, the suite itself)",
    r"^inside a docs block$": "the suite run by a docs block does not run the docs blocks again",
    r"GiB free$": "a 1 GiB round trip needs memory that a CI machine may not have free",
}


def ci_forbids(report) -> str | None:
    """The message of a skip that CI must not have (None when allowed, or not in CI, or no skip)."""
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return None
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if any(re.search(pattern, reason) for pattern in CI_SKIPS):
        return None
    return f"skipped in CI, which can run it (tests/support.py CI_SKIPS lists what may skip there): {reason}"


def new_key() -> str:
    return "test-" + secrets.token_hex(16)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02, detail=None):
    """Poll until predicate() is truthy and return its value; fail after `timeout` seconds (saying what
    `detail()` returns then, if given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s" + (f": {detail()}" if detail else ""))


def holds_for(predicate, seconds: float, interval: float = 0.05) -> None:
    """Poll predicate() for `seconds` and fail as soon as it is falsy: for what must not happen meanwhile
    (a second warning, say). This, wait_until and paced are the only places where tests sleep."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate(), "the condition stopped holding"
        time.sleep(interval)


def paced(items, interval: float):
    """Yield each of `items`, `interval` seconds apart: the pace of a load that a test plays (a task every
    40 ms, say), as a slow link's helper does; never a wait for something to happen."""
    for i, item in enumerate(items):
        if i:
            time.sleep(interval)
        yield item


def built_or_refused(data) -> str:
    """Requirements.from_wire(data) builds requirements that their own wire form builds again, or refuses
    with a ValueError that says what is wrong; returns which ("built" or "refused"), for hypothesis.event."""
    from gpulayer.matching import Requirements

    try:
        built = Requirements.from_wire(data)
    except ValueError as error:
        assert str(error), "a refusal says what is wrong"
        return "refused"
    assert Requirements.from_wire(built.to_wire()) == built, built
    return "built"


DUMPS_STACKS = {"PYTHONFAULTHANDLER": "1"}  # in a CLI's environment: `interrupt` can show where it hung


def interrupt(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """Ctrl-C to a CLI process (started in text mode, `DUMPS_STACKS` in its environment): its stdout and stderr
    once it ended. AssertionError if it did not end within `timeout`, with every thread's stack, which
    faulthandler writes on the SIGABRT that then ends it."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"still running {timeout:g} s after Ctrl-C; its stderr and threads:\n"
                             f"{err[-10000:]}") from None


def process_gone(pid: int) -> bool:
    """The process `pid` has ended (a zombie not yet reaped counts as ended): it can do nothing more."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


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


def key_config(base: Path, key: str) -> str:
    """`base` as a config folder holding the cluster key file, as `gpulayer key init` writes it: a peer
    started with XDG_CONFIG_HOME there lets its tasks (whose environment never holds the key) read it."""
    (base / "gpulayer").mkdir()
    path = base / "gpulayer" / "key"
    path.write_text(key)
    path.chmod(0o600)
    return str(base)


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

    from gpulayer.protocol import handshake
    from gpulayer.transport import blocking

    conn = blocking.BlockingConnection(socket.create_connection(("127.0.0.1", peer.port), timeout=10))
    handshake.client_handshake(conn, peer.key.encode(), client_id)
    return conn


class LocalUser:
    """A second account of this machine (useradd), to test what any local user can reach: loopback,
    abstract Unix sockets, /proc. `remove()` deletes it; the `other_user` fixture makes and removes one."""

    def __init__(self) -> None:
        import pwd

        self.name = f"gltest-{secrets.token_hex(4)}"
        subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", self.name],
                       check=True, capture_output=True, timeout=60)
        entry = pwd.getpwnam(self.name)
        self.uid, self.gid = entry.pw_uid, entry.pw_gid
        self.python: str | None = None

    @staticmethod
    def unavailable() -> str | None:
        """Why this machine cannot make one, or None."""
        import shutil

        if os.getuid() != 0:
            return "making another local user needs root"
        missing = [tool for tool in ("useradd", "userdel", "setpriv") if shutil.which(tool) is None]
        return f"no {', '.join(missing)} on this machine" if missing else None

    def find_python(self) -> str | None:
        """An interpreter this user may run (the venv's may lie in a folder out of its reach)."""
        import shutil

        candidates = [os.path.realpath(sys.executable), getattr(sys, "_base_executable", ""),
                      shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or ""]
        self.python = next((p for p in candidates if p and self.run("pass", python=p).returncode == 0), None)
        return self.python

    def run(self, code: str, *args: str, timeout: float = 120, python: str | None = None) \
            -> subprocess.CompletedProcess:
        """Python `code` (with sys.argv[1:] = args) run as this user, through setpriv: its uid and gid, no
        other groups, a bare environment (no key, no token), in /, bounded by `timeout`."""
        argv = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                python or self.python or "python3", "-I", "-c", code, *args]
        return subprocess.run(argv, env={"PATH": "/usr/bin:/bin"}, cwd="/", capture_output=True, text=True,
                              timeout=timeout)

    def remove(self) -> None:
        """Kill what still runs as this user (only the tests' own processes can), then userdel."""
        import psutil

        for proc in psutil.process_iter(["uids"]):
            if proc.info["uids"] is not None and self.uid in proc.info["uids"]:
                try:
                    proc.kill()
                    proc.wait(10)
                except psutil.NoSuchProcess:
                    pass
        subprocess.run(["userdel", self.name], check=True, capture_output=True, timeout=60)


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
