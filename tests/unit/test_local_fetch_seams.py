"""The seams of a fetch on one host (jobs/local_fetch.py): the peer's `pass_file` and the submitter's
`Receiver`, joined by a real local link (a SOCK_SEQPACKET pair) and real files and descriptors.

The submitter takes from the link only a regular file of its uid at least the size the header said
(a pipe, a device or a shorter file is refused, and nothing is written); a file that its job goes on
appending to gives the bytes listed, as over TCP, and one that changed size before the peer opened it
ends the fetch with the same error as over TCP.
"""

from __future__ import annotations

import os
from functools import partial

import pytest

from gpulayer.jobs import local_fetch, transfer
from gpulayer.jobs.folder import FolderError
from gpulayer.protocol import messages
from gpulayer.transport import shm

pytestmark = pytest.mark.skipif(not shm.SUPPORTED, reason="descriptors pass on Linux only")
SIZE = 2 << 20


@pytest.fixture
def link():
    peer_end, submitter_end = shm.link_pair()
    yield peer_end, submitter_end
    peer_end.close()
    submitter_end.close()


def receiver_for(dest, submitter_end, size: int = SIZE) -> local_fetch.Receiver:
    receiver = local_fetch.Receiver(dest)
    receiver.use(submitter_end)
    receiver.feed(messages.file_header(1, [["a.bin", size, False]]), [])
    return receiver


def fetch(root, dest, link, local: bool, between) -> None:
    """Run a fetch of `root`'s a.bin from the peer's messages to a Receiver, over the `link` pair if `local`;
    `between` runs after the peer made each message of the file's bytes and before the submitter reads it."""
    peer_end, submitter_end = link
    handover = partial(local_fetch.pass_file, peer_end) if local else None
    receiver = local_fetch.Receiver(dest)
    if handover is not None:
        receiver.use(submitter_end)
    try:
        for msg, buffers in transfer.file_messages(root, transfer.listing(root, ["a.bin"]), 1, handover=handover):
            if "files" not in msg:  # the file is open (TCP) or passed (local)
                between()
            receiver.feed(msg, [bytes(b) for b in buffers])
        receiver.finish()
    finally:
        receiver.abort()


def passed_fd(peer_end, fd: int) -> None:
    shm.send_handles(peer_end, [shm.Handle(fd, SIZE)])


@pytest.mark.parametrize("make, says", [
    (lambda tmp: os.pipe()[0], "is not a regular file"),
    (lambda tmp: os.open("/dev/zero", os.O_RDONLY), "is not a regular file"),
    (lambda tmp: os.open(tmp, os.O_RDONLY | os.O_DIRECTORY), "is not a regular file"),
    (lambda tmp: _file(tmp / "short", SIZE - 1), f"has {SIZE - 1} bytes where its message said {SIZE}"),
])
def test_the_submitter_refuses_a_descriptor_that_is_not_the_file_announced(link, tmp_path, make, says):
    peer_end, submitter_end = link
    dest = tmp_path / "dest"
    receiver = receiver_for(dest, submitter_end)
    passed_fd(peer_end, make(tmp_path))
    with pytest.raises(FolderError, match=says):
        receiver.feed(messages.file_passed(1, 0), [])
    assert list(dest.iterdir()) == []


def test_a_descriptor_message_with_nothing_on_the_link_is_refused(link, tmp_path):
    receiver = receiver_for(tmp_path / "dest", link[1])
    with pytest.raises(FolderError, match="did not come first"):
        receiver.feed(messages.file_passed(1, 0), [])


def _file(path, size: int) -> int:
    path.write_bytes(os.urandom(size))
    return os.open(path, os.O_RDONLY)


@pytest.mark.parametrize("local", [True, False], ids=["local", "tcp"])
def test_a_file_its_job_appends_to_gives_the_bytes_listed(link, tmp_path, local):
    root = tmp_path / "job"
    root.mkdir()
    data = os.urandom(SIZE)
    (root / "a.bin").write_bytes(data)

    def append():
        with open(root / "a.bin", "ab") as f:
            f.write(b"more")

    fetch(root, tmp_path / "dest", link, local, append)
    assert (tmp_path / "dest" / "a.bin").read_bytes() == data


@pytest.mark.parametrize("local", [True, False], ids=["local", "tcp"])
def test_a_file_that_changed_size_before_it_was_opened_ends_the_fetch_alike(link, tmp_path, local):
    root = tmp_path / "job"
    root.mkdir()
    (root / "a.bin").write_bytes(os.urandom(SIZE))
    files = transfer.listing(root, ["a.bin"])
    with open(root / "a.bin", "ab") as f:
        f.write(b"more")
    handover = partial(local_fetch.pass_file, link[0]) if local else None
    with pytest.raises(FolderError, match="changed size since it was scanned"):
        list(transfer.file_messages(root, files, 1, handover=handover))
