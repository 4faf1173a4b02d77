"""Shared memory for the data plane: sealed memfd segments and the links that pass them (ADR 0009).

A big out-of-band buffer that stays on one host travels as a descriptor, not as bytes: it lives
in a `memfd` (anonymous shared memory: it has no name, so nothing is ever left behind, even after
kill -9), sealed so that it can neither shrink nor grow (a receiver mapping it can never fault
with SIGBUS), and its descriptor crosses a *local link*, a Unix SOCK_SEQPACKET socket, with
SCM_RIGHTS. The message that owns the buffers says where they go in its buffer list
(``"fds": [[position, size], ...]``) and travels on its usual connection; the descriptors are
sent on the link just before it, so they are there when the message is read.

Local links exist between the peer and its workers (a socket pair made at start), and between a
submitter and a peer of the same host and user: the peer listens on an abstract Unix socket
(Linux; abstract names are private to a network namespace), tells each authenticated connection
its name and a one-time token over the secure channel, and admits a link only from a process of
its own uid (SO_PEERCRED) that presents a live token. The channel's key never crosses a link.

Fresh shared memory is dear (the kernel allocates and zeroes every page, and a virtual machine
may first fetch each one from its host); copying into pages a process already has is several
times cheaper. So a process keeps the segments it made in a bounded *pool* and writes the next
buffer of the same size into one that no one else holds any more, and that held data of the same
owner (submitter) before: a segment never carries one submitter's data to another. A worker
tells its pool whose task it runs (`Pool.serve`): the segments of other submitters are zeroed, or
let go where another process holds them still, so that the task cannot read them.

Where memfd or SCM_RIGHTS are missing (macOS, an old job interpreter), or GPULAYER_SHM=0,
everything travels inline.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import socket
import stat
import struct
import sys
import threading
import time
import weakref
from typing import Any, Iterable
from ..protocol.framing import MAX_BUFFERS


SHM_MIN = 1 << 20  # buffers this big travel by descriptor over a local link
SUPPORTED = sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
MAX_FDS_PER_SEND = 250  # under the kernel's SCM_MAX_FD (253)
TOKEN_BYTES = 16
_SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) if SUPPORTED else 0
_BATCH = struct.Struct(">BH")  # the payload of one SCM_RIGHTS record: b"F", how many descriptors it carries
_SOCKET_MARK = b"S"  # the payload of the SCM_RIGHTS record that carries a socket (send_socket)
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault the whole mapping in at once
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)  # Linux: map pages that exist at once
_PWRITE_MAX = 1 << 30
_PARALLEL_COPY_MIN = 32 << 20  # copies this big are split over two threads (copy_into)
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)  # Linux 3.15: locks owned by an open file description
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux: type, whence, start, len, pid
POOL_SUPPORTED = SUPPORTED and sys.maxsize > 2**32 and os.path.isdir("/proc/self/fd")


def enabled() -> bool:
    """Whether this process uses shared memory: where it is supported, unless GPULAYER_SHM=0."""
    value = os.environ.get("GPULAYER_SHM", "1")
    if value not in ("0", "1"):
        raise ValueError(f"GPULAYER_SHM must be 0 or 1, not {value!r}")
    return SUPPORTED and value == "1"


class ShmError(ValueError):
    """A descriptor that arrived on a local link is not a segment we accept, or did not arrive."""


class Segment(mmap.mmap):
    """A shared, writable mapping of a sealed memfd; `handle` passes it on by descriptor."""

    handle: Handle


class Handle:
    """One sealed memfd of `size` bytes, owned: sent on by descriptor, or mapped where its bytes are used.

    The descriptor is closed when the handle is closed or collected; the memory lives on as long
    as a mapping or another process's descriptor holds it.
    """

    __slots__ = ("fd", "size", "_close", "__weakref__")

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self._close = weakref.finalize(self, os.close, fd)

    def map(self, populate: bool = False) -> Segment:
        """A writable shared mapping of the segment (zero-copy; whoever sent it has let go of it).

        With `populate`, the pages the segment has are mapped at once rather than one fault at a time.
        """
        flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
        segment = Segment(self.fd, self.size, flags=flags)
        segment.handle = self
        return segment

    def close(self) -> None:
        self._close()


def _memfd(size: int) -> int:
    """A fresh sealed memfd of `size` bytes (at least 1)."""
    fd = os.memfd_create("gpulayer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create(size: int, owner: str | None = None) -> tuple[Handle, mmap.mmap | None]:
    """A segment of `size` bytes to write `owner`'s data into (by default the process's: `Pool.serve`),
    and the pool's own mapping of it where it is one the pool had already (its pages exist and are
    mapped), else None."""
    lent = POOL.lend(size, owner)
    return lent if lent is not None else (Handle(_memfd(size), size), None)


def receive_segment(size: int, owner: str | None = None) -> Segment:
    """A mapped segment to receive a frame of `size` bytes from `owner` into (its pages faulted in at once)."""
    handle, kept = create(size, owner)
    segment = handle.map(populate=kept is not None)
    if kept is None:
        try:
            segment.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            pass
    return segment


def copy_in(view: memoryview) -> Handle:
    """A segment holding a copy of `view`: copied into the pool's mapping of a segment it had, or
    written by the kernel into a fresh one (one pass, no page faults here)."""
    handle, kept = create(view.nbytes)
    if kept is not None:
        copy_into(kept, view)
        return handle
    offset = 0
    while offset < view.nbytes:
        offset += os.pwrite(handle.fd, view[offset:offset + _PWRITE_MAX], offset)
    return handle


def copy_into(dest: mmap.mmap, view: memoryview) -> None:
    """dest[:] = view, in two halves on two threads where the copy is big and both can run at
    once: the second half by `ctypes.memmove`, which lets go of the GIL (13 GB/s here against
    11.4 on one thread; memory bandwidth, not the cores, is what is left)."""
    n = view.nbytes
    if n < _PARALLEL_COPY_MIN or (os.cpu_count() or 1) < 2 or view.readonly:
        dest[:] = view  # a read-only buffer has no address that ctypes gives: one thread
        return
    import ctypes  # here, as in _address and _zero: a submitter that sends no big buffer never loads it

    half = (n // 2) & ~0xFFF
    src = ctypes.addressof(ctypes.c_char.from_buffer(view))
    dst = ctypes.addressof(ctypes.c_char.from_buffer(dest))
    helper = threading.Thread(target=ctypes.memmove, args=(dst + half, src + half, n - half),
                              name="gpulayer-copy", daemon=True)
    helper.start()
    ctypes.memmove(dst, src, half)
    helper.join()


def _address(buf: Any) -> int | None:
    """Where a writable buffer's memory starts; None for a read-only one (ctypes gives no address)."""
    import ctypes

    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):
        return None


def _zero(mapping: mmap.mmap) -> None:
    """Write zeros over a whole writable mapping (in C, without the GIL: 15 ms for 256 MiB here)."""
    import ctypes

    start = ctypes.c_char.from_buffer(mapping)
    ctypes.memset(ctypes.addressof(start), 0, len(mapping))
    del start  # the mapping can be closed again


def reuse(buffers: list[Any], segments: Iterable[Any]) -> list[Any]:
    """`buffers`, each that is the whole of one of `segments` replaced by that segment, which then goes
    on by descriptor, with no copy: a task that returns its argument, changed in place or not, sends
    it back as it came. Only for segments that are the sender's own to give (a task's own arguments)."""
    spans = {}
    for segment in segments:
        address = _address(segment) if isinstance(segment, Segment) else None
        if address is not None:
            spans[(address, len(segment))] = segment
    if not spans:
        return buffers
    out = []
    for buf in buffers:
        view = memoryview(buf)
        span = (_address(view), view.nbytes) if view.nbytes >= SHM_MIN and view.c_contiguous else None
        out.append(spans.get(span, buf))
    return out


# ---- the pool ----------------------------------------------------------------------------------

def _ofd_lock(fd: int, kind: int) -> bool:
    """Take (or with F_UNLCK drop) an OFD lock on the whole of `fd`; False when another holds one in the way."""
    try:
        fcntl.fcntl(fd, _OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _setting(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    try:
        number = float(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be a number, not {value!r}") from None
    if not 0 <= number < float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")
    return number


def pool_settings() -> tuple[float, float]:
    """(the most bytes the pool keeps, the seconds a kept segment may go unused): GPULAYER_SHM_POOL_MB
    (default 1024, and at most an eighth of physical memory) and GPULAYER_SHM_POOL_IDLE_S (default 30)."""
    limit = min(_setting("GPULAYER_SHM_POOL_MB", 1024) * (1 << 20),
                os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 8)
    return limit, _setting("GPULAYER_SHM_POOL_IDLE_S", 30)


class _Kept:
    __slots__ = ("fd", "size", "used", "mapping", "owner", "written")

    def __init__(self, fd: int, size: int, used: float, owner: str | None):
        self.fd, self.size, self.used, self.owner = fd, size, used, owner
        self.mapping: mmap.mmap | None = None  # mapped (all pages at once) when it is first reused
        self.written = False  # it was lent since it was last zeroed (or made)

    def map(self) -> mmap.mmap:
        """The pool's own mapping of the segment, with all its pages."""
        if self.mapping is None:
            self.mapping = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        return self.mapping

    def close(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
        os.close(self.fd)


class Pool:
    """The segments this process made, kept (within `pool_settings`) to be written again once no one
    else holds them.

    A segment is lent as a descriptor of an open file description of its own that carries a shared
    OFD lock; the lock lives as long as any process, or a local link in flight, holds a descriptor
    of that description (mappings keep theirs: Segment.handle), and the kernel drops it with the
    last one, kill -9 included. The pool takes a segment back only when an exclusive lock on its
    own description succeeds: when no lent descriptor is left anywhere; and only for the owner whose
    data it held (a process that kept access without the lock, by opening it again, never reads
    another owner's data in it).
    """

    def __init__(self) -> None:
        self.working = POOL_SUPPORTED  # false for good once /proc or OFD locks failed this process
        self.owner: str | None = None  # whose data this process writes now (a worker: its task's submitter)
        self._lock = threading.Lock()
        self._kept: list[_Kept] = []  # least recently used first
        self._trimmer: threading.Thread | None = None

    def lend(self, size: int, owner: str | None = None) -> tuple[Handle, mmap.mmap | None] | None:
        """A lent segment of `size` bytes for `owner`'s data (by default the process's: `serve`) and, where
        it was kept from before, the pool's mapping of it; None where the pool is off or `size` is beyond
        its bound."""
        if not self.working or size < SHM_MIN:
            return None
        limit, _ = pool_settings()
        if size > limit:
            return None
        owner = self.owner if owner is None else owner
        now = time.monotonic()
        with self._lock:
            for kept in self._kept:
                if kept.size == size and kept.owner == owner and _ofd_lock(kept.fd, fcntl.F_WRLCK):
                    _ofd_lock(kept.fd, fcntl.F_UNLCK)
                    self._kept.remove(kept)
                    mapping = kept.map()
                    lent = self._lent(kept, now)
                    return (lent, mapping) if lent is not None else None
            while sum(k.size for k in self._kept) + size > limit:
                self._kept.pop(0).close()
            lent = self._lent(_Kept(_memfd(size), size, now, owner), now)
            if lent is not None and self._trimmer is None:
                self._trimmer = threading.Thread(target=self._trim, name="gpulayer-shm-pool", daemon=True)
                self._trimmer.start()
            return (lent, None) if lent is not None else None

    def _lent(self, kept: _Kept, now: float) -> Handle | None:
        """A descriptor of a new open file description of `kept`, with a shared OFD lock; None (and the
        pool off for good) where /proc or OFD locks fail this process."""
        try:
            fd = os.open(f"/proc/self/fd/{kept.fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return self._off(kept)
        try:
            _ofd_lock(fd, fcntl.F_RDLCK)
        except OSError:
            os.close(fd)
            return self._off(kept)
        kept.used, kept.written = now, True
        self._kept.append(kept)
        return Handle(fd, kept.size)

    def serve(self, owner: str) -> bool:
        """From now on this process works for `owner` (a worker, before a task of that submitter); True
        when that is another owner than before. Nothing the pool keeps of other owners is left for the
        code of this process to read: a segment no one else holds is zeroed (and written again for
        its own owner only), one that another process still holds is let go of."""
        with self._lock:
            if owner == self.owner:
                return False
            self.owner = owner
            for kept in [k for k in self._kept if k.owner != owner and k.written]:
                if _ofd_lock(kept.fd, fcntl.F_WRLCK):
                    _zero(kept.map())
                    kept.written = False
                    _ofd_lock(kept.fd, fcntl.F_UNLCK)
                else:
                    self._kept.remove(kept)
                    kept.close()
        return True

    def _off(self, kept: _Kept) -> None:
        self.working = False
        kept.close()
        self.clear()

    def _trim(self) -> None:
        """Let go of segments unused for GPULAYER_SHM_POOL_IDLE_S seconds; end when none is kept."""
        while True:
            try:
                _, idle = pool_settings()
            except ValueError:  # reported where a segment is made (and at a peer's start)
                idle = 30.0
            time.sleep(min(max(idle / 2, 0.05), 5))
            with self._lock:
                self.clear(time.monotonic() - idle)
                if not self._kept:
                    self._trimmer = None
                    return

    def clear(self, before: float = float("inf")) -> None:
        """Let go of the segments last used before `before` (all by default); the caller holds the lock."""
        for kept in [k for k in self._kept if k.used < before]:
            self._kept.remove(kept)
            kept.close()

    def drop_free(self) -> int:
        """Let go of every kept segment that no one holds now (memory is short); the bytes freed."""
        with self._lock:
            free = [k for k in self._kept if _ofd_lock(k.fd, fcntl.F_WRLCK)]
            for kept in free:
                self._kept.remove(kept)
                kept.close()
        return sum(k.size for k in free)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self.clear()
        self._trimmer = None


POOL = Pool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=POOL._after_fork)


def adopt(fd: int, size: Any, sealed: bool = True) -> Handle:
    """A descriptor received on a local link as a Handle, after checking that it is a segment.

    It must be a memfd of this uid, sealed against shrinking and growing, of exactly `size` bytes
    (what its message said). Anything else (a file such as /etc/passwd, an unsealed memfd that
    could be truncated under us) is closed and refused with ShmError. Without `sealed` (a job's file
    that a fetch brings, whose first `size` bytes are copied once, never mapped), a regular file of this
    uid and at least that size: one that its job appends to still gives the bytes listed, as over TCP.
    """
    try:
        info = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if sealed else 0
    except OSError:
        os.close(fd)
        raise ShmError("a descriptor on the local link is not a sealed memfd segment") from None
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file" if not sealed else "is not a memfd sealed against shrinking and growing"
    elif sealed and seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
        problem = "is not a memfd sealed against shrinking and growing"
    elif info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not {os.getuid()}"
    elif isinstance(size, bool) or not isinstance(size, int) or size < 1 or info.st_size < size \
            or (sealed and info.st_size != size):
        problem = f"has {info.st_size} bytes where its message said {size!r}"
    if problem:
        os.close(fd)
        raise ShmError(f"a descriptor on the local link {problem}")
    return Handle(fd, size)


# ---- what messages carry ----------------------------------------------------------------------

def split(buffers: Iterable[Any], copy: bool) -> tuple[list[Any], list[Handle], list[list[int]]]:
    """Buffers for a message over a local link: (inline ones, handles to send, their [position, size]).

    Segments go by descriptor; other buffers of SHM_MIN bytes or more are copied into a segment when
    `copy` is true (the sender holds them in private memory), else sent inline.
    """
    inline: list[Any] = []
    handles: list[Handle] = []
    where: list[list[int]] = []
    for position, buf in enumerate(buffers):
        handle = buf.handle if isinstance(buf, Segment) else None
        if handle is None and copy:
            view = memoryview(buf).cast("B")
            handle = copy_in(view) if view.nbytes >= SHM_MIN else None
        if handle is None:
            inline.append(buf)
        else:
            handles.append(handle)
            where.append([position, handle.size])
    return inline, handles, where


def check_places(places: Any, inline: int) -> list[tuple[int, int]]:
    """A message's "fds" field, checked against its `inline` buffers: [(position, size)] in order."""
    if not isinstance(places, list) or len(places) + inline > MAX_BUFFERS:
        raise ShmError(f"bad 'fds': a list of at most {MAX_BUFFERS} [position, size] pairs, not {type(places).__name__}")
    checked = []
    for item in places:
        if not (isinstance(item, list) and len(item) == 2 and all(type(x) is int for x in item)):
            raise ShmError("bad 'fds': each entry is [position, size]")
        checked.append((item[0], item[1]))
    positions = [p for p, _ in checked]
    if positions != sorted(set(positions)) or (positions and not 0 <= positions[0] <= positions[-1] < len(positions) + inline):
        raise ShmError("bad 'fds': positions must rise and lie within the message's buffers")
    return checked


def merge(inline: list[Any], handles: list[Handle], places: list[tuple[int, int]],
          populate: bool = False) -> list[Any]:
    """The message's whole buffer list: `handles`, mapped, at their places among `inline`.

    Mapping costs no copy and touches no page: a peer that only passes a segment on never reads it.
    With `populate` (a worker, whose task reads its arguments) the pages are mapped at once, which
    costs less than a fault at a time: 5 ms against 9 for 256 MiB here.
    """
    out: list[Any] = []
    rest = iter(inline)
    for (position, _), handle in zip(places, handles):
        while len(out) < position:
            out.append(next(rest))
        out.append(handle.map(populate))
    out.extend(rest)
    return out


def send_over(link: socket.socket | None, msg: Any, buffers: Any, copy: bool) -> list[Any]:
    """Send the segments among `buffers` by descriptor on `link` and name them in msg["fds"]; return
    the buffers left to send inline (see `split`). Without a link, or when a non-blocking one is full,
    everything goes inline."""
    if link is not None and buffers:
        rest, handles, places = split(buffers, copy)
        if handles and (len(handles) <= MAX_FDS_PER_SEND or link.getblocking()):
            try:
                send_handles(link, handles)
            except BlockingIOError:  # nothing of it was sent
                return list(buffers)
            msg["fds"] = places
            return rest
    return list(buffers)


def receive_with(link: socket.socket | None, msg: dict[str, Any], buffers: list[Any],
                 populate: bool = False) -> list[Any]:
    """A received message's whole buffer list, with the segments its "fds" names taken from `link`
    (mapped with their pages at once where `populate`: see `merge`)."""
    if "fds" not in msg:
        return buffers
    if link is None:
        raise ShmError("a message named shared-memory descriptors, but there is no local link")
    places = check_places(msg.pop("fds"), len(buffers))
    return merge(buffers, receive_handles(link, places), places, populate)


# ---- the link ---------------------------------------------------------------------------------

def link_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of local links (the peer's end, the worker's end)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send_handles(link: socket.socket, handles: list[Handle]) -> None:
    """Send the descriptors of `handles` (raises BlockingIOError on a full non-blocking link, before any is sent)."""
    for start in range(0, len(handles), MAX_FDS_PER_SEND):
        batch = handles[start:start + MAX_FDS_PER_SEND]
        socket.send_fds(link, [_BATCH.pack(0x46, len(batch))], [h.fd for h in batch])


def receive_handles(link: socket.socket, places: list[tuple[int, int]], sealed: bool = True) -> list[Handle]:
    """The descriptors of a message (sent before it) as checked Handles (`adopt`); ShmError if they are not there."""
    handles: list[Handle] = []
    try:
        while len(handles) < len(places):
            try:
                data, fds, flags, _ = socket.recv_fds(link, _BATCH.size, MAX_FDS_PER_SEND,
                                                      socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                raise ShmError("a message named descriptors that did not come first on the local link") from None
            good = (len(data) == _BATCH.size and _BATCH.unpack(data) == (0x46, len(fds))
                    and not flags & socket.MSG_CTRUNC and len(handles) + len(fds) <= len(places))
            if not good:
                for fd in fds:
                    os.close(fd)
                raise ShmError("the local link carried something other than the message's descriptors")
            for i, fd in enumerate(fds):
                try:
                    handles.append(adopt(fd, places[len(handles)][1], sealed))
                except ShmError:
                    for other in fds[i + 1:]:
                        os.close(other)
                    raise
    except BaseException:
        for handle in handles:
            handle.close()
        raise
    return handles


def send_socket(link: socket.socket, sock: socket.socket) -> None:
    """Send a connected socket on a local link, before the message that names it (ADR 0012)."""
    socket.send_fds(link, [_SOCKET_MARK], [sock.fileno()])


def receive_socket(link: socket.socket) -> socket.socket:
    """The socket that `send_socket` sent before the message now read; ShmError if it is not there."""
    try:
        data, fds, flags, _ = socket.recv_fds(link, len(_SOCKET_MARK), 1, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
    except BlockingIOError:
        raise ShmError("a message named a socket that did not come first on the local link") from None
    sockets = [fd for fd in fds if stat.S_ISSOCK(os.fstat(fd).st_mode)]
    if data != _SOCKET_MARK or len(fds) != 1 or len(sockets) != 1 or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise ShmError("the local link carried something other than the message's socket")
    return socket.socket(fileno=fds[0])


def peer_uid(link: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: the kernel's word)."""
    creds = link.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def listen_address() -> str:
    """A fresh abstract socket name for a peer's local links (private to its network namespace)."""
    return f"\0gpulayer-{os.getpid()}-{secrets.token_hex(8)}"


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


_ACK = b"\x01"
LINK_TIMEOUT = 2.0


def open_link(address: Any, token: Any) -> socket.socket | None:
    """The submitter's side: a local link to the peer at abstract `address`, or None when that is not
    this host (another network namespace: nothing listens there) or not this user.

    The peer's end must be of our own uid too, and must acknowledge `token`.
    """
    if not (enabled() and isinstance(address, str) and address.startswith("\0gpulayer-") and len(address) < 100
            and isinstance(token, bytes) and len(token) == TOKEN_BYTES):
        return None
    link = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        link.settimeout(LINK_TIMEOUT)
        link.connect(address)
        if peer_uid(link) != os.getuid():
            link.close()
            return None
        link.sendall(token)
        if link.recv(1) != _ACK:
            link.close()
            return None
        link.settimeout(None)
        return link
    except OSError:
        link.close()
        return None

