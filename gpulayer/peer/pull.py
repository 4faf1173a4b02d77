"""Peers pull waiting work (docs/adr/0019-pulling-queued-jobs.md): a peer with a free slot takes over a job
queued on another, with that owner's agreement over the secure channel, exactly once.

The puller holds one connection to each peer it knows (mDNS adverts and gossip members) and, while it has
a free slot and nothing queued, keeps one JOB_PULL waiting there: the owner answers it at once with a
queued job that fits the puller (its advert), or when one is queued, or with nothing after `wait` s. The
hand-over has two phases, each recorded in both SQLite stores:

1. The owner takes the job out of its queue and records it `moving` (to the puller) before it offers it;
   the puller gets the blobs it lacks (JOB_TAKE "need"), builds the folder and records the job
   `arriving`, then asks to commit (JOB_TAKE "commit").
2. The owner records it `moved` (a forwarding record naming the puller) and says so; only then does the
   puller queue it. A "moving" job whose connection goes, or whose commit does not come in time, is
   queued again on its owner; an "arriving" one whose answer was lost asks again (the commit is
   idempotent) on the next connection to its owner, and is dropped when the owner says no.

The owner's "moved" is the one point of decision: the job runs on the puller only after it, on the owner
only if it never came. A job that already ran (preempted, queued again), one pinned with `--peer`, and an
array's jobs never move.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..checks import seconds_from_env
from ..discovery import Address
from ..errors import GPULayerError
from ..jobs import folder, transfer
from ..jobs.store import ARRIVING, LOST, MOVED, MOVING, QUEUED, JobRow, JobSpec, check_job_id, kill_point
from ..matching import Requirements, match
from ..protocol import jobs as job_protocol, messages
from ..resources.model import Advert, features_of
from ..transport import blocking
from .slots import JobHolder

if TYPE_CHECKING:
    from .jobs import JobConnection, Jobs

log = logging.getLogger("gpulayer.peer")

PULL_WAIT_S = 120.0  # how long an owner holds a puller's JOB_PULL before it answers "nothing" (the cost at rest)
HANDOVER_S = 60.0  # a "moving" job not committed in this time is queued again on its owner
SCAN_S = 1.0  # how often the puller looks for peers it holds no connection to
RETRY_S = 2.0  # after a failed connection to an owner, the puller waits this long before the next
CONNECT_TIMEOUT_S = 5.0
PING_S = 10.0  # while a JOB_PULL waits, a PING this often: the owner drops a connection silent for 15 s
ANSWER_TIMEOUT_S = 30.0  # an owner's answer to a JOB_TAKE step (the blobs may take longer: see `idle`)
MAX_OWNERS = 64  # connections (and threads) a puller holds to owners at most
LOOKAHEAD = 256  # how deep an owner looks in its queue for a job that fits a puller
ARRIVING_ENV = "GPULAYER_PULL_ARRIVING_S"
ARRIVING_S = 86400.0  # an arriving job whose owner is unheard this long is recorded lost on the puller


def arriving_bound_from_env() -> float:
    """Seconds a puller keeps an arriving job while its owner is unheard (GPULAYER_PULL_ARRIVING_S, default a
    day); ConfigError for a value that is not a positive number."""
    return seconds_from_env(ARRIVING_ENV, ARRIVING_S)

T = TypeVar("T")


def movable(row: JobRow) -> bool:
    """Whether a peer may pull the job: queued, never run (its folder is as it was shipped, with no work of
    its in it), not pinned to its peer (--peer), not an array's (a stop of the array acts on its peer), not a
    gang's (its watcher reserved that peer)."""
    return row.state == QUEUED and not (row.spec.pinned or row.attempts or row.restarts or row.spec.array
                                        or row.spec.gang)


# ---- the owner's side ---------------------------------------------------------------------------------


@dataclass(eq=False)
class Ask:
    """A puller's JOB_PULL held until a job fits it."""

    conn: JobConnection
    request_id: int
    holder: str  # the puller's
    advert: Advert
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class Moving:
    """A job offered to a puller, out of the queue, until the puller commits (or the hand-over is undone)."""

    conn: JobConnection
    holder: str
    timer: asyncio.TimerHandle


class Owner:
    """The owner's side of the hand-over: JOB_PULL answered with a queued job that fits the puller, or
    held until one is queued; JOB_TAKE's steps (the blobs, the commit, a refusal)."""

    def __init__(self, jobs: Jobs):
        self.jobs = jobs
        self.waiting: list[Ask] = []
        self.moving: dict[str, Moving] = {}

    def pull(self, conn: JobConnection, msg: messages.Message) -> None:
        try:
            advert = Advert.from_txt(msg["advert"])
        except ValueError as exc:
            return conn.channel.write(messages.error("bad-request", f"the puller's advert: {exc}", msg["id"]))
        if msg["holder"] == self.jobs.holder:
            return conn.channel.write(messages.error("bad-request", "a peer does not pull its own jobs", msg["id"]))
        for old in [a for a in self.waiting if a.conn is conn]:  # one ask a connection waits: the last
            self._drop(old)
            self._nothing(old)
        ask = Ask(conn, msg["id"], msg["holder"], advert)
        if self._offer(ask):
            return
        if not msg["wait"]:
            return self._nothing(ask)
        ask.timer = asyncio.get_running_loop().call_later(msg["wait"], self._expire, ask)
        self.waiting.append(ask)

    def queued(self, row: JobRow, task: JobHolder) -> None:
        """The job `row` stayed queued: offer it to the first puller waiting that it fits."""
        if not movable(row):
            return
        for ask in list(self.waiting):
            if ask.conn.channel.closed:
                self._drop(ask)
            elif not match(task.req, ask.advert):
                self._drop(ask)
                self._hand(ask, row, task)
                return

    def _drop(self, ask: Ask) -> None:
        if ask in self.waiting:
            self.waiting.remove(ask)
        if ask.timer is not None:
            ask.timer.cancel()

    def _expire(self, ask: Ask) -> None:
        if ask in self.waiting:
            self.waiting.remove(ask)
            self._nothing(ask)

    def _nothing(self, ask: Ask) -> None:
        ask.conn.channel.write({"t": messages.JOB_OFFER, "id": ask.request_id, "holder": self.jobs.holder, "job": None})

    def _candidate(self, advert: Advert) -> tuple[JobRow, JobHolder] | None:
        """The first queued job, in the queue's order, that may move and fits the puller's advert."""
        for task in islice(self.jobs.scheduler.state.queue, LOOKAHEAD):
            if not isinstance(task, JobHolder) or self.jobs.queued.get(task.job_id) is not task:
                continue
            row = self.jobs.store.get(task.job_id)
            if row is not None and movable(row) and not match(task.req, advert):
                return row, task
        return None

    def _offer(self, ask: Ask) -> bool:
        """Offer the puller a job: out of the queue and recorded moving (durably) first. False if none fits."""
        found = self._candidate(ask.advert)
        return found is not None and self._hand(ask, *found)

    def _hand(self, ask: Ask, row: JobRow, task: JobHolder) -> bool:
        if not self.jobs.scheduler.withdraw(task):
            return False
        del self.jobs.queued[row.id]
        self.jobs.store.update(row.id, state=MOVING, moved=ask.holder)
        timer = asyncio.get_running_loop().call_later(HANDOVER_S, self.undo, row.id, "no commit in time")
        self.moving[row.id] = Moving(ask.conn, ask.holder, timer)
        manifest = json.loads((self.jobs.store.folder(row.id) / "manifest.json").read_text())
        log.info("job %s offered to the peer of jobs %s-*", row.id, ask.holder)
        ask.conn.channel.write({"t": messages.JOB_OFFER, "id": ask.request_id, "holder": self.jobs.holder,
                                "job": {"id": row.id, "spec": asdict(row.spec), "submitted": row.submitted},
                                "files": manifest})
        return True

    def take(self, conn: JobConnection, msg: messages.Message) -> None:
        """A step of a hand-over: only the connection the job was offered on, for the holder it was offered to,
        may take it; a commit already recorded is acknowledged again (the puller may ask after a lost answer)."""
        job_id, step = msg["job"], msg["step"]
        row = self.jobs.store.get(job_id)
        moving = self.moving.get(job_id)
        if step == "commit" and row is not None and row.state == MOVED and row.moved == msg["holder"]:
            return self._moved(conn, msg, row)
        if row is None or row.state != MOVING or moving is None or moving.conn is not conn \
                or moving.holder != msg["holder"]:
            shown = row.state if row is not None else "not known here"
            return conn.channel.write(messages.error(
                "no-handover", f"job {job_id} is not being handed over to this peer ({shown})", msg["id"]))
        if step == "refuse":
            self.undo(job_id, "the puller refused it")
            return conn.channel.write({"t": messages.JOB_INFO, "id": msg["id"], "job": None})
        if step == "need":
            self.jobs.scheduler.spawn(self._send_blobs(conn, msg, row))
            return None
        moving.timer.cancel()
        del self.moving[job_id]
        self.jobs.store.update(job_id, state=MOVED, ended=time.time(),
                               reason=f"pulled by the peer of jobs {msg['holder']}-*")
        kill_point("job-moved")
        self.jobs.discard(self.jobs.store.folder(job_id))
        log.info("job %s moved to the peer of jobs %s-*", job_id, msg["holder"])
        self.jobs.gone(job_id)
        moved = self.jobs.store.get(job_id)
        assert moved is not None
        self._moved(conn, msg, moved)

    def _moved(self, conn: JobConnection, msg: messages.Message, row: JobRow) -> None:
        conn.channel.write({"t": messages.JOB_INFO, "id": msg["id"], "job": row.public()})

    async def _send_blobs(self, conn: JobConnection, msg: messages.Message, row: JobRow) -> None:
        """The blobs the puller lacks, from this peer's blob store, then a JOB_INFO. A blob the store lacks intact (a
        running job wrote into its file, ADR 0025) is read from the queued job's own copy (the puller checks every
        blob against its digest)."""
        home = self.jobs.store.folder(row.id)
        blobs = self.jobs.blobs
        try:
            shipped = folder.Manifest.from_wire(json.loads((home / "manifest.json").read_text()), 1 << 62)
            manifest = folder.Manifest(shipped.entries, {
                e.path: blobs.blob_path(e.digest) if blobs.intact(e.digest, e.size)
                else str(folder.resolve_inside(home / "work", e.path)) for e in shipped.entries})
            pool = transfer.Pool()  # each piece read into a buffer that comes back once sealed
            for piece, buffers in transfer.blob_messages(manifest, msg.get("need", []), msg["id"],
                                                         allocate=pool.allocate):
                conn.channel.write(piece, buffers, partial(pool.release, buffers[0]) if buffers else None)
                await conn.channel.drain(transfer.CHUNK)
                if conn.channel.closed:
                    return
        except (OSError, ValueError, folder.FolderError) as exc:
            self.undo(row.id, f"its blobs could not be sent: {exc}")
            return conn.channel.write(messages.error("bad-request", f"the blobs: {exc}", msg["id"]))
        conn.channel.write({"t": messages.JOB_INFO, "id": msg["id"], "job": None})

    def undo(self, job_id: str, why: str) -> None:
        """The hand-over did not complete: the job is queued here again (if it is still moving)."""
        moving = self.moving.pop(job_id, None)
        if moving is None:
            return
        moving.timer.cancel()
        row = self.jobs.store.get(job_id)
        if row is None or row.state != MOVING:
            return
        log.info("job %s stays: %s", job_id, why)
        self.jobs.store.update(job_id, state=QUEUED, moved="")
        self.jobs.requeue(job_id)

    def cancel(self, job_id: str) -> bool:
        """The job is stopped while it is being handed over: the puller's commit will be refused. False if it
        is not being handed over."""
        moving = self.moving.pop(job_id, None)
        if moving is not None:
            moving.timer.cancel()
        return moving is not None

    def forget(self, conn: JobConnection) -> None:
        """A connection went: its asks are dropped and its hand-overs not committed are undone."""
        for ask in [a for a in self.waiting if a.conn is conn]:
            self._drop(ask)
        for job_id in [j for j, m in self.moving.items() if m.conn is conn]:
            self.undo(job_id, "the puller's connection went before it committed")


# ---- the puller's side --------------------------------------------------------------------------------


class OwnerLink:
    """One authenticated connection from this peer to an owner, used on a pull thread (blocking)."""

    def __init__(self, key: bytes, client_id: str, addresses: list[Address]):
        self.conn, self.hello, _ = blocking.handshaken(addresses, key, client_id, CONNECT_TIMEOUT_S)
        self._ids = iter(range(1, 1 << 62))

    def close(self) -> None:
        """Close it; a pull thread blocked on it wakes (shutdown does that, close alone may not)."""
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()

    def send(self, msg: messages.Message) -> int:
        msg["id"] = next(self._ids)
        self.conn.send(msg)
        return int(msg["id"])

    def answer(self, request_id: int, timeout: float) -> messages.Message:
        """The owner's JOB_OFFER or JOB_INFO for `request_id`; GPULayerError for its ERROR (code first)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg, _ = self.conn.recv(min(deadline, time.monotonic() + PING_S))
            except socket.timeout:
                if time.monotonic() >= deadline:
                    raise
                self.conn.send(messages.ping())
                continue
            if msg.get("id") != request_id:
                continue
            if msg["t"] == messages.ERROR:
                raise Refused(messages.printable(msg.get("code"), 40), messages.printable(msg.get("message"), 400))
            if msg["t"] in (messages.JOB_OFFER, messages.JOB_INFO):
                return msg

    def ask(self, msg: messages.Message, timeout: float = ANSWER_TIMEOUT_S) -> messages.Message:
        return self.answer(self.send(msg), timeout)

    def blobs(self, msg: messages.Message, store: folder.BlobStore, expected: dict[str, int]) -> None:
        """JOB_TAKE "need": receive the blobs asked for into `store`, then the owner's JOB_INFO."""
        request_id = self.send(msg)
        if expected:
            transfer.receive_blobs(self.conn, store, expected)
        self.answer(request_id, ANSWER_TIMEOUT_S)


class Refused(GPULayerError):
    """The owner answered a step with an ERROR."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class Watch:
    """The puller's connection to one owner (None until made) and that owner's holder, once heard."""

    link: OwnerLink | None = None
    holder: str = ""
    task: asyncio.Task[None] | None = None
    fresh: bool = True  # the next ask is the first on this connection: answered at once
    failures: int = 0
    ignored: bool = False  # this peer itself, one that does not answer JOB_PULL, or one watched at other addresses


class Puller:
    """This peer's pulling: one `Watch` a known peer, a JOB_PULL waiting at each while a slot is free."""

    def __init__(self, jobs: Jobs, key: bytes, peer_id: str, advert: Callable[[], Advert],
                 owners: Callable[[], list[list[Address]]]):
        self.jobs = jobs
        self.key = key
        self.peer_id = peer_id
        self.advert = advert
        self.owners = owners
        self.watches: dict[tuple[Address, ...], Watch] = {}
        self._watching: dict[str, Watch] = {}  # the peer id its HELLO named -> its watch
        self._task: asyncio.Task[None] | None = None
        self._heard = asyncio.Event()  # a new peer was heard of: look at once
        self._room = asyncio.Event()
        self._taking = 0
        self.arriving_bound = arriving_bound_from_env()
        self._unheard: dict[str, float] = {}  # an arriving job -> since when (monotonic) its owner is unheard
        self._committing: set[str] = set()
        self._pool = ThreadPoolExecutor(MAX_OWNERS, thread_name_prefix="gpulayer-pull")

    def verified(self) -> set[str]:
        """The peers this one holds a connection to, by the id their handshake proved."""
        return {peer for peer, watch in self._watching.items() if watch.link is not None}

    def room(self) -> int:
        """Slots free for a pulled job: none while anything waits here, less the jobs being taken."""
        state = self.jobs.scheduler.state
        if state.queued or self.jobs.scheduler.stopping:
            return 0
        return sum(s.ready for s in state.slots) - self._taking

    def changed(self) -> None:
        """The scheduler acted (a slot freed or was taken): wake the watches, or let them rest."""
        if self.room() > 0:
            self._room.set()
        else:
            self._room.clear()

    async def run(self) -> None:
        """Watch each peer this one knows, until `stop`."""
        self._task = asyncio.current_task()
        try:
            while True:
                for addresses in self.owners()[:MAX_OWNERS]:
                    watch = self.watches.setdefault(tuple(addresses), Watch())
                    if not watch.ignored and (watch.task is None or watch.task.done()):
                        watch.task = asyncio.get_running_loop().create_task(self._watch(addresses, watch))
                self.changed()
                self._expire_arriving()
                self._heard.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._heard.wait(), SCAN_S)
        finally:
            for watch in self.watches.values():
                if watch.task is not None:
                    watch.task.cancel()
                if watch.link is not None:
                    watch.link.close()
            self._pool.shutdown(wait=False, cancel_futures=True)

    def heard(self) -> None:
        """A peer was heard of (discovery's thread may call this through the loop): look at the owners now."""
        self._heard.set()

    def stop(self) -> None:
        """The peer stops: no more pulls (a hand-over under way is undone by its owner, or settled later)."""
        if self._task is not None:
            self._task.cancel()

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _watch(self, addresses: list[Address], watch: Watch) -> None:
        """While a slot is free, keep a JOB_PULL waiting at this owner; take what it offers. Ends when the
        peer is this one, does not pull, or failed and is not known any more."""
        while True:
            await self._room.wait()
            try:
                if watch.link is None:
                    watch.link = await self._call(OwnerLink, self.key, f"peer-{self.peer_id}", addresses)
                    watch.fresh = True
                    peer = watch.link.hello["peer"]
                    other = self._watching.get(peer)
                    if peer == self.peer_id or messages.JOB_PULL not in features_of(watch.link.hello["advert"]) \
                            or (other is not None and other is not watch and other.link is not None):
                        watch.link.close()
                        watch.link, watch.ignored = None, True
                        return
                    self._watching[peer] = watch
                wait = 0.0 if watch.fresh else PULL_WAIT_S
                offer = await self._call(watch.link.ask, {
                    "t": messages.JOB_PULL, "holder": self.jobs.holder, "advert": self.advert().to_txt(),
                    "wait": wait}, wait + ANSWER_TIMEOUT_S)
                watch.holder = messages.printable(offer.get("holder"), 12)
                if watch.fresh:
                    watch.fresh = False
                    await self._settle(watch.link, watch.holder)
                if offer.get("job") is not None:
                    await self._take(watch.link, watch.holder, offer)
                watch.failures = 0
            except (OSError, ConnectionError, GPULayerError, ValueError) as exc:
                if watch.link is not None:
                    watch.link.close()
                    watch.link = None
                watch.failures += 1
                log.debug("pulling from %s: %s", addresses, exc)
                if list(addresses) not in self.owners():
                    return
                if watch.failures > 1:  # the first: a connection the owner closed while this peer was busy
                    await asyncio.sleep(min(RETRY_S * watch.failures, 30.0))

    def _checked(self, offer: messages.Message) -> tuple[str, JobSpec, folder.Manifest, float] | str:
        """(id, spec, manifest, submitted) of an offer, or why this peer does not take it."""
        job = offer.get("job")
        if not isinstance(job, dict) or check_job_id(job.get("id")) is not None:
            return "an offer names a job by its id"
        fields = job.get("spec")
        submitter = fields.get("submitter") if isinstance(fields, dict) else None
        spec = job_protocol.check_spec(fields, submitter if isinstance(submitter, str) else "")
        if isinstance(spec, str):
            return spec
        try:
            manifest = folder.Manifest.from_wire(offer.get("files"))
            reasons = match(Requirements.from_wire(spec.req), self.advert())
        except (ValueError, folder.FolderError) as exc:
            return str(exc)
        submitted = job.get("submitted")
        if reasons or not isinstance(submitted, (int, float)) or isinstance(submitted, bool):
            return "; ".join(reasons) or "an offer gives the job's submit time"
        if self.jobs.store.get(job["id"]) is not None:
            return f"job {job['id']} is known here already"
        if self.room() <= 0:
            return "no free slot here now"
        return job["id"], spec, manifest, float(submitted)

    async def _take(self, link: OwnerLink, owner: str, offer: messages.Message) -> None:
        """Take an offered job: the blobs this peer lacks, its folder, `arriving` recorded, then the commit."""
        checked = self._checked(offer)
        job = offer["job"]
        if isinstance(checked, str):
            log.info("not taking job %s: %s", messages.printable(job.get("id") if isinstance(job, dict) else "?", 40),
                     checked)
            if isinstance(job, dict) and isinstance(job.get("id"), str):
                await self._call(link.ask, self._step(job["id"], "refuse"))
            return
        job_id, spec, manifest, submitted = checked
        self._taking += 1
        self.changed()
        try:
            sizes = manifest.blobs()
            self.jobs.janitor.use(sizes)  # before `missing`: a prune under way keeps them (peer/janitor.py)
            need = self.jobs.blobs.missing(sizes)
            self.jobs.pulling[job_id] = manifest
            await self._call(link.blobs, {**self._step(job_id, "need"), "need": need}, self.jobs.blobs,
                             {d: sizes[d] for d in need})
            incoming = await self._call(self._build, manifest)
            try:
                self.jobs.store.add_arriving(job_id, spec, submitted, manifest.total_bytes, owner, incoming)
            except BaseException:
                self.jobs.discard(incoming)
                raise
        finally:
            self.jobs.pulling.pop(job_id, None)
            self._taking -= 1
        await self._commit(link, job_id)

    def _build(self, manifest: folder.Manifest) -> Path:
        """A job's folder built from the blobs, in a fresh folder of `reserve` (recorded with the job)."""
        incoming = Path(self.jobs.store.reserve())
        try:
            folder.materialise(manifest, self.jobs.blobs, incoming / "work")
            (incoming / "manifest.json").write_text(json.dumps(manifest.to_wire()))
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)
            raise
        return incoming

    def _step(self, job_id: str, step: str) -> messages.Message:
        return {"t": messages.JOB_TAKE, "job": job_id, "holder": self.jobs.holder, "step": step}

    async def _commit(self, link: OwnerLink, job_id: str) -> None:
        """Ask the owner to record the job moved; queue it here once it has, drop it when it says no. With
        no answer (the connection went), it stays arriving until the next connection to the owner."""
        self._committing.add(job_id)
        try:
            reply = await self._call(link.ask, self._step(job_id, "commit"))
        except Refused as exc:
            log.info("job %s stays with its owner: %s", job_id, exc)
            self.jobs.delete(job_id)
            return
        finally:
            self._committing.discard(job_id)
        job = reply.get("job")
        if not isinstance(job, dict) or job.get("state") != MOVED or job.get("moved") != self.jobs.holder:
            log.warning("job %s: the owner's commit answer is not 'moved here': dropped", job_id)
            self.jobs.delete(job_id)
            return
        self.jobs.store.update(job_id, state=QUEUED, reason="")
        log.info("job %s pulled from the peer of jobs %s-*", job_id, link.hello["peer"])
        self.jobs.requeue(job_id)

    async def _settle(self, link: OwnerLink, owner: str) -> None:
        """The jobs that arrived from `owner` without its word on the commit: ask again."""
        for row in self.jobs.store.rows([ARRIVING]):
            if row.moved == owner:
                await self._commit(link, row.id)

    def _expire_arriving(self) -> None:
        """An arriving job whose owner was not heard for `arriving_bound` s (since this peer started, or its
        last connection to the owner) is recorded lost here and its folder deleted: the owner may have
        recorded it moved, or not (and run it itself). Never queued here after that: only arriving jobs
        are ever committed."""
        heard = {w.holder for w in self.watches.values() if w.link is not None and w.holder}
        now = time.monotonic()
        for row in self.jobs.store.rows([ARRIVING]):
            if row.moved in heard or row.id in self._committing:
                self._unheard.pop(row.id, None)
            elif now - self._unheard.setdefault(row.id, now) >= self.arriving_bound:
                del self._unheard[row.id]
                reason = (f"its owner, the peer of jobs {row.moved}-*, was not heard for {self.arriving_bound:g} s "
                          "after it offered the job here: it may have run there (this peer never ran it)")
                self.jobs.store.update(row.id, state=LOST, ended=time.time(), reason=reason)
                self.jobs.discard(self.jobs.store.folder(row.id))
                log.warning("job %s lost: %s", row.id, reason)
                self.jobs.gone(row.id)
