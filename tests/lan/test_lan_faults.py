"""Hosts that die or fall off the network mid-task, across the bridge.

zeroconf keeps listing a peer that died without a goodbye for about 19 minutes, so these
faults are found by GPUlayer's own liveness: a reset socket (kill -9), or the heartbeat (a cut
link: nothing comes back, so 3 silent intervals). Each task leaves a start and an end marker
per run (lan_tasks.marked), so that runs that began, runs that completed, and results delivered
can be told apart: every item must be delivered exactly once, correct.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from lanlab import runs
from support import wait_until
from gpulayer.transport import sockets


LAN_PEERS = 3
HEARTBEAT = 1.0
# 3 silent intervals, plus up to one more for the heartbeat thread's tick, plus slack for a busy 2-CPU box
DETECTION_BOUND = 4 * HEARTBEAT + 1.5
UPLOAD_WAIT = sockets.USER_TIMEOUT_MS / 1000 / 2  # 15 s: see the upload test



def started_on(folder: Path, peer: str) -> set[int]:
    return {r["item"] for r in runs(folder) if r["peer"] == peer and r["kind"] == "start"}


def check_exactly_once(outcomes: dict, items: list[int], folder: Path) -> dict:
    """Every item delivered once, correct, from a run that completed; returns counts for the report."""
    delivered = Counter()
    for tag, out in outcomes.items():
        assert out is not None and out["ok"], (tag, out)
        x, square, peer, token = out["value"]
        assert square == x * x
        delivered[x] += 1
        ends = [r for r in runs(folder) if r["token"] == token and r["kind"] == "end"]
        assert len(ends) == 1 and ends[0]["peer"] == peer and ends[0]["item"] == x, (x, token, ends)
    assert sorted(delivered) == sorted(items) and set(delivered.values()) == {1}, delivered
    all_runs = runs(folder)
    completed = Counter(r["item"] for r in all_runs if r["kind"] == "end" and r["item"] in items)
    begun = Counter(r["item"] for r in all_runs if r["kind"] == "start" and r["item"] in items)
    return {"delivered": sum(delivered.values()), "runs_begun": sum(begun.values()),
            "runs_completed": sum(completed.values()),
            "orphan_runs_completed": sum(completed.values()) - len(items)}


def busy_victim(lan, name: str, marks: Path, seconds: float):
    """A new peer busy with its share of 8 tasks: one pinned to it without retries (it must fail
    with PeerLost) and 7 free ones with retries=1 that fill the 8 slots, some of them on it."""
    victim = lan.start_peer(name, concurrency=2)
    agent = lan.submitter(f"{name}-sub", heartbeat=HEARTBEAT)
    assert agent.call("wait_names", present=[*lan.names, victim.name], timeout=10)["ok"]
    marks.mkdir()
    agent.call("submit", tag="pinned", fn="marked", args=[-1, 30, str(marks)], peer=victim.name)
    items = list(range(7))
    for i in items:
        agent.call("submit", tag=f"t{i}", fn="marked", args=[i, seconds, str(marks)], retries=1)
    placed = agent.call("where", tags=[f"t{i}" for i in items])["peers"]
    on_victim = {int(tag[1:]) for tag, peer in placed.items() if peer == victim.name}
    assert on_victim, placed
    wait_until(lambda: started_on(marks, victim.name) >= {-1, *on_victim}, 15)
    return victim, agent, items, on_victim


def test_kill_9_of_a_peer_mid_task_gives_peer_lost_and_retries_elsewhere_exactly_once(lan, reliability, tmp_path):
    marks = tmp_path / "marks"
    victim, agent, items, on_victim = busy_victim(lan, "victim-kill", marks, 3.0)

    killed_at = time.monotonic()
    victim.kill()  # the peer and its workers: the machine is gone, no goodbye
    pinned = agent.call("wait", tags=["pinned"], timeout=30)["outcomes"]["pinned"]
    assert pinned is not None and pinned["error"] == "PeerLost", pinned
    detection = pinned["t"] - killed_at
    assert detection < DETECTION_BOUND, detection

    outcomes = agent.call("wait", tags=[f"t{i}" for i in items], timeout=60)["outcomes"]
    counts = check_exactly_once(outcomes, items, marks)
    assert all(outcomes[f"t{i}"]["peer"] != victim.name for i in on_victim)
    assert counts["orphan_runs_completed"] == 0  # the killed runs never finished
    assert not any(r["kind"] == "end" and r["peer"] == victim.name for r in runs(marks))

    # zeroconf still lists the dead peer (no goodbye was sent), but GPUlayer sends it nothing
    records = {r["name"]: r for r in agent.call("names")["records"]}
    still_listed = victim.name in records
    out = agent.call("map", fn="where", items=list(range(40)), reply_timeout=180)
    assert out["ok"] and victim.name not in out["results"], out
    reliability.record("kill_9_mid_task", faults_injected={"kill_9": 1}, detection_s=round(detection, 4),
                       detection_bound_s=DETECTION_BOUND, heartbeat_s=HEARTBEAT,
                       moved_by_retry=len(on_victim), still_listed_by_zeroconf=still_listed,
                       tasks_completed=len(items) + 40, duplicates=0, lost=0, **counts)


def test_a_cut_link_mid_task_gives_peer_lost_then_the_peer_is_rediscovered(lan, reliability, tmp_path):
    marks = tmp_path / "marks"
    victim, agent, items, on_victim = busy_victim(lan, "victim-cut", marks, 2 * DETECTION_BOUND)

    cut_at = time.monotonic()
    victim.host.link_down()
    try:
        pinned = agent.call("wait", tags=["pinned"], timeout=30)["outcomes"]["pinned"]
        assert pinned is not None and pinned["error"] == "PeerLost", pinned
        detection = pinned["t"] - cut_at
        assert detection < DETECTION_BOUND, detection
        assert victim.alive()  # it is only unreachable
        # its other tasks, lost with it, were given to other peers (the retries run in the background)
        wait_until(lambda: victim.name not in agent.call("where", tags=[f"t{i}" for i in on_victim])["peers"].values(),
                 5)
    finally:
        restored_at = time.monotonic()
        victim.host.link_up()

    # the same submitter uses it again, and a newcomer finds it over mDNS
    again = agent.call("run_until", fn="where", peer=victim.name, timeout=30)
    assert again["ok"] and again["value"] == victim.name, again
    reused = again["t"] - restored_at  # the client skips a lost peer for a few seconds (DOWN_BACKOFF)
    assert reused < 15, again
    newcomer = lan.submitter("after-cut")
    found = newcomer.call("wait_names", present=[victim.name], up=True, timeout=10)
    assert found["ok"], found
    assert newcomer.call("run", fn="where", peer=victim.name)["value"] == victim.name

    outcomes = agent.call("wait", tags=[f"t{i}" for i in items], timeout=60)["outcomes"]
    counts = check_exactly_once(outcomes, items, marks)
    assert all(outcomes[f"t{i}"]["peer"] != victim.name for i in on_victim)
    reliability.record("link_cut_mid_task", faults_injected={"link_down": 1}, detection_s=round(detection, 4),
                       detection_bound_s=DETECTION_BOUND, heartbeat_s=HEARTBEAT, moved_by_retry=len(on_victim),
                       reused_after_restore_s=round(reused, 4), reuse_attempts=again["attempts"],
                       newcomer_found_s=round(found["elapsed"], 4),
                       tasks_completed=len(items) + 2, duplicates=0, lost=0, **counts)


def queued_to(host, ip: str) -> int:
    """Bytes that `host` has sent over TCP to `ip` and that are not acknowledged yet (ss's Send-Q)."""
    out = host.run(["ss", "-tnH", "state", "established", "dst", ip], timeout=10).stdout
    return sum(int(line.split()[1]) for line in out.splitlines() if line.strip())


def test_a_link_cut_during_a_large_upload_is_detected_and_other_peers_stay_watched(lan, reliability, tmp_path):
    """A peer cut off while a big argument is being sent to it.

    The send blocks once the socket's buffer is full (nothing is acknowledged), so the client
    must not let that send hold up its heartbeat: the upload and, above all, the other peers'
    liveness checks must still end in PeerLost.
    """
    victim = lan.start_peer("victim-upload", concurrency=1)
    other = lan.start_peer("other-upload", concurrency=1)
    agent = lan.submitter("upload-sub", heartbeat=HEARTBEAT)
    assert agent.call("wait_names", present=[victim.name, other.name], timeout=10)["ok"]
    for peer in (victim, other):  # connected and authenticated to both
        assert agent.call("run", fn="where", peer=peer.name)["value"] == peer.name
    marks = tmp_path / "marks"
    marks.mkdir()
    agent.call("submit", tag="long", fn="marked", args=[0, 60, str(marks)], peer=other.name)
    wait_until(lambda: 0 in started_on(marks, other.name), 15)  # a task in flight: its silence counts
    victim.host.link_down()
    cut_at = time.monotonic()
    try:
        agent.call("submit", tag="upload", fn="length", blob_mb=64, peer=victim.name, background=True)
        # the upload is stuck: its bytes wait in the socket's buffer, unacknowledged (more than pings would be)
        wait_until(lambda: queued_to(agent.host, victim.host.ip) > 8 << 10, 15)
        other.host.link_down()  # a second fault, on a peer the client must still be watching
        other_cut_at = time.monotonic()
        # each is found lost about 3 s after its cut, 3 silent heartbeats (bench/results/reliability.json,
        # link_cut_during_upload: 2.9 s and 3.5 s). The wait's timeout stays under the kernel's own backstop
        # (TCP_USER_TIMEOUT, 30 s), which ends the stuck send and so frees a heartbeat held up by it: a
        # heartbeat closing the cut connection only once its send ended was seen at 30.6 s
        waited = agent.call("wait", tags=["long", "upload"], timeout=UPLOAD_WAIT)
        stacks = agent.call("stacks")["stacks"]
        stuck = "\n".join(f"--- {name}\n{stack}" for name, stack in stacks.items()
                          if "heartbeat" in name or "send" in stack)
    finally:
        victim.host.link_up()
        other.host.link_up()
    upload, long = waited["outcomes"]["upload"], waited["outcomes"]["long"]
    reliability.record("link_cut_during_upload", faults_injected={"link_down": 2},
                       upload_detected_s=round(upload["t"] - cut_at, 3) if upload else None,
                       other_peer_detected_s=round(long["t"] - other_cut_at, 3) if long else None,
                       detection_bound_s=DETECTION_BOUND, heartbeat_s=HEARTBEAT)
    assert long is not None, f"the heartbeat stopped: a cut link to another peer went unnoticed\n{stuck}"
    assert long["error"] == "PeerLost", long
    assert upload is not None, f"a submit to a cut-off peer blocked past the heartbeat\n{stuck}"
    assert upload["error"] == "PeerLost", upload
