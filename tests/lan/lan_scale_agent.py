"""A fresh submitter process for the scale measurements, driven by JSON lines (lanserve.py).

It records when it started, before importing gpulayer, so that `discover` can say how long a
fresh process took to see every peer and to get its first result. Ops are bounded in time.
"""

from __future__ import annotations

import time

STARTED = time.monotonic()

import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lan_scale_tasks  # noqa: E402
from lanserve import serve  # noqa: E402

import gpulayer as gl  # noqa: E402
from gpulayer.matching import Requirements  # noqa: E402

MAX_WAIT = 300.0


class ScaleAgent:
    def __init__(self):
        self.client = gl.configure(echo_output=False)

    def op_discover(self, count: int, timeout: float = 60.0):
        """Start browsing; wait until `count` peers are listed up, then run one trivial task.

        Times are seconds since this process started: `seen` (all listed), `first_result`.
        """
        self.client.start()
        enough = self.client.directory.wait_for(
            lambda records: sum(r.up for r in records) >= count, min(timeout, MAX_WAIT))
        seen = time.monotonic()
        listed = sum(r.up for r in self.client.directory.records())
        value = self.client.submit(lan_scale_tasks.trivial, (7,), req=Requirements.build()).result(60)
        return {"ok": enough and value == 7, "listed": listed, "seen": seen - STARTED,
                "first_result": time.monotonic() - STARTED, "started": STARTED}

    def op_map(self, fn: str, items: list):
        """gl.map(fn, items): its wall time, and the peers that ran the tasks (`work` results name them)."""
        started = time.monotonic()
        results = gl.map(getattr(lan_scale_tasks, fn), items, progress=False)
        ended = time.monotonic()
        return {"started": started, "ended": ended, "results": results if fn == "work" else len(results)}

    def op_usage(self):
        """This submitter's threads, open file descriptors and resident memory."""
        import psutil

        me = psutil.Process()
        return {"threads": threading.active_count(), "os_threads": me.num_threads(),
                "fds": len(os.listdir("/proc/self/fd")), "rss": me.memory_info().rss,
                "thread_names": sorted({t.name.rstrip("0123456789_-") for t in threading.enumerate()}),
                "connections": len(self.client.pool.own), "leases": len(self.client.leases.by_peer)}

    def op_exit(self):
        gl.api.shutdown()
        return {"bye": True}


if __name__ == "__main__":
    serve(ScaleAgent)
