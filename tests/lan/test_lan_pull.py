"""Peers pull waiting work across the bridge (issue 28, ADR 0019): jobs queued on one host are taken over by
peers on hosts that join later, found over real mDNS multicast between namespaces (every job holds its slot
until the test releases it, so each joiner takes one however late it hears of the owner); each job runs once
(read from the jobs' own output), the pinned ones stay, and `gpulayer jobs` shows where each one ran."""

from __future__ import annotations

import json
import sys

from lanlab import lan_env
from support import wait_until

LAN_PEERS = 1
LAN_CONCURRENCY = 1
JOBS = 24

SUBMIT = """
import json, sys
from gpulayer.client import Client
from gpulayer.client.jobs import Jobs
from gpulayer.matching import Requirements

out, release, key = sys.argv[1], sys.argv[2], sys.argv[3].encode()
client = Client(key=key, echo_output=False)
jobs = Jobs(client)
held = f"while [ ! -e {release} ]; do sleep 0.05; done"
write = ["sh", "-c", f'echo "$GPULAYER_JOB_ID $GPULAYER_PEER_NAME" >> {out}; {held}']
pinned = Requirements.build(accelerator="cpu", peer="p1")
blocker = jobs.submit(["sh", "-c", held], None, pinned)
ids = [jobs.submit(write, None, pinned).id for _ in range(2)]
ids += [jobs.submit(write, None, Requirements.build(accelerator="cpu")).id for _ in range({jobs})]
print(json.dumps({"blocker": blocker.id, "pinned": ids[:2], "ids": ids, "peers": sorted({blocker.peer})}))
client.close()
"""


def test_jobs_queued_on_one_host_are_pulled_by_hosts_that_join(lan, tmp_path):
    laptop = lan.net.add_host("laptop")
    out, release = tmp_path / "out", tmp_path / "release"
    submitted = laptop.run([sys.executable, "-c", SUBMIT.replace("{jobs}", str(JOBS)), str(out), str(release),
                            lan.key], timeout=300, env=lan_env(lan.key))
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    plan = json.loads(submitted.stdout.strip().splitlines()[-1])
    assert plan["peers"] == ["p1"] and not out.exists()  # all queued behind the blocker on p1
    joiners = [lan.net.add_host(name).start_peer(name, lan.key, 1) for name in ("p2", "p3")]
    for peer in joiners:
        peer.wait_ready()

    def ran() -> list[list[str]]:
        return [line.split() for line in out.read_text().splitlines()] if out.exists() else []

    wait_until(lambda: {peer for _, peer in ran()} == {"p2", "p3"}, 120, detail=ran)  # p1's slot is still held
    release.touch()
    wait_until(lambda: len(ran()) >= len(plan["ids"]), 180, detail=ran)
    where = dict(ran())
    assert sorted(job_id for job_id, _ in ran()) == sorted(plan["ids"])  # each exactly once
    assert {where[job_id] for job_id in plan["pinned"]} == {"p1"}
    listed = laptop.run([sys.executable, "-m", "gpulayer.cli", "jobs", "--json"], timeout=120, env=lan_env(lan.key))
    assert listed.returncode == 0, listed.stderr
    rows = {row["id"]: row for row in json.loads(listed.stdout)}
    assert all(rows[job_id]["peer"] == where[job_id] for job_id in plan["ids"])
    pulled = [job_id for job_id in plan["ids"] if where[job_id] != "p1"]
    assert pulled and all(rows[job_id]["moved"] == plan["blocker"].split("-")[0] for job_id in pulled)
