"""The message vocabulary: every message type, its TypedDict and builder, and its validator.

A message is a msgpack map {"t": type, "v": version, ...} (framing.py carries it); docs/wire.md has the
full table. A builder makes the map a sender passes to its connection; a validator (`check_*`) says what
is wrong with one that was read, or None, and is the one check of that message wherever it is read;
the peer calls a request's (`check`, by CHECKS) before its handler.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, TypedDict, Union

from .. import held, security
from ..checks import check_concurrency, check_priority, check_timeout, check_user
from ..taskenv import check_env, read_at_load

PROTOCOL_VERSION = 3  # 3: jobs' content digests are BLAKE3 (ADR 0023). In every message ("v") and every advert ("ver"); bump on any incompatible change

HELLO, AUTH, AUTH_OK = "hello", "auth", "auth_ok"
SUBMIT, ACCEPT, REJECT = "submit", "accept", "reject"
LOG, RESULT, ERROR, CANCEL = "log", "result", "error", "cancel"
PING, PONG, STATUS, BYE = "ping", "pong", "status", "bye"
ACTOR, CALL, CLOSE, ACTOR_END = "actor", "call", "close", "actor_end"  # actors (docs/actors.md)
FETCH, RELEASE = "fetch", "release"  # held results (docs/data.md)
LOCAL = "local"  # the peer's offer of a local link for shared memory (transport/shm.py, ADR 0009)
WITHDRAW = "withdraw"  # the submitter takes back a task still queued on the peer (ADR 0011)
DIRECT = "direct"  # the submitter asks that this connection be handed to an actor's worker (ADR 0012)
LEASE, LEASE_END = "lease", "lease_end"  # a warm worker lent to one submitter's connection (ADR 0013)
WAIT = "wait"  # a worker's task blocks on a future, or goes on: its slot is lent meanwhile (ADR 0014)
BLOB, FILE = "blob", "file"  # a job's working folder up, its files down (checked by gpulayer/jobs/transfer.py)
INVITE, PAKE, PAKE_CONFIRM = "invite", "pake", "pake_confirm"  # invite codes (invite.py, docs/security.md)
PEERS = "peers"  # lists of verified peers, between key holders (peer/gossip.py, ADR 0017)
# jobs (ADR 0016; their builders and checks are in protocol/jobs.py): requests, then the peer's replies
JOB_SUBMIT, JOB_LIST, JOB_LOGS, JOB_WAIT, JOB_STOP, JOB_FETCH, JOB_RM = (
    "job_submit", "job_list", "job_logs", "job_wait", "job_stop", "job_fetch", "job_rm")
JOB_NEED, JOB_INFO, JOB_LOG = "job_need", "job_info", "job_log"
JOB_GANG = "job_gang"  # a gang's watcher to a rank's peer: claim, reserve, start (peer/gangs.py, ADR 0020)
# a peer pulls a queued job from its owner (peer/pull.py, ADR 0019): JOB_PULL -> JOB_OFFER, then JOB_TAKE steps
JOB_PULL, JOB_OFFER, JOB_TAKE = "job_pull", "job_offer", "job_take"
JOB_REQUESTS = frozenset({JOB_SUBMIT, BLOB, JOB_LIST, JOB_LOGS, JOB_WAIT, JOB_STOP, JOB_FETCH, JOB_RM, JOB_GANG,
                          JOB_PULL, JOB_TAKE})
MESSAGE_TYPES = frozenset({HELLO, AUTH, AUTH_OK, SUBMIT, ACCEPT, REJECT, LOG, RESULT, ERROR,
                           CANCEL, PING, PONG, STATUS, BYE, ACTOR, CALL, CLOSE, ACTOR_END, FETCH, RELEASE,
                           LOCAL, WITHDRAW, DIRECT, LEASE, LEASE_END, WAIT, BLOB, FILE, INVITE, PAKE, PAKE_CONFIRM,
                           PEERS, *JOB_REQUESTS, JOB_NEED, JOB_INFO, JOB_LOG, JOB_OFFER})
# Messages added within one protocol version, that a peer answers only when its advert names them ("ft"):
# an older peer of the same version refuses an unknown type and closes the connection.
FEATURES = frozenset({PEERS, JOB_GANG, JOB_PULL})

# The messages (docs/wire.md has the full table). "id" is the task id, or a request id for
# STATUS and PING; "load" ([busy, queued]) and, on a GPU peer, "free" (GB) ride on the peer's replies.
Message = dict[str, Any]  # any decoded message: check "t" before reading the rest


class Envelope(TypedDict, total=False):
    """The keys any message may carry; `encode` sets "v" and "nb"."""

    v: int  # the protocol version
    nb: int  # how many out-of-band buffer frames follow
    fds: list[list[int]]  # [position, size] of the buffers that came first on the local link (shm.py)
    id: int | None
    load: list[int]
    free: float  # on a GPU peer's replies: the most GB one task may take now on one device
    submitters: int  # on the peer's replies: how many submitters contend for its slots (ADR 0011)
    ran: float  # on a task's outcome: the seconds it ran (ADR 0011)
    w: bool  # on an ACCEPT: the task is queued, and WITHDRAW may take it back until it starts (ADR 0011)
    s: bool  # on an ACCEPT of an ACTOR: it took its slot at once, and its worker starts (ADR 0018)


class _SubmitOptions(TypedDict, total=False):
    env: dict[str, str]  # the task's environment variables (check_env); omitted when there are none
    keep: str  # keep the result on the peer under this id (held.new_result_id; docs/data.md)
    refs: list[dict[str, Any]]  # the held results among its arguments (`ref` entries)
    priority: int  # its place in the peer's queue, higher first (check_priority); omitted when 0
    user: str  # the submitter's login name (check_user): its user@host's quota of the peer's slots


class SubmitMessage(Envelope, _SubmitOptions):
    t: str
    fn: bytes  # the pickled function
    args: bytes  # the pickled (args, kwargs), with "nb" out-of-band buffers after it
    req: dict[str, Any]  # Requirements.to_wire()
    timeout: float | None
    name: str


class ErrorMessage(Envelope, total=False):
    t: str
    code: str  # auth, protocol, too-large, version, bad-request, timeout, cancelled, exception, worker-died, ...
    message: str
    type: str  # for "exception": the qualified type name; "exc" the pickled exception, "tb" the traceback
    exc: bytes | None
    tb: str


class RejectMessage(Envelope):
    t: str
    code: str  # busy, no-match, bad-request
    message: str


class LogMessage(Envelope):
    t: str
    stream: str  # "out" or "err"
    data: bytes


class HelloMessage(Envelope):
    t: str
    nonce: bytes
    peer: str
    cluster: str
    advert: dict[str, str]


# Union, not "|": a job interpreter may be a Python older than 3.10 (see docs/apple-silicon.md)
Outgoing = Union[Message, Envelope]  # what the senders take: a typed message or a plain map
Buffers = Union[list[Any], tuple[Any, ...]]  # out-of-band buffers: anything with the buffer protocol


def submit(task_id: int, fn: bytes, args: bytes, req: dict[str, Any], timeout: float | None,
           name: str, env: Mapping[str, str] | None = None, keep: str | None = None,
           refs: list[dict[str, Any]] | None = None, priority: int = 0, user: str = "") -> SubmitMessage:
    msg: SubmitMessage = {"t": SUBMIT, "id": task_id, "fn": fn, "args": args, "req": req, "timeout": timeout,
                          "name": name}
    if priority:
        msg["priority"] = priority
    if user:
        msg["user"] = user
    if env:
        msg["env"] = dict(env)
    if keep is not None:
        msg["keep"] = keep
    if refs:
        msg["refs"] = refs
    return msg


ACTOR_ID_HEX = 32  # an actor id: 16 random bytes in hex, unguessable


def actor(task_id: int, cls: bytes, args: bytes, req: dict[str, Any], timeout: float | None, name: str,
          concurrency: int, env: Mapping[str, str] | None = None) -> Message:
    """Create an actor: like SUBMIT, with the pickled class in "cls" and its max_concurrency in "conc"."""
    msg: Message = {"t": ACTOR, "id": task_id, "cls": cls, "args": args, "req": req, "timeout": timeout,
                    "name": name, "conc": concurrency}
    if env:
        msg["env"] = dict(env)
    return msg


def call(call_id: int, actor_id: str, method: str, args: bytes, timeout: float | None) -> Message:
    """Call a method of a live actor; answered like a task (LOG, RESULT, ERROR), matched by "id"."""
    return {"t": CALL, "id": call_id, "actor": actor_id, "method": method, "args": args, "timeout": timeout}


def direct(request_id: int, actor_id: str) -> Message:
    """Ask, as the first message after AUTH_OK, that the connection go to the actor's worker (ADR 0012)."""
    return {"t": DIRECT, "id": request_id, "actor": actor_id}


BEAT_MIN, BEAT_MAX = 0.05, 60.0  # seconds between a leased worker's signs of life, at least and at most


def lease(request_id: int, req: dict[str, Any], beat: float) -> Message:
    """Ask, as the first message after AUTH_OK, that the connection go to a warm worker that runs this
    submitter's tasks of requirements `req` until the lease ends, and that says it is alive every
    `beat` seconds while a task runs (ADR 0013)."""
    return {"t": LEASE, "id": request_id, "req": req, "beat": beat}


def close(request_id: int, actor_id: str) -> Message:
    return {"t": CLOSE, "id": request_id, "actor": actor_id}


def actor_end(actor_id: str, code: str, reason: str, served: int, request_id: int | None = None) -> Message:
    """The peer's word that an actor ended: code "closed" or "died", with the calls it answered."""
    return {"t": ACTOR_END, "id": request_id, "actor": actor_id, "code": code, "message": reason, "served": served}


def check_actor_id(value: Any) -> str | None:
    """Why `value` is not an actor id (ACTOR_ID_HEX lowercase hex digits), or None."""
    if not isinstance(value, str) or len(value) != ACTOR_ID_HEX or value.strip("0123456789abcdef"):
        return f"an actor id is {ACTOR_ID_HEX} lowercase hex digits, not {printable(repr(value), 60)}"
    return None


def check_method(value: Any) -> str | None:
    """Why `value` may not be called as an actor's method (an identifier, not a dunder), or None."""
    if not isinstance(value, str) or not value.isidentifier() or value.startswith("__"):
        return f"an actor method is an identifier not starting with '__', not {printable(repr(value), 60)}"
    return None


def _request_id_problem(msg: Mapping[str, Any]) -> str | None:
    """Why a request's "id" is not an integer (its answer carries it), or None."""
    value = msg.get("id")
    if not isinstance(value, int) or isinstance(value, bool):
        return f"a {printable(msg.get('t'), 20).upper()} needs an integer 'id'"
    return None


def check_close(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with a CLOSE's (or a DIRECT's) id or actor id, or None."""
    return _request_id_problem(msg) or check_actor_id(msg.get("actor"))


check_direct = check_close  # a DIRECT names its actor as a CLOSE does


def check_lease(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with a LEASE's id or beat, or None (its "req" is read as Requirements by the peer)."""
    problem, beat = _request_id_problem(msg), msg.get("beat")
    if problem is None and (isinstance(beat, bool) or not isinstance(beat, (int, float))
                            or not BEAT_MIN <= beat <= BEAT_MAX):
        problem = f"a LEASE needs 'beat', seconds from {BEAT_MIN} to {BEAT_MAX}"
    return problem


def check_call(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with a CALL's id, actor id, method, arguments or timeout, or None."""
    problem = _request_id_problem(msg) or check_actor_id(msg.get("actor")) or check_method(msg.get("method"))
    if problem is None and not isinstance(msg.get("args"), bytes):
        problem = "a CALL needs 'args' as a binary pickle"
    return problem or _timeout_problem(msg.get("timeout"))


def _timeout_problem(value: Any) -> str | None:
    """Why `value` is not a task's or call's "timeout" (check_timeout), or None."""
    try:
        check_timeout(value)
    except ValueError:
        return f"bad timeout {printable(repr(value), 60)}: a positive, finite number of seconds or nil"
    return None


def _id_problem(what: str, task_id: Any) -> str | None:
    """Why `task_id` is not the "id" of `what` (a message that starts a task: a positive integer), or None."""
    if not isinstance(task_id, int) or isinstance(task_id, bool) or task_id < 1:
        return f"{what} needs a positive integer 'id'"
    return None


def check_actor(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with an ACTOR (the creation of an actor), or None."""
    problem = _id_problem("an ACTOR", msg.get("id"))
    if problem is None and (not isinstance(msg.get("cls"), bytes) or not isinstance(msg.get("args"), bytes)):
        problem = "an ACTOR needs 'cls' and 'args' as binary pickles"
    if problem is None and not isinstance(msg.get("name"), str):
        problem = "an ACTOR needs its class's 'name'"
    if problem is None:
        try:
            check_concurrency(msg.get("conc"))
        except ValueError as exc:
            problem = str(exc)
    return problem or _timeout_problem(msg.get("timeout"))


MAX_REFS = 256  # held results one task may take as arguments
MAX_REF_ADDRESSES = 8  # addresses of the peer holding one


def check_result_id(value: Any) -> str | None:
    """Why `value` is not a held result's id (RESULT_ID_HEX lowercase hex digits), or None."""
    if not isinstance(value, str) or len(value) != held.RESULT_ID_HEX or value.strip("0123456789abcdef"):
        return f"a result id is {held.RESULT_ID_HEX} lowercase hex digits, not {printable(repr(value), 60)}"
    return None


def ref(result_id: str, peer_id: str, addresses: list[tuple[str, int]]) -> dict[str, Any]:
    """A SUBMIT's "refs" entry: a held result it takes as an argument, and the peer that holds it."""
    return {"ref": result_id, "peer": peer_id, "at": [[host, port] for host, port in addresses]}


def _address(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and len(value[0]) <= 255 \
        and isinstance(value[1], int) and not isinstance(value[1], bool) and 0 < value[1] < 65536


def check_refs(value: Any) -> str | None:
    """Why a SUBMIT's "refs" is not a list of `ref` entries (at most MAX_REFS), or None."""
    if not isinstance(value, list) or len(value) > MAX_REFS:
        return f"'refs' must be a list of at most {MAX_REFS} held results"
    for entry in value:
        if not isinstance(entry, dict):
            return "each of 'refs' must be a map with 'ref', 'peer' and 'at'"
        problem = check_result_id(entry.get("ref"))
        if problem is not None:
            return problem
        at = entry.get("at")
        if not isinstance(entry.get("peer"), str) or not isinstance(at, list) \
                or not 0 < len(at) <= MAX_REF_ADDRESSES or not all(_address(a) for a in at):
            return f"a held result's 'peer' is its peer id and 'at' 1 to {MAX_REF_ADDRESSES} [host, port] pairs"
    return None


def check_submit(msg: Mapping[str, Any], leased: bool = False) -> str | None:
    """What is wrong with a SUBMIT, or None: the peer asks it at admission, a leased worker (`leased`) before
    it runs the task; then it must also be one that a lease runs (`lease_refusal`). The scheduler checks
    `env` of what goes through the peer (an ACTOR's too)."""
    problem = _id_problem("a SUBMIT", msg.get("id"))
    if problem is None and (not isinstance(msg.get("fn"), bytes) or not isinstance(msg.get("args"), bytes)):
        problem = "a SUBMIT needs 'fn' and 'args' as binary pickles"
    problem = problem or _timeout_problem(msg.get("timeout"))
    if problem is None and "keep" in msg and (problem := check_result_id(msg["keep"])) is not None:
        problem = f"bad 'keep': {problem}"
    if problem is None and "refs" in msg:
        problem = check_refs(msg["refs"])
    if problem is None and ("priority" in msg or "user" in msg):
        try:
            check_priority(msg.get("priority", 0))
            check_user(msg.get("user", ""))
        except ValueError as exc:
            problem = f"a SUBMIT's {exc}"
    if problem is None and leased:
        problem = lease_refusal(msg)
    return problem


def lease_refusal(msg: Mapping[str, Any]) -> str | None:
    """Why a SUBMIT goes through the peer rather than on a lease (ADR 0013), or None: a task that keeps its
    result or takes held ones (the peer holds and fetches them), or whose `env` needs a fresh worker. The
    leased worker refuses such a SUBMIT with it; the submitter asks it before it sends a task there."""
    if msg.get("keep") is not None or msg.get("refs"):
        return "a task that keeps its result or takes held ones goes through the peer, not on a lease"
    try:
        env = check_env(msg.get("env"))
    except (TypeError, ValueError) as exc:
        return str(exc)
    if any(read_at_load(name) for name in env):
        return "a task whose env needs a fresh worker goes through the peer, not on a lease"
    return None


def fetch(request_id: int, result_id: str, owner: str | None = None) -> Message:
    """Ask for a held result; answered with a RESULT (its pickle and buffers) or ERROR "no-result".

    A peer fetching for a task names the submitter that owns the result in "for"."""
    msg: Message = {"t": FETCH, "id": request_id, "ref": result_id}
    if owner is not None:
        msg["for"] = owner
    return msg


def check_fetch(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with a FETCH's id or "for", or None. Its "ref" is not checked: any id that names no
    result held for the submitter gets the same "no-result" (the id is the capability)."""
    if not isinstance(msg.get("for", ""), str):
        return "a FETCH's 'for' names a submitter"
    return _request_id_problem(msg)


def check_release(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with a RELEASE (it names a held result), or None."""
    return check_result_id(msg.get("ref"))


def release(result_id: str) -> Message:
    """The submitter no longer needs a held result: its peer frees it (no answer)."""
    return {"t": RELEASE, "ref": result_id}


def reject(task_id: int | None, code: str, message: str) -> RejectMessage:
    return {"t": REJECT, "id": task_id, "code": code, "message": message}


def log(task_id: int, stream: str, data: bytes) -> LogMessage:
    return {"t": LOG, "id": task_id, "stream": stream, "data": data}


def cancel(task_id: int) -> Message:
    return {"t": CANCEL, "id": task_id}


def withdraw(task_id: int) -> Message:
    """Take back a queued task: REJECT "withdrawn" if it had not started, else nothing (it runs)."""
    return {"t": WITHDRAW, "id": task_id}


def ping() -> Message:
    return {"t": PING}


def status_request() -> Message:
    return {"t": STATUS}


def error(code: str, message: str, task_id: int | None = None) -> ErrorMessage:
    return {"t": ERROR, "id": task_id, "code": code, "message": message}


def printable(value: object, limit: int = 200) -> str:
    """Peer-supplied text fit for a terminal: no control characters, at most `limit` characters."""
    return "".join(ch for ch in str(value) if ch.isprintable())[:limit]


# ---- invite codes (invite.py, docs/security.md) -------------------------------------------------------

INVITE_MAX_TTL = 24 * 3600.0  # seconds an invite may stay open at most
INVITE_MAX_USES = 100
PROOF_BYTES = 32  # a PAKE_CONFIRM's MAC (HMAC-SHA256)


def check_invite(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with an INVITE request, or None: 'ttl' seconds (0, INVITE_MAX_TTL], 'uses' 1..INVITE_MAX_USES."""
    ttl, uses = msg.get("ttl"), msg.get("uses")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= INVITE_MAX_TTL:
        return f"an INVITE needs 'ttl', seconds up to {INVITE_MAX_TTL:.0f}"
    if isinstance(uses, bool) or not isinstance(uses, int) or not 0 < uses <= INVITE_MAX_USES:
        return f"an INVITE needs 'uses', from 1 to {INVITE_MAX_USES}"
    return None


def check_invite_reply(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with the peer's INVITE reply (its new code), or None."""
    code = msg.get("code")
    return None if isinstance(code, str) and 0 < len(code) <= 64 else "an INVITE reply needs its 'code'"


def check_pake(msg: Mapping[str, Any], from_joiner: bool) -> str | None:
    """What is wrong with a PAKE, or None: its SPAKE2 message 'm', and the joiner's the invite's channel 'ch'."""
    channel = msg.get("ch")
    if from_joiner and (not isinstance(channel, int) or isinstance(channel, bool)):
        return "a PAKE needs the invite's channel 'ch', a number"
    if not isinstance(msg.get("m"), bytes) or not 0 < len(msg["m"]) <= 256:
        return "a PAKE needs its SPAKE2 message 'm', bytes"
    return None


def check_pake_confirm(msg: Mapping[str, Any], from_joiner: bool) -> str | None:
    """What is wrong with a PAKE_CONFIRM, or None: its proof 'mac', and the peer's the sealed key 'box'."""
    mac, box = msg.get("mac"), msg.get("box")
    if not isinstance(mac, bytes) or len(mac) != PROOF_BYTES:
        return f"a PAKE_CONFIRM needs its proof 'mac', {PROOF_BYTES} bytes"
    if not from_joiner and (not isinstance(box, bytes) or not 0 < len(box) <= 1024):
        return "the peer's PAKE_CONFIRM needs the sealed key 'box', bytes"
    return None


# ---- lists of verified peers (peer/gossip.py, client/gossip.py, ADR 0017) --------------------------

AGE_OUT = 10.0  # seconds after its last verification anywhere that gossip drops a peer: the oldest age sent
MAX_LIST = 256  # entries of one PEERS list, sent or taken
MAX_ADDRESSES = 8  # addresses of one entry
PeerEntry = tuple[str, list[tuple[str, int]], float]  # (peer id, addresses, seconds since its last verification)


def peers(request_id: int | None, entries: list[dict[str, Any]], port: int | None = None) -> Message:
    """A PEERS message: a request (with the sender's own `port` when it is a peer) or the reply."""
    msg: Message = {"t": PEERS, "id": request_id, "peers": entries}
    if port is not None:
        msg["port"] = port
    return msg


def peers_entry(peer_id: str, addresses: list[tuple[str, int]], age: float) -> dict[str, Any]:
    """One entry of a PEERS list."""
    return {"id": peer_id, "a": [list(a) for a in addresses], "age": round(age, 3)}


def check_peers(msg: Mapping[str, Any]) -> tuple[list[PeerEntry], int | None]:
    """The well-formed entries of a PEERS message (MAX_LIST at most) and the sender's port (None: none or
    bad). The others are skipped, not refused: a list comes from a key holder, of another version maybe."""
    out = []
    value = msg.get("peers")
    for entry in value[:MAX_LIST] if isinstance(value, list) else []:
        if not isinstance(entry, dict):
            continue
        peer_id, addresses, age = entry.get("id"), entry.get("a"), entry.get("age")
        if not isinstance(peer_id, str) or not 0 < len(peer_id) <= 64 or not peer_id.isalnum():
            continue
        if isinstance(age, bool) or not isinstance(age, (int, float)) or not 0 <= age <= AGE_OUT:
            continue
        good = [(a[0], a[1]) for a in (addresses[:MAX_ADDRESSES] if isinstance(addresses, list) else [])
                if _address(a) and a[0]]
        if good:
            out.append((peer_id, good, float(age)))
    port = msg.get("port")
    return out, port if _address(["", port]) else None


# A job's bytes (gpulayer/jobs/transfer.py; the receivers check order and sizes against what they expect)

def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and not value.strip("0123456789abcdef")


def blob_pack(request_id: int, pack: list[list[Any]]) -> Message:
    """Whole small blobs ([[digest, size], ...]), their bytes one after another in the one buffer."""
    return {"t": BLOB, "id": request_id, "pack": pack}


def blob_chunk(request_id: int, digest: str, offset: int, size: int) -> Message:
    """A piece of one blob of `size` bytes, from `offset`, in the one buffer."""
    return {"t": BLOB, "id": request_id, "d": digest, "off": offset, "size": size}


def check_blob(msg: Mapping[str, Any], buffers: int) -> str | None:
    """What is wrong with a BLOB's shape (`buffers`: how many came with it), or None."""
    if buffers > 1:
        return "a BLOB carries at most one buffer"
    if "pack" in msg:
        pack = msg["pack"]
        if not isinstance(pack, list) or not all(isinstance(p, list) and len(p) == 2 and _digest(p[0])
                                                 and _count(p[1]) for p in pack):
            return "a BLOB's 'pack' lists [digest hex, size] pairs"
        return None
    if not _digest(msg.get("d")) or not _count(msg.get("off")) or not _count(msg.get("size")):
        return "a BLOB needs 'd' (digest hex), 'off' and 'size' (whole numbers), or a 'pack'"
    return None


def file_header(request_id: int, files: list[list[Any]]) -> Message:
    """The files a fetch brings, [[path, size, executable], ...]; their chunks follow in that order."""
    return {"t": FILE, "id": request_id, "files": files}


def file_chunk(request_id: int, index: int, offset: int) -> Message:
    """A piece of the header's file number `index`, from `offset`, in the one buffer."""
    return {"t": FILE, "id": request_id, "n": index, "off": offset}


def file_passed(request_id: int, index: int) -> Message:
    """The header's file number `index`, whole, as the descriptor sent just before on the local link
    (a submitter that asked with "local": jobs/local_fetch.py)."""
    return {"t": FILE, "id": request_id, "n": index, "fd": True}


def check_file(msg: Mapping[str, Any], buffers: int) -> str | None:
    """What is wrong with a FILE's shape (`buffers`: how many came with it), or None; the receiver checks
    the paths against its folder."""
    if "files" in msg:
        files = msg["files"]
        if buffers or not isinstance(files, list) or not all(
                isinstance(f, list) and len(f) == 3 and isinstance(f[0], str) and _count(f[1])
                and isinstance(f[2], bool) for f in files):
            return "a FILE header lists [path, size, executable] entries, with no buffer"
        return None
    if msg.get("fd") is True and not buffers and _count(msg.get("n")):
        return None
    if buffers != 1 or not _count(msg.get("n")) or not _count(msg.get("off")):
        return "a FILE chunk needs 'n' and 'off' (whole numbers) and one buffer"
    return None


def _nonce_problem(msg: Mapping[str, Any]) -> str | None:
    nonce = msg.get("nonce")
    if not isinstance(nonce, bytes) or len(nonce) != security.NONCE_BYTES:
        return f"a {printable(msg.get('t'), 20).upper()} needs a nonce of {security.NONCE_BYTES} bytes"
    return None


def check_hello(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with the peer's HELLO (a nonce and a peer id), or None."""
    if msg.get("t") != HELLO or not isinstance(msg.get("peer"), str):
        return "expected HELLO with a nonce and a peer id from the peer"
    return _nonce_problem(msg)


def check_auth(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with an AUTH's shape (a nonce and a client id), or None; handshake.check_auth checks its proof."""
    if msg.get("t") != AUTH or not isinstance(msg.get("client", ""), str):
        return "expected AUTH with a nonce and a client id"
    return _nonce_problem(msg)


CHECKS: dict[str, Callable[[Mapping[str, Any]], str | None]] = {
    SUBMIT: check_submit, ACTOR: check_actor, CALL: check_call, CLOSE: check_close, DIRECT: check_direct,
    LEASE: check_lease, FETCH: check_fetch, RELEASE: check_release}


def check(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with a request a peer read from an authenticated submitter, by its kind's validator
    (CHECKS), or None; the kinds not there carry nothing to check, or are checked as they are read
    (INVITE, PEERS, the job requests: their answers say more than bad-request)."""
    validator = CHECKS.get(msg["t"])
    return validator(msg) if validator is not None else None
