"""Load across hosts: 4 submitter processes, each in its own namespace, send 10,000 small tasks
to 3 peers found over mDNS. Every result comes back correct exactly once, no peer runs more
tasks at once than its slots, and the peers' memory stays bounded."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

from lanlab import BackgroundSampler

LAN_PEERS = 3
LAN_CONCURRENCY = 2
SUBMITTERS = 4
TASKS = 10_000
PAUSE = 0.001  # each task sleeps 1 ms, so that tasks overlapping on a peer would show
RSS_GROWTH_BOUND = 96 << 20


class Sampler(BackgroundSampler):
    """Peak resident memory of each peer daemon (and of its workers), sampled every 50 ms."""

    interval = 0.05

    def __init__(self, peers):
        super().__init__()
        self.peers = peers
        self.base = {p.name: p.rss() for p in peers}
        self.peak = dict(self.base)
        self.worker_peak = {p.name: 0 for p in peers}
        self.max_workers = {p.name: 0 for p in peers}
        self.samples = 0

    def sample(self) -> None:
        import psutil

        for peer in self.peers:
            self.peak[peer.name] = max(self.peak[peer.name], peer.rss())
            total = 0
            workers = peer.workers()
            for pid in workers:
                try:
                    total += psutil.Process(pid).memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            self.worker_peak[peer.name] = max(self.worker_peak[peer.name], total)
            self.max_workers[peer.name] = max(self.max_workers[peer.name], len(workers))
        self.samples += 1


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda ev: (ev[0], ev[1]))
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def test_four_submitters_ten_thousand_tasks_three_peers(lan, reliability):
    agents = [lan.submitter(f"load{i}") for i in range(SUBMITTERS)]
    monitor = lan.submitter("monitor")
    for agent in [*agents, monitor]:
        assert agent.call("wait_names", present=lan.names, timeout=10)["ok"]
    # warm: every submitter connected to every peer, every worker has loaded the function once
    for agent in agents:
        assert agent.call("map", fn="square_where", items=list(range(24)), extra=[0], reply_timeout=60)["ok"]
    share = TASKS // SUBMITTERS
    batches = [list(range(i * share, (i + 1) * share)) for i in range(SUBMITTERS)]

    monitor.call("monitor_start", interval=0.1)
    with Sampler(lan.peers) as sampler:
        started = time.monotonic()
        for agent, items in zip(agents, batches):
            agent.send("map", fn="square_where", items=items, extra=[PAUSE])
        replies = [agent.reply(300) for agent in agents]
        wall = time.monotonic() - started
    seen = monitor.call("monitor_stop")["seen"]

    delivered = Counter()
    per_peer = defaultdict(list)
    pids = defaultdict(set)
    for reply, items in zip(replies, batches):
        assert reply["ok"], reply
        results = reply["results"]
        assert [r[0] for r in results] == items  # in order, one per item
        for x, square, peer, pid, start, end in results:
            assert square == x * x
            delivered[x] += 1
            per_peer[peer].append((start, end))
            pids[peer].add(pid)
    assert len(delivered) == TASKS and set(delivered.values()) == {1}
    duplicates = sum(n - 1 for n in delivered.values())
    lost = TASKS - len(delivered)

    slots = {p.name: p.concurrency for p in lan.peers}
    overlap = {peer: max_overlap(iv) for peer, iv in per_peer.items()}
    assert set(per_peer) == set(slots)  # all three peers worked
    for peer, n in overlap.items():
        assert n <= slots[peer], (peer, n)  # never more tasks at once than slots
        assert len(pids[peer]) <= slots[peer], (peer, pids[peer])  # one warm worker per slot, no more
    for peer, entry in seen["peers"].items():
        assert entry["max_busy"] <= entry["slots"] == slots[peer], (peer, entry)  # as the peer itself reports
    assert seen["polls"] > 10, seen
    for peer in lan.peers:
        assert peer.alive()
        growth = sampler.peak[peer.name] - sampler.base[peer.name]
        assert growth < RSS_GROWTH_BOUND, (peer.name, sampler.base[peer.name], sampler.peak[peer.name])

    mib = 1 << 20
    reliability.record(
        "load_4_submitters", submitters=SUBMITTERS, peers=len(lan.peers), slots_per_peer=LAN_CONCURRENCY,
        tasks=TASKS, tasks_completed=len(delivered), duplicates=duplicates, lost=lost,
        wall_s=round(wall, 2), tasks_per_s=round(TASKS / wall, 1),
        per_peer_tasks={peer: len(iv) for peer, iv in sorted(per_peer.items())},
        max_concurrent_runs_per_peer=dict(sorted(overlap.items())),
        max_busy_reported={peer: e["max_busy"] for peer, e in sorted(seen["peers"].items())},
        max_queued_reported={peer: e["max_queued"] for peer, e in sorted(seen["peers"].items())},
        status_polls=seen["polls"],
        peer_rss_base_mib={k: round(v / mib, 1) for k, v in sorted(sampler.base.items())},
        peer_rss_peak_mib={k: round(v / mib, 1) for k, v in sorted(sampler.peak.items())},
        worker_rss_peak_mib={k: round(v / mib, 1) for k, v in sorted(sampler.worker_peak.items())},
        rss_samples=sampler.samples)
