"""The dashboard's picture of the cluster: it asks every known peer for its STATUS about once a second.

A submitter's Client finds the peers (mDNS, static peers, the cache) and holds the authenticated
connections; the Monitor polls each peer in a small thread pool (a slow peer never holds up the
others), checks the replies (status.py) and keeps, per peer, its latest view and a bounded
timeline of finished tasks. Peer times are moved to this machine's clock by the offset between
the peer's `now` and the moment its reply arrived.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..client import Client
from ..discovery import PeerRecord
from ..errors import GPULayerError
from .status import clean_status

POLL_THREADS = 16
TIMELINE_KEEP = 500  # finished tasks kept, over all peers
GONE_KEEP_S = 120.0  # a peer that left the directory is shown as down this long


@dataclass
class PeerView:
    """What the dashboard knows of one peer."""

    record: PeerRecord
    state: str = "unverified"  # up (its STATUS came over the authenticated channel), down, unverified
    error: str = ""
    status: dict[str, Any] = field(default_factory=dict)  # the checked STATUS (status.clean_status)
    offset: float = 0.0  # add to a peer time to get this machine's
    polled: float = 0.0  # when its last reply (or failure) came, this machine's time
    gone: float = 0.0  # when it left the directory (0: it is there)


class Monitor:
    """Polls the peers of `client` every `interval` seconds in the background; `snapshot` reads it."""

    def __init__(self, client: Client, interval: float = 1.0):
        self.client = client
        self.interval = interval
        self._views: dict[str, PeerView] = {}
        self._timeline: dict[tuple[str, str, str, float], dict[str, Any]] = {}
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(POLL_THREADS, thread_name_prefix="gpulayer-dashboard")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpulayer-dashboard-poll", daemon=True)

    def start(self) -> None:
        self.client.start()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def poll(self) -> None:
        """Ask every known peer that has no request in flight for its STATUS; note the ones gone."""
        now = time.time()
        records = {r.advert.peer_id: r for r in self.client.directory.records()}
        with self._lock:
            for peer_id, view in list(self._views.items()):
                if peer_id not in records and not view.gone:
                    view.gone, view.state, view.error = now, "down", "left the cluster"
                if view.gone and now - view.gone > GONE_KEEP_S:
                    del self._views[peer_id]
            for peer_id, record in records.items():
                view = self._views.setdefault(peer_id, PeerView(record))
                view.record, view.gone = record, 0.0
                if peer_id not in self._in_flight:
                    self._in_flight.add(peer_id)
                    self._pool.submit(self._poll_one, record)

    def _poll_one(self, record: PeerRecord) -> None:
        peer_id = record.advert.peer_id
        try:
            reply: Any = self.client.status(record)
            error = ""
        except (OSError, GPULayerError) as exc:
            reply, error = None, str(exc)
        arrived = time.time()
        with self._lock:
            self._in_flight.discard(peer_id)
            view = self._views.get(peer_id)
            if view is None or view.gone:
                return
            view.polled = arrived
            if reply is None:
                verified = record.verified or record.source == "static"
                view.state, view.error = ("down" if verified else "unverified"), error
                return
            view.status = clean_status(reply)
            view.offset = arrived - view.status["now"] if view.status["now"] is not None else 0.0
            view.state, view.error = "up", ""
            self._merge(record, view)

    def _merge(self, record: PeerRecord, view: PeerView) -> None:
        """Add the peer's finished tasks to the timeline (each once), keeping the newest TIMELINE_KEEP."""
        for task in view.status["finished"]:
            key = (record.advert.peer_id, task["device"], task["name"], task["start"])
            self._timeline.setdefault(key, {**task, "peer": record.advert.name, "peer_id": record.advert.peer_id,
                                            "start": task["start"] + view.offset, "end": task["end"] + view.offset})
        if len(self._timeline) > TIMELINE_KEEP:
            newest = sorted(self._timeline.items(), key=lambda kv: kv[1]["end"])[-TIMELINE_KEEP:]
            self._timeline = dict(newest)

    # ---- what the API serves --------------------------------------------------------------------

    def peers(self) -> list[dict[str, Any]]:
        """One row per peer, by name."""
        with self._lock:
            return sorted((_peer_row(v) for v in self._views.values()), key=lambda r: (r["name"], r["peer_id"]))

    def tasks(self) -> dict[str, Any]:
        """Running tasks and actors, finished tasks (oldest first), refusals and jobs, in this machine's time."""
        now = time.time()
        with self._lock:
            running, refusals, jobs = [], [], []
            for view in self._views.values():
                if view.state != "up":
                    continue
                where = {"peer": view.record.advert.name, "peer_id": view.record.advert.peer_id}
                for task in view.status["running"]:
                    start = task["start"] + view.offset
                    running.append({**task, **where, "kind": "task", "start": start,
                                    "elapsed_s": round(max(now - start, 0.0), 3)})
                running += [{**actor, **where, "kind": "actor"} for actor in view.status["actors"]]
                refusals += [{**r, **where, "t": r["t"] + view.offset} for r in view.status["refusals"]]
                jobs += [_job_row(job, where, view.offset, now) for job in view.status["jobs"]]
            finished = sorted(self._timeline.values(), key=lambda t: t["end"])
        return {"now": now, "running": running, "finished": finished,
                "refusals": sorted(refusals, key=lambda r: r["t"]), "jobs": sorted(jobs, key=lambda j: j["submitted"]),
                "submitter_refusals": self.client.placement.refusal_reasons()}

    def trace(self) -> dict[str, Any]:
        """The finished and running tasks as Chrome trace JSON (Perfetto, chrome://tracing): a process
        per peer, a thread per device."""
        tasks = self.tasks()
        now = tasks["now"]
        peers = sorted({t["peer_id"]: t["peer"] for t in tasks["finished"] + tasks["running"]}.items())
        pids = {peer_id: i + 1 for i, (peer_id, _) in enumerate(peers)}
        lanes: dict[tuple[str, str], int] = {}
        events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pids[p], "tid": 0,
                                         "args": {"name": name}} for p, name in peers]
        for task in tasks["finished"] + [t for t in tasks["running"] if t["kind"] == "task"]:
            lane = (task["peer_id"], task["device"])
            if lane not in lanes:
                lanes[lane] = len(lanes) + 1
                events.append({"name": "thread_name", "ph": "M", "pid": pids[lane[0]], "tid": lanes[lane],
                               "args": {"name": task["device"] or "?"}})
            end = task.get("end", now)
            events.append({"name": task["name"], "cat": "task", "ph": "X", "pid": pids[lane[0]], "tid": lanes[lane],
                           "ts": round(task["start"] * 1e6), "dur": round(max(end - task["start"], 0.0) * 1e6),
                           "args": {"submitter": task["submitter"], "outcome": task.get("outcome", "running")}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def _job_row(job: dict[str, Any], where: dict[str, str], offset: float, now: float) -> dict[str, Any]:
    """A job of a peer's STATUS in this machine's time, with how long it ran (or has run)."""
    moved = {k: job[k] + offset if job[k] is not None else None for k in ("submitted", "started", "ended")}
    started, ended = moved["started"], moved["ended"] or now
    elapsed = round(max(ended - started, 0.0), 3) if started is not None else None
    return {**job, **moved, **where, "elapsed_s": elapsed}


def _peer_row(view: PeerView) -> dict[str, Any]:
    a, s = view.record.advert, view.status
    util = s.get("util") if view.state == "up" else None
    measured = {g["index"]: g for g in (util or {}).get("gpus", [])}
    devices = []
    for index, total in enumerate(a.device_memory_gb):
        gpu = measured.get(index, {})
        used = gpu.get("memory_used_gb")
        if a.memory_kind == "unified":
            free = util["ram_available_gb"] if util else None
        else:
            free = None if used is None else max(total - used, 0.0)
        devices.append({"index": index, "total_gb": total, "used_gb": used, "free_gb": free,
                        "unreserved_gb": s.get("unreserved_gb", {}).get(f"{a.accelerator}:{index}"),
                        "util_percent": gpu.get("util_percent")})
    return {"name": a.name, "peer_id": a.peer_id, "address": view.record.address, "source": view.record.source,
            "accelerator": a.accelerator, "device": a.device_name, "memory_kind": a.memory_kind,
            "devices": devices, "ram_gb": a.ram_gb, "python": a.python, "frameworks": dict(a.frameworks),
            "slots": a.slots, "busy": s.get("busy"), "queued": s.get("queued"), "done": s.get("done"),
            "draining": s.get("draining", False), "state": view.state, "error": view.error,
            "held_bytes": s.get("held_bytes", 0), "held": s.get("held", 0),
            "job_isolation": s.get("job_isolation"), "job_isolation_reason": s.get("job_isolation_reason", ""),
            "cpu_percent": util["cpu_percent"] if util else None,
            "ram_available_gb": util["ram_available_gb"] if util else None,
            "util_source": util["source"] if util else None,
            "util_age_s": round(max(time.time() - (util["t"] + view.offset), 0.0), 3) if util else None}
