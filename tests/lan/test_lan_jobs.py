"""A job across the bridge: its submitter's host falls off the network while it runs (issue 27).

The submitter host's link goes down while the job runs: the job finishes all the same (another host
of the cluster sees it end), and once the link is back the first host re-attaches and reads the
whole log.
"""

from __future__ import annotations

import sys

from lanlab import lan_env

LAN_PEERS = 1
LAN_CONCURRENCY = 1


def gpulayer(host, key: str, *args: str, timeout: float = 120.0):
    return host.run([sys.executable, "-m", "gpulayer.cli", *args], timeout=timeout, env=lan_env(key))


def test_a_job_finishes_while_its_submitters_link_is_down_and_is_reattached(lan, tmp_path):
    laptop, other = lan.add_host("laptop"), lan.add_host("desk")
    project, release = tmp_path / "project", tmp_path / "release"
    project.mkdir()
    (project / "train.py").write_text(
        "import os, time\n"
        "print('epoch 0', flush=True)\n"
        f"while not os.path.exists({str(release)!r}):\n"
        "    time.sleep(0.02)\n"
        "print('epoch 1', flush=True)\n")
    submitted = gpulayer(laptop, lan.key, "submit", "--working-dir", str(project), "--", "python", "train.py")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    laptop.link_down()
    try:
        first = gpulayer(other, lan.key, "logs", job_id)
        assert first.returncode == 0 and "epoch 0" in first.stdout, first.stderr
        unreachable = gpulayer(laptop, lan.key, "logs", job_id, timeout=60)
        assert unreachable.returncode == 1 and "no peer of this cluster holds job" in unreachable.stderr
        release.touch()
        waited = gpulayer(other, lan.key, "wait", job_id)
        assert waited.returncode == 0, waited.stderr
    finally:
        laptop.link_up()
    back = gpulayer(laptop, lan.key, "logs", job_id)
    assert back.returncode == 0, back.stderr
    assert back.stdout.splitlines() == ["epoch 0", "epoch 1"]
