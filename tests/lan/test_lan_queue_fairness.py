"""Priorities and fair turns across peers that pull (issue 28): 3 submitters, 4 peers of 2, 1, 3 and 4 slots,
300 jobs of 3 priorities and random lengths.

All 300 are queued on p1 while both of its slots are held by blockers, by three submitters, each in a
namespace of its own and a user of its own (LOGNAME). Then p2, p3 and p4 join and pull from p1 (each has
started one, by the jobs' own marks), and p1 is released. Each job marks where it ran (its own output);
its start and end are read from its record (`Jobs.rows`, what `gpulayer jobs --json` prints), in the
peers' clocks (one host: one clock).

Each submitter gets the same seeded random lengths (its k-th job of a priority lasts as long as the
others'): the queue shares turns, not measured time, so equal turns must then give equal slot-time.

What is asserted:
- every job ran exactly once (its marks), on the peer its record names, and succeeded;
- priorities, on every peer: no job J started on a peer P while a job K of higher priority waited on P.
  K waited on P from its submission to its start when P recorded it and ran it (it never moved: a job
  that stays where it was submitted waits there the whole time). A pulled job's arrival on its puller is
  not recorded, nor the moment a job left its owner for a puller, so those count as J (they must not
  start before a higher-priority job that waited on their peer) but not as K. Pulling keeps the order
  otherwise: an owner offers in its queue's order, and a puller pulls only with an empty queue (ADR 0019).
- fair share: for each priority, over the window from the first start of any of the 300 to the first
  moment one submitter had no job of that priority left waiting (the last start of its jobs of that
  priority), the slot-time of each submitter's jobs of that priority (their run time inside the window)
  is within 20% of each other submitter's (the largest at most 1.2 times the smallest).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

from lanlab import Host, lan_env
from support import wait_until

LAN_PEERS = 1
LAN_CONCURRENCY = 2  # p1: both slots held by blockers while everything is queued on it
PULLERS = {"p2": 1, "p3": 3, "p4": 4}
USERS = ("alice", "bob", "carol")
PRIORITIES = (0, 1, 2)
JOBS = 300
SEED = 28
SHORTEST_S, LONGEST_S = 0.05, 0.25
SHARE_TOLERANCE = 1.2

SCRIPT = """
import json, sys
from gpulayer.client import Client
from gpulayer.client.jobs import Jobs
from gpulayer.matching import Requirements

mode, key, marks, arg = sys.argv[1], sys.argv[2].encode(), sys.argv[3], json.loads(sys.argv[4])
client = Client(key=key, echo_output=False)
jobs = Jobs(client)
mark = f"touch {marks}/$GPULAYER_JOB_ID.$GPULAYER_PEER_NAME"
if mode == "block":  # [release, count]: jobs that hold p1's slots until `release` exists
    release, count = arg
    command = ["sh", "-c", f"{mark}; while [ ! -e {release} ]; do sleep 0.05; done"]
    ids = [jobs.submit(command, None, Requirements.build(accelerator="cpu", peer="p1")).id for _ in range(count)]
elif mode == "submit":  # [[priority, seconds], ...], in this order; each job is named by its length
    ids = [jobs.submit(["sh", "-c", f"{mark}; sleep {seconds}"], None, Requirements.build(accelerator="cpu"),
                       name=str(seconds), priority=priority).id for priority, seconds in arg]
else:  # "rows": wait for these jobs' ends, then every job's row
    for job_id in arg:
        jobs.job(job_id).wait(120)
    ids = jobs.rows()
print(json.dumps(ids))
client.close()
"""


def plan() -> list[tuple[int, float]]:
    """What each submitter submits, in order: (priority, seconds), the same seeded lengths for all."""
    rng = random.Random(SEED)
    priorities = [PRIORITIES[i % len(PRIORITIES)] for i in range(JOBS // len(USERS))]
    rng.shuffle(priorities)
    return [(priority, round(rng.uniform(SHORTEST_S, LONGEST_S), 3)) for priority in priorities]


def start(host: Host, key: str, marks: Path, mode: str, arg, user: str = "root") -> subprocess.Popen:
    """SCRIPT in `mode` on `host`, as `user` (LOGNAME: the queue's submitter is user@host)."""
    return host.popen([sys.executable, "-c", SCRIPT, mode, key, str(marks), json.dumps(arg)],
                      lan_env(key, LOGNAME=user), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def answer(proc: subprocess.Popen, timeout: float = 240.0) -> list:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def ran(marks: Path) -> list[tuple[str, str]]:
    """(job id, peer) of each run, from the marks the jobs left."""
    return [(path.stem, path.suffix[1:]) for path in marks.iterdir()]  # <job id>.<peer name>


def in_window(row: dict, start: float, end: float) -> float:
    return max(0.0, min(row["ended"], end) - max(row["started"], start))


def test_priorities_hold_on_every_peer_and_submitters_share_slot_time(lan, tmp_path):
    marks, release = tmp_path / "marks", tmp_path / "release"
    marks.mkdir()
    desk = lan.add_host("desk")
    blockers = answer(start(desk, lan.key, marks, "block", [str(release), LAN_CONCURRENCY]))
    wait_until(lambda: len(ran(marks)) == LAN_CONCURRENCY, 120)  # p1 has no free slot now
    work = plan()
    submitting = {user: start(lan.add_host(user), lan.key, marks, "submit", work, user) for user in USERS}
    submitted = {user: answer(proc) for user, proc in submitting.items()}
    pullers = [lan.start_peer(name, concurrency=slots, wait=False) for name, slots in PULLERS.items()]
    for peer in pullers:
        peer.wait_ready()
    wait_until(lambda: set(PULLERS) <= {peer for _, peer in ran(marks)}, 120)  # each pulled while p1 is held
    release.touch()
    ids = [job_id for user in USERS for job_id in submitted[user]]
    rows = {row["id"]: row for row in answer(start(desk, lan.key, marks, "rows", ids), timeout=300)}
    jobs = [rows[job_id] for job_id in ids]
    where = dict(ran(marks))
    assert Counter(job_id for job_id, _ in ran(marks)) == Counter(ids + blockers)  # each exactly once
    assert all(row["state"] == "succeeded" and row["peer"] == where[row["id"]] for row in jobs), \
        [row for row in jobs if row["state"] != "succeeded"][:5]
    assert [(row["user"], row["priority"], float(row["name"])) for row in jobs] == [
        (user, priority, seconds) for user in USERS for priority, seconds in work]

    for peer in ["p1", *PULLERS]:
        here = [row for row in jobs if row["peer"] == peer]
        stayed = [row for row in here if not row["moved"]]  # waited here from its submission to its start
        for job in here:
            overtaken = [k["id"] for k in stayed if k["priority"] > job["priority"]
                         and k["submitted"] < job["started"] < k["started"]]
            assert not overtaken, f"{job['id']} (priority {job['priority']}) started on {peer} before {overtaken}"

    first = min(row["started"] for row in jobs)
    for priority in PRIORITIES:
        mine = {user: [rows[i] for i in submitted[user] if rows[i]["priority"] == priority] for user in USERS}
        window_end = min(max(row["started"] for row in theirs) for theirs in mine.values())
        share = {user: sum(in_window(row, first, window_end) for row in theirs) for user, theirs in mine.items()}
        assert max(share.values()) <= SHARE_TOLERANCE * min(share.values()), (priority, share)
