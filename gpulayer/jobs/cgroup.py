"""A cgroup (v2) per job, where the peer may make one (docs/jobs.md, "What a job gets").

The peer's own cgroup v2 folder is found from /proc/self/cgroup and /proc/self/mountinfo. If the peer
may make a folder there (root, or a delegated cgroup), its jobs' cgroups are
`<peer's cgroup>/gpulayer-<holder>/job-<job id>`: `gpulayer-<holder>` holds no process (cgroup v2's
"no internal processes" rule), and no controller is enabled. The supervisor enters the job's cgroup,
starts the command there and steps back out (jobs/shim.py), so every descendant of the command is in
it whatever it does (setsid, a double fork, a daemon), and the peer kills what is left in it when the
job ends, and removes it. Elsewhere (no cgroup v2, not
writable, macOS, GPULAYER_JOB_CGROUPS=0) `find` says why, and jobs run as before: a process group and a
child subreaper.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ENV = "GPULAYER_JOB_CGROUPS"  # "0": no cgroups for jobs (docs/configuration.md)
EMPTY_WAIT_S = 5.0  # the longest a killed cgroup is waited for to empty before it is removed


def own_cgroup(proc: Path = Path("/proc/self")) -> Path | None:
    """This process's cgroup v2 folder (where the cgroup2 file system is mounted), or None."""
    try:
        lines = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None
    for mount in mounts:
        fields, _, rest = mount.partition(" - ")
        parts = fields.split()
        if rest.split()[:1] == ["cgroup2"] and len(parts) >= 5:
            root, point = parts[3], parts[4]
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return Path(point) / path[len(root):].lstrip("/")
    return None


class Cgroups:
    """The cgroups of one peer's jobs: `<base>/job-<job id>`."""

    def __init__(self, base: Path):
        self.base = base

    @classmethod
    def find(cls, holder: str) -> Cgroups | str:
        """The cgroups of the jobs of `holder`, made ready, or why jobs get none here."""
        if os.environ.get(ENV) == "0":
            return f"{ENV}=0"
        own = own_cgroup()
        if own is None:
            return "no cgroup v2 here (/proc/self/cgroup names none mounted)"
        base = own / f"gpulayer-{holder}"
        try:
            base.mkdir(exist_ok=True)
            if not os.access(base / "cgroup.procs", os.W_OK):
                return f"{base}/cgroup.procs is not writable"
        except OSError as exc:
            return f"cannot make {base}: {exc.strerror or exc}"
        return cls(base)

    def path(self, job_id: str) -> Path:
        return self.base / f"job-{job_id}"

    def make(self, job_id: str) -> Path:
        """The job's cgroup, made empty (what an earlier attempt left is killed first)."""
        self.remove(job_id)
        self.path(job_id).mkdir()
        return self.path(job_id)

    def remove(self, job_id: str) -> None:
        """Kill what is left in the job's cgroup and remove it (nothing happens if it is not there)."""
        path = self.path(job_id)
        if path.is_dir():
            kill(path)
            try:
                path.rmdir()
            except OSError:
                pass  # not empty in time: swept at the next start

    def sweep(self) -> list[str]:
        """At the peer's start, no job runs: the cgroups of its earlier life (of jobs that ended while it was
        down, or lost) killed and removed; their job ids."""
        gone = sorted(p.name[4:] for p in self.base.glob("job-*"))
        for job_id in gone:
            self.remove(job_id)
        return gone

    def close(self) -> None:
        """The peer stops, its jobs ended: its folder of cgroups goes (it stays if a job's is left in it)."""
        try:
            self.base.rmdir()
        except OSError:
            pass  # a job's cgroup not emptied in time: swept at the next start


def kill(path: Path) -> None:
    """SIGKILL every process of the cgroup `path` (cgroup.kill; else frozen, each killed, thawed), and
    wait (EMPTY_WAIT_S at most) until it holds none."""
    if not _write(path / "cgroup.kill", "1"):
        frozen = _write(path / "cgroup.freeze", "1")
        for pid in procs(path):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # gone meanwhile
        if frozen:
            _write(path / "cgroup.freeze", "0")
    deadline = time.monotonic() + EMPTY_WAIT_S
    while "populated 1" in _read(path / "cgroup.events") and time.monotonic() < deadline:
        time.sleep(0.01)


def procs(path: Path) -> list[int]:
    """The pids in the cgroup `path`."""
    return [int(word) for word in _words(path / "cgroup.procs")]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _words(path: Path) -> list[str]:
    return _read(path).split()


def _write(path: Path, text: str) -> bool:
    try:
        path.write_text(text)
    except OSError:
        return False
    return True
