"""A cgroup (v2) per job, where the peer may make one (docs/jobs.md, "What a job gets").

The peer's own cgroup v2 folder is found from /proc/self/cgroup and /proc/self/mountinfo. If the peer
may make a folder there (root, or a delegated cgroup), its jobs' cgroups are
`<peer's cgroup>/gpulayer-<holder>/job-<job id>`: `gpulayer-<holder>` holds no process (cgroup v2's
"no internal processes" rule), and no controller is enabled but memory, where the peer's cgroup has it
(its `memory.peak`, Linux 5.19+, is the job's peak memory: `Cgroups.end`). The supervisor enters the job's cgroup,
starts the command there and steps back out (jobs/shim.py), so every descendant of the command is in
it whatever it does (setsid, a double fork, a daemon), and the peer kills what is left in it when the
job ends, and removes it. Elsewhere (no cgroup v2, not
writable, macOS, GPULAYER_JOB_CGROUPS=0) `find` says why, and jobs run as before: a process group and a
child subreaper.

Paths are strings and the module uses `os` alone (no pathlib: the supervisor imports it, and its start
is on the path of every job's first line).
"""

from __future__ import annotations

import os
import time

ENV = "GPULAYER_JOB_CGROUPS"  # "0": no cgroups for jobs (docs/configuration.md)
EMPTY_WAIT_S = 5.0  # the longest a killed cgroup is waited for to empty before it is removed
SIGKILL = 9  # signal.SIGKILL, without the signal module's enums


def own_cgroup(proc: str = "/proc/self") -> str | None:
    """This process's cgroup v2 folder (where the cgroup2 file system is mounted), or None."""
    lines, mounts = _read(os.path.join(proc, "cgroup")).splitlines(), _read(os.path.join(proc, "mountinfo")).splitlines()
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None
    for mount in mounts:
        fields, _, rest = mount.partition(" - ")
        parts = fields.split()
        if rest.split()[:1] == ["cgroup2"] and len(parts) >= 5:
            root, point = parts[3], parts[4]
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return os.path.join(point, path[len(root):].lstrip("/")).rstrip("/") or "/"
    return None


class Cgroups:
    """The cgroups of one peer's jobs: `<base>/job-<job id>`."""

    def __init__(self, base: str):
        self.base = base

    @classmethod
    def find(cls, holder: str) -> Cgroups | str:
        """The cgroups of the jobs of `holder`, made ready, or why jobs get none here."""
        if os.environ.get(ENV) == "0":
            return f"{ENV}=0"
        own = own_cgroup()
        if own is None:
            return "no cgroup v2 here (/proc/self/cgroup names none mounted)"
        cgroups = cls(os.path.join(own, f"gpulayer-{holder}"))
        return cgroups._prepare() or cgroups

    def _prepare(self) -> str | None:
        """Make the peer's folder (if it is not there), its jobs' memory controller on where its cgroup has one
        (each job's memory.peak); why it cannot be used, or None."""
        base = self.base
        try:
            os.makedirs(base, exist_ok=True)
            if not os.access(os.path.join(base, "cgroup.procs"), os.W_OK):
                return f"{base}/cgroup.procs is not writable"
        except OSError as exc:
            return f"cannot make {base}: {exc.strerror or exc}"
        if "memory" in _read(os.path.join(base, "cgroup.controllers")).split():
            _write(os.path.join(base, "cgroup.subtree_control"), "+memory")
        return None

    def path(self, job_id: str) -> str:
        return os.path.join(self.base, f"job-{job_id}")

    def make(self, job_id: str) -> str:
        """The job's cgroup, made empty (what an earlier attempt left is killed first); the peer's folder too, if it
        was removed meanwhile (by hand, or by a sweep of empty cgroups)."""
        self.remove(job_id)
        try:
            os.mkdir(self.path(job_id))
        except FileNotFoundError:
            self._prepare()
            os.mkdir(self.path(job_id))
        return self.path(job_id)

    def end(self, job_id: str) -> int | None:
        """The job ended: its cgroup's peak memory in bytes (None without the memory controller's memory.peak,
        Linux 5.19+), read before what is left in it is killed and it is removed."""
        peak = _read(os.path.join(self.path(job_id), "memory.peak")).strip()
        self.remove(job_id)
        return int(peak) if peak.isdigit() else None

    def remove(self, job_id: str) -> None:
        """Kill what is left in the job's cgroup and remove it (nothing happens if it is not there)."""
        path = self.path(job_id)
        if os.path.isdir(path):
            kill(path)
            try:
                os.rmdir(path)
            except OSError:
                pass  # not empty in time: swept at the next start

    def sweep(self) -> list[str]:
        """At the peer's start, no job runs: the cgroups of its earlier life (of jobs that ended while it was
        down, or lost) killed and removed; their job ids."""
        try:
            names = os.listdir(self.base)
        except FileNotFoundError:  # removed since `find`: made again for the next job (`make`)
            return []
        gone = sorted(name[4:] for name in names if name.startswith("job-"))
        for job_id in gone:
            self.remove(job_id)
        return gone

    def close(self) -> None:
        """The peer stops, its jobs ended: its folder of cgroups goes (it stays if a job's is left in it)."""
        try:
            os.rmdir(self.base)
        except OSError:
            pass  # a job's cgroup not emptied in time: swept at the next start


def join(path: str) -> None:
    """This process into the cgroup folder `path` (the supervisor, around its start of the command)."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write("0")


def kill(path: str) -> None:
    """SIGKILL every process of the cgroup `path` (cgroup.kill; else frozen, each killed, thawed), and
    wait (EMPTY_WAIT_S at most) until it holds none."""
    if not _write(os.path.join(path, "cgroup.kill"), "1"):
        frozen = _write(os.path.join(path, "cgroup.freeze"), "1")
        for pid in procs(path):
            try:
                os.kill(pid, SIGKILL)
            except OSError:
                pass  # gone meanwhile
        if frozen:
            _write(os.path.join(path, "cgroup.freeze"), "0")
    deadline = time.monotonic() + EMPTY_WAIT_S
    while "populated 1" in _read(os.path.join(path, "cgroup.events")) and time.monotonic() < deadline:
        time.sleep(0.01)


def procs(path: str) -> list[int]:
    """The pids in the cgroup `path`."""
    return [int(word) for word in _read(os.path.join(path, "cgroup.procs")).split()]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:
        return False
    return True
