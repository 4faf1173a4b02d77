"""A job across the bridge: its submitter's host falls off the network while it runs (issue 27).

The submitter host's link goes down for LINK_DOWN_S (the issue's 60 s) while the job runs, with a
`submit -f` following its log: the follower loses the peer, the job runs on through the whole time
(another host of the cluster sees it running), and once the link is back the first host
re-attaches, waits for the job's end and reads the whole log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from lanlab import lan_env

LAN_PEERS = 1
LAN_CONCURRENCY = 1
LINK_DOWN_S = 60.0  # the figure: a laptop's lid closed, a Wi-Fi drop


def gpulayer(host, key: str, *args: str, timeout: float = 120.0):
    return host.run([sys.executable, "-m", "gpulayer.cli", *args], timeout=timeout, env=lan_env(key))


def job_state(host, key: str, job_id: str) -> str:
    listed = gpulayer(host, key, "jobs", "--json")
    assert listed.returncode == 0, listed.stderr
    return next(row["state"] for row in json.loads(listed.stdout) if row["id"] == job_id)


def test_a_job_runs_on_while_its_submitters_link_is_down_and_is_reattached(lan, tmp_path):
    laptop, other = lan.add_host("laptop"), lan.add_host("desk")
    project, release = tmp_path / "project", tmp_path / "release"
    project.mkdir()
    (project / "train.py").write_text(
        "import os, time\n"
        "print('epoch 0', flush=True)\n"
        f"while not os.path.exists({str(release)!r}):\n"
        "    time.sleep(0.02)\n"
        "print('epoch 1', flush=True)\n")
    follower = laptop.popen([sys.executable, "-m", "gpulayer.cli", "submit", "-f", "--working-dir", str(project),
                             "--", "python", "train.py"], lan_env(lan.key), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert follower.stdout is not None
        job_id = follower.stdout.readline().strip()
        assert follower.stdout.readline() == "epoch 0\n"  # it runs, and its log is followed
        laptop.link_down()
        down_since = time.monotonic()
        try:
            unreachable = gpulayer(laptop, lan.key, "logs", job_id, timeout=60)
            assert unreachable.returncode == 1 and "no peer of this cluster holds job" in unreachable.stderr
            _, lost = follower.communicate(timeout=LINK_DOWN_S)  # the follower gives up on the silent peer
            assert follower.returncode == 1 and "the peer went silent" in lost, lost
            while time.monotonic() - down_since < LINK_DOWN_S:  # the whole time: the job runs on
                assert job_state(other, lan.key, job_id) == "running"
        finally:
            laptop.link_up()
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    assert job_state(laptop, lan.key, job_id) == "running"  # re-attached, from the host that was cut off
    release.touch()
    waited = gpulayer(laptop, lan.key, "wait", job_id)
    assert waited.returncode == 0, waited.stderr
    back = gpulayer(laptop, lan.key, "logs", job_id)
    assert back.returncode == 0, back.stderr
    assert back.stdout.splitlines() == ["epoch 0", "epoch 1"]
