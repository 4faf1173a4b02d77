"""A job's supervisor: `python -I -S shim.py [--cgroup DIR] LOG STATUS GRACE_FILE -- COMMAND...`, started by
the peer in a session of its own, in the job's folder, with the job's environment; or the same started
ahead as a standby (`shim.py --standby`), that the peer hands its job to on stdin.

With --cgroup (jobs/cgroup.py), it starts COMMAND from inside the job's cgroup DIR (and goes back to the
peer's cgroup right after), so COMMAND's whole tree is in it whatever it does, and the tree is signalled
through it (SIGKILL with cgroup.kill).

It runs COMMAND with stdout and stderr both on the log (in the order written), and stays the parent
of the job's whole process tree: on Linux it is a child subreaper, so a descendant whose parent
exits (one started with `setsid` and left behind, say) is re-parented to it, not to init. When
COMMAND ends, or on SIGTERM (the peer's stop or timeout), every descendant gets SIGTERM, and
SIGKILL after the seconds that GRACE_FILE holds (DEFAULT_GRACE_S when it holds none: the peer writes
it before a stop); then it writes {"code": N} or {"signal": N} to STATUS, with "maxrss" (largest_rss: the peak
resident memory of the largest process of the tree it waited for, in bytes), and exits. Stopped before it
started COMMAND, it writes {} and never starts it.

**Standby** (`--standby`, docs/jobs.md "How a job starts"): the peer starts it before a job needs it, in a
session of its own, with stdin a pipe from the peer and the peer's environment less the cluster key. It
pays its interpreter's start and its imports, sets its signal handlers and becomes a subreaper, then
reads stdin to its end. The handover is `marshal.dumps((cwd, env, argv))`: the job's folder, its whole
environment and the arguments above (`[--cgroup DIR] LOG STATUS GRACE_FILE -- COMMAND...`), written by
the peer, which then closes the pipe; from there it is that job's supervisor, as if started with them
in that folder with that environment. The pipe's end with no handover (the peer closed it, or died,
kill -9 included) makes it exit without running anything; so does a SIGTERM before its handover is read
(the peer's stop of the job it had just handed over: that job never started).

It runs with the peer's interpreter, isolated and without site (its start costs no site-packages;
psutil, with site, is imported when a tree is signalled; no gpulayer import, nor json, subprocess,
typing, pathlib or signal's enums: COMMAND starts with os.posix_spawnp), so that a peer killed with -9
leaves a supervisor that the restarted peer can still stop by its pid.
"""

from __future__ import annotations

import _signal as signal  # signal's C module: the same functions and numbers, without enum (3 ms of the start)
import ctypes
import errno
import marshal
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs the supervisor's start 4 ms: for the annotations only
    from types import ModuleType

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
DEFAULT_GRACE_S = 10.0
SIGTERM, SIGINT, SIGKILL, SIGALRM, SIGPIPE, SIGXFSZ = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL, signal.SIGALRM,
                                                       signal.SIGPIPE, signal.SIGXFSZ)


def become_subreaper() -> None:
    """Orphans of the job's tree come to this process (Linux); elsewhere nothing happens."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def signal_tree(sig: int) -> None:
    """Send `sig` to every descendant of this process (again for what forked meanwhile, with SIGKILL)."""
    if "psutil" not in sys.modules and sys.flags.no_site:
        import site

        site.main()  # started with -S: the site-packages (psutil's) are added only when a tree is signalled
    import psutil  # here: a job whose tree ends by itself never pays for it (nor for site) at start

    for _ in range(5):  # again, for what forked meanwhile
        try:
            tree = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        if not tree:
            return
        for proc in tree:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        if sig != SIGKILL:
            return


def largest_rss() -> int:
    """The peak resident memory, in bytes, of the largest single process this one waited for, counting what
    each of them waited for in turn (ru_maxrss of RUSAGE_CHILDREN: KiB on Linux, bytes on macOS)."""
    import resource  # here: paid once the job ended, not on the way to its first line

    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)


def has_children() -> bool:
    """Whether any process is still this one's child (an orphan of the tree is, here: the subreaper)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def load_cgroup() -> ModuleType:
    """jobs/cgroup.py (standard library only), imported from this file's folder (-I leaves it off sys.path)."""
    if "cgroup" not in sys.modules:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cgroup

    return cgroup


class Supervisor:
    """One job's supervisor; from its creation a SIGTERM or SIGINT stops the job (or cancels it, not started)."""

    def __init__(self) -> None:
        self.grace_file = ""
        self.cgroup: str | None = None  # the job's cgroup folder (jobs/cgroup.py), if it has one
        self.waiting = False  # a standby reading its handover
        self.started = False  # whether the command was started
        self.ending = False
        signal.signal(SIGTERM, self.end)
        signal.signal(SIGINT, self.end)
        signal.signal(SIGALRM, lambda *_: self.signal_tree(SIGKILL))
        become_subreaper()

    def signal_tree(self, sig: int) -> None:
        """`sig` to the job's tree: every process of its cgroup, or every descendant of this process."""
        if self.cgroup is None:
            return signal_tree(sig)
        cgroups = load_cgroup()
        if sig == SIGKILL:
            cgroups.kill(self.cgroup)
            return
        for pid in set(cgroups.procs(self.cgroup)) - {os.getpid()}:  # here while it starts the command
            try:
                os.kill(pid, sig)
            except OSError:
                pass  # gone meanwhile

    def grace(self) -> float:
        try:
            with open(self.grace_file) as f:
                return max(float(f.read()), 0.01)
        except (OSError, ValueError):
            return DEFAULT_GRACE_S

    def end(self, *_: object) -> None:
        """Stop the job: the tree gets SIGTERM now, SIGKILL after the grace (SIGALRM); a command not started
        never starts; a standby still waiting for its job exits at once."""
        if self.waiting:
            raise SystemExit(0)
        if self.ending:
            return
        self.ending = True
        if self.started:
            self.stop_tree()

    def stop_tree(self) -> None:
        self.signal_tree(SIGTERM)
        signal.setitimer(signal.ITIMER_REAL, self.grace())

    def wait_for_job(self) -> list[str] | None:
        """Standby: the job the peer hands over on stdin (read to its end), its folder and environment made
        this process's; its arguments, or None when the pipe ended without one."""
        self.waiting, data = True, b""
        while chunk := os.read(0, 1 << 16):
            data += chunk
        self.waiting = False
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the pipe closed: nothing of the peer's stays open here
        os.close(null)
        try:
            cwd, env, argv = marshal.loads(data)
        except (EOFError, ValueError, TypeError):
            return None
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        return list(argv)

    def run(self, log: str, status_file: str, grace_file: str, cgroup: str | None, command: list[str]) -> int:
        self.grace_file, self.cgroup = grace_file, cgroup
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if self.ending:  # stopped while it started: the command never runs
            return _write_status(status_file, {})
        try:
            # as subprocess.Popen would (its import costs the job's start): stdin from /dev/null, the log
            # as stdout and stderr, SIGPIPE and SIGXFSZ back to their defaults (Python ignores them); the
            # peer started this process with no other descriptor open, and `out` is not inherited
            if cgroup is not None:
                load_cgroup().join(cgroup)  # the command starts in the job's cgroup, and all it starts stays there
            child = os.posix_spawnp(command[0], command, os.environ, setsigdef=(SIGPIPE, SIGXFSZ),
                                    file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                                  (os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, out, 2)])
        except OSError as exc:
            os.write(out, f"gpulayer: cannot run {command[0]!r}: {exc.strerror or exc}\n".encode())
            return _write_status(status_file, {"code": 127})
        finally:  # back to the peer's cgroup: a kill of the job's cgroup spares its supervisor
            if cgroup is not None:
                load_cgroup().join(os.path.dirname(os.path.dirname(cgroup)))
        self.started = True
        if self.ending:  # stopped while the command was being started: it goes too
            self.stop_tree()
        status: dict[str, int] = {}
        while True:
            try:
                pid, code = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except OSError as exc:  # pragma: no cover - EINTR is retried by Python itself
                if exc.errno != errno.EINTR:
                    raise
                continue
            if pid == child:
                status = {"signal": os.WTERMSIG(code)} if os.WIFSIGNALED(code) else {"code": os.WEXITSTATUS(code)}
                if has_children():
                    self.end()  # what it left behind goes too
        signal.setitimer(signal.ITIMER_REAL, 0)
        return _write_status(status_file, {**status, "maxrss": largest_rss()} if status else {"code": 127})


def _write_status(path: str, status: dict[str, int]) -> int:
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write("{%s}" % ", ".join(f'"{name}": {int(value)}' for name, value in status.items()))  # JSON
    os.replace(partial, path)
    return 0


def main(argv: list[str]) -> int:
    supervisor = Supervisor()
    if argv == ["--standby"]:
        load_cgroup()  # paid ahead too, whether the job has a cgroup or not
        handed = supervisor.wait_for_job()
        if handed is None:
            return 0  # its peer closed the pipe, or died: nothing runs
        argv = handed
    cgroup = argv[1] if argv[:1] == ["--cgroup"] else None
    log, status_file, grace_file, sep, *command = argv[2:] if cgroup else argv
    if sep != "--" or not command:
        print("usage: shim.py [--cgroup DIR] LOG STATUS GRACE_FILE -- COMMAND...  |  shim.py --standby",
              file=sys.stderr)
        return 2
    return supervisor.run(log, status_file, grace_file, cgroup, command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
