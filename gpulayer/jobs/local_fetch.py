"""A fetch on one host: each file's bytes move in the kernel, not through the secure channel (ADR 0016).

Where the submitter and the peer share a host and a uid, the submitter opens a local link beside its
connection (ADR 0009: LOCAL over the secure channel, an abstract Unix socket, SO_PEERCRED both ways,
a one-time token) and asks its JOB_FETCH with `"local": true`. The peer then passes each non-empty
file, opened read-only after the same path checks as over TCP, as a descriptor on the link, and
sends `FILE {"id", "n": index, "fd": true}` in place of its chunks (`pass_file`; files of 1 MiB or
more, as for buffers in ADR 0009). The submitter
checks each descriptor (`shm.adopt`: a regular file of its uid, at least the size the header said;
a file the job still writes to is copied as it was when listed, as over TCP),
copies it in the kernel (copy_file_range, a read loop where that fails) beside its final name and
renames it into place, as for chunks (`Receiver`). A file the link cannot carry (full, or no link:
another host, another network namespace, another uid, GPULAYER_SHM=0, macOS) goes as chunks.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from ..protocol import messages
from ..transport import shm
from . import transfer
from .folder import FolderError, PathLike, copy_fd


class _Asker(Protocol):
    """What opening a link needs of a job connection (client/jobs.py's JobLink)."""

    def ask_local(self) -> messages.Message | None: ...


def pass_file(link: Any, path: Path, size: int) -> bool:
    """The peer's side: send the descriptor of the job's file `path` (of `size` bytes when listed) on the
    submitter's local `link`; False where it cannot go that way (the caller sends its chunks). FolderError,
    as over TCP, when it is no longer a regular file of that size. Files under shm.SHM_MIN (1 MiB) go as
    chunks, as small buffers do (ADR 0009): a descriptor each would cost more than their bytes."""
    if size < shm.SHM_MIN:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # the chunks' own open says why
    handle = shm.Handle(fd, size)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise FolderError(f"{path} changed size since it was scanned")
        shm.send_handles(link, [handle])
        return True
    except OSError:  # the link is full (BlockingIOError) or the kernel holds too many in flight
        return False
    finally:
        handle.close()


class Receiver(transfer.FileReceiver):
    """A FileReceiver that also takes whole files as descriptors on a local link (`attach`)."""

    def __init__(self, dest: PathLike, force: bool = False, disk: transfer.DiskThread | None = None,
                 release: Callable[[Any], None] | None = None):
        super().__init__(dest, force, disk, release)
        self.link: Any = None
        self.passed = 0  # files that came by descriptor

    def attach(self, conn: _Asker) -> bool:
        """Open a local link beside `conn` where the peer is on this host, as this user; True if one is open
        (then ask with "local": true)."""
        if self.link is not None:  # a link beside an earlier connection (the job moved)
            self.link.close()
            self.link = None
        if shm.enabled():
            reply = conn.ask_local()
            link = shm.open_link(reply.get("addr"), reply.get("token")) if reply is not None else None
            if link is not None:
                self.use(link)
        return self.link is not None

    def use(self, link: socket.socket) -> None:
        """Take descriptors from `link`, without waiting: a descriptor comes before the message that names it
        (and Python before 3.12 drops recv_fds's MSG_DONTWAIT)."""
        link.setblocking(False)
        self.link = link

    def feed(self, msg: messages.Message, buffers: list[Any]) -> bool:
        if msg.get("t") != messages.FILE or "fd" not in msg:
            return super().feed(msg, buffers)
        index = self._next
        problem = messages.check_file(msg, len(buffers))
        if problem is None and (self.link is None or self.files is None or self.done or msg.get("n") != index
                                or self._offset):
            problem = f"a FILE descriptor out of place: file {msg.get('n')!r}"
        if problem is None:
            assert self.files is not None
            rel, size, _ = self.files[index]
            try:
                handle = shm.receive_handles(self.link, [(0, size)], sealed=False)[0]
            except shm.ShmError as exc:
                problem = f"{rel}: {exc}"
        if problem is not None:
            self.abort()
            raise FolderError(problem)
        self.received += size
        self.passed += 1
        self._sink.run(partial(self._copy, index, rel, handle))
        self._sink.run(self._complete)
        self._next += 1
        return self._skip_empty()

    def _copy(self, index: int, rel: str, handle: shm.Handle) -> None:
        """Write the file `index` from the peer's descriptor, in the kernel where it can."""
        try:
            self._open(index)
            assert self._fd is not None
            copy_fd(handle.fd, self._fd, handle.size)
        except FolderError as exc:
            raise FolderError(f"{rel}: {exc}") from None
        finally:
            handle.close()

    def abort(self) -> None:
        super().abort()
        if self.link is not None:
            self.link.close()
            self.link = None
