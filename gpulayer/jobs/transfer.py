"""A job's bytes over a connection's secure channel: blobs up (the working folder), files down (fetch).

Upload. The submitter sends the manifest in its job message (`Manifest.to_wire`); the peer answers
with the digests its `BlobStore` lacks (`BlobStore.missing`); the submitter sends only those as BLOB
messages (`push_blobs`): blobs of up to PACK_MAX bytes whole, packed several to a message, then each
larger one in chunks of CHUNK bytes; every chunk is an out-of-band buffer read straight from the files
into one reused buffer and sealed from there. The peer feeds them to a `BlobReceiver`, which writes
each blob as it comes and stores it only when its size and digest check out (`BlobWriter`), then
`materialise`s the job's folder. A resubmit of an unchanged folder sends the manifest and nothing else.

    BLOB {"id": request, "pack": [[digest, size], ...]} + [their bytes, one after another]  (no buffer: all empty)
    BLOB {"id": request, "d": digest, "off": offset, "size": the blob's size} + [chunk]

Fetch. The peer sends a FILE header with the files' list (`listing`), then each file's bytes as FILE
chunks (`send_files`, or `file_messages` on the event loop); the submitter's `FileReceiver` checks
every path and what it would overwrite before writing anything, writes each file beside its final
name and renames it into place when its last byte is in, so a fetch that breaks leaves no half file.

    FILE {"id": request, "files": [[path, size, executable], ...]}     then, in order,
    FILE {"id": request, "n": index in the list, "off": offset} + [chunk]   (no chunk for an empty file)

A sender that fails in the middle (a file gone, a path refused) sends ERROR with the request's id
(`messages.error`); the receiver raises FolderError with its message. After any FolderError the stream is
mid-way: the caller closes the connection. The peer runs the same code on a connection handed to a
thread (blocking) or drives `BlobReceiver` and `file_messages` from its event loop.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, Protocol

from ..protocol import framing, messages
from .folder import (BlobStore, BlobWriter, Builder, FolderError, Manifest, PathLike, Place, check_relpath,
                     files_under, new_digest, resolve_inside)
from .store import pause_point

BLOB, FILE = messages.BLOB, messages.FILE
CHUNK = 4 << 20  # bytes a BLOB or FILE message carries at most
IDLE_TIMEOUT = 60.0  # seconds a receiver waits for the next message before it gives up
MAX_LISTED = 200_000  # files one fetch may bring
BACKLOG = 16 << 20  # bytes of received chunks that may wait for the disk (ADR 0024: each is fresh memory)
PACK_MAX = 1 << 20  # blobs of at most this many bytes travel whole, several to a BLOB message


class Connection(Protocol):
    """What the blocking helpers need: `transport.blocking.BlockingConnection` (or a PeerConnection's own)."""

    def send(self, msg: messages.Outgoing, buffers: messages.Buffers = ()) -> None: ...

    def recv(self, deadline: float | None = None) -> tuple[messages.Message, list[Any]]: ...


def _open_sized(path: PathLike, size: int) -> int:
    """A descriptor of the file `path`; FolderError if it is not `size` bytes any more."""
    fd = os.open(path, os.O_RDONLY)
    if os.fstat(fd).st_size != size:
        os.close(fd)
        raise FolderError(f"{path} changed size since it was scanned")
    return fd


def _read_into(fd: int, view: memoryview, path: PathLike) -> None:
    """Fill `view` from the descriptor; FolderError if the file ends first."""
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if not n:
            raise FolderError(f"{path} ended early while it was sent")
        got += n


def _chunks(path: PathLike, size: int, step: int,
            allocate: Callable[[int], memoryview]) -> Iterator[tuple[int, memoryview]]:
    """(offset, piece) of a file of `size` bytes, in pieces of `step` bytes (the last shorter), each read into
    `allocate(its size)`; FolderError if it is not that size any more."""
    fd = _open_sized(path, size)
    try:
        for offset in range(0, size, step):
            piece = allocate(min(step, size - offset))
            _read_into(fd, piece, path)
            yield offset, piece
    finally:
        os.close(fd)


# --- upload: submitter -> peer ------------------------------------------------------------------------


def blob_messages(manifest: Manifest, missing: list[str], request_id: int, chunk: int = CHUNK,
                  allocate: Callable[[int], memoryview] | None = None,
                  ) -> Iterator[tuple[messages.Message, list[memoryview]]]:
    """The BLOB messages of the `missing` digests (a scanned manifest's, read from its sources), with their
    buffers: small blobs packed together, then each large one in chunks. Each message's buffer is a view of
    `allocate(chunk)` (the event loop's `Pool`, whose buffers come back once sealed), or without it of one
    read buffer for all (send each message before asking for the next)."""
    sizes, sources = manifest.blobs(), manifest.source_of()
    unknown = [d for d in missing if d not in sizes]
    if unknown:
        raise FolderError(f"the peer asked for {str(unknown[0])[:16]!r}, which is not in the manifest")
    if allocate is None:
        one = memoryview(bytearray(chunk))
        allocate = lambda n: one[:n]  # noqa: E731
    view = allocate(chunk)
    pack: list[list[Any]] = []
    used = 0
    for digest in (d for d in missing if sizes[d] <= PACK_MAX):
        size = sizes[digest]
        if used + size > chunk:
            yield messages.blob_pack(request_id, pack), [view[:used]]
            pack, used, view = [], 0, allocate(chunk)
        fd = _open_sized(sources[digest], size)
        try:
            _read_into(fd, view[used:used + size], sources[digest])
        finally:
            os.close(fd)
        pack.append([digest, size])
        used += size
    if pack:
        yield messages.blob_pack(request_id, pack), [view[:used]] if used else []
    for digest in (d for d in missing if sizes[d] > PACK_MAX):
        for offset, piece in _chunks(sources[digest], sizes[digest], chunk, allocate):
            yield messages.blob_chunk(request_id, digest, offset, sizes[digest]), [piece]


def push_blobs(conn: Connection, manifest: Manifest, missing: list[str], request_id: int,
               progress: Callable[[int], object] | None = None) -> int:
    """Send the blobs the peer lacks (blocking); returns the bytes of content sent. `progress(n)`, if given, is
    told the bytes of each message once sent."""
    sent = 0
    for msg, buffers in blob_messages(manifest, missing, request_id):
        conn.send(msg, buffers)
        nbytes = sum(b.nbytes for b in buffers)
        sent += nbytes
        if progress is not None:
            progress(nbytes)
    return sent


class DiskThread:
    """A receiver's disk work (create, write, hash, rename), done in order on a thread of its own so that it
    overlaps with receiving and decrypting; at most `limit` bytes of chunks wait for it (`run` blocks
    meanwhile). After its first error, or `stop`, it skips the rest; `run` or `finish` raises that error.

    With `on_room`, `run` never blocks: the caller (the peer's event loop) stops reading while `full`, and
    `on_room()` is called (from this thread) each time the bytes waiting fall below the limit again.
    `beside` runs a piece of that work on a second thread, at the same time as this one's (a chunk hashed
    while it is written: both let go of the GIL)."""

    def __init__(self, limit: int = BACKLOG, on_room: Callable[[], object] | None = None):
        self.limit = limit
        self._on_room = on_room
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], int] | None] = queue.SimpleQueue()
        self._room = threading.Condition()
        self._waiting = 0  # bytes of the chunks queued
        self._error: BaseException | None = None
        self._skip = False
        self._thread = threading.Thread(target=self._loop, name="gpulayer-disk", daemon=True)
        self._thread.start()
        self._second: ThreadPoolExecutor | None = None  # `beside`'s, started at its first use

    @property
    def full(self) -> bool:
        """Whether `limit` bytes or more wait for the disk."""
        return self._waiting >= self.limit

    def run(self, work: Callable[[], None], nbytes: int = 0) -> None:
        with self._room:
            while self._on_room is None and self._waiting and self._waiting + nbytes > self.limit \
                    and self._error is None:
                self._room.wait()
            if self._error is not None:
                raise self._error
            self._waiting += nbytes
        self._jobs.put((work, nbytes))

    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            work, nbytes = item
            if self._error is None and not self._skip:
                try:
                    work()
                except BaseException as exc:  # handed to the receiving thread
                    self._error = exc
            with self._room:
                room = self._waiting >= self.limit > self._waiting - nbytes  # it was full, and is not
                self._waiting -= nbytes
                self._room.notify_all()
            if room and self._on_room is not None:
                self._on_room()

    def beside(self, work: Callable[[], object]) -> Callable[[], object]:
        """Start `work` on the second thread (from this one's work); returns what waits for it to end."""
        if self._second is None:
            self._second = ThreadPoolExecutor(1, "gpulayer-disk-beside")
        return self._second.submit(work).result

    def finish(self) -> None:
        """Wait until all the work is done; raise its first error."""
        self._end()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """Skip the work still queued, and end the thread."""
        self._skip = True
        self._end()

    def _end(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        if self._second is not None:
            self._second.shutdown()


class _Sink:
    """Where a receiver's disk work runs: inline, or on a DiskThread; `release` gets each chunk once written."""

    def __init__(self, disk: DiskThread | None, release: Callable[[Any], None] | None):
        self.disk = disk
        self._release = release

    def run(self, work: Callable[[], None], nbytes: int = 0) -> None:
        """Disk work, in order."""
        if self.disk is None:
            work()
        else:
            self.disk.run(work, nbytes)

    def beside(self, work: Callable[[], object]) -> Callable[[], object]:
        """Start `work` beside the disk work in progress (`DiskThread.beside`), or do it now if inline; returns
        what waits for it."""
        if self.disk is None:
            work()
            return lambda: None
        return self.disk.beside(work)

    def release(self, chunk: Any) -> None:
        """The chunk is written: back to the pool it came from."""
        if self._release is not None:
            self._release(chunk)

    def finish(self) -> None:
        if self.disk is not None:
            self.disk.finish()

    def stop(self) -> None:
        if self.disk is not None:
            self.disk.stop()


class BlobReceiver:
    """The peer's end of an upload: BLOB messages in, verified blobs in the store out.

    `expected` is what the peer asked for (digest -> size). Blobs come one after another, each in
    order; `feed` checks each message and returns True once the last expected byte has come; `finish`
    then waits for the disk work (hashing and writing; on `disk`, if given, else done inline) and raises
    its error.
    FolderError (and nothing of the blob kept) for a digest not asked for, a chunk out of place or past
    its size, or a blob that fails its check. `release(chunk)`, if given, gets each chunk once written. With
    `builder`, the disk work writes each blob as its first file in the job's folder (`Builder.first`) and has
    the builder place its other files once it is stored.
    """

    def __init__(self, store: BlobStore, expected: Mapping[str, int], disk: DiskThread | None = None,
                 release: Callable[[Any], None] | None = None, builder: Builder | None = None):
        self.store = store
        self._builder = builder
        self.left = dict(expected)
        self.received = 0  # content bytes
        self._sink = _Sink(disk, release)
        self._current: str | None = None  # the blob being received, how much of it came, their digest so far
        self._offset = 0
        self._hash = new_digest()  # updated by the disk work, before it writes each chunk
        self._writer: BlobWriter | None = None  # touched by the disk work only

    @property
    def done(self) -> bool:
        return not self.left

    def feed(self, msg: messages.Message, buffers: list[Any]) -> bool:
        """Take one BLOB message (or an ERROR from the sender, which raises FolderError)."""
        _check(self, msg, len(buffers), BLOB, messages.check_blob, "the upload stopped")
        if "pack" in msg:
            return self._unpack(msg["pack"], buffers[0] if buffers else b"")
        digest, offset, size = msg["d"], msg["off"], msg["size"]
        if self._current is None:
            if self.left.get(digest) != size or offset != 0:
                _refuse(self, f"blob {digest[:16]} of {size} bytes at {offset} was not asked for, or not from its start")
            self._current, self._offset, self._hash = digest, 0, new_digest()
            self._sink.run(partial(self._open, digest, size))
        elif self._current != digest or self._offset != offset:
            _refuse(self, f"blob {digest[:16]} at {offset}: expected {self._current[:16]} at {self._offset}")
        if buffers:
            view = memoryview(buffers[0]).cast("B")
            if self._offset + view.nbytes > size:
                _refuse(self, f"blob {digest[:16]} got more than the {size} bytes announced")
            self._offset += view.nbytes
            self.received += view.nbytes
            self._sink.run(partial(self._write, buffers[0], self._hash), view.nbytes)
        if self._offset == size:
            self._current = None
            del self.left[digest]
            self._sink.run(partial(self._commit, self._hash))
        return self.done

    def _unpack(self, pack: Any, chunk: Any) -> bool:
        """Whole small blobs, one after another in `chunk`, as `pack` ([[digest, size], ...]) lists them."""
        view = memoryview(chunk).cast("B")
        if self._current is not None or not all(self.left.get(p[0]) == p[1] for p in pack) \
                or sum(p[1] for p in pack) != view.nbytes or len({p[0] for p in pack}) != len(pack):
            _refuse(self, "a BLOB pack lists blobs not asked for, or not what its chunk holds")
        blobs, offset = [], 0
        for digest, size in pack:
            blobs.append((digest, view[offset:offset + size]))
            offset += size
            del self.left[digest]
        self._sink.run(partial(self._store_whole, blobs, chunk), view.nbytes)  # one piece of disk work for the pack
        self.received += view.nbytes
        return self.done

    def _store_whole(self, blobs: list[tuple[str, memoryview]], chunk: Any) -> None:
        """Store whole blobs (digest, bytes: views of `chunk`), each checked against its digest."""
        for digest, data in blobs:
            self.store.put(digest, data, self._first(digest))
            self._placed(digest)
        self._sink.release(chunk)

    def finish(self) -> None:
        """Wait for the disk work; FolderError if a blob failed its check (nothing of it kept)."""
        self._sink.finish()

    def _first(self, digest: str) -> Place | None:
        return None if self._builder is None else self._builder.first(digest)

    def _placed(self, digest: str) -> None:
        if self._builder is not None:
            self._builder.stored(digest)

    def _open(self, digest: str, size: int) -> None:
        self._writer = self.store.writer(digest, size, caller_hashes=True, at=self._first(digest))

    def _write(self, chunk: Any, hasher: Any) -> None:
        """Write the chunk, and hash it at the same time on the disk thread's second thread: the side
        receiving the messages (the peer's event loop, say) only decrypts and parses."""
        assert self._writer is not None
        pause_point("blob-writing")  # tests only: a disk that falls behind
        hashed = self._sink.beside(partial(hasher.update, chunk))
        try:
            self._writer.write(chunk)
        finally:
            hashed()  # the chunk is read no more: it may go back to the pool
        self._sink.release(chunk)

    def _commit(self, hasher: Any) -> None:
        assert self._writer is not None
        writer, self._writer = self._writer, None
        writer.commit(hasher.hexdigest())
        self._placed(writer.digest)

    def abort(self) -> None:
        """Drop the blob being received (the connection broke, or the upload was refused)."""
        self._sink.stop()
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


def _refuse(receiver: _Receiver, message: str) -> NoReturn:
    """Drop what the receiver holds, and raise FolderError."""
    receiver.abort()
    raise FolderError(message)


def _check(receiver: _Receiver, msg: messages.Message, buffers: int, kind: str,
           check: Callable[[messages.Message, int], str | None], stopped: str) -> None:
    """Refuse (`_refuse`) what is not a well-formed message of `kind`; an ERROR from the sender says why it
    `stopped`."""
    if msg.get("t") == messages.ERROR:
        _refuse(receiver, f"{stopped}: {messages.printable(msg.get('message'))}")
    problem = check(msg, buffers) if msg.get("t") == kind else f"expected a {kind.upper()} message"
    if problem is not None:
        _refuse(receiver, problem)


class Pool:
    """Receive buffers for frames of up to CHUNK bytes (a view of a CHUNK buffer's start), used again once
    written (`release`): no fresh memory, to be faulted in and zeroed, per chunk."""

    def __init__(self) -> None:
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> Any:
        if nbytes > CHUNK:
            return framing.receive_buffer(nbytes)
        with self._lock:
            buf = self._free.pop() if self._free else None
        return memoryview(buf if buf is not None else bytearray(CHUNK))[:nbytes]

    def release(self, chunk: Any) -> None:
        buf = chunk.obj if isinstance(chunk, memoryview) else None
        if isinstance(buf, bytearray) and len(buf) == CHUNK:
            with self._lock:
                self._free.append(buf)


def receive_blobs(conn: Connection, store: BlobStore, expected: Mapping[str, int],
                  idle_timeout: float = IDLE_TIMEOUT) -> int:
    """Receive the `expected` blobs (blocking) into the store; returns the content bytes received."""
    pool = Pool()
    receiver = BlobReceiver(store, expected, DiskThread(), pool.release)
    _drive(conn, receiver, idle_timeout, pool)
    return receiver.received


class _Receiver(Protocol):
    @property
    def done(self) -> bool: ...

    def feed(self, msg: messages.Message, buffers: list[Any]) -> bool: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


def _drive(conn: Connection, receiver: _Receiver, idle_timeout: float, pool: Pool) -> None:
    """Feed `receiver` the connection's messages until it is done, and wait for its disk work; it drops
    what it holds on failure. A BlockingConnection's large frames are received into `pool`'s buffers."""
    reader = getattr(conn, "reader", None)
    allocate = getattr(reader, "allocate", None)
    if allocate is not None:
        reader.allocate = pool.allocate  # type: ignore[union-attr]
    try:
        while not receiver.done:
            receiver.feed(*conn.recv(time.monotonic() + idle_timeout))
        receiver.finish()
    finally:
        receiver.abort()
        if allocate is not None:
            reader.allocate = allocate  # type: ignore[union-attr]


# --- fetch: peer -> submitter -------------------------------------------------------------------------


def listing(root: PathLike, relpaths: list[str]) -> list[list[Any]]:
    """[[path, size, executable], ...] of the files `relpaths` name in the job's folder `root`
    (`files_under`: each path checked, folders expanded); FolderError for a path that leaves it."""
    out = []
    for rel in files_under(root, relpaths):
        st = os.stat(resolve_inside(root, rel))
        out.append([rel, st.st_size, bool(st.st_mode & 0o111)])
    if len(out) > MAX_LISTED:
        raise FolderError(f"{len(out)} files: a fetch brings at most {MAX_LISTED}; name fewer")
    return out


def file_messages(root: PathLike, files: list[list[Any]], request_id: int, chunk: int = CHUNK,
                  allocate: Callable[[int], memoryview] | None = None,
                  handover: Callable[[Path, int], bool] | None = None,
                  ) -> Iterator[tuple[messages.Message, list[memoryview]]]:
    """The FILE messages of `files` (what `listing` gave), header first. Each chunk is read into
    `allocate(its size)` (the event loop's `Pool`, whose buffers come back once sealed), or without it
    into one read buffer for all (send each before the next). A file that `handover(path, size)` passed
    on by descriptor (local_fetch.py) is one FILE message with no chunk."""
    yield messages.file_header(request_id, files), []
    if allocate is None:
        largest = max((size for _, size, _ in files), default=0)
        view = memoryview(bytearray(min(chunk, largest) or 1))
        allocate = lambda n: view[:n]  # noqa: E731
    for index, (rel, size, _) in enumerate(files):  # an empty file has no chunk
        if size and handover is not None and handover(resolve_inside(root, rel), size):
            yield messages.file_passed(request_id, index), []
            continue
        for offset, piece in _chunks(resolve_inside(root, rel), size, chunk, allocate):
            yield messages.file_chunk(request_id, index, offset), [piece]


def send_files(conn: Connection, root: PathLike, relpaths: list[str], request_id: int) -> int:
    """Send the files `relpaths` name in the job's folder (blocking); returns the content bytes sent.

    A path refused, or a file that changed while it was sent, ends the stream with an ERROR and raises."""
    sent = 0
    try:
        for msg, buffers in file_messages(root, listing(root, relpaths), request_id):
            conn.send(msg, buffers)
            sent += sum(b.nbytes for b in buffers)
    except FolderError as exc:
        conn.send(messages.error("bad-request", str(exc), request_id))
        raise
    return sent


class FileReceiver:
    """The submitter's end of a fetch: FILE messages in, files under `dest` out.

    The header's paths are checked first (relative, inside `dest`, not through a symlink out of it) and
    so is what they would overwrite (FolderError naming the files, unless `force`): nothing is written
    before. Each file is written beside its final name and renamed into place when complete. The disk
    work runs on `disk` if given (then `finish` waits for it), else inline.
    """

    def __init__(self, dest: PathLike, force: bool = False, disk: DiskThread | None = None,
                 release: Callable[[Any], None] | None = None):
        self.dest = Path(dest)
        self.force = force
        self.files: list[list[Any]] | None = None
        self.total: int | None = None  # the bytes of the files listed, once the header came
        self.received = 0
        self._sink = _Sink(disk, release)
        self._next = 0  # the index of the file being received, and how much of it came
        self._offset = 0
        self._fd: int | None = None  # the disk work's: the file being written, under its partial name
        self._partial: Path | None = None
        self._target = self.dest

    @property
    def done(self) -> bool:
        return self.files is not None and self._next == len(self.files)

    def feed(self, msg: messages.Message, buffers: list[Any]) -> bool:
        """Take one FILE message (or the sender's ERROR, which raises FolderError); True when all came."""
        _check(self, msg, len(buffers), FILE, messages.check_file, "the peer stopped the fetch")
        if self.files is None:
            if "files" not in msg:
                _refuse(self, "a fetch starts with a FILE header")
            self._start(msg["files"])
        else:
            index, size = self._next, self.files[self._next][1] if not self.done else 0
            n = memoryview(buffers[0]).nbytes
            if self.done or msg.get("n") != index or msg.get("off") != self._offset or not n \
                    or self._offset + n > size:
                _refuse(self, f"a FILE chunk out of place: file {msg.get('n')!r} at {msg.get('off')!r}, {n} bytes")
            self._offset += n
            self.received += n
            self._sink.run(partial(self._write, index, buffers[0]), n)
            if self._offset == size:
                self._sink.run(self._complete)
                self._next, self._offset = index + 1, 0
        return self._skip_empty()

    def _skip_empty(self) -> bool:
        """Write the empty files that come next (an empty file has no chunk); True when all came."""
        while self.files is not None and not self.done and self.files[self._next][1] == 0:
            self._sink.run(partial(self._empty, self._next))
            self._next += 1
        return self.done

    def finish(self) -> None:
        """Wait for the disk work; raise its error."""
        self._sink.finish()

    def _start(self, files: list[list[Any]]) -> None:
        if len(files) > MAX_LISTED:
            _refuse(self, f"a FILE header lists more than {MAX_LISTED} files")
        paths = [f[0] for f in files]
        for rel in paths:
            check_relpath(rel, strict=True)
        if len(set(paths)) != len(paths):
            _refuse(self, "a FILE header names a file twice")
        self.dest.mkdir(parents=True, exist_ok=True)
        existing = []
        for rel in paths:
            target = resolve_inside(self.dest, rel)  # refuses a path that leaves `dest`, symlinks included
            if os.path.lexists(target) and not (self.force and os.path.isfile(target)):
                existing.append(rel)
        if existing:
            shown = ", ".join(existing[:5]) + (f" and {len(existing) - 5} more" if len(existing) > 5 else "")
            _refuse(self, f"would overwrite {shown} in {self.dest} (--force overwrites files)")
        self.files, self.total = files, sum(f[1] for f in files)

    def _open(self, index: int) -> None:
        assert self.files is not None
        rel, _, executable = self.files[index]
        target = resolve_inside(self.dest, rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._partial = target.with_name(f".{target.name}.partial-{secrets.token_hex(4)}")
        self._fd = os.open(self._partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                           0o755 if executable else 0o644)
        self._target = target

    def _empty(self, index: int) -> None:
        self._open(index)
        self._complete()

    def _write(self, index: int, chunk: Any) -> None:
        if self._fd is None:
            self._open(index)
        assert self._fd is not None
        view = memoryview(chunk).cast("B")
        while view:
            view = view[os.write(self._fd, view):]
        self._sink.release(chunk)

    def _complete(self) -> None:
        assert self._fd is not None and self._partial is not None
        os.close(self._fd)
        self._fd = None
        os.replace(self._partial, self._target)
        self._partial = None

    def abort(self) -> None:
        """Remove the file being written; files already complete stay."""
        self._sink.stop()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._partial is not None:
            self._partial.unlink(missing_ok=True)
            self._partial = None


def receive_files(conn: Connection, dest: PathLike, force: bool = False,
                  idle_timeout: float = IDLE_TIMEOUT) -> list[str]:
    """Receive a fetch (blocking) into `dest`; returns the paths written."""
    pool = Pool()
    receiver = FileReceiver(dest, force, DiskThread(), pool.release)
    _drive(conn, receiver, idle_timeout, pool)
    assert receiver.files is not None
    return [f[0] for f in receiver.files]
