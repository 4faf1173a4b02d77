"""A job's bytes over a connection's secure channel: blobs up (the working folder), files down (fetch).

Upload. The submitter sends the manifest in its job message (`Manifest.to_wire`); the peer answers
with the digests its `BlobStore` lacks (`BlobStore.missing`); the submitter sends only those as BLOB
messages (`push_blobs`), each blob in chunks of CHUNK bytes, every chunk an out-of-band buffer read
straight from the file into one reused buffer and sealed from there. The peer feeds them to a
`BlobReceiver`, which writes each blob as it comes and stores it only when its size and digest check
out (`BlobWriter`), then `materialise`s the job's folder. A resubmit of an unchanged folder sends the
manifest and nothing else.

    BLOB {"id": request, "d": digest, "off": offset, "size": the blob's size} + [chunk]   (no buffer: an empty blob)

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
import secrets
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from ..protocol import messages
from .folder import (PathLike, BlobStore, BlobWriter, FolderError, Manifest, check_relpath, files_under,
                     is_digest, resolve_inside)

BLOB, FILE = messages.BLOB, messages.FILE
CHUNK = 4 << 20  # bytes a BLOB or FILE message carries at most
IDLE_TIMEOUT = 60.0  # seconds a receiver waits for the next message before it gives up
MAX_LISTED = 200_000  # files one fetch may bring


class Connection(Protocol):
    """What the blocking helpers need: `transport.blocking.BlockingConnection` (or a PeerConnection's own)."""

    def send(self, msg: messages.Outgoing, buffers: messages.Buffers = ()) -> None: ...

    def recv(self, deadline: float | None = None) -> tuple[messages.Message, list[Any]]: ...


def _chunks(path: PathLike, size: int, buf: bytearray) -> Iterator[tuple[int, memoryview]]:
    """(offset, piece) of a file of `size` bytes, read into `buf` (reused: each piece is valid until the next);
    FolderError if it is not that size any more."""
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size != size:
            raise FolderError(f"{path} changed size since it was scanned")
        offset = 0
        while offset < size:
            n = f.readinto(view[:min(len(buf), size - offset)])
            if not n:
                raise FolderError(f"{path} ended at {offset} of {size} bytes while it was sent")
            yield offset, view[:n]
            offset += n


# --- upload: submitter -> peer ------------------------------------------------------------------------


def blob_messages(manifest: Manifest, missing: list[str], request_id: int,
                  chunk: int = CHUNK) -> Iterator[tuple[messages.Message, list[memoryview]]]:
    """The BLOB messages of the `missing` digests (a scanned manifest's, read from its sources), with their
    buffers. One read buffer is reused: send each message before asking for the next."""
    sizes, sources = manifest.blobs(), manifest.source_of()
    buf = bytearray(min(chunk, max((sizes[d] for d in missing), default=0)) or 1)
    for digest in missing:
        if digest not in sizes:
            raise FolderError(f"the peer asked for {str(digest)[:16]!r}, which is not in the manifest")
        size = sizes[digest]
        if size == 0:
            yield {"t": BLOB, "id": request_id, "d": digest, "off": 0, "size": 0}, []
        for offset, piece in _chunks(sources[digest], size, buf):
            yield {"t": BLOB, "id": request_id, "d": digest, "off": offset, "size": size}, [piece]


def push_blobs(conn: Connection, manifest: Manifest, missing: list[str], request_id: int) -> int:
    """Send the blobs the peer lacks (blocking); returns the bytes of content sent."""
    sent = 0
    for msg, buffers in blob_messages(manifest, missing, request_id):
        conn.send(msg, buffers)
        sent += sum(b.nbytes for b in buffers)
    return sent


class BlobReceiver:
    """The peer's end of an upload: BLOB messages in, verified blobs in the store out.

    `expected` is what the peer asked for (digest -> size). Blobs come one after another, each in
    order; `feed` returns True once every expected blob is stored. FolderError (and nothing of the
    blob kept) for a digest not asked for, a chunk out of place, or a blob that fails its check.
    """

    def __init__(self, store: BlobStore, expected: Mapping[str, int]):
        self.store = store
        self.left = dict(expected)
        self.received = 0  # content bytes
        self._writer: BlobWriter | None = None

    @property
    def done(self) -> bool:
        return not self.left

    def feed(self, msg: messages.Message, buffers: list[Any]) -> bool:
        """Take one BLOB message (or an ERROR from the sender, which raises FolderError)."""
        if msg.get("t") == messages.ERROR:
            self.abort()
            raise FolderError(f"the upload stopped: {messages.printable(msg.get('message'))}")
        digest, offset, size = msg.get("d"), msg.get("off"), msg.get("size")
        if msg.get("t") != BLOB or not is_digest(digest) or not isinstance(offset, int) \
                or not isinstance(size, int) or len(buffers) > 1:
            self.abort()
            raise FolderError("expected a BLOB message with 'd', 'off', 'size' and at most one chunk")
        writer = self._writer
        if writer is None:
            if self.left.get(digest) != size or offset != 0:
                raise FolderError(f"blob {digest[:16]} of {size} bytes at {offset} was not asked for, "
                                  "or not from its start")
            writer = self._writer = self.store.writer(digest, size)
        elif writer.digest != digest or writer.written != offset:
            self.abort()
            raise FolderError(f"blob {digest[:16]} at {offset}: expected {writer.digest[:16]} at {writer.written}")
        if buffers:
            writer.write(buffers[0])
            self.received += memoryview(buffers[0]).nbytes
        if writer.written == size:
            self._writer = None
            writer.commit()
            del self.left[digest]
        return self.done

    def abort(self) -> None:
        """Drop the blob being received (the connection broke, or the upload was refused)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


def receive_blobs(conn: Connection, store: BlobStore, expected: Mapping[str, int],
                  idle_timeout: float = IDLE_TIMEOUT) -> int:
    """Receive the `expected` blobs (blocking) into the store; returns the content bytes received."""
    receiver = BlobReceiver(store, expected)
    _drive(conn, receiver, idle_timeout)
    return receiver.received


class _Receiver(Protocol):
    @property
    def done(self) -> bool: ...

    def feed(self, msg: messages.Message, buffers: list[Any]) -> bool: ...

    def abort(self) -> None: ...


def _drive(conn: Connection, receiver: _Receiver, idle_timeout: float) -> None:
    """Feed `receiver` the connection's messages until it is done; it drops what it holds on failure."""
    try:
        while not receiver.done:
            receiver.feed(*conn.recv(time.monotonic() + idle_timeout))
    finally:
        receiver.abort()


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
                  reuse: bool = True) -> Iterator[tuple[messages.Message, list[memoryview]]]:
    """The FILE messages of `files` (what `listing` gave), header first. With `reuse`, one read buffer
    serves every chunk (send each before the next); without, each chunk has its own (the event loop
    queues them unsent)."""
    yield {"t": FILE, "id": request_id, "files": files}, []
    largest = max((size for _, size, _ in files), default=0)
    buf = bytearray(min(chunk, largest) or 1)
    for index, (rel, size, _) in enumerate(files):  # an empty file has no chunk
        for offset, piece in _chunks(resolve_inside(root, rel), size, buf if reuse else bytearray(chunk)):
            yield {"t": FILE, "id": request_id, "n": index, "off": offset}, [piece]


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
    before. Each file is written beside its final name and renamed into place when complete.
    """

    def __init__(self, dest: PathLike, force: bool = False):
        self.dest = Path(dest)
        self.force = force
        self.files: list[list[Any]] | None = None
        self.received = 0
        self._next = 0  # the index of the file being received
        self._fd: int | None = None
        self._partial: Path | None = None
        self._written = 0

    @property
    def done(self) -> bool:
        return self.files is not None and self._next == len(self.files)

    def feed(self, msg: messages.Message, buffers: list[Any]) -> bool:
        """Take one FILE message (or the sender's ERROR, which raises FolderError); True when all came."""
        if msg.get("t") == messages.ERROR:
            self.abort()
            raise FolderError(f"the peer stopped the fetch: {messages.printable(msg.get('message'))}")
        if msg.get("t") != FILE or len(buffers) > 1:
            self.abort()
            raise FolderError("expected a FILE message with at most one chunk")
        if self.files is None:
            self._start(msg.get("files"))
        elif msg.get("n") != self._next or msg.get("off") != self._written:
            self.abort()
            raise FolderError(f"a FILE chunk out of order: {msg.get('n')!r} at {msg.get('off')!r}")
        else:
            self._write(buffers[0] if buffers else b"")
        self._finish_empty()
        return self.done

    def _start(self, files: Any) -> None:
        if not isinstance(files, list) or len(files) > MAX_LISTED or not all(
                isinstance(f, list) and len(f) == 3 and isinstance(f[0], str) and isinstance(f[1], int)
                and not isinstance(f[1], bool) and f[1] >= 0 and isinstance(f[2], bool) for f in files):
            raise FolderError("a FILE header lists [path, size, executable] entries")
        paths = [f[0] for f in files]
        for rel in paths:
            check_relpath(rel, strict=True)
        if len(set(paths)) != len(paths):
            raise FolderError("a FILE header names a file twice")
        self.dest.mkdir(parents=True, exist_ok=True)
        existing = []
        for rel in paths:
            target = resolve_inside(self.dest, rel)  # refuses a path that leaves `dest`, symlinks included
            if os.path.lexists(target) and not (self.force and os.path.isfile(target)):
                existing.append(rel)
        if existing:
            shown = ", ".join(existing[:5]) + (f" and {len(existing) - 5} more" if len(existing) > 5 else "")
            raise FolderError(f"would overwrite {shown} in {self.dest} (--force overwrites files)")
        self.files = files

    def _finish_empty(self) -> None:
        """Open the next file; complete those that are empty (they have no chunk)."""
        assert self.files is not None
        while self._fd is None and self._next < len(self.files):
            rel, size, executable = self.files[self._next]
            target = resolve_inside(self.dest, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            self._partial = target.with_name(f".{target.name}.partial-{secrets.token_hex(4)}")
            self._fd = os.open(self._partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                               0o755 if executable else 0o644)
            self._written = 0
            if size:
                return
            self._complete(target)

    def _write(self, data: Any) -> None:
        assert self.files is not None and self._fd is not None
        view = memoryview(data).cast("B")
        size = self.files[self._next][1]
        if self._written + view.nbytes > size or not view.nbytes:
            self.abort()
            raise FolderError(f"{self.files[self._next][0]}: a chunk past its size of {size} bytes")
        self._written += view.nbytes
        self.received += view.nbytes
        while view:
            view = view[os.write(self._fd, view):]
        if self._written == size:
            self._complete(resolve_inside(self.dest, self.files[self._next][0]))

    def _complete(self, target: Path) -> None:
        assert self._fd is not None and self._partial is not None
        os.close(self._fd)
        self._fd = None
        os.replace(self._partial, target)
        self._partial = None
        self._next += 1

    def abort(self) -> None:
        """Remove the file being written; files already complete stay."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._partial is not None:
            self._partial.unlink(missing_ok=True)
            self._partial = None


def receive_files(conn: Connection, dest: PathLike, force: bool = False,
                  idle_timeout: float = IDLE_TIMEOUT) -> list[str]:
    """Receive a fetch (blocking) into `dest`; returns the paths written."""
    receiver = FileReceiver(dest, force)
    _drive(conn, receiver, idle_timeout)
    assert receiver.files is not None
    return [f[0] for f in receiver.files]
