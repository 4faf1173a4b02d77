"""A job interpreter in a venv made the ordinary way (issue 26, item 11).

`python3 -m venv jobenv` links its python to the same base interpreter as the peer's; it is still
another environment, whose site-packages lack gpulayer. Both kinds of venv, with symlinks and with
`--copies`, run tasks as the job interpreter of a real peer (`--python`), through the peer and on a
lease (ADR 0013), whose worker must not need the peer's own packages (psutil); and actors, through
the peer and on the direct connections their workers take (ADR 0012), in the same interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

import gpulayer as gl
from support import job_venv, wait_until


def prefix():
    return sys.prefix


def has_psutil() -> bool:
    return importlib.util.find_spec("psutil") is not None


@gl.remote
class Counter:
    def __init__(self):
        self.count = 0

    def add(self, n):
        self.count += n
        print(f"added {n}")
        return self.count, has_psutil()


@pytest.fixture(scope="module")
def venvs(tmp_path_factory):
    root = tmp_path_factory.mktemp("job-venvs")
    return {"linked": job_venv(root / "linked"), "copied": job_venv(root / "copied", "--copies")}


@pytest.fixture(scope="module")
def peers(peer_factory, cluster_key, gl_client, venvs):
    return {name: peer_factory(name, "--concurrency", "1", "--python", python, key=cluster_key)
            for name, python in venvs.items()}


@pytest.mark.parametrize("kind", ["linked", "copied"])
def test_a_venv_of_the_peers_own_python_runs_tasks_and_leases(peers, venvs, gl_client, kind):
    if kind == "linked":  # what the bug needs: the same executable as the peer's, once links are resolved
        assert os.path.realpath(venvs[kind]) == os.path.realpath(sys.executable)
    venv = os.path.dirname(os.path.dirname(venvs[kind]))

    def on_a_lease():  # a task through the peer (the first ones) or on its lease, then: is there one?
        assert gl.run(prefix, peer=kind, timeout=60) == venv
        lease = gl_client.leases.by_peer.get(peers[kind].peer_id)
        return lease is not None and not lease.closed

    wait_until(on_a_lease, 60)
    assert gl.map(pow, [2, 3], [3, 2], peer=kind) == [8, 9]
    assert gl.run(prefix, peer=kind, timeout=60) == venv


def test_an_actor_lives_in_a_job_interpreter_without_psutil(peers, gl_client):
    assert not gl.run(has_psutil, peer="linked", timeout=60)  # what the worker has: the venv's packages
    counter = Counter.options(peer="linked")()
    try:
        first = counter.add.submit(1)
        assert first.result(60) == (1, False)
        assert first.stdout == "added 1\n"
        calls = [counter.add.submit(n) for n in range(2, 12)]
        assert [f.result(60)[0] for f in calls] == [sum(range(1, n + 1)) for n in range(2, 12)]
        direct = gl_client.pool.directs.get(counter.actor_id)  # the calls after the first went straight to it
        assert direct is not None and not direct.closed
        assert [f.stdout for f in calls] == [f"added {n}\n" for n in range(2, 12)]  # on the direct connection
    finally:
        counter.close()
