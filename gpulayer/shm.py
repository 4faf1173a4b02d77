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

Where memfd or SCM_RIGHTS are missing (macOS, an old job interpreter), or GPULAYER_SHM=0,
everything travels inline.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import socket
import stat
import struct
import sys
import weakref
from typing import Any, Iterable

SHM_MIN = 1 << 20  # buffers this big travel by descriptor over a local link
SUPPORTED = sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
MAX_FDS_PER_SEND = 250  # under the kernel's SCM_MAX_FD (253)
TOKEN_BYTES = 16
_SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) if SUPPORTED else 0
_BATCH = struct.Struct(">BH")  # the payload of one SCM_RIGHTS record: b"F", how many descriptors it carries
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault the whole mapping in at once
_PWRITE_MAX = 1 << 30


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

    def map(self) -> Segment:
        """A writable shared mapping of the segment (zero-copy; whoever sent it has let go of it)."""
        segment = Segment(self.fd, self.size)
        segment.handle = self
        return segment

    def close(self) -> None:
        self._close()


def create(size: int) -> Handle:
    """A fresh sealed memfd of `size` bytes (at least 1)."""
    fd = os.memfd_create("gpulayer", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return Handle(fd, size)


def receive_segment(size: int) -> Segment:
    """A mapped fresh segment to receive a frame of `size` bytes into (pages faulted in at once)."""
    segment = create(size).map()
    try:
        segment.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        pass
    return segment


def copy_in(view: memoryview) -> Handle:
    """A segment holding a copy of `view` (one pass, written by the kernel: no page faults here)."""
    handle = create(view.nbytes)
    offset = 0
    while offset < view.nbytes:
        offset += os.pwrite(handle.fd, view[offset:offset + _PWRITE_MAX], offset)
    return handle


def adopt(fd: int, size: Any) -> Handle:
    """A descriptor received on a local link as a Handle, after checking that it is a segment.

    It must be a memfd of this uid, sealed against shrinking and growing, of exactly `size` bytes
    (what its message said). Anything else (a file such as /etc/passwd, an unsealed memfd that
    could be truncated under us) is closed and refused with ShmError.
    """
    try:
        info = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        os.close(fd)
        raise ShmError("a descriptor on the local link is not a sealed memfd segment") from None
    problem = None
    if not stat.S_ISREG(info.st_mode) or seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != \
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
        problem = "is not a memfd sealed against shrinking and growing"
    elif info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not {os.getuid()}"
    elif isinstance(size, bool) or not isinstance(size, int) or info.st_size != size or size < 1:
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
    from .wire import MAX_BUFFERS

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


def merge(inline: list[Any], handles: list[Handle], places: list[tuple[int, int]]) -> list[Any]:
    """The message's whole buffer list: `handles`, mapped, at their places among `inline`.

    Mapping costs no copy and touches no page: a peer that only passes a segment on never reads it.
    """
    out: list[Any] = []
    rest = iter(inline)
    for (position, _), handle in zip(places, handles):
        while len(out) < position:
            out.append(next(rest))
        out.append(handle.map())
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


def receive_with(link: socket.socket | None, msg: dict[str, Any], buffers: list[Any]) -> list[Any]:
    """A received message's whole buffer list, with the segments its "fds" names taken from `link`."""
    if "fds" not in msg:
        return buffers
    if link is None:
        raise ShmError("a message named shared-memory descriptors, but there is no local link")
    places = check_places(msg.pop("fds"), len(buffers))
    return merge(buffers, receive_handles(link, places), places)


# ---- the link ---------------------------------------------------------------------------------

def link_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of local links (the peer's end, the worker's end)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send_handles(link: socket.socket, handles: list[Handle]) -> None:
    """Send the descriptors of `handles` (raises BlockingIOError on a full non-blocking link, before any is sent)."""
    for start in range(0, len(handles), MAX_FDS_PER_SEND):
        batch = handles[start:start + MAX_FDS_PER_SEND]
        socket.send_fds(link, [_BATCH.pack(0x46, len(batch))], [h.fd for h in batch])


def receive_handles(link: socket.socket, places: list[tuple[int, int]]) -> list[Handle]:
    """The descriptors of a message (sent before it) as checked Handles; ShmError if they are not there."""
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
                    handles.append(adopt(fd, places[len(handles)][1]))
                except ShmError:
                    for other in fds[i + 1:]:
                        os.close(other)
                    raise
    except BaseException:
        for handle in handles:
            handle.close()
        raise
    return handles


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

