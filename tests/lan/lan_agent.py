"""A submitter that the LAN tests drive from outside its namespace: one JSON request a line on
stdin, one JSON reply a line on stdout (replies carry "t", this process's time.monotonic()).

Run inside a namespace as `ip netns exec NS python tests/lan/lan_agent.py`, with GPULAYER_KEY
in the environment and nothing else configured: discovery is real mDNS on the namespace's
interfaces. Requests name a function of lan_tasks.py; see the op_* methods.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lan_tasks  # noqa: E402
from lanserve import serve  # noqa: E402

import gpulayer as gl  # noqa: E402
from gpulayer.matching import Requirements  # noqa: E402

MAX_LOOP_SECONDS = 300.0


def outcome(future, t_done: float) -> dict:
    exc = future.exception(0) if not future.cancelled() else None
    out = {"t": t_done, "peer": future.peer}
    if future.cancelled():
        out.update(ok=False, error="CancelledError", message="")
    elif exc is not None:
        out.update(ok=False, error=type(exc).__name__, message=str(exc)[:2000])
    else:
        out.update(ok=True, value=future.result(0))
    return out


class Agent:
    def __init__(self):
        self.client = None
        self.futures: dict[str, object] = {}
        self.outcomes: dict[str, dict] = {}
        self.done = threading.Condition()
        self.loop_thread: threading.Thread | None = None
        self.loop_stop = threading.Event()
        self.loop_stats: dict = {}

    # ---- set-up and discovery ----------------------------------------------------------------------

    def op_configure(self, key=None, mdns=True, peers=None, heartbeat=None, discovery_timeout=None, start=True,
                     leases=None):
        """gl.configure(): with no arguments, everything comes from the environment (the key only)."""
        options = {"echo_output": False}
        if key is not None:
            options["key"] = key.encode()
        if not mdns:
            options["mdns"] = False
        if peers is not None:
            options["peers"] = peers
        if heartbeat is not None:
            options["heartbeat"] = heartbeat
        if discovery_timeout is not None:
            options["discovery_timeout"] = discovery_timeout
        if leases is not None:
            options["leases"] = leases
        self.client = gl.configure(**options)
        self.goodbyes = []
        check = self.client.pool._on_goodbye  # mDNS goodbyes that the directory passed on to be checked

        def on_goodbye(record, check=check):
            self.goodbyes.append(record.advert.name)
            check(record)

        self.client.pool._on_goodbye = on_goodbye  # before start(), which hands it to the browser
        if start:
            self.client.start()
        return {"submitter_id": self.client.submitter_id, "cluster": self.client.cluster}

    def records(self) -> list[dict]:
        return [{"name": r.advert.name, "peer_id": r.advert.peer_id, "cluster": r.advert.cluster, "up": r.up,
                 "source": r.source, "address": r.address, "error": r.error, "slots": r.advert.slots,
                 "verified": r.verified} for r in self.client.directory.records()]

    def op_heard(self):
        """The service names whose PTR records this submitter's mDNS cache holds (what the browser heard)."""
        from gpulayer.discovery import SERVICE_TYPE

        browser = self.client.pool._browser
        if browser is None:
            return {"names": []}
        return {"names": sorted({r.alias for r in browser.zc.cache.get_all_by_details(SERVICE_TYPE, 12, 1)})}

    def op_goodbyes(self):
        """The names of the verified or static peers whose mDNS goodbyes were checked with the peer."""
        return {"names": list(self.goodbyes)}

    def op_watch_names(self, names, seconds=3.0, interval=0.05):
        """Sample the directory for `seconds`: how often each of `names` was missing or down, and its addresses."""
        missing = {n: 0 for n in names}
        addresses = {n: set() for n in names}
        samples = 0
        deadline = time.monotonic() + min(seconds, MAX_LOOP_SECONDS)
        while time.monotonic() < deadline:
            listed = {r.advert.name: r for r in self.client.directory.records()}
            samples += 1
            for n in names:
                if n not in listed or not listed[n].up:
                    missing[n] += 1
                else:
                    addresses[n].add(listed[n].address)
            time.sleep(interval)
        return {"samples": samples, "missing": missing, "addresses": {n: sorted(a) for n, a in addresses.items()},
                "records": self.records()}

    def op_names(self):
        return {"records": self.records()}

    def op_wait_names(self, present=(), absent=(), timeout=10.0, up=False):
        """Wait until every name in `present` is listed (and up, with up=True) and none of `absent` is."""
        started = time.monotonic()

        def good(_records) -> bool:
            listed = {r.advert.name: r for r in self.client.directory.records()}
            return (all(n in listed and (not up or listed[n].up) for n in present)
                    and not any(n in listed for n in absent))

        ok = False
        deadline = started + timeout
        while time.monotonic() < deadline:  # wait_for wakes on directory changes; re-check for `up`
            if self.client.directory.wait_for(good, min(0.2, max(0.0, deadline - time.monotonic()))):
                ok = True
                break
        return {"ok": ok, "elapsed": time.monotonic() - started, "wall": time.time(), "records": self.records()}

    def op_peers(self, wait=0.0):
        return {"peers": [{k: row.get(k) for k in ("name", "state", "busy", "queued", "error", "source", "slots", "verified",
                                                   "address", "peer_id", "device", "frameworks")}
                          for row in self.client.peers(wait=wait)]}

    # ---- work ----------------------------------------------------------------------------------------

    def op_map(self, fn, items, retries=0, timeout=None, extra=()):
        """gl.map(fn, items) (each item a list of arguments when `extra` is given: fn(item, *extra))."""
        func = getattr(lan_tasks, fn)
        if extra:
            extra = tuple(extra)
            call = _Bound(func, extra)
        else:
            call = func
        started = time.monotonic()
        try:
            results = gl.map(call, items, retries=retries, timeout=timeout, progress=False)
        except Exception as exc:
            return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:4000],
                    "elapsed": time.monotonic() - started}
        return {"ok": True, "results": results, "started": started, "elapsed": time.monotonic() - started}

    def op_submit(self, tag, fn, args=(), peer=None, retries=0, timeout=None, blob_mb=0, background=False):
        """Submit and keep the future under `tag`; with blob_mb, the only argument is that many MiB of bytes.

        background=True submits from another thread (sending a big argument can block) and
        replies at once; a submit that raises is recorded as the task's outcome.
        """
        func = getattr(lan_tasks, fn)
        if blob_mb:
            args = [bytes(int(blob_mb * (1 << 20)))]
        if background:
            def submit():
                try:
                    self._submit(tag, func, args, peer, retries, timeout)
                except Exception as exc:
                    with self.done:
                        self.outcomes[tag] = {"t": time.monotonic(), "ok": False, "error": type(exc).__name__,
                                              "message": str(exc)[:2000], "peer": None, "in_submit": True}
                        self.done.notify_all()

            threading.Thread(target=submit, daemon=True).start()
            return {"peer": None}
        return self._submit(tag, func, args, peer, retries, timeout)

    def _submit(self, tag, func, args, peer, retries, timeout):
        future = self.client.submit(func, tuple(args), req=Requirements.build(peer=peer), retries=retries,
                                    timeout=timeout)
        self.futures[tag] = future

        def done(f, tag=tag):
            record = outcome(f, time.monotonic())
            with self.done:
                self.outcomes[tag] = record
                self.done.notify_all()

        future.add_done_callback(done)
        return {"peer": future.peer}

    def op_submit_many(self, fn, count, args=(), peer=None, wait=10.0, pause=0.0):
        """`count` submits one after another (each may need a new connection), then up to `wait` s for all.

        Replies how many futures were still pending then, the outcomes of the others, and the
        errors of the submits that raised (NoMatchingPeer, say).
        """
        from collections import Counter
        from concurrent.futures import TimeoutError as FutureTimeout

        func = getattr(lan_tasks, fn)
        futures, submit_errors = [], Counter()
        for _ in range(min(count, 1000)):
            try:
                futures.append(self.client.submit(func, tuple(args), req=Requirements.build(peer=peer)))
            except Exception as exc:
                submit_errors[f"{type(exc).__name__}: {str(exc)[-120:]}"] += 1
            if pause:
                time.sleep(pause)
        deadline = time.monotonic() + min(wait, MAX_LOOP_SECONDS)
        outcomes = Counter()
        for future in futures:
            try:
                exc = future.exception(max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                continue
            outcomes["ok" if exc is None else f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
        return {"submitted": len(futures), "pending": sum(not f.done() for f in futures),
                "outcomes": dict(outcomes), "submit_errors": dict(submit_errors)}

    def op_where(self, tags):
        """The peer each task was given to (now; a retry moves it)."""
        return {"peers": {tag: self.futures[tag].peer if tag in self.futures else None for tag in tags}}

    def op_wait(self, tags, timeout=30.0):
        deadline = time.monotonic() + timeout
        with self.done:
            while not all(t in self.outcomes for t in tags):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.done.wait(left)
            return {"outcomes": {t: self.outcomes.get(t) for t in tags},
                    "pending": [t for t in tags if t not in self.outcomes]}

    def op_run(self, fn, args=(), peer=None, retries=0, timeout=30.0, size_only=False):
        started = time.monotonic()
        try:
            future = self.client.submit(getattr(lan_tasks, fn), tuple(args), req=Requirements.build(peer=peer),
                                        retries=retries)
        except Exception as exc:  # NoMatchingPeer comes at once
            return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:2000],
                    "elapsed": time.monotonic() - started}
        try:
            future.result(timeout)
        except Exception:
            pass
        if not future.done():
            future.cancel()
            return {"ok": False, "error": "Timeout", "message": f"no result in {timeout} s",
                    "elapsed": time.monotonic() - started}
        out = {**outcome(future, time.monotonic()), "elapsed": time.monotonic() - started}
        if size_only and out.get("ok"):
            out["value"] = len(out["value"])
        return out

    def op_run_until(self, fn, args=(), peer=None, timeout=20.0, pause=0.2):
        """Retry a pinned call until it works (rediscovery after a fault); bounded by `timeout`."""
        started = time.monotonic()
        attempts, last = 0, None
        while time.monotonic() - started < timeout and attempts < 1000:
            attempts += 1
            try:
                value = self.client.submit(getattr(lan_tasks, fn), tuple(args), req=Requirements.build(peer=peer)
                                           ).result(max(1.0, timeout - (time.monotonic() - started)))
                return {"ok": True, "value": value, "elapsed": time.monotonic() - started, "attempts": attempts,
                        "last_error": last}
            except Exception as exc:
                last = f"{type(exc).__name__}: {str(exc)[:300]}"
                time.sleep(pause)
        return {"ok": False, "error": "Timeout", "message": last, "elapsed": time.monotonic() - started,
                "attempts": attempts}

    # ---- an honest submitter that keeps working while the peer is attacked ----------------------------

    def op_loop_start(self, fn="echo", pause=0.02, call_timeout=15.0, max_seconds=120.0, max_calls=100_000):
        self.loop_stop.clear()
        stats = self.loop_stats = {"calls": 0, "ok": 0, "failures": [], "max_latency": 0.0, "latencies": []}
        max_seconds = min(max_seconds, MAX_LOOP_SECONDS)

        def loop():
            started = time.monotonic()
            i = 0
            while not self.loop_stop.is_set() and time.monotonic() - started < max_seconds and i < max_calls:
                i += 1
                t0 = time.monotonic()
                try:
                    value = self.client.submit(getattr(lan_tasks, fn), (i,), req=Requirements.build()
                                               ).result(call_timeout)
                    if value != i:
                        raise AssertionError(f"wrong result {value!r} for {i}")
                    stats["ok"] += 1
                except Exception as exc:
                    stats["failures"].append(f"{time.monotonic() - started:.2f}s {type(exc).__name__}: "
                                             f"{str(exc)[:300]}")
                latency = time.monotonic() - t0
                stats["calls"] += 1
                stats["max_latency"] = max(stats["max_latency"], latency)
                stats["latencies"].append(latency)
                self.loop_stop.wait(pause)

        self.loop_thread = threading.Thread(target=loop, daemon=True)
        self.loop_thread.start()
        return {}

    def op_loop_stop(self):
        self.loop_stop.set()
        if self.loop_thread is not None:
            self.loop_thread.join(60)
        stats = dict(self.loop_stats)
        lat = sorted(stats.pop("latencies", []))
        stats["p50_latency"] = lat[len(lat) // 2] if lat else None
        stats["p99_latency"] = lat[int(len(lat) * 0.99)] if lat else None
        return {"stats": stats}

    # ---- a monitor that polls every peer's STATUS (busy slots and queue) --------------------------------

    def op_monitor_start(self, interval=0.1, max_seconds=300.0):
        self.monitor_stop = threading.Event()
        seen = self.monitor_seen = {"polls": 0, "peers": {}, "errors": []}

        def loop():
            started = time.monotonic()
            while not self.monitor_stop.wait(interval) and time.monotonic() - started < min(max_seconds,
                                                                                            MAX_LOOP_SECONDS):
                try:
                    rows = self.client.peers(wait=0)
                except Exception as exc:
                    seen["errors"].append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                seen["polls"] += 1
                for row in rows:
                    if row.get("busy") is None:
                        continue
                    entry = seen["peers"].setdefault(row["name"], {"slots": row["slots"], "max_busy": 0,
                                                                   "max_queued": 0, "samples": 0})
                    entry["max_busy"] = max(entry["max_busy"], row["busy"])
                    entry["max_queued"] = max(entry["max_queued"], row["queued"])
                    entry["samples"] += 1

        self.monitor_thread = threading.Thread(target=loop, daemon=True)
        self.monitor_thread.start()
        return {}

    def op_monitor_stop(self):
        self.monitor_stop.set()
        self.monitor_thread.join(30)
        return {"seen": self.monitor_seen}

    # ---- jobs --------------------------------------------------------------------------------------------

    def op_submit_job(self, tag, command, name, nodes=1, peer=None, silence_s=None):
        """gl.submit_job(command), with an empty folder, on `peer` or as a gang of `nodes`, from another thread (it waits for the peer's answers);
        its outcome under `tag` (op_wait), the job's id as its value. `silence_s` replaces the time a submit
        waits for a silent peer before it sends the submit again (client/jobs.py's SILENCE_S, 15 s)."""
        from gpulayer.client import jobs

        if silence_s is not None:
            jobs.SILENCE_S = silence_s

        def submit():
            try:
                options = {"nodes": nodes} if nodes > 1 else {"peer": peer}
                out = {"ok": True, "value": gl.submit_job(command, None, name=name, **options).id}
            except Exception as exc:
                out = {"ok": False, "error": type(exc).__name__, "message": str(exc)[:2000]}
            with self.done:
                self.outcomes[tag] = {"t": time.monotonic(), **out}
                self.done.notify_all()

        threading.Thread(target=submit, daemon=True).start()
        return {}

    def op_job(self, job_id, timeout=60.0):
        """Wait for the job to end: its state and log, and its ranks' ids (a gang's)."""
        job = gl.job(job_id)
        return {"state": job.wait(timeout), "log": job.logs(), "ranks": [rank.id for rank in job.ranks]}

    def op_jobs(self, name):
        """The ids of the cluster's jobs named `name` (every peer is asked; gl.jobs is the subpackage here)."""
        return {"ids": [row["id"] for row in gl.api.jobs() if row.get("name") == name]}

    def op_open_connections(self, peer=None):
        """The ids of this submitter's connections (leases too) that are open now, to `peer` (a name) if given."""
        conns = [*self.client.pool.own.values(), *self.client.leases.all()]
        return {"ids": [id(c) for c in conns if not c.closed and peer in (None, c.name)]}

    def op_stacks(self):
        """Where every thread is now (for a failure's message)."""
        names = {t.ident: t.name for t in threading.enumerate()}
        return {"stacks": {names.get(ident, str(ident)): "".join(traceback.format_stack(frame)[-4:])
                           for ident, frame in sys._current_frames().items()}}

    def op_exit(self):
        gl.api.shutdown()
        return {"bye": True}


class _Bound:
    """fn(item, *extra), picklable by value."""

    def __init__(self, fn, extra):
        self.fn, self.extra = fn, extra

    def __call__(self, item):
        return self.fn(item, *self.extra)


def main() -> None:
    serve(Agent)


if __name__ == "__main__":
    main()
