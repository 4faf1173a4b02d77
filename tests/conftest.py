"""Session-wide safety and fixtures: mDNS on loopback only, private config and cache folders."""

from __future__ import annotations

import contextlib
import glob
import os
import signal

import pytest

from support import LocalUser, PeerProcess, ci_forbids, new_key

# Network safety: every zeroconf a test (or a peer it starts) creates binds to loopback only.
os.environ["GPULAYER_INTERFACES"] = "127.0.0.1"
os.environ["GPULAYER_CACHE"] = "0"
os.environ.pop("GPULAYER_PEERS", None)
os.environ.pop("GPULAYER_KEY", None)

# A session started with SIGINT ignored (a background job of a non-interactive shell, which POSIX has ignore
# it) hands that on to every process it starts, and Python then never turns Ctrl-C into KeyboardInterrupt:
# the tests that stop a CLI with Ctrl-C would wait in vain. With Python's own handler here, the processes
# started from the session begin with SIGINT's default, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# In CI, a skip that support.CI_SKIPS does not allow is an error: at collection, setup or call.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if (message := ci_forbids(report)) is not None:
        report.outcome, report.longrepr = "failed", message


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if (message := ci_forbids(report)) is not None:
        report.outcome, report.longrepr = "failed", message


@pytest.fixture(autouse=True, scope="session")
def _private_dirs(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    os.environ["XDG_CONFIG_HOME"] = str(home / "config")
    os.environ["XDG_CACHE_HOME"] = str(home / "cache")
    os.environ["XDG_STATE_HOME"] = str(home / "state")  # the peers' jobs (peer/jobs.py)
    yield


@pytest.fixture(autouse=True, scope="session")
def _job_cgroups_removed():
    """The job cgroups left by the peers this session killed with -9 (where a machine died, its cgroups went with
    it) are removed at its end: the folders of peers that were not there before it, where no process is left."""
    from gpulayer.jobs.cgroup import Cgroups, own_cgroup

    own = own_cgroup()
    before = set(_peer_cgroups(own))
    yield
    for base in set(_peer_cgroups(own)) - before:
        for job in glob.glob(os.path.join(base, "job-*")):
            with contextlib.suppress(OSError):  # a process still in it: left for whoever looks
                os.rmdir(job)
        Cgroups(base).close()  # the peer's own end: its folder goes if no job's is left in it


def _peer_cgroups(own: str | None) -> list[str]:
    """The peers' folders of job cgroups under this process's cgroup (jobs/cgroup.py)."""
    return glob.glob(os.path.join(own, "gpulayer-*")) if own else []


@pytest.fixture(scope="module")
def peer_factory(tmp_path_factory):
    """start(name, *args, key=..., env=...) -> a started PeerProcess; all are stopped after the module."""
    workdir = tmp_path_factory.mktemp("peers")
    started: list[PeerProcess] = []

    def start(name: str, *args: str, key: str, env: dict | None = None, wait: bool = True) -> PeerProcess:
        peer = PeerProcess(workdir, key, name, *args, env=env)
        started.append(peer)
        return peer.start(wait=wait)

    yield start
    for peer in started:
        peer.stop(timeout=10)
        peer.kill()


@pytest.fixture
def cluster(peer_factory):
    """cluster(*names, args=...) -> (client, {name: peer}): one-slot peers of a fresh cluster key and a
    submitter of that cluster; the submitter is closed after the test (the peers after the module)."""
    from gpulayer.client import Client

    clients = []

    def start(*names: str, args: tuple = ("--concurrency", "1")):
        key = new_key()
        peers = {name: peer_factory(name, *args, key=key) for name in names}
        clients.append(Client(key=key.encode(), echo_output=False))
        return clients[-1], peers

    yield start
    for client in clients:
        client.close()


@pytest.fixture(scope="module")
def cluster_key() -> str:
    return new_key()


@pytest.fixture(scope="module")
def gl_client(cluster_key):
    """The process-wide gl client, set to this module's cluster key; closed after the module."""
    import gpulayer as gl

    client = gl.configure(key=cluster_key.encode(), interfaces=["127.0.0.1"])
    yield client
    gl.api.shutdown()


@pytest.fixture(scope="module")
def other_user():
    """A second local account of this machine (LocalUser), removed after the module, also on failure.
    Skipped where none can be made or it can run no Python, except in CI (CI=true), which must run it."""
    give_up = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    problem = LocalUser.unavailable()
    if problem is not None:
        give_up(problem)
    user = LocalUser()
    try:
        if user.find_python() is None:
            give_up(f"no Python interpreter that user {user.name} may run")
        yield user
    finally:
        user.remove()
