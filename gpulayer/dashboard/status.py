"""A peer's STATUS reply, checked: what the dashboard shows of it, as untrusted input made safe.

Every text is printable and bounded, every number finite and in range, every list capped; a
field of the wrong shape reads as missing (or the entry holding it is dropped), never as an error.
"""

from __future__ import annotations

from typing import Any

from ..client.pool import job_isolation
from ..resources.utilisation import MAX_GB, Sample, clean_sample, finite

RUNNING_MAX = 1024  # running tasks, actors and devices kept of one reply
FINISHED_MAX = 1000  # finished tasks kept of one reply
REFUSALS_MAX = 200  # refusals kept of one reply
NAME_MAX = 200  # characters of a name, a device or a host
MESSAGE_MAX = 1000  # characters of a refusal's message
TIME_MAX = 1e11  # seconds since 1970 (the year 5138)
HELD_MAX = 1 << 50  # results or bytes a peer may say it holds


def text(value: Any, limit: int = NAME_MAX) -> str:
    """Printable characters only, at most `limit` of them; a non-string is empty."""
    return "".join(ch for ch in value[:limit * 4] if ch.isprintable())[:limit] if isinstance(value, str) else ""


def number(value: Any, low: float = 0.0, high: float = TIME_MAX) -> float | None:
    """A finite number within [low, high] (a time, by default), else None."""
    return finite(value, low, high)


def _entries(value: Any, limit: int) -> list[dict[str, Any]]:
    """The last `limit` dicts of a list (the newest, as a peer lists the oldest first)."""
    return [v for v in value[-limit:] if isinstance(v, dict)] if isinstance(value, list) else []


def _running(entry: dict[str, Any]) -> dict[str, Any] | None:
    start = number(entry.get("start"))
    if start is None:
        return None
    return {"name": text(entry.get("name")) or "?", "submitter": text(entry.get("submitter")),
            "device": text(entry.get("device")), "start": start}


def _finished(entry: dict[str, Any]) -> dict[str, Any] | None:
    task, end = _running(entry), number(entry.get("end"))
    if task is None or end is None or end < task["start"]:
        return None
    return {**task, "end": end, "outcome": text(entry.get("outcome"), 40) or "?"}


def _refusal(entry: dict[str, Any]) -> dict[str, Any] | None:
    t = number(entry.get("t"))
    if t is None:
        return None
    return {"t": t, "submitter": text(entry.get("submitter")), "code": text(entry.get("code"), 40) or "?",
            "message": text(entry.get("message"), MESSAGE_MAX)}


def _actor(entry: dict[str, Any]) -> dict[str, Any]:
    return {"name": text(entry.get("class")) or "?", "actor": text(entry.get("actor"), 40),
            "slot": number(entry.get("slot"), 0, RUNNING_MAX), "served": number(entry.get("served"), 0, 1e15)}


JOB_STATES = ("queued", "running", "succeeded", "failed", "stopped", "lost")
TAIL_MAX = 2000  # characters of a job's log tail


def _job(entry: dict[str, Any]) -> dict[str, Any] | None:
    submitted, state = number(entry.get("submitted")), entry.get("state")
    if submitted is None or state not in JOB_STATES:
        return None
    tail = entry.get("tail")
    return {"id": text(entry.get("id"), 40), "name": text(entry.get("name")), "state": state,
            "submitter": text(entry.get("submitter")), "submitted": submitted,
            "started": number(entry.get("started")), "ended": number(entry.get("ended")),
            "exit_code": number(entry.get("exit_code"), -255, 255), "reason": text(entry.get("reason"), MESSAGE_MAX),
            "peak_memory_bytes": _count(entry.get("peak_memory_bytes")) or None,
            "tail": "".join(ch for ch in tail[-TAIL_MAX:] if ch.isprintable() or ch == "\n")
            if isinstance(tail, str) else ""}


def _unreserved(value: Any) -> dict[str, float]:
    """Per device name, the GB its running tasks have not reserved."""
    if not isinstance(value, dict):
        return {}
    pairs = ((text(k, 40), number(v, 0, MAX_GB)) for k, v in list(value.items())[:RUNNING_MAX] if isinstance(k, str))
    return {k: v for k, v in pairs if k and v is not None}


def _count(value: Any) -> int:
    """A count of results or bytes held: a whole number in range, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= HELD_MAX else 0


def _load(value: Any) -> tuple[float | None, float | None]:
    if not isinstance(value, list) or len(value) < 2:
        return None, None
    return number(value[0], 0, 1e9), number(value[1], 0, 1e9)


def clean_status(msg: Any) -> dict[str, Any]:
    """The dashboard's view of one STATUS reply: load, activity, actors, jobs and the utilisation sample."""
    msg = msg if isinstance(msg, dict) else {}
    busy, queued = _load(msg.get("load"))
    util: Sample | None = clean_sample(msg.get("util"))
    return {
        "now": number(msg.get("now")),
        "busy": busy, "queued": queued,
        "slots": number(msg.get("slots"), 0, RUNNING_MAX),
        "done": number(msg.get("done"), 0, 1e15),
        "draining": msg.get("draining") is True,
        "running": [t for e in _entries(msg.get("running"), RUNNING_MAX) if (t := _running(e))],
        "finished": [t for e in _entries(msg.get("finished"), FINISHED_MAX) if (t := _finished(e))],
        "refusals": [r for e in _entries(msg.get("refusals"), REFUSALS_MAX) if (r := _refusal(e))],
        "actors": [_actor(e) for e in _entries(msg.get("actors"), RUNNING_MAX)],
        "jobs": [j for e in _entries(msg.get("jobs"), RUNNING_MAX) if (j := _job(e))],
        "util": util,
        "unreserved_gb": _unreserved(msg.get("unreserved_gb")),
        "held_bytes": _count(msg.get("held_bytes")), "held": _count(msg.get("held")),
        **job_isolation(msg),
    }
