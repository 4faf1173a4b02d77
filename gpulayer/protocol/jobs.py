"""The job messages (ADR 0016): their builders, and one check for each request the peer reads.

A submit is JOB_SUBMIT (the spec and the folder's manifest) -> JOB_NEED (the digests the peer lacks)
-> BLOB messages of those (jobs/transfer.py) -> JOB_INFO (the job, recorded). The other requests name
a job and are answered with JOB_INFO, after JOB_LOG pieces for logs and FILE messages for a fetch
(jobs/transfer.py); a refusal is an ERROR with the request's id. Every one travels on the secure
channel, after the handshake.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ..checks import MAX_PRIORITY, check_timeout, check_user
from ..taskenv import check_env
from ..jobs import folder
from ..jobs.store import PREEMPT_GRACE_S, JobSpec, check_job_id
from . import messages

MAX_COMMAND_ARGS = 4096
MAX_RETRIES = 100
MAX_ARRAY_JOBS, MAX_ARRAY_INDEX = 10_000, 1_000_000
MAX_GRACE_S = 3600.0
MAX_FILES = 200_000
MAX_TAIL = 1_000_000
MAX_NODES = 256  # ranks of a gang job
GANG_OPS = ("claim", "reserve", "start")  # a JOB_GANG's steps (peer/gangs.py)
RANK_FIELDS = {"job", "peer", "at", "addr", "peer_id", "own"}  # a gang record's rank (the last two optional)
RENDEZVOUS = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "MLX_RANK", "MLX_HOSTFILE", "GPULAYER_RANK_ADDR"})  # what a JOB_GANG's start may set
DEFAULT_GRACE_S = 10.0
MAX_PULL_WAIT_S = 600.0  # the longest a JOB_PULL may be held for a job to offer
TAKE_STEPS = ("need", "commit", "refuse")  # a JOB_TAKE: the blobs the puller lacks, then its word
HOLDER = re.compile(r"[0-9a-f]{12}")
TOKEN = re.compile(r"[0-9a-f]{32}")  # a submission's token: 128 random bits


def submit(request_id: int, spec: JobSpec, files: list[list[Any]],
           array: tuple[int, int, int] | None = None) -> messages.Message:
    """Ask to record a job: `spec` (JobSpec, the submitter set by the peer) and its folder's manifest
    (`Manifest.to_wire`); with `array` (first, last, limit), one job per index of first..last."""
    fields = {"command": spec.command, "name": spec.name, "env": spec.env, "req": spec.req,
              "timeout": spec.timeout, "retries": spec.retries, "function": spec.function,
              "priority": spec.priority, "user": spec.user, "preemptible": spec.preemptible, "grace": spec.grace,
              "pinned": spec.pinned, **({"gang": spec.gang} if spec.gang else {}),
              **({"token": spec.token} if spec.token else {})}
    return {"t": messages.JOB_SUBMIT, "id": request_id, "spec": fields, "files": files,
            **({"array": list(array)} if array is not None else {})}


def request(kind: str, request_id: int, job_id: str | None = None, **fields: Any) -> messages.Message:
    """Any other job request: JOB_LIST (all), JOB_LOGS (offset, follow, tail), JOB_WAIT (timeout),
    JOB_STOP (grace), JOB_FETCH (paths), JOB_RM."""
    return {"t": kind, "id": request_id, **({"job": job_id} if job_id is not None else {}), **fields}


def _number(value: Any, low: float, high: float) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) \
        and low <= value <= high


def _count(value: Any, high: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= high


def check_spec(fields: Any, submitter: str) -> JobSpec | str:
    """The JobSpec of a JOB_SUBMIT's "spec", or why it is refused."""
    if not isinstance(fields, Mapping):
        return "a JOB_SUBMIT needs a 'spec' map"
    command = fields.get("command")
    if not isinstance(command, list) or not command or len(command) > MAX_COMMAND_ARGS \
            or not all(isinstance(a, str) and "\0" not in a for a in command) or not command[0]:
        return f"the command is a non-empty list of at most {MAX_COMMAND_ARGS} strings without NUL"
    name = fields.get("name", "")
    if not isinstance(name, str) or len(name) > 200 or not name.isprintable():
        return "a job's name is printable text of at most 200 characters"
    retries = fields.get("retries", 0)
    if not _count(retries, MAX_RETRIES):
        return f"retries is a whole number from 0 to {MAX_RETRIES}"
    preemptible, grace = fields.get("preemptible", False), fields.get("grace", PREEMPT_GRACE_S)
    if not isinstance(preemptible, bool) or not _number(grace, 0, MAX_GRACE_S):
        return f"a job's 'preemptible' is a boolean and its 'grace' seconds from 0 to {MAX_GRACE_S:g}"
    priority, user = fields.get("priority", 0), fields.get("user", "")
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
        return f"a job's priority is a whole number from -{MAX_PRIORITY} to {MAX_PRIORITY}"
    try:
        check_user(user)
    except ValueError as exc:
        return f"a job's {exc}"
    if not isinstance(fields.get("req", {}), dict) or not isinstance(fields.get("function", False), bool) \
            or not isinstance(fields.get("pinned", False), bool):
        return "a JOB_SUBMIT's 'req' is a map, 'function' and 'pinned' booleans"
    token = fields.get("token", "")
    if not (token == "" or isinstance(token, str) and TOKEN.fullmatch(token)):
        return "a job's 'token' is 32 hex digits (128 random bits)"
    gang = fields.get("gang", {})
    problem = check_gang(gang)
    if problem is not None:
        return problem
    try:
        env = check_env(fields.get("env"))
        timeout = check_timeout(fields.get("timeout"))
    except (TypeError, ValueError) as exc:
        return str(exc)
    return JobSpec(command=command, name=name, env=env, req=fields.get("req", {}), timeout=timeout,
                   retries=retries, submitter=submitter, function=fields.get("function", False),
                   priority=priority, user=user, preemptible=preemptible, grace=float(grace), gang=gang,
                   pinned=fields.get("pinned", False), token=token)


def _text(value: Any, most: int) -> bool:
    return isinstance(value, str) and 0 < len(value) <= most and value.isprintable()


def check_gang(gang: Any) -> str | None:
    """Why a spec's "gang" is malformed, or None: {} (no gang), a rank's {"rank", "size"}, or the gang's own
    {"size", "ranks": [{"job", "peer", "at": [[host, port], ...], "addr"}, ...]} (one entry per rank; optionally
    "peer_id", the id its handshake proved, and "own": [[host, port], ...], the addresses its peer gave)."""
    if gang == {}:
        return None
    shape = (f"a job's 'gang' is {{'rank', 'size'}} or {{'size', 'ranks'}}, with a size from 2 to {MAX_NODES} and "
             "each rank's job id, peer name, addresses and rendezvous address")
    if not isinstance(gang, dict) or not (_count(gang.get("size"), MAX_NODES) and gang["size"] >= 2):
        return shape
    if set(gang) == {"rank", "size"}:
        return None if _count(gang["rank"], gang["size"] - 1) else shape
    ranks = gang.get("ranks")
    if set(gang) != {"size", "ranks"} or not isinstance(ranks, list) or len(ranks) != gang["size"]:
        return shape
    for rank in ranks:
        if not (isinstance(rank, dict) and {"job", "peer", "at", "addr"} <= set(rank) <= RANK_FIELDS
                and check_job_id(rank["job"]) is None and _text(rank["peer"], 200) and _text(rank["addr"], 100)
                and are_addresses(rank["at"]) and rank["at"] and are_addresses(rank.get("own", []))
                and ("peer_id" not in rank or _text(rank["peer_id"], 64))):
            return shape
    return None



def are_addresses(value: Any) -> bool:
    """Whether `value` is a list of at most 16 [host, port]."""
    return isinstance(value, list) and len(value) <= 16 and all(
        isinstance(a, list) and len(a) == 2 and _text(a[0], 100) and _count(a[1], 65535) for a in value)


def check_array(value: Any) -> tuple[range, int] | str | None:
    """A JOB_SUBMIT's "array" ([first, last, limit]) as (its indices, its limit), None for a single job,
    or why it is refused."""
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 3 and all(_count(v, MAX_ARRAY_INDEX) for v in value)
            and value[0] <= value[1] and value[1] - value[0] < MAX_ARRAY_JOBS and value[2] <= MAX_ARRAY_JOBS):
        return (f"an array is [first, last, limit]: indices from 0 to {MAX_ARRAY_INDEX}, first <= last, at most "
                f"{MAX_ARRAY_JOBS} jobs, a limit from 0 (none) to {MAX_ARRAY_JOBS}")
    return range(value[0], value[1] + 1), value[2]


def check_request(msg: Mapping[str, Any]) -> str | None:
    """Why a job request other than JOB_SUBMIT and BLOB (jobs/transfer.py checks those) is malformed, or None."""
    kind = msg["t"]
    if not isinstance(msg.get("id"), int) or isinstance(msg.get("id"), bool):
        return f"a {kind.upper()} needs an integer 'id'"
    if kind == messages.JOB_LIST:
        return None if isinstance(msg.get("all", False), bool) else "a JOB_LIST's 'all' is a boolean"
    if kind in (messages.JOB_PULL, messages.JOB_TAKE) and not (isinstance(msg.get("holder"), str)
                                                                and HOLDER.fullmatch(msg["holder"])):
        return f"a {kind.upper()} names the pulling peer's 'holder' (12 hex digits)"
    if kind == messages.JOB_PULL:
        advert = msg.get("advert")
        if not (isinstance(advert, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in advert.items())
                and _number(msg.get("wait"), 0, MAX_PULL_WAIT_S)):
            return f"a JOB_PULL needs 'advert' (the puller's TXT map) and 'wait' (seconds up to {MAX_PULL_WAIT_S:g})"
        return None
    problem = check_job_id(msg.get("job"))
    if problem is not None:
        return problem
    if kind == messages.JOB_LOGS and not (_count(msg.get("offset", 0), 1 << 62) and isinstance(msg.get("follow"), bool)
                                      and (msg.get("tail") is None or _count(msg.get("tail"), MAX_TAIL))):
        return "a JOB_LOGS needs 'offset' (bytes), 'follow' (a boolean) and 'tail' (lines, or nil)"
    if kind == messages.JOB_WAIT and msg.get("timeout") is not None and not _number(msg.get("timeout"), 0, 1e9):
        return "a JOB_WAIT's 'timeout' is seconds, or nil"
    if kind == messages.JOB_STOP and not _number(msg.get("grace", DEFAULT_GRACE_S), 0, MAX_GRACE_S):
        return f"a JOB_STOP's 'grace' is seconds from 0 to {MAX_GRACE_S:g}"
    if kind == messages.JOB_TAKE and (msg.get("step") not in TAKE_STEPS or not (
            isinstance(msg.get("need", []), list) and all(folder.is_digest(d) for d in msg.get("need", [])))):
        return f"a JOB_TAKE's 'step' is one of {', '.join(TAKE_STEPS)}, its 'need' a list of digests"
    if kind == messages.JOB_GANG:
        env = msg.get("env", {})
        if msg.get("op") not in GANG_OPS or not isinstance(env, dict) or not set(env) <= RENDEZVOUS \
                or not all(isinstance(v, str) and len(v) <= 1 << 16 and "\0" not in v for v in env.values()):
            return (f"a JOB_GANG's 'op' is one of {', '.join(GANG_OPS)}, and its 'env' maps rendezvous variables "
                    f"({', '.join(sorted(RENDEZVOUS))}) to text")
    if kind == messages.JOB_FETCH:
        paths = msg.get("paths")
        if paths is not None and not (isinstance(paths, list) and len(paths) <= MAX_FILES
                                      and all(isinstance(p, str) for p in paths)):
            return "a JOB_FETCH's 'paths' is a list of relative paths, or nil for what the job created or changed"
    return None
