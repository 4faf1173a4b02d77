"""Jobs (issue 27, ADR 0016): real peers in subprocesses, the `gpulayer` command in others, real TCP.

A job outlives its submitter (SIGKILLed right after the submit) and its peer (kill -9, restarted on the
same state folder); it is stopped as a whole tree (children that left its session included); its
exit, timeout and signal give its state; hostile paths and ids are refused and change nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from blake3 import blake3

from support import DUMPS_STACKS, interrupt, new_key, process_gone, wait_until

ROOT = Path(__file__).resolve().parents[2]


def gpulayer(*args: str, key: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpulayer.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "GPULAYER_KEY": key})


@pytest.fixture
def jobs_peer(peer_factory, tmp_path):
    """start(name) -> (peer, state folder, key, jobs API): a one-slot peer with a state folder of its own."""
    from gpulayer.client import Client
    from gpulayer.client.jobs import Jobs

    key = new_key()
    client = Client(key=key.encode(), echo_output=False)

    def start(name: str = "jobs", *args: str, env: dict | None = None):
        state = tmp_path / f"{name}-state"
        peer = peer_factory(name, "--concurrency", "1", "--state-dir", str(state), *args, key=key, env=env)
        return peer, state, key, Jobs(client)

    yield start
    client.close()


def processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or []):
            found.append(proc)
    return found


def write_project(folder: Path, release: Path) -> bytes:
    """A training script with a local package, a data file read by a relative path and a .gitignored
    50 MB file; it prints lines, waits for `release`, then writes ckpt/last.pt. The checkpoint's bytes."""
    (folder / "mypkg").mkdir(parents=True)
    (folder / "mypkg" / "__init__.py").write_text("def scale(x):\n    return 3 * x\n")
    (folder / "data").mkdir()
    (folder / "data" / "numbers.txt").write_text("1\n2\n3\n")
    (folder / ".gitignore").write_text("big.bin\n")
    with open(folder / "big.bin", "wb") as f:
        f.truncate(50 << 20)
    (folder / "train.py").write_text(
        "import os, sys, time\n"
        "from mypkg import scale\n"
        "numbers = [int(x) for x in open('data/numbers.txt')]\n"
        "for n in numbers:\n"
        "    print('step', scale(n), flush=True)\n"
        "print('to stderr', file=sys.stderr, flush=True)\n"
        "while not os.path.exists(os.environ['RELEASE']):\n"
        "    time.sleep(0.02)\n"
        "os.makedirs('ckpt', exist_ok=True)\n"
        "open('ckpt/last.pt', 'wb').write(bytes(range(256)) * 4096 + str(sum(numbers)).encode())\n"
        "print('saved', os.environ['GPULAYER_JOB_ID'], flush=True)\n")
    return bytes(range(256)) * 4096 + b"6"


def test_a_job_outlives_its_submitter_and_is_reattached(jobs_peer, tmp_path):
    peer, state, key, _ = jobs_peer()
    project, release = tmp_path / "project", tmp_path / "release"
    expected = write_project(project, release)
    submitter = subprocess.Popen(
        [sys.executable, "-m", "gpulayer.cli", "submit", "--follow", "--env", f"RELEASE={release}", "--",
         "python", "train.py"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "GPULAYER_KEY": key})
    try:
        job_id = submitter.stdout.readline().decode().strip()
        assert submitter.stdout.readline().decode().strip() == "step 3"  # it runs, and this process follows it
    finally:
        submitter.kill()
        submitter.wait(10)
    release.touch()
    reattached = gpulayer("logs", "-f", job_id, key=key)
    assert reattached.returncode == 0, reattached.stderr
    assert reattached.stdout.splitlines() == ["step 3", "step 6", "step 9", "to stderr", f"saved {job_id}"]
    assert gpulayer("wait", job_id, key=key).returncode == 0
    fetched = gpulayer("fetch", job_id, "ckpt/last.pt", "--to", str(tmp_path / "out"), key=key)
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "out" / "ckpt" / "last.pt").read_bytes() == expected
    # the ignored file never left this host: not in the job's folder, not among the peer's blobs
    work = state / "jobs" / job_id / "work"
    assert (work / "train.py").exists() and not (work / "big.bin").exists()
    assert sum(p.stat().st_size for p in (state / "blobs").rglob("*") if p.is_file()) < 1 << 20
    listed = gpulayer("jobs", "--json", key=key)
    row = next(r for r in json.loads(listed.stdout) if r["id"] == job_id)
    assert row["state"] == "succeeded" and row["exit_code"] == 0 and row["peer"] == peer.name


def test_the_state_folder_is_private(jobs_peer):
    _, state, _, jobs = jobs_peer()
    job = jobs.submit(["true"], None, _cpu())
    assert job.wait(60) == "succeeded"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "jobs.sqlite3").stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "jobs" / job.id).stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "jobs" / job.id / "log").stat().st_mode) == 0o600


def _cpu():
    from gpulayer.matching import Requirements

    return Requirements.build(accelerator="cpu")


def test_a_peer_killed_with_a_running_and_a_queued_job(jobs_peer, tmp_path):
    peer, state, key, jobs = jobs_peer()
    marker = f"marker-{secrets.token_hex(4)}"
    release = tmp_path / "go"
    running = jobs.submit(["python", "-c", f"import os, time  # {marker}\nprint('started', flush=True)\n"
                                           f"while True: time.sleep(1)"], None, _cpu())
    queued = jobs.submit(["python", "-c", f"import os, time\nwhile not os.path.exists({str(release)!r}): "
                                          "time.sleep(0.02)\nprint('second done')"], None, _cpu())
    wait_until(lambda: "started" in running.logs(), 60)
    assert queued.refresh().state == "queued"
    peer.proc.kill()  # kill -9 of the peer alone: the job's supervisor lives on, in its own session
    peer.proc.wait(10)
    assert processes_with(marker)
    peer.start()
    wait_until(lambda: not processes_with(marker), 30)  # the restarted peer stopped what was left of it
    release.touch()
    lost = jobs.job(running.id)
    assert lost.state == "lost" and "died while it ran" in lost.reason and "started" in lost.logs()
    assert lost.peak_memory is None and lost.info["peak_memory_source"] is None  # unknown, not 0
    assert jobs.job(queued.id).wait(60) == "succeeded"
    assert "second done" in jobs.job(queued.id).logs()


def cgroups_or_skip() -> None:
    """Skip where this process's cgroup v2 folder cannot be written (no cgroup v2, not root nor delegated)."""
    from gpulayer.jobs.cgroup import own_cgroup

    own = own_cgroup()
    if own is None or not os.access(own, os.W_OK):
        pytest.skip(f"no writable cgroup v2 folder for this process ({own}): jobs run without cgroups here")


@pytest.mark.parametrize("cgroups", ["1", "0"])
def test_stop_ends_the_whole_tree_children_that_left_with_setsid_or_a_double_fork_included(jobs_peer, cgroups):
    """A child, a child that left the session with setsid, and a daemon (a double fork: re-parented, in a
    session of its own), two of them deaf to SIGTERM: a stop ends them all, in a cgroup or (GPULAYER_JOB_CGROUPS=0)
    as a process group with a subreaper."""
    if cgroups == "1":
        cgroups_or_skip()
    _, _, _, jobs = jobs_peer(env={"GPULAYER_JOB_CGROUPS": cgroups})
    marker = str(secrets.randbelow(10 ** 6) + 10 ** 7)  # seconds no other process sleeps
    script = (f"sleep {marker} & setsid sh -c 'trap \"\" TERM; sleep {marker}; :' & "
              f"(setsid sh -c 'sleep {marker}' &) ; trap '' TERM; sleep {marker}; :")
    job = jobs.submit(["sh", "-c", script], None, _cpu())
    wait_until(lambda: len([p for p in processes_with(marker) if p.name() == "sleep"]) == 4, 60)
    pids = [p.pid for p in processes_with(marker)]
    assert job.stop(grace=0.5) == "stopped"
    wait_until(lambda: all(process_gone(pid) for pid in pids), 10)
    assert not processes_with(marker)


def test_what_outlives_a_killed_supervisor_is_killed_with_the_jobs_cgroup(jobs_peer):
    """A job whose daemon (double fork, setsid, deaf to SIGTERM) then kills its supervisor with SIGKILL: no
    process group or subreaper is left to stop it, but the job's cgroup is, and it goes when the job ends."""
    cgroups_or_skip()
    _, _, _, jobs = jobs_peer()
    marker = str(secrets.randbelow(10 ** 6) + 10 ** 7)
    script = f"(setsid sh -c 'trap \"\" TERM; sleep {marker}; :' &) ; kill -9 $PPID; sleep {marker}"
    job = jobs.submit(["sh", "-c", script], None, _cpu())
    try:
        assert job.wait(60) == "failed" and "without a status" in job.reason
        wait_until(lambda: not processes_with(marker), 10)
    finally:
        for proc in processes_with(marker):  # what a failure left (on a peer without cgroups)
            proc.kill()


def test_a_peers_cgroup_folder_removed_while_it_runs_is_made_again_for_its_next_job(jobs_peer):
    """The peer's folder of job cgroups, removed while it runs (by hand, or a sweep of empty cgroups): its next
    job still gets a cgroup of its own there, made again."""
    from gpulayer.jobs import cgroup

    cgroups_or_skip()
    _, _, _, jobs = jobs_peer()
    first = jobs.submit(["true"], None, _cpu())
    assert first.wait(60) == "succeeded"
    base = os.path.join(cgroup.own_cgroup(), f"gpulayer-{first.id.rsplit('-', 1)[0]}")
    os.rmdir(base)
    job = jobs.submit(["sh", "-c", "cat /proc/self/cgroup"], None, _cpu())
    assert job.wait(60) == "succeeded", job.reason
    assert f"/gpulayer-{first.id.rsplit('-', 1)[0]}/job-{job.id}" in job.logs()


def test_a_peers_cgroup_folder_removed_before_its_start_sweep_is_made_again_with_its_memory_controller():
    """Removed between the peer's `find` and its `sweep` at start (the end of a test session beside it once did
    that, and the peer failed to start): the sweep finds nothing, and the next job's cgroup makes it again, with
    what `find` had turned on for the jobs (the memory controller, where the peer's cgroup has it)."""
    from gpulayer.jobs import cgroup

    cgroups_or_skip()
    groups = cgroup.Cgroups.find(f"test-{secrets.token_hex(4)}")
    assert isinstance(groups, cgroup.Cgroups), groups
    on = os.path.join(groups.base, "cgroup.subtree_control")
    controllers = cgroup._read(on).split()
    os.rmdir(groups.base)
    try:
        assert groups.sweep() == []
        assert os.path.isdir(groups.make("again")) and cgroup._read(on).split() == controllers
        groups.remove("again")
    finally:
        groups.close()
    assert not os.path.exists(groups.base)


def test_without_cgroup_kill_a_cgroup_is_frozen_and_each_of_its_processes_killed(monkeypatch):
    """Before Linux 5.14 a cgroup has no cgroup.kill file: `jobs.cgroup.kill` then freezes it (nothing in it can
    fork meanwhile), sends SIGKILL to each of its processes and thaws it. A real cgroup, real processes (a shell
    that forks a sleeper every 10 ms, and one in a session of its own); only the file is taken away, at the seam,
    where `_write` fails on it as on such a kernel."""
    from gpulayer.jobs import cgroup

    cgroups_or_skip()
    groups = cgroup.Cgroups(os.path.join(cgroup.own_cgroup(), f"gpulayer-test-{secrets.token_hex(4)}"))
    path = groups.make("frozen")
    marker = str(secrets.randbelow(10 ** 6) + 10 ** 7)
    script = f"setsid sleep {marker} & while :; do sleep {marker} & sleep 0.01; done"
    shell = subprocess.Popen(["sh", "-c", script], preexec_fn=lambda: cgroup.join(path))
    written = []
    write = cgroup._write

    def without_kill(file: str, text: str) -> bool:  # a kernel before 5.14: no cgroup.kill to write
        written.append((os.path.basename(file), text))
        return not file.endswith("cgroup.kill") and write(file, text)

    monkeypatch.setattr(cgroup, "_write", without_kill)
    try:
        wait_until(lambda: len(cgroup.procs(path)) >= 10, 30)
        cgroup.kill(path)
        assert [w for w in written if w[0] != "cgroup.kill"] == [("cgroup.freeze", "1"), ("cgroup.freeze", "0")]
        assert shell.wait(10) == -signal.SIGKILL
        assert cgroup.procs(path) == [] and "populated 0" in Path(path, "cgroup.events").read_text()
        assert not processes_with(marker)
    finally:
        monkeypatch.undo()
        groups.remove("frozen")
        groups.close()
        assert not os.path.exists(groups.base)


def peak_source_here(cgroups: str) -> str:
    """What measures a job's peak memory on this machine: its cgroup's memory.peak where the peer's jobs get
    cgroups with the memory controller (given to the peer's cgroup's children; Linux 5.19+), else the largest
    process of its tree."""
    from gpulayer.jobs.cgroup import own_cgroup

    own = own_cgroup()
    release = tuple(int(part) for part in os.uname().release.split(".")[:2])
    memory = own is not None and "memory" in Path(own, "cgroup.subtree_control").read_text().split()
    return "cgroup" if cgroups == "1" and memory and release >= (5, 19) else "largest-process"


@pytest.mark.parametrize("cgroups", ["1", "0"])
def test_a_jobs_peak_memory_and_how_its_peer_holds_jobs_are_shown(jobs_peer, cgroups):
    """A job that fills 200 MiB: once it ended, its peak memory (at least that, well under 2 GB) and what measured
    it are in its Job, `gpulayer jobs --json` and the table; a job that forged its status file has none;
    `gpulayer peers` shows how the peer holds a job's processes (a cgroup each, or a process group only, and why)."""
    from gpulayer.peer_table import format_bytes, format_peers

    if cgroups == "1":
        cgroups_or_skip()
    peer, _, key, jobs = jobs_peer(env={"GPULAYER_JOB_CGROUPS": cgroups})
    job = jobs.submit(["python", "-c", "filled = b'x' * (200 << 20); print(len(filled))"], None, _cpu())
    assert job.peak_memory is None  # not known before it ends
    assert job.wait(60) == "succeeded", job.reason
    assert 200 << 20 <= job.peak_memory < 2 << 30
    assert job.info["peak_memory_source"] == peak_source_here(cgroups)
    row = next(r for r in json.loads(gpulayer("jobs", "--json", key=key).stdout) if r["id"] == job.id)
    assert (row["peak_memory_bytes"], row["peak_memory_source"]) == (job.peak_memory, job.info["peak_memory_source"])
    header, *lines = gpulayer("jobs", key=key).stdout.splitlines()
    assert header.endswith("PEAK MEM")
    assert next(line for line in lines if line.startswith(job.id)).endswith(format_bytes(job.peak_memory))
    # a status file that the job forged (no supervisor's, which it killed) is no status; the peer records the end
    forged = jobs.submit(["sh", "-c", f"echo '{{\"code\": 0, \"maxrss\": {10 ** 30}}}' > ../exit.json; kill -9 $PPID"],
                         None, _cpu())
    assert forged.wait(60) == "failed" and "without a status" in forged.reason and forged.peak_memory is None
    rows = [r for r in jobs.client.peers(wait=0.2) if r["name"] == peer.name]  # the rows of `gpulayer peers`
    if cgroups == "1":
        assert [(r["job_isolation"], r["job_isolation_reason"]) for r in rows] == [("cgroup", "")]
    else:
        assert [(r["job_isolation"], r["job_isolation_reason"]) for r in rows] == [("process-group",
                                                                                    "GPULAYER_JOB_CGROUPS=0")]
    header, line = format_peers(rows).splitlines()
    column = header.index(" JOBS ") + 1  # the cells are padded to the header's columns
    assert line[column:].split()[0] == rows[0]["job_isolation"]


@pytest.mark.parametrize("command, timeout, state, code, reason", [
    (["sh", "-c", "exit 3"], None, "failed", 3, "exited with code 3"),
    (["sh", "-c", "kill -9 $$"], None, "failed", -9, "killed by SIGKILL"),
    (["sleep", "60"], 0.5, "failed", -15, "ran past its timeout of 0.5 s"),
    (["sh", "-c", "echo fine"], None, "succeeded", 0, ""),
])
def test_exit_codes_timeouts_and_signals_give_the_state(jobs_peer, command, timeout, state, code, reason):
    _, _, _, jobs = jobs_peer()
    job = jobs.submit(command, None, _cpu(), timeout=timeout)
    assert job.wait(60) == state
    assert job.exit_code == code and reason in job.reason


def test_a_submit_followed_at_once_is_followed_over_the_submits_connection(jobs_peer):
    """keep_link (`gpulayer submit -f`): the follow opens no connection of its own (one handshake less
    before the job's first line), and its end brings the job's state."""
    peer, _, _, jobs = jobs_peer()

    def to_peer() -> set[int]:
        return {c.laddr.port for c in psutil.Process().net_connections("tcp")
                if c.raddr and c.raddr.port == peer.port and c.status == psutil.CONN_ESTABLISHED}

    job = jobs.submit(["sh", "-c", "echo one; exit 4"], None, _cpu(), keep_link=True)
    kept, after_submit = job.kept.conn.sock.getsockname()[1], to_peer()
    pieces: list[tuple[bytes, set[int]]] = []

    class Out:
        def write(self, data: bytes) -> None:
            pieces.append((data, to_peer()))

        def flush(self) -> None:
            pass

    job.logs(follow=True, out=Out())
    assert b"".join(data for data, _ in pieces) == b"one\n" and kept in after_submit
    assert all(during == after_submit for _, during in pieces)
    assert job.kept is None and (job.state, job.exit_code) == ("failed", 4)


def test_gpulayer_submit_loads_only_what_it_uses(jobs_peer, tmp_path):
    """`gpulayer submit -f` pickles nothing and makes no actor: no cloudpickle, no client/actors.py; a
    folder whose ignore rules and files are unchanged is scanned without pathspec (its decisions are in
    the digest cache). The command runs to its end against a real peer, then says what it loaded."""
    peer, _, key, _ = jobs_peer()
    folder = tmp_path / "project"
    (folder / "logs").mkdir(parents=True)
    (folder / ".gitignore").write_text("logs/\n*.tmp\n")
    (folder / "run.py").write_text("print('ran', flush=True)\n")
    (folder / "scratch.tmp").write_text("left out")
    code = ("import json, sys; from gpulayer.cli import main; "
            f"rc = main(['submit', '-f', '--working-dir', {str(folder)!r}, '--', 'python', 'run.py']); "
            "print(json.dumps(sorted(m for m in ('cloudpickle', 'gpulayer.client.actors', 'pathspec') "
            "if m in sys.modules)), file=sys.stderr); sys.exit(rc)")
    env = {**os.environ, "GPULAYER_KEY": key, "GPULAYER_PEERS": peer.address}
    loaded = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ran", out.stderr
        loaded.append(json.loads(out.stderr.splitlines()[-1]))
    assert loaded == [["pathspec"], []]


def test_retries_run_a_failed_job_again(jobs_peer):
    _, _, _, jobs = jobs_peer()
    job = jobs.submit(["sh", "-c", "echo attempt; exit 1"], None, _cpu(), retries=2)
    assert job.wait(60) == "failed" and job.info["attempts"] == 3
    assert job.logs().count("attempt\n") == 3


def test_a_function_job_gives_its_result_or_its_exception(jobs_peer):
    from gpulayer.errors import RemoteTraceback

    _, _, _, jobs = jobs_peer()

    def double(x):
        print("doubling", x)
        return {"twice": 2 * x}

    def fails():
        raise KeyError("missing")

    job = jobs.submit_function(double, (21,), {}, _cpu())
    assert jobs.job(job.id).result(60) == {"twice": 42}  # from a fresh handle, as another process would
    assert "doubling 21" in job.logs()
    bad = jobs.submit_function(fails, (), {}, _cpu())
    with pytest.raises(KeyError) as raised:
        bad.result(60)
    assert isinstance(raised.value.__cause__, RemoteTraceback) and "fails" in str(raised.value.__cause__)


def test_hostile_fetch_paths_are_refused(jobs_peer, tmp_path):
    _, _, key, jobs = jobs_peer()
    job = jobs.submit(["sh", "-c", "ln -s /etc etc-link && echo data > inside.txt"], None, _cpu())
    assert job.wait(60) == "succeeded"
    out = tmp_path / "out"
    for path, says in [("../../etc/passwd", "goes up with '..'"), ("/etc/passwd", "is an absolute path"),
                       ("etc-link/passwd", "leads out of the job's folder")]:
        refused = gpulayer("fetch", job.id, path, "--to", str(out), key=key)
        assert refused.returncode == 1 and says in refused.stderr, refused.stderr
        assert not out.exists() or not any(out.rglob("*"))
    assert [p.name for p in job.fetch(["inside.txt"], out)] == ["inside.txt"]
    exists = gpulayer("fetch", job.id, "inside.txt", "--to", str(out), key=key)
    assert exists.returncode == 1 and "--force" in exists.stderr


def test_a_job_id_of_another_cluster_or_malformed_names_nothing(jobs_peer):
    from gpulayer.client.jobs import JobError

    _, _, key, jobs = jobs_peer()
    with pytest.raises(JobError, match="no peer of this cluster holds job 0123456789ab-1"):
        jobs.job("0123456789ab-1")
    out = gpulayer("logs", "../../x", key=key)
    assert out.returncode == 1 and "a job id is <12 hex digits>-<number>" in out.stderr


def _tcp_at(port: int) -> tuple[int, int]:
    """(bytes waiting unread in their receive queues, bytes received) of the established TCP connections on
    local `port`, as the kernel counts them (`ss -ti`): what the process that holds them has not read yet,
    and all that came."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    queued = sum(int(line.split()[0]) for line in out.splitlines() if line and not line[0].isspace())
    return queued, sum(int(n) for n in re.findall(r"bytes_received:(\d+)", out))


@pytest.mark.skipif(shutil.which("ss") is None, reason="reads the kernel's TCP counters with ss (iproute2)")
def test_an_upload_whose_disk_falls_behind_is_held_back_by_tcp_while_the_peer_answers(jobs_peer, tmp_path):
    """The peer's disk thread stops (its pause point) at the first chunk of a 96 MiB upload: the peer reads
    that connection until 16 MiB (its BACKLOG) wait for the disk, then stops reading it (`AsyncChannel.hold`), so the
    bytes wait in the kernel's receive queue and TCP's window holds the sender back, not the peer's memory;
    its event loop answers another connection meanwhile. Once the disk goes on, the upload completes and
    the job reads its file whole."""
    from gpulayer.client.jobs import JobLink
    from gpulayer.jobs import transfer
    from gpulayer.protocol import jobs as job_protocol, messages

    pause = tmp_path / "pause"
    pause.mkdir()
    (pause / "blob-writing.hold").touch()
    peer, _, key, jobs = jobs_peer("held", env={"GPULAYER_TEST_PAUSE_IN": str(pause)})
    project, size = tmp_path / "project", 6 * transfer.BACKLOG
    project.mkdir()
    block = secrets.token_bytes(1 << 20)
    with open(project / "big.bin", "wb") as f:
        for i in range(size >> 20):
            f.write(i.to_bytes(8, "big") + block[8:])  # every MiB different
    expected = blake3((project / "big.bin").read_bytes()).hexdigest()
    script = "from blake3 import blake3; print(blake3(open('big.bin', 'rb').read()).hexdigest())"
    with ThreadPoolExecutor(1) as pool:
        submitted = pool.submit(jobs.submit, ["python", "-c", script], project, _cpu())
        try:
            wait_until(lambda: (pause / "blob-writing.reached").exists(), 60)
            wait_until(lambda: _tcp_at(peer.port)[0] >= 1 << 20, 30)  # bytes wait unread: the peer stopped reading
            client = type("Client", (), {"key": key.encode(), "submitter_id": "another"})()
            with JobLink(client, [("127.0.0.1", peer.port)]) as link:  # its event loop is free meanwhile
                assert link.ask(job_protocol.request(messages.JOB_LIST, 0), timeout=30)["jobs"] == []
            def read_on() -> bool:
                queued, received = _tcp_at(peer.port)
                return queued < 1 << 20 or received >= size - transfer.BACKLOG

            with pytest.raises(AssertionError, match="not met"):  # for 3 s: a peer that kept reading would
                wait_until(read_on, 3)  # have all of it in well under that
            assert not submitted.done()  # its send waits for TCP's window, however long (not a timeout)
        finally:
            (pause / "blob-writing.hold").unlink()  # the disk goes on
        job = submitted.result(timeout=120)
    assert job.wait(120) == "succeeded"
    assert expected in job.logs()


def test_a_truncated_upload_records_nothing(jobs_peer, tmp_path):
    """The connection closes half way through a blob, once the peer has begun writing it as the job's file:
    nothing is recorded or kept, and the peer holds none of the dropped folder open."""
    from gpulayer.protocol import handshake, jobs as job_protocol, messages
    from gpulayer.transport import blocking
    from gpulayer.jobs.store import JobSpec

    peer, state, key, jobs = jobs_peer()
    data = secrets.token_bytes(1 << 20)
    digest = blake3(data).hexdigest()
    conn = blocking.BlockingConnection(socket.create_connection(("127.0.0.1", peer.port), timeout=10))
    try:
        handshake.client_handshake(conn, key.encode(), "truncating")
        conn.send(job_protocol.submit(1, JobSpec(["true"]), [["blob.bin", len(data), False, digest]]))
        need, _ = conn.recv()
        assert need["t"] == messages.JOB_NEED and need["need"] == [digest]
        conn.send({"t": messages.BLOB, "id": 1, "d": digest, "off": 0, "size": len(data)}, [data[:1000]])
        wait_until(lambda: list((state / "jobs").glob("*/.work.partial-*/blob.bin")), 10)  # written as the job's file
    finally:
        conn.close()
    assert jobs.rows(include_old=True) == []
    wait_until(lambda: not list((state / "blobs").glob("*/*")), 10)  # no blob, no partial one
    assert not list((state / "jobs").iterdir())
    if sys.platform == "linux":  # and the dropped job's folder is not held open
        held = [os.readlink(fd) for fd in Path(f"/proc/{peer.proc.pid}/fd").iterdir() if fd.is_symlink()]
        folders = [path for path in held if path.startswith((f"{state / 'jobs'}/", f"{state / 'trash'}/"))]
        assert folders == []


def test_a_job_that_writes_into_a_shipped_file_leaves_the_next_job_the_files_as_shipped(jobs_peer, tmp_path):
    """A blob received for a job is that job's file itself (ADR 0025: written once). The job rewrites one
    shipped file and appends to another; the same folder submitted again gets the bytes as shipped (those two
    sent again, the unchanged one not), and the first job's folder keeps what it wrote."""
    _, state, _, jobs = jobs_peer()
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.txt").write_text("lr=0.1\n")
    (project / "log.txt").write_text("shipped\n")
    (project / "weights.bin").write_bytes(secrets.token_bytes(1 << 20))
    script = ("cat config.txt log.txt; echo lr=9.9 > config.txt; echo appended >> log.txt; "
              "python -c 'import hashlib; print(hashlib.sha256(open(\"weights.bin\", \"rb\").read()).hexdigest())'")
    first = jobs.submit(["sh", "-c", script], project, _cpu())
    assert first.wait(60) == "succeeded", first.logs()
    weights = state / "jobs" / first.id / "work" / "weights.bin"
    stored = state / "blobs" / blake3(weights.read_bytes()).hexdigest()[:2] / blake3(weights.read_bytes()).hexdigest()
    linked = sys.platform != "darwin"  # on macOS every file is a clone
    assert (weights.stat().st_ino == stored.stat().st_ino) is linked  # one file: its bytes were written once
    second = jobs.submit(["sh", "-c", script], project, _cpu())
    assert second.wait(60) == "succeeded", second.logs()
    for job in (first, second):
        assert job.logs().splitlines()[:2] == ["lr=0.1", "shipped"], job.logs()
        assert job.logs().splitlines()[2] == hashlib.sha256((project / "weights.bin").read_bytes()).hexdigest()
    assert (state / "jobs" / first.id / "work" / "config.txt").read_text() == "lr=9.9\n"
    assert (state / "jobs" / first.id / "work" / "log.txt").read_text() == "shipped\nappended\n"
    # the unchanged blob was not sent again: the second job's copy of it is a copy out of the store
    assert (state / "jobs" / second.id / "work" / "weights.bin").stat().st_ino != stored.stat().st_ino


def test_a_folder_of_many_chunks_up_and_an_artifact_of_many_chunks_down_arrive_byte_exact(jobs_peer, tmp_path):
    """The peer builds the job's folder as the blobs come (each blob's files placed on a thread of their own)
    from chunks received into buffers it uses again, and sends a fetch from chunk buffers it uses again,
    sealed into record buffers it uses again; the submitter writes on a disk thread from buffers it uses
    again. Whatever was reused, every byte arrives as it was: nested folders, one content under two names,
    an executable, an empty file and files of several chunks, up (fresh, then found in the store) and down."""
    from gpulayer.jobs import transfer

    _, _, _, jobs = jobs_peer()
    project = tmp_path / "project"
    (project / "data" / "deep").mkdir(parents=True)
    big = os.urandom(2 * transfer.CHUNK + 12345)
    (project / "data" / "big.bin").write_bytes(big)
    (project / "data" / "deep" / "same.bin").write_bytes(big)
    for i in range(40):
        (project / "data" / f"small-{i:02d}.txt").write_bytes(os.urandom(3000 + i))
    (project / "empty.txt").write_bytes(b"")
    (project / "check.sh").write_text("#!/bin/sh\ncat data/big.bin data/deep/same.bin data/small-*.txt > out.bin\n")
    (project / "check.sh").chmod(0o755)
    expected = big + big + b"".join((project / "data" / f"small-{i:02d}.txt").read_bytes() for i in range(40))
    for round_ in ("fresh", "stored"):
        job = jobs.submit(["./check.sh"], project, _cpu())
        assert job.wait(60) == "succeeded", (round_, job.reason)
        back = tmp_path / f"back-{round_}"
        job.fetch(["out.bin", "empty.txt", "check.sh"], back)
        assert (back / "out.bin").read_bytes() == expected, round_
        assert (back / "empty.txt").read_bytes() == b"" and os.access(back / "check.sh", os.X_OK)


def test_a_submit_of_many_files_is_answered_at_once(jobs_peer):
    """The peer's answer to a manifest of 30,000 files (each a blob of its own) takes time linear in it:
    on main it rebuilt the digest -> size map per needed blob, on its event loop, about a minute here."""
    from gpulayer.protocol import handshake, jobs as job_protocol, messages
    from gpulayer.transport import blocking
    from gpulayer.jobs.store import JobSpec

    peer, state, key, jobs = jobs_peer()
    files = [[f"f{i:05d}", 1, False, blake3(str(i).encode()).hexdigest()] for i in range(30_000)]
    conn = blocking.BlockingConnection(socket.create_connection(("127.0.0.1", peer.port), timeout=10))
    try:
        handshake.client_handshake(conn, key.encode(), "many-files")
        conn.send(job_protocol.submit(1, JobSpec(["true"]), files))
        need, _ = conn.recv(deadline=time.monotonic() + 20)
        assert need["t"] == messages.JOB_NEED and need["need"] == [f[3] for f in files]
    finally:
        conn.close()
    assert jobs.rows(include_old=True) == []


def test_the_trainer_example_as_a_job_with_its_logs_fetched(jobs_peer, tmp_path):
    pytest.importorskip("torch")
    _, _, key, _ = jobs_peer()
    submitted = gpulayer("submit", "--follow", "--working-dir", str(ROOT / "examples" / "trainer_regression"), "--",
                         "python", "train.py", "--epochs", "2", "--accelerator", "cpu", key=key, timeout=240)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.splitlines()[0]
    assert "final val_loss=" in submitted.stdout
    fetched = gpulayer("fetch", job_id, "--to", str(tmp_path / "back"), key=key)
    assert fetched.returncode == 0, fetched.stderr
    logs = tmp_path / "back" / "lightning_logs"
    assert logs.is_dir() and any(p.is_file() for p in logs.rglob("*"))


def test_folders_that_cannot_ship_are_refused_before_anything_is_sent(jobs_peer, tmp_path):
    _, state, key, jobs = jobs_peer()
    leaky = tmp_path / "leaky"
    leaky.mkdir()
    (leaky / "train.py").write_text("print('x')\n")
    (leaky / "secrets").symlink_to("/etc")
    out = gpulayer("submit", "--working-dir", str(leaky), "--", "python", "train.py", key=key)
    assert out.returncode == 1 and "secrets" in out.stderr and out.stdout == "", out.stderr
    big = tmp_path / "big"
    big.mkdir()
    (big / "weights.bin").write_bytes(b"\0" * (2 << 20))
    out = subprocess.run([sys.executable, "-m", "gpulayer.cli", "submit", "--working-dir", str(big), "--", "true"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GPULAYER_KEY": key, "GPULAYER_JOB_FOLDER_LIMIT_MB": "1"})
    assert out.returncode == 1 and "over the limit" in out.stderr and "weights.bin" in out.stderr, out.stderr
    assert jobs.rows(include_old=True) == [] and not list((state / "jobs").iterdir())


def test_a_job_no_peer_can_run_is_refused_with_the_reasons(jobs_peer):
    from gpulayer.errors import NoMatchingPeer
    from gpulayer.matching import Requirements

    _, state, _, jobs = jobs_peer()
    with pytest.raises(NoMatchingPeer, match="cuda"):
        jobs.submit(["true"], None, Requirements.build(accelerator="cuda"))
    assert not list((state / "jobs").iterdir())


def test_ctrl_c_while_following_detaches_and_the_job_goes_on(jobs_peer, tmp_path):
    _, _, key, jobs = jobs_peer()
    release = tmp_path / "release"
    script = (f"import os, time\nprint('waiting', flush=True)\n"
              f"while not os.path.exists({str(release)!r}): time.sleep(0.02)\nprint('after')")
    follower = subprocess.Popen([sys.executable, "-m", "gpulayer.cli", "submit", "-f", "--", "python", "-c", script],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "GPULAYER_KEY": key, **DUMPS_STACKS})
    job_id = follower.stdout.readline().strip()
    assert follower.stdout.readline().strip() == "waiting"
    _, err = interrupt(follower, 30)
    assert follower.returncode == 130 and f"job {job_id} goes on" in err
    assert jobs.job(job_id).state == "running"
    release.touch()
    job = jobs.job(job_id)
    assert job.wait(60) == "succeeded" and job.logs() == "waiting\nafter\n"


def test_retention_removes_the_oldest_ended_job_and_the_content_only_it_held(jobs_peer, tmp_path):
    from gpulayer.client.jobs import JobError

    _, state, _, jobs = jobs_peer("retaining", "--job-retention-gb", str(1.5 / 1024))  # 1.5 MiB of job folders
    done = []
    for name in ("first", "second"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "weights.bin").write_bytes(secrets.token_bytes(1 << 20))
        job = jobs.submit(["true"], folder, _cpu())
        assert job.wait(60) == "succeeded"
        done.append((job, blake3((folder / "weights.bin").read_bytes()).hexdigest()))
    (first, first_digest), (second, second_digest) = done
    with pytest.raises(JobError, match="no-job"):
        first.refresh()
    assert second.refresh().state == "succeeded" and (state / "jobs" / second.id).is_dir()
    assert not (state / "jobs" / first.id).exists()

    def stored() -> set[str]:
        return {p.name for p in (state / "blobs").rglob("*") if p.is_file()}

    wait_until(lambda: not any(first_digest in name for name in stored()))  # pruned off the event loop
    assert any(second_digest in name for name in stored())


def test_a_peer_stopped_with_sigterm_stops_its_running_job_and_records_it_lost(jobs_peer):
    peer, _, _, jobs = jobs_peer()
    marker = str(secrets.randbelow(10 ** 6) + 10 ** 7)
    job = jobs.submit(["sh", "-c", f"echo up; sleep {marker}; :"], None, _cpu())
    wait_until(lambda: "up" in job.logs(), 60)
    assert peer.stop(timeout=60) == 0  # a clean stop: the job's tree is stopped before the peer exits
    assert not [p for p in processes_with(marker) if p.name() == "sleep"]
    peer.start()
    lost = jobs.job(job.id)
    assert lost.state == "lost" and "stopped while it ran" in lost.reason and lost.logs().startswith("up\n")


def test_a_job_stopped_while_its_supervisor_starts_ends_stopped(jobs_peer):
    """A stop that comes right after the submit reaches the job before, while or just after its supervisor
    starts (before its SIGTERM handler is set, on main: recorded failed); each ends stopped, the slot free."""
    _, _, _, jobs = jobs_peer()
    for _ in range(6):
        job = jobs.submit(["sleep", "30"], None, _cpu())
        assert job.stop(grace=0.5) == "stopped", job.reason
        assert job.stop(grace=0.5) == "stopped"  # a second stop changes nothing
    running = jobs.submit(["sleep", "30"], None, _cpu())
    queued = jobs.submit(["sleep", "30"], None, _cpu())
    assert queued.stop() == "stopped" and queued.reason == "stopped before it started" and queued.exit_code is None
    assert running.stop(grace=0.5) == "stopped"
    assert jobs.submit(["true"], None, _cpu()).wait(60) == "succeeded"  # the one slot was given back each time


def standbys(peer) -> list[psutil.Process]:
    """The peer's idle standby supervisors (jobs/shim.py --standby)."""
    found = []
    for proc in psutil.Process(peer.proc.pid).children():
        try:
            if "--standby" in proc.cmdline():
                found.append(proc)
        except psutil.Error:
            pass  # gone meanwhile
    return found


def test_jobs_handed_to_standby_supervisors_get_their_own_folder_environment_and_exit_code(jobs_peer):
    """Each job's supervisor was started ahead (its command line still says --standby) and handed that job:
    its folder, its own GPULAYER_JOB_ID and --env (one larger than the pipe's buffer), the interpreter's bin
    first on PATH, no cluster key, its exit code."""
    _, state, _, jobs = jobs_peer()
    script = ('echo "$(pwd -P)|$GPULAYER_JOB_ID|$MINE|${PATH%%:*}|${GPULAYER_KEY:-no key}|${#BIG}"; '
              'tr "\\0" " " < /proc/$PPID/cmdline; echo; exit $CODE')
    for code, big in ((0, 0), (7, 100_000)):  # the second job goes to the standby the first one's handover started
        job = jobs.submit(["sh", "-c", script], None, _cpu(),
                          env={"MINE": f"mine-{code}", "CODE": str(code), "BIG": "x" * big})
        assert job.wait(60) == ("succeeded" if code == 0 else "failed") and job.exit_code == code
        line, parent = job.logs().splitlines()
        work = (state / "jobs" / job.id / "work").resolve()
        assert line == f"{work}|{job.id}|mine-{code}|{state / 'bin'}|no key|{big}"
        assert "shim.py --standby" in parent


def test_a_standby_supervisor_goes_with_its_peer_killed_or_stopped_and_holds_no_key(jobs_peer):
    """The idle standby's environment lacks the cluster key; it exits by itself when its peer is killed with
    -9 (the end of its pipe), and with its peer's clean stop; it never runs anything."""
    peer, _, key, jobs = jobs_peer()
    for end in ("kill", "stop"):
        assert jobs.submit(["true"], None, _cpu()).wait(60) == "succeeded"
        standby, = wait_until(lambda: standbys(peer), 30)
        assert key.encode() not in Path(f"/proc/{standby.pid}/environ").read_bytes()
        if end == "kill":
            peer.proc.kill()
            peer.proc.wait(10)
            wait_until(lambda: process_gone(standby.pid), 30)
            peer.start()
        else:
            assert peer.stop(timeout=60) == 0
            assert process_gone(standby.pid)


def test_a_stop_racing_the_handover_never_runs_the_command(jobs_peer, tmp_path):
    """The job is handed to a standby that has not read it yet (held with SIGSTOP), and stopped: the SIGTERM
    waits with the handover; let go, the standby ends without running the command, the job is stopped and
    its slot free (the next job runs)."""

    peer, _, _, jobs = jobs_peer()
    assert jobs.submit(["true"], None, _cpu()).wait(60) == "succeeded"
    standby, = wait_until(lambda: standbys(peer), 30)
    ran = tmp_path / "ran"
    standby.suspend()
    try:
        job = jobs.submit(["touch", str(ran)], None, _cpu())
        with ThreadPoolExecutor(1) as pool:
            stopped = pool.submit(job.stop, 0.5)
            wait_until(lambda: _pending(standby.pid) & (1 << (signal.SIGTERM - 1)), 30)
            standby.resume()
            assert stopped.result(60) == "stopped"
    finally:
        if not process_gone(standby.pid):
            standby.resume()
    assert job.reason == "stopped before it started" and job.exit_code is None and not ran.exists()
    assert jobs.submit(["touch", str(ran)], None, _cpu()).wait(60) == "succeeded" and ran.exists()


def _pending(pid: int) -> int:
    """The signals pending for the process `pid` (its ShdPnd mask: bit N-1 for signal N)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return int(line.split()[1], 16)
    return 0


def test_a_timeout_that_ends_before_the_supervisor_started_is_a_timeout(jobs_peer):
    _, _, _, jobs = jobs_peer()
    job = jobs.submit(["sleep", "30"], None, _cpu(), timeout=0.001)
    assert job.wait(60) == "failed" and "ran past its timeout of 0.001 s" in job.reason


@pytest.mark.parametrize("point", ["job-placed", "job-recorded"])
def test_a_submit_whose_peer_is_killed_as_it_records_the_job_records_it_once(jobs_peer, tmp_path, point,
                                                                            monkeypatch):
    """kill -9 of the peer with the job's folder moved into place but its record not committed, and with
    the record committed but the submit not acknowledged; the peer restarts on the same state folder while
    the submitter sends the same submit (its token) again: it gets the id of the one job recorded, which
    runs once, with its folder (a folder without a record is swept, and the job recorded anew)."""
    from concurrent.futures import ThreadPoolExecutor

    from gpulayer.client import jobs as client_jobs

    monkeypatch.setattr(client_jobs, "SUBMIT_RETRY_S", 120.0, raising=False)  # the restart below may be slow on a busy machine
    peer, state, _, jobs = jobs_peer(env={"GPULAYER_TEST_KILL_AT": point})
    project = tmp_path / "project"
    project.mkdir()
    (project / "data.txt").write_text("shipped\n")
    with ThreadPoolExecutor(1) as pool:
        submitted = pool.submit(jobs.submit, ["sh", "-c", 'cat data.txt; echo ran >> "$RUNS"'], project, _cpu(),
                                env={"RUNS": str(tmp_path / "runs")})
        assert peer.proc.wait(60) == -signal.SIGKILL
        del peer.env["GPULAYER_TEST_KILL_AT"]
        peer.start()
        job = submitted.result(150)
    assert job.wait(60) == "succeeded" and job.logs() == "shipped\n"
    assert [p.name for p in (state / "jobs").iterdir()] == [job.id]  # one job, with its folder
    assert (tmp_path / "runs").read_text() == "ran\n"
