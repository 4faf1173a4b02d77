"""Scale measurements on a LAN of namespaces (lanlab.py): what test_lan_scale.py checks and bench/scale.py plots.

- `ScaleLan`: N peers with real mDNS, `per_host` of them in each namespace, each with its own
  slots and speed (LAN_SCALE_SLOWDOWN, read by lan_scale_tasks.work).
- `discovery`: a fresh submitter process until it lists every peer, and until its first result.
- `MdnsCapture`: the mDNS packets reaching a silent observer namespace on the bridge.
- `throughput`: gl.map over the peers, trivial and 10 ms tasks, and the submitter's threads,
  descriptors and memory afterwards.
- `fairness`: several submitters at once over heterogeneous peers: makespan against the ideal,
  idle slots while work waits, and each submitter's share.
Every loop here is bounded in count and time.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lanlab import HERE, Agent, Host, Lan, LanPeer, lan_env
from support import new_key

SCALE_AGENT = HERE / "lan_scale_agent.py"
CAPTURE = HERE / "lan_mdns_capture.py"
STARTUP_WAVE = 4  # peers started at once: each probes its interpreter (importing torch), a few seconds of CPU


@dataclass(frozen=True)
class PeerSpec:
    name: str
    slots: int = 1
    slowdown: float = 1.0


class ScaleLan:
    """One bridge, N peers (`per_host` to a namespace) and the submitters' namespaces; `close()` removes all."""

    def __init__(self, workdir: Path, specs: list[PeerSpec], per_host: int = 1):
        self.net = Lan(workdir)
        self.key = new_key()
        self.specs = {s.name: s for s in specs}
        self.peers: list[LanPeer] = []
        try:
            hosts = [self.net.add_host(f"h{i}") for i in range((len(specs) + per_host - 1) // per_host)]
            for start in range(0, len(specs), STARTUP_WAVE):  # machines of a LAN do not share two vCPUs
                wave = [self.start_peer(spec, hosts[i // per_host], wait=False)
                        for i, spec in enumerate(specs[start:start + STARTUP_WAVE], start)]
                for peer in wave:
                    peer.wait_ready(180)
                self.peers.extend(wave)
        except BaseException:
            self.close()
            raise

    def start_peer(self, spec: PeerSpec, host: Host | None = None, wait: bool = True) -> LanPeer:
        host = host or self.net.add_host(spec.name)
        peer = host.start_peer(spec.name, self.key, spec.slots, {"LAN_SCALE_SLOWDOWN": str(spec.slowdown)})
        return peer.wait_ready(120) if wait else peer

    def submitter(self, label: str) -> Agent:
        """A fresh submitter process (lan_scale_agent.py) in a namespace of its own."""
        return self.net.add_host(label).agent(self.key, name=label, script=SCALE_AGENT)

    @property
    def capacity(self) -> float:
        """Task-seconds of unit work done per second by all the peers."""
        return sum(s.slots / s.slowdown for s in self.specs.values())

    def close(self) -> None:
        self.net.close()


# ---- discovery ------------------------------------------------------------------------------------

def discovery(lan: ScaleLan, label: str) -> tuple[Agent, dict]:
    """A fresh submitter: seconds from its spawn until it lists every peer, and until its first result."""
    spawned = time.monotonic()
    agent = lan.submitter(label)
    reply = agent.call("discover", count=len(lan.peers), timeout=60.0)
    assert reply["ok"], reply
    base = reply["started"] - spawned  # interpreter start-up before the agent's first line
    return agent, {"seen_s": base + reply["seen"], "first_result_s": base + reply["first_result"],
                   "listed": reply["listed"]}


# ---- mDNS traffic -----------------------------------------------------------------------------------

class MdnsCapture:
    """lan_mdns_capture.py in a silent namespace of its own, for `seconds`."""

    def __init__(self, lan: ScaleLan, seconds: float, label: str = "observer"):
        host = lan.net.add_host(label)
        self.proc = host.popen([sys.executable, str(CAPTURE), "--seconds", str(seconds)], lan_env(None),
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.seconds = seconds
        line = self.proc.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError("the mDNS capture did not start")

    def packets(self) -> list[tuple[float, int]]:
        """Wait for the end of the capture: (arrival time, bytes) of each mDNS packet."""
        line = self.proc.stdout.readline()
        self.proc.wait(30)
        return [(t, n) for t, n in json.loads(line)["packets"]]


def window(packets: list[tuple[float, int]], start: float, end: float) -> dict:
    """Packets and bytes in [start, end), and per minute."""
    inside = [n for t, n in packets if start <= t < end]
    minutes = (end - start) / 60
    return {"packets": len(inside), "bytes": sum(inside), "seconds": round(end - start, 2),
            "packets_per_min": len(inside) / minutes, "bytes_per_min": sum(inside) / minutes}


def mdns_traffic(lan: ScaleLan, idle_s: float, change_s: float) -> dict:
    """The bridge's mDNS traffic: N idle peers (and one idle browsing submitter), then one peer joins, then leaves.

    A submitter browses throughout (it is what reacts to a change). Each change gets `change_s`
    seconds; what it costs is the packets in its window less the idle rate over that window.
    """
    browser, _ = discovery(lan, "mdns-browser")
    time.sleep(3.0)  # the browser's first queries and their answers are over
    capture = MdnsCapture(lan, idle_s + 2 * change_s + 15)
    t0 = time.monotonic()
    time.sleep(idle_s)
    joined = time.monotonic()
    newcomer = lan.start_peer(PeerSpec("joiner"), wait=False)
    newcomer.wait_ready(120)
    assert browser.call("discover", count=len(lan.peers) + 1, timeout=30.0)["ok"]
    time.sleep(max(0.0, joined + change_s - time.monotonic()))
    left = time.monotonic()
    newcomer.stop(timeout=20)
    time.sleep(change_s)
    packets = capture.packets()
    idle = window(packets, t0, joined)
    join, leave = window(packets, joined, left), window(packets, left, left + change_s)
    browser.close()
    for change in (join, leave):
        change["above_idle"] = change["packets"] - idle["packets_per_min"] * change["seconds"] / 60
    return {"idle": idle, "join": join, "leave": leave}


# ---- throughput and the submitter's footprint ---------------------------------------------------------

def throughput(agent: Agent, tasks: int, rounds: int) -> dict:
    """gl.map of `tasks` trivial and of `tasks` 10 ms tasks, interleaved for `rounds`: tasks/s, median and range."""
    agent.call("map", fn="trivial", items=list(range(tasks)), reply_timeout=300)  # warm: every peer, every worker
    rates: dict[str, list[float]] = {"trivial": [], "10ms": []}
    for _ in range(rounds):
        for kind, fn, items in (("trivial", "trivial", list(range(tasks))), ("10ms", "pause", [0.01] * tasks)):
            reply = agent.call("map", fn=fn, items=items, reply_timeout=300)
            rates[kind].append(tasks / (reply["ended"] - reply["started"]))
    return {kind: {"tasks_per_s": statistics.median(r), "range": [min(r), max(r)], "tasks": tasks, "rounds": rounds}
            for kind, r in rates.items()}


# ---- fairness ----------------------------------------------------------------------------------------------

def task_lengths(count: int, seed: int, low: float = 0.01, high: float = 1.0) -> list[float]:
    """`count` task lengths spread evenly over [low, high] (seconds at unit speed), shuffled by `seed`."""
    lengths = [low + (high - low) * (i + 0.5) / count for i in range(count)]
    random.Random(seed).shuffle(lengths)
    return lengths


def fairness(lan: ScaleLan, submitters: int, tasks_each: int, label: str = "fair") -> dict:
    """`submitters` processes each gl.map the same work (in its own order) at once over the peers."""
    agents = [lan.submitter(f"{label}{i}") for i in range(submitters)]
    try:
        slots = sum(s.slots for s in lan.specs.values())
        for agent in agents:
            assert agent.call("discover", count=len(lan.peers), timeout=60.0)["ok"]
        for agent in agents:  # warm: connected to every peer, the function loaded in the workers
            agent.call("map", fn="work", items=[0.0] * (4 * slots), reply_timeout=120)
        work = [task_lengths(tasks_each, seed) for seed in range(submitters)]
        for agent, lengths in zip(agents, work):
            agent.send("map", fn="work", items=lengths)
        replies = [agent.reply(600) for agent in agents]
    finally:
        for agent in agents:
            agent.close()
    return analyse(lan, work, replies)


def analyse(lan: ScaleLan, work: list[list[float]], replies: list[dict]) -> dict:
    """Makespan against the ideal, idle slot time while tasks waited, and each submitter's share of the work."""
    start = max(r["started"] for r in replies)  # every submitter has its work out
    end = max(r["ended"] for r in replies)
    ideal = sum(map(sum, work)) / lan.capacity
    runs = [(length, *run) for lengths, r in zip(work, replies) for length, run in zip(lengths, r["results"])]
    last_start = max(run[3] for run in runs)  # until then some task waited (at a peer, or in a submitter)
    busy: dict[str, float] = {}
    for _, peer, _pid, t0, t1 in runs:
        busy[peer] = busy.get(peer, 0.0) + max(0.0, min(t1, last_start) - max(t0, start))
    waiting = max(1e-9, last_start - start)
    idle = {peer: 1 - busy.get(peer, 0.0) / (spec.slots * waiting) for peer, spec in lan.specs.items()}
    common = min(r["ended"] for r in replies)  # every submitter still had work until then
    shares = []
    for lengths, r in zip(work, replies):
        done = 0.0
        for length, (_, _, t0, t1) in zip(lengths, r["results"]):
            done += length * min(1.0, max(0.0, (common - t0) / max(t1 - t0, 1e-9)))
        shares.append(done)
    slot_total = sum(s.slots for s in lan.specs.values())
    return {
        "submitters": len(replies), "tasks_each": len(work[0]), "work_s": sum(map(sum, work)),
        "capacity": lan.capacity, "ideal_s": ideal, "makespan_s": end - start,
        "makespan_over_ideal": (end - start) / ideal,
        "idle_while_waiting": sum(idle[p] * lan.specs[p].slots for p in idle) / slot_total,
        "idle_while_waiting_per_peer": idle, "waiting_s": waiting,
        "shares": shares, "share_spread": max(shares) / max(min(shares), 1e-9),
        "finish_s": [r["ended"] - start for r in replies],
        "tasks_per_peer": {p: sum(run[1] == p for run in runs) for p in lan.specs},
        "timeline": [[peer, i, round(t0 - start, 4), round(t1 - start, 4)]  # [peer, submitter, start, end]
                     for i, r in enumerate(replies) for peer, _, t0, t1 in r["results"]],
        "mean_slowdown": [statistics.mean(lan.specs[run[0]].slowdown for run in r["results"]) for r in replies],
    }
