"""The submitter's side of jobs (ADR 0016, docs/jobs.md): submit, find, watch, stop, fetch and remove.

Each operation opens a connection of its own to the peer that holds the job (the secure channel, as
every submitter's), so that a job needs nothing of the process that submitted it: `job(id)` in any
process of any machine with the cluster key finds the peer by asking the peers of the cluster which
of them holds it (a job id names its holder). The Client is used for discovery and placement only.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from .. import distributed
from ..checks import login_user
from ..errors import ConfigError, GPULayerError, NoMatchingPeer, PeerLost
from ..jobs import call, folder, local_fetch, transfer
from ..jobs.store import ARRIVING, ENDED, MOVED, PREEMPT_GRACE_S, JobSpec, check_job_id, holder_of
from ..matching import Requirements
from ..progress import TRANSFER_DELAY_S, ProgressBar
from ..protocol import jobs as job_protocol, messages
from ..resources.model import Advert
from ..transport import blocking, shm
from .connection import CONNECT_TIMEOUT
from .engine import Client
from .inference import with_inferred

log = logging.getLogger("gpulayer.client")
PING_EVERY_S = 1.0  # while waiting on a long answer (wait, a followed log), a PING this often keeps it open
SILENCE_S = 15.0  # nothing heard from the peer this long: the connection is lost
SUBMIT_RETRY_S = 10.0  # a submit whose answer was lost is sent again to the same peer this long (it may restart)
MAX_HOPS = 8  # a job that moved (pulled by another peer) is followed this many times at most for one request


class JobError(GPULayerError):
    """A job request refused by its peer (no such job, a path outside its folder, ...), or no job."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class Holder:
    """A peer that holds jobs: its job identity (the first part of their ids), name and addresses."""

    holder: str
    name: str
    addresses: list[tuple[str, int]]


class JobLink:
    """One authenticated connection to a peer for job requests, closed after use."""

    def __init__(self, client: Client, addresses: list[tuple[str, int]]):
        try:
            self.conn, self.hello, self.address = blocking.handshaken(addresses, client.key, client.submitter_id,
                                                                      CONNECT_TIMEOUT)
        except OSError as exc:  # none accepted, or the connection broke or stalled in the handshake
            raise PeerLost(f"the peer is unreachable: {exc}") from None
        self._ids = iter(range(1, 1 << 62))

    def __enter__(self) -> JobLink:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.conn.close()

    def send(self, msg: messages.Message, buffers: messages.Buffers = ()) -> int:
        msg.setdefault("id", next(self._ids))
        self.conn.send(msg, buffers)
        return int(msg["id"])

    def answer(self, request_id: int, on_data: Callable[[messages.Message, list[Any]], object] | None = None,
               timeout: float | None = None) -> messages.Message:
        """The peer's JOB_NEED or JOB_INFO for `request_id` (JOB_LOG and FILE pieces go to `on_data`); raises
        JobError for its ERROR, PeerLost when the connection is lost or silent, TimeoutError past `timeout`."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                msg, buffers = self.conn.recv(time.monotonic() + PING_EVERY_S)
            except socket.timeout:
                if time.monotonic() - self.conn.last_received > SILENCE_S:
                    raise PeerLost(f"the peer went silent for {SILENCE_S:g} s") from None
                if end is not None and time.monotonic() > end:
                    raise TimeoutError("no answer in time") from None
                self.conn.send(messages.ping())
                continue
            except (OSError, ConnectionError) as exc:
                raise PeerLost(f"the connection to the peer was lost: {exc}") from None
            if msg.get("id") != request_id:
                continue  # a PONG, or the peer's word on something else
            if msg["t"] == messages.ERROR:
                raise JobError(messages.printable(msg.get("code"), 40), messages.printable(msg.get("message"), 2000))
            if msg["t"] in (messages.JOB_LOG, messages.FILE):
                if on_data is not None:
                    on_data(msg, buffers)
                continue
            if msg["t"] in (messages.JOB_NEED, messages.JOB_INFO, messages.LOCAL):
                return msg

    def ask_local(self) -> messages.Message | None:
        """The peer's LOCAL answer (a local link's address and token, ADR 0009), or None if none came in time."""
        try:
            return self.answer(self.send({"t": messages.LOCAL}), timeout=shm.LINK_TIMEOUT)
        except TimeoutError:
            return None

    def ask(self, msg: messages.Message, on_data: Callable[[messages.Message, list[Any]], object] | None = None,
            timeout: float | None = None) -> messages.Message:
        return self.answer(self.send(msg), on_data, timeout)


class Jobs:
    """Jobs of the cluster that `client` (the LAN's Client) belongs to."""

    def __init__(self, client: Any):
        if not isinstance(client, Client):
            raise ConfigError("jobs need the LAN's peers (GPULAYER_BACKEND is not ray)")
        self.client = client
        self._holders: dict[str, Holder] = {}

    # ---- finding peers ----------------------------------------------------------------------

    def holders(self, include_old: bool = False) -> list[tuple[Holder, messages.Message | str]]:
        """Every peer of the cluster, with its JOB_INFO listing (the last day's jobs, or all with
        `include_old`) or why it did not answer."""
        self.client.peers(probe=False)  # waits for the mDNS answers, as `gpulayer peers` does
        return self._ask([r for r in self.client.directory.records() if r.addresses], include_old)

    def _ask(self, records: list[Any], include_old: bool = False) -> list[tuple[Holder, messages.Message | str]]:
        """The JOB_LIST answers of these peers (or why each did not answer), asked at once."""
        def ask(record: Any) -> tuple[Holder, messages.Message | str]:
            try:
                with JobLink(self.client, record.addresses) as link:
                    info = link.ask(job_protocol.request(messages.JOB_LIST, 0, all=include_old), timeout=10.0)
            except (OSError, GPULayerError, TimeoutError) as exc:
                return Holder("", record.advert.name, record.addresses), str(exc)
            holder = Holder(messages.printable(info.get("holder"), 12), record.advert.name, record.addresses)
            self._holders[holder.holder] = holder
            return holder, info

        with ThreadPoolExecutor(8, thread_name_prefix="gpulayer-jobs") as pool:
            return list(pool.map(ask, records))

    def holder(self, job_id: str, fresh: bool = False) -> Holder:
        """The peer that holds `job_id` (asked again with `fresh`: it may have moved to another port);
        JobError when no peer of this cluster does."""
        problem = check_job_id(job_id)
        if problem is not None:
            raise JobError("bad-request", problem)
        return self.located(holder_of(job_id), job_id, fresh)

    def located(self, wanted: str, job_id: str, fresh: bool = False) -> Holder:
        """The peer whose jobs are `wanted`-*, which holds `job_id` (its own, or one it pulled)."""
        if fresh:
            self._holders.pop(wanted, None)
        if wanted not in self._holders:
            answered = self._find(wanted)
            if wanted not in self._holders:
                puller = self._pulled_by(job_id) if wanted == holder_of(job_id) else None
                if puller is not None:
                    return puller
                raise JobError("no-job", f"no peer of this cluster holds job {job_id} ({answered} peer(s) "
                                         "answered; a job of another cluster, or of a peer that is down, is not "
                                         "found)")
        return self._holders[wanted]

    def _pulled_by(self, job_id: str) -> Holder | None:
        """Its owner is down: the peer that pulled `job_id` from it (ADR 0019), asked by id over the
        authenticated channel, among the peers that answered; one that runs it before one it is arriving at."""
        def ask(holder: Holder) -> tuple[Holder, str] | None:
            try:
                with JobLink(self.client, holder.addresses) as link:
                    job = link.ask(job_protocol.request(messages.JOB_WAIT, 0, job_id, timeout=0), timeout=10.0)["job"]
            except (OSError, GPULayerError, TimeoutError):
                return None
            state = job.get("state") if isinstance(job, dict) else None
            return (holder, state) if isinstance(state, str) and state != MOVED else None

        with ThreadPoolExecutor(8, thread_name_prefix="gpulayer-jobs") as pool:
            found = [f for f in pool.map(ask, list(self._holders.values())) if f is not None]
        found.sort(key=lambda f: f[1] == ARRIVING)
        return found[0][0] if found else None

    def _find(self, wanted: str) -> int:
        """Ask the peers as they are discovered until the holder `wanted` answers, or the discovery
        time passes (GPULAYER_DISCOVERY_TIMEOUT); how many peers answered."""
        self.client.discover()
        directory, answered = self.client.directory, 0
        asked: set[str] = set()
        deadline = time.monotonic() + self.client.discovery_timeout

        def unasked(records: list[Any]) -> list[Any]:
            return [r for r in records if r.addresses and r.advert.peer_id not in asked]

        while wanted not in self._holders:
            left = deadline - time.monotonic()
            if left <= 0 or not directory.wait_for(lambda records: bool(unasked(records)), left):
                break
            fresh = unasked(directory.records())
            asked.update(r.advert.peer_id for r in fresh)
            answered += sum(not isinstance(info, str) for _, info in self._ask(fresh))
        return answered

    def job(self, job_id: str) -> Job:
        job = Job(self, self.holder(job_id), {"id": job_id})
        job.refresh()
        return job

    def rows(self, include_old: bool = False) -> list[dict[str, Any]]:
        """Every job the peers know (those not ended and those ended in the last day, or all with
        `include_old`), with its peer; a peer that did not answer gives a row in state "unknown"."""
        rows: list[dict[str, Any]] = []
        for holder, info in self.holders(include_old):
            if isinstance(info, str):
                rows.append({"id": "?", "peer": holder.name, "state": "unknown", "reason": info})
                continue
            rows += [{**row, "peer": holder.name} for row in info.get("jobs") or [] if isinstance(row, dict)]
        settled = {r.get("id") for r in rows if r.get("state") != ARRIVING}  # an arriving job is listed by its owner
        return sorted([r for r in rows if r.get("state") != ARRIVING or r.get("id") not in settled],
                      key=lambda r: r.get("submitted") or 0.0)

    # ---- submitting -------------------------------------------------------------------------

    def submit(self, command: list[str], working_dir: str | os.PathLike[str] | None, req: Requirements, *,
               excludes: tuple[str, ...] = (), name: str = "", env: dict[str, str] | None = None,
               timeout: float | None = None, retries: int = 0, limit_bytes: int | None = None,
               function: bool = False, priority: int = 0, array: tuple[int, int, int] | None = None,
               preemptible: bool = False, grace: float = PREEMPT_GRACE_S, nodes: int = 1,
               keep_link: bool = False, progress: bool | None = False) -> Job:
        """Ship `working_dir` (none: an empty folder) and record the job on the best matching peer;
        returns once a peer has recorded it. The folder is scanned (and refused) before anything is sent.
        With `array` (first, last, limit): one job per index on that peer, the first one returned (its id
        names the array). With `nodes` > 1: a gang of that many ranks on distinct peers (docs/gangs.md).
        With `keep_link` (not for a gang), the job's first request goes over the submit's connection
        (`gpulayer submit -f`: one handshake for the submit and the follow; Job.close() when unused).
        `progress`: the upload's bar (ProgressBar: None, on a terminal once it takes TRANSFER_DELAY_S)."""
        if nodes > 1 and (array is not None or preemptible or retries or function):
            raise ConfigError("a gang job (nodes > 1) takes no array, preemptible, retries or function (not yet)")
        if working_dir is None:
            with tempfile.TemporaryDirectory(prefix="gpulayer-job-") as empty:
                return self.submit(command, empty, req, name=name, env=env, timeout=timeout, retries=retries,
                                   function=function, priority=priority, array=array, preemptible=preemptible,
                                   grace=grace, nodes=nodes, keep_link=keep_link, progress=progress)
        manifest = folder.scan(working_dir, excludes, limit_bytes)
        spec = JobSpec(command=list(command), name=name, env=dict(env or {}), req=req.to_wire(), timeout=timeout,
                       retries=retries, function=function, priority=priority, user=login_user(), preemptible=preemptible,
                       grace=grace, pinned=req.peer is not None)
        if nodes > 1:
            return self._submit_gang(spec, manifest, req, nodes, progress)
        placement, failures, refused = self.client.placement, dict[str, list[str]](), set[str]()  # refused: peer ids
        self.client.start()
        for attempt in range(2):  # the second after discovery, when every known candidate failed (a stale cache)
            if attempt or not placement.candidates(req):
                self.client.wait_for_match(req, refused)
            for record in placement.ranked(req, refused):
                try:
                    holder, info, link = self._record_on(record, replace(spec, token=secrets.token_hex(16)),
                                                         manifest, array, progress)
                except (PeerLost, JobError) as exc:
                    if isinstance(exc, JobError) and exc.code not in ("no-match", "busy"):
                        raise
                    failures[f"{record.advert.name} ({record.address})"] = [str(exc)]
                    if isinstance(exc, JobError):  # the peer said no; an unreachable claim is out (_link_to), not
                        refused.add(record.advert.peer_id)  # its peer: discovery may find it at another address
                    continue
                job = Job(self, holder, info["job"])
                if keep_link:
                    job.kept = link
                else:
                    link.close()
                return job
            if not failures:
                break
        raise NoMatchingPeer(req, {**placement.reasons(req), **failures})

    def _record_on(self, record: Any, spec: JobSpec, manifest: folder.Manifest, array: tuple[int, int, int] | None,
                   progress: bool | None = False) -> tuple[Holder, messages.Message, JobLink]:
        """The job recorded on the peer of `record`: its holder, JOB_INFO and the open link. When the connection
        breaks after the submit went, the same peer (found again by its holder once its JOB_NEED named it: it may have
        restarted elsewhere) is sent the same submit (the same token) again, with backoff, for SUBMIT_RETRY_S:
        it records the job at most once. PeerLost if it was never reached; JobError "unacknowledged" past that."""
        heard: dict[str, Any] = {}
        addresses, deadline, pause = record.addresses, 0.0, 0.1
        while True:
            try:
                link = self._link_to(record, addresses)
                try:
                    info = _submit_over(link, spec, manifest, array, heard, progress, record.advert.name)
                except BaseException:
                    link.close()
                    raise
                holder = Holder(holder_of(info["job"]["id"]), record.advert.name, addresses)
                self._holders[holder.holder] = holder
                return holder, info, link
            except PeerLost as exc:
                if not deadline and not heard.get("sent"):
                    raise  # never reached: nothing of the job is there
                deadline = deadline or time.monotonic() + SUBMIT_RETRY_S
                if time.monotonic() + pause > deadline:
                    raise JobError("unacknowledged", (
                        f"peer {record.advert.name} ({record.address}) did not acknowledge the job ({exc}); it may "
                        "have been recorded there: `gpulayer jobs` shows it")) from None
            time.sleep(pause)  # the peer may be restarting
            pause = min(2 * pause, 1.0)
            holder_id = heard.get("holder")
            if isinstance(holder_id, str) and job_protocol.HOLDER.fullmatch(holder_id):
                self._holders.pop(holder_id, None)
                self._find(holder_id)  # not found (yet): the addresses tried last
                addresses = self._holders[holder_id].addresses if holder_id in self._holders else addresses

    def _link_to(self, record: Any, addresses: list[tuple[str, int]]) -> JobLink:
        """A link to the peer of `record` at `addresses`; the peer its handshake proved goes into the
        directory (as a pooled connection's does: the peer cache keeps it). A cached claim whose
        address is unreachable is dropped, and any other skipped for a while (as the pool does)."""
        try:
            link = JobLink(self.client, addresses)
        except PeerLost as exc:
            if record.source == "cache":
                self.client.directory.drop(record)
            else:
                self.client.pool.mark_down(record.advert.peer_id, str(exc), addresses)
            raise
        try:
            advert = Advert.from_txt(link.hello.get("advert") or {})
        except ValueError:
            return link  # the submit's answer tells
        self.client.directory.prove(advert, [link.address], record.source)
        return link

    def _submit_gang(self, spec: JobSpec, manifest: folder.Manifest, req: Requirements, nodes: int,
                     progress: bool | None) -> Job:
        """Record one rank on each of `nodes` distinct matching peers (in peer-id order: rank 0 on the
        lowest), then the gang's own record on rank 0's peer, which watches the ranks from then on
        (peer/gangs.py). A rank that cannot be recorded stops those recorded before it."""
        from .gangs import choose

        chosen = [self.client.directory.get(peer_id)
                  for peer_id in sorted(choose(self.client, req, nodes, messages.JOB_GANG))]
        ranks: list[dict[str, Any]] = []
        try:
            for index, record in enumerate(chosen):
                assert record is not None
                rank_spec = replace(spec, gang={"rank": index, "size": nodes}, token=secrets.token_hex(16))
                _, info, link = self._record_on(record, rank_spec, manifest, None, progress)  # retried as a job is
                link.close()
                at = [list(link.address), *(list(a) for a in record.addresses if a != link.address)]
                own = info.get("at") if job_protocol.are_addresses(info.get("at")) else []  # where it says it listens
                ranks.append({"job": info["job"]["id"], "peer": record.advert.name, "at": at,
                              "peer_id": str(link.hello["peer"]), "own": own})
            hosts = distributed.rank_addresses([list(dict.fromkeys(host for host, _ in rank["at"])) for rank in ranks])
            gang = {"size": nodes, "ranks": [{**rank, "addr": host} for rank, host in zip(ranks, hosts)]}
            with tempfile.TemporaryDirectory(prefix="gpulayer-gang-") as empty:
                assert chosen[0] is not None
                watcher = replace(chosen[0], addresses=[tuple(a) for a in ranks[0]["at"]])  # where rank 0 was recorded
                _, info, link = self._record_on(watcher, replace(spec, gang=gang, token=secrets.token_hex(16)),
                                                folder.scan(empty), None)
                link.close()
        except BaseException:
            for rank in ranks:  # best effort: otherwise they fail once no watcher claimed them
                try:
                    Job(self, self._holders[holder_of(rank["job"])], {"id": rank["job"]}).stop(0)
                except (GPULayerError, OSError):
                    pass
            raise
        return Job(self, self._holders[holder_of(info["job"]["id"])], info["job"])

    def submit_function(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                        req: Requirements, **options: Any) -> Job:
        """fn(*args, **kwargs) as a job whose folder holds only the call; Job.result() gives its outcome."""
        packed = call.pack_call(fn, args, kwargs)
        name = options.pop("name", "") or getattr(fn, "__qualname__", "function")
        with tempfile.TemporaryDirectory(prefix="gpulayer-call-") as holder:
            path = Path(holder, call.CALL_FILE)
            path.parent.mkdir()
            path.write_bytes(packed)
            return self.submit(call.COMMAND, holder, with_inferred(req, fn, packed), name=name, function=True,
                               **options)

    # ---- one job ----------------------------------------------------------------------------

    def link(self, holder: Holder) -> JobLink:
        return JobLink(self.client, holder.addresses)


def _submit_over(link: JobLink, spec: JobSpec, manifest: folder.Manifest, array: tuple[int, int, int] | None,
                 heard: dict[str, Any] | None = None, progress: bool | None = False,
                 peer: str = "") -> messages.Message:
    """JOB_SUBMIT, then the blobs the peer lacks (their bar, ProgressBar's `enabled` = `progress`, if any are
    needed); the peer's JOB_INFO once it recorded the job (at once when it recorded this submission's token
    before). `heard` gets "sent" and the JOB_NEED's "holder"."""
    request_id = link.send(job_protocol.submit(0, spec, manifest.to_wire(), array))
    heard = {} if heard is None else heard
    heard["sent"] = True
    answer = link.answer(request_id, timeout=60.0)
    if answer["t"] == messages.JOB_INFO:
        return answer
    heard["holder"] = answer.get("holder")
    need = answer.get("need") or []
    if not isinstance(need, list) or not all(isinstance(digest, str) for digest in need):
        raise JobError("bad-reply", "the peer's JOB_NEED does not list digests")
    # The peer stops reading while its disk is behind (ADR 0022): a send waits for TCP's window as long as
    # it takes, not for the last receive's timeout; keepalive and TCP_USER_TIMEOUT notice a peer gone.
    link.conn.sock.settimeout(None)
    sizes = manifest.blobs() if need else {}  # a digest not in it: push_blobs refuses it
    bar = ProgressBar(sum(sizes.get(digest, 0) for digest in need), f"upload to {peer}", unit="B",
                      enabled=progress if need else False, delay=TRANSFER_DELAY_S)
    try:
        transfer.push_blobs(link.conn, manifest, need, request_id, bar.advance)
    finally:
        bar.close()
    return link.answer(request_id, timeout=None if need else 60.0)


class Job:
    """A job on its peer: `id`, `peer`, and its `state`, `exit_code` and `reason` as last heard."""

    def __init__(self, jobs: Jobs, holder: Holder, info: dict[str, Any]):
        self._jobs = jobs
        self._holder = holder
        self.info = info
        self.id: str = info["id"]
        self.kept: JobLink | None = None  # the submit's connection, for the first request (Jobs.submit's keep_link)

    def __repr__(self) -> str:
        return f"Job({self.id!r}, state={self.state!r}, peer={self.peer!r})"

    @property
    def peer(self) -> str:
        return self._holder.name

    @property
    def state(self) -> str:
        return str(self.info.get("state", "?"))

    @property
    def exit_code(self) -> int | None:
        return self.info.get("exit_code")

    @property
    def peak_memory(self) -> int | None:
        """The most memory the job used at once, in bytes, once it ended (None before, and for a job lost with
        its peer); `info["peak_memory_source"]` says what measured it (docs/jobs.md, "Peak memory")."""
        return self.info.get("peak_memory_bytes")

    @property
    def reason(self) -> str:
        return str(self.info.get("reason") or "")

    @property
    def ranks(self) -> list[Job]:
        """A gang job's ranks, in rank order (each a job on its own peer); [] for any other job."""
        return [Job(self._jobs, Holder(holder_of(r["job"]), r["peer"], [tuple(a) for a in r["at"]]), {"id": r["job"]})
                for r in (self.info.get("gang") or {}).get("ranks", [])]

    def _link(self) -> JobLink:
        """A connection to the job's peer; where it is not reachable where it was, the peers are asked
        again which of them holds the job (a restarted peer listens on another port). The submit's
        connection, where it was kept, serves the first request."""
        if self.kept is not None:
            link, self.kept = self.kept, None
            return link
        try:
            return self._jobs.link(self._holder)
        except PeerLost:
            self._holder = self._jobs.holder(self.id, fresh=True)
            return self._jobs.link(self._holder)

    def _ask(self, kind: str, on_data: Callable[[messages.Message, list[Any]], object] | None = None,
             local: Callable[[JobLink], bool] | None = None, **fields: Any) -> messages.Message:
        """Ask the job's peer (following it where it moved); `local(link)` True adds "local": true."""
        for _ in range(MAX_HOPS):
            with self._link() as link:
                extra = {"local": True} if local is not None and local(link) else {}
                reply = link.ask(job_protocol.request(kind, 0, self.id, **fields, **extra), on_data)
            job = reply.get("job")
            if isinstance(job, dict):
                self.info = job
            if not isinstance(job, dict) or job.get("state") != MOVED or not isinstance(job.get("moved"), str):
                return reply
            self._holder = self._jobs.located(job["moved"], self.id)  # pulled by that peer: asked there
        raise JobError("no-job", f"job {self.id} moved more than {MAX_HOPS} times while it was asked for")

    def close(self) -> None:
        """Close the submit's connection if it was kept and not used."""
        if self.kept is not None:
            self.kept.close()
            self.kept = None

    def refresh(self) -> Job:
        """Ask its peer for its state now."""
        self._ask(messages.JOB_WAIT, timeout=0)
        return self

    def wait(self, timeout: float | None = None) -> str:
        """Block until the job ends (or `timeout` s pass); its state."""
        self._ask(messages.JOB_WAIT, timeout=timeout)
        return self.state

    def stop(self, grace: float = job_protocol.DEFAULT_GRACE_S) -> str:
        """SIGTERM to its processes, SIGKILL after `grace` s; returns once it ended (its state)."""
        self._ask(messages.JOB_STOP, grace=grace)
        return self.state

    def remove(self) -> None:
        """Forget the ended job on its peer and delete its folder there (a gang's: its ranks' too)."""
        self._ask(messages.JOB_RM)
        for rank in self.ranks:
            rank.remove()

    def logs(self, follow: bool = False, tail: int | None = None, out: IO[bytes] | None = None) -> str:
        """Its stdout and stderr as written, from the start (or the last `tail` lines); with `follow`,
        until it ends. With `out`, the bytes go there as they come (and "" is returned). A gang's is
        every rank's, each line after `[rank K] ` (the gang's own notes after `[gang] `): with `follow`
        in the order they come, else rank after rank."""
        pieces: list[bytes] = []
        lock = threading.Lock()

        def write(data: bytes) -> None:
            with lock:
                if out is None:
                    pieces.append(data)
                else:
                    out.write(data)
                    out.flush()

        sources = [(f"[rank {i}] ".encode(), rank) for i, rank in enumerate(self.ranks)]
        if not sources:
            self._ask(messages.JOB_LOGS, lambda _msg, buffers: write(bytes(buffers[0]) if buffers else b""),
                      offset=0, follow=follow, tail=tail)
            return b"".join(pieces).decode("utf-8", "replace")
        sources.append((b"[gang] ", self))
        if follow:
            threads = [threading.Thread(target=_prefixed_log, args=(job, prefix, write, follow, tail), daemon=True)
                       for prefix, job in sources]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for prefix, job in sources:
                _prefixed_log(job, prefix, write, follow, tail)
        return b"".join(pieces).decode("utf-8", "replace")

    def fetch(self, paths: list[str] | None = None, to: str | os.PathLike[str] = ".", force: bool = False,
              rank: int | None = None, progress: bool | None = None) -> list[Path]:
        """Bring files of the job's folder into `to` (default: what the job created or changed); nothing is
        written when one would overwrite a file, unless `force`. Returns the paths written. A gang's: those
        of its rank `rank` (default 0). `progress`: a bar of the bytes (None: on a terminal, once the fetch
        takes TRANSFER_DELAY_S; True: always; False: never)."""
        ranks = self.ranks
        if ranks or rank is not None:
            if not 0 <= (rank or 0) < len(ranks):
                raise JobError("bad-request", f"job {self.id} has {len(ranks)} rank(s): no rank {rank}")
            return ranks[rank or 0].fetch(paths, to, force, progress=progress)
        pool = transfer.Pool()  # chunks received into buffers used again, written on a thread of their own
        receiver = local_fetch.Receiver(to, force, transfer.DiskThread(), pool.release)
        bar = ProgressBar(None, f"fetch from {self.peer}", unit="B", enabled=progress, delay=TRANSFER_DELAY_S)

        def attach(link: JobLink) -> bool:
            link.conn.reader.allocate = pool.allocate
            return receiver.attach(link)

        def feed(msg: messages.Message, buffers: list[Any]) -> bool:
            done = receiver.feed(msg, buffers)
            bar.reach(receiver.received, receiver.total)
            return done

        try:
            self._ask(messages.JOB_FETCH, feed, attach, paths=paths)
            receiver.finish()
        finally:
            bar.close()
            receiver.abort()
        log.debug("fetched %d file(s) of job %s, %d by descriptor on a local link", len(receiver.files or []),
                  self.id, receiver.passed)
        return [Path(to, f[0]) for f in receiver.files or []]

    def result(self, timeout: float | None = None) -> Any:
        """A function job's return value, or its exception raised here with the remote traceback."""
        if not self.info.get("function"):
            raise JobError("bad-request", f"job {self.id} runs a command, not a function: it has no result")
        if self.wait(timeout) not in ENDED:
            raise TimeoutError(f"job {self.id} is still {self.state} after {timeout} s")
        with tempfile.TemporaryDirectory(prefix="gpulayer-result-") as here:
            try:
                self.fetch([call.OUTCOME_FILE], here, progress=False)
            except JobError:
                raise JobError("no-result", f"job {self.id} ended {self.state} without a result"
                                            f"{': ' + self.reason if self.reason else ''}") from None
            return call.outcome(Path(here, call.OUTCOME_FILE).read_bytes())


def _prefixed_log(job: Job, prefix: bytes, write: Callable[[bytes], None], follow: bool, tail: int | None) -> None:
    """A job's log, each line after `prefix`, to `write` (whole lines only: a line cut between pieces is
    joined first). A peer that cannot be asked gives a line that says why."""
    partial = b""

    def take(_msg: messages.Message, buffers: list[Any]) -> None:
        nonlocal partial
        *lines, partial = (partial + (bytes(buffers[0]) if buffers else b"")).split(b"\n")
        if lines:
            write(b"".join(prefix + line + b"\n" for line in lines))

    try:
        job._ask(messages.JOB_LOGS, take, offset=0, follow=follow, tail=tail)
    except (GPULayerError, OSError) as exc:
        if partial:
            write(prefix + partial + b"\n")
        partial = f"gpulayer: the log of job {job.id} cannot be read: {exc}".encode()
    if partial:
        write(prefix + partial + b"\n")


def exit_status(job: Job) -> int:
    """The exit status a shell gives for the job: its code, 128+N for signal N, 1 when it has none."""
    code = job.exit_code
    if code is None:
        return 0 if job.state == "succeeded" else 1
    return 128 - code if code < 0 else code

