"""gpulayer.jobs.transfer over a real TCP connection on loopback, after the real handshake, through the
secure channel (issue 27): a working folder up (only the blobs the store lacks, each verified), files
down (byte-exact, nothing overwritten unless forced), and what a broken or hostile other side gets.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

import pytest
from blake3 import blake3

from gpulayer import security
from gpulayer.jobs import transfer
from gpulayer.protocol import handshake, messages
from gpulayer.transport import blocking
from gpulayer.jobs.folder import BlobStore, Builder, DigestCache, FolderError, materialise, scan

KEY = b"k" * 32
TIMEOUT = 30.0


class Pair:
    """Two ends of one authenticated, secured TCP connection on loopback: `client` and `peer`."""

    def __init__(self):
        listener = socket.create_server(("127.0.0.1", 0))
        client_sock = socket.create_connection(listener.getsockname(), timeout=TIMEOUT)
        peer_sock, _ = listener.accept()
        listener.close()
        peer_sock.settimeout(TIMEOUT)
        self.client, self.peer = blocking.BlockingConnection(client_sock), blocking.BlockingConnection(peer_sock)
        hello = handshake.hello(security.new_nonce(), "peer-1", security.cluster_id(KEY), {})

        def peer_side():
            self.peer.send(hello)
            msg, _ = self.peer.recv()
            checked = handshake.check_auth(msg, KEY, hello)
            assert checked is not None
            self.peer.send(checked[0])
            self.peer.secure(*checked[1])

        self.run_beside(peer_side, lambda: handshake.client_handshake(self.client, KEY, "client-1"))

    def run_beside(self, other, mine):
        """Run `other` in a thread and `mine` here; both results, or the first exception of either.

        When `mine` fails, the stream is mid-way: the connection is shut down, which ends `other` too."""
        box: dict = {}

        def target():
            try:
                box["other"] = other()
            except BaseException as exc:  # re-raised below, in the test's thread
                box["error"] = exc

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        try:
            result = mine()
        except BaseException:
            for end in (self.client, self.peer):
                with contextlib.suppress(OSError):  # ENOTCONN: the first shutdown's reset closed this end already
                    end.sock.shutdown(socket.SHUT_RDWR)
            raise
        finally:
            thread.join(TIMEOUT)
        assert not thread.is_alive()
        if "error" in box:
            raise box["error"]
        return box.get("other"), result

    def close(self):
        self.client.close()
        self.peer.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def write(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)


@pytest.fixture
def project(tmp_path) -> Path:
    root = tmp_path / "project"
    write(root / "train.py", b"print('hi')\n", 0o755)
    write(root / "data" / "big.bin", os.urandom(9 * transfer.CHUNK // 4 + 123))  # several chunks, an odd end
    write(root / "data" / "copy.bin", (root / "data" / "big.bin").read_bytes())  # the same content: one blob
    write(root / "empty.txt", b"")
    return root


def upload(pair: Pair, root: Path, store: BlobStore) -> tuple[int, int]:
    """The upload conversation: the manifest goes, the peer says what it lacks, only that comes."""
    manifest = scan(root, cache=DigestCache(None))
    pair.client.send({"t": messages.SUBMIT, "id": 1, "manifest": manifest.to_wire()})

    def peer_side():
        msg, _ = pair.peer.recv()
        received = transfer.Manifest.from_wire(msg["manifest"])
        missing = store.missing(received.blobs())
        pair.peer.send({"t": messages.ACCEPT, "id": 1, "missing": missing})
        return transfer.receive_blobs(pair.peer, store, {d: received.blobs()[d] for d in missing})

    def client_side():
        reply, _ = pair.client.recv()
        return transfer.push_blobs(pair.client, manifest, reply["missing"], 1)

    received, sent = pair.run_beside(peer_side, client_side)
    assert received == sent
    return sent, manifest.total_bytes


def test_upload_sends_only_what_the_store_lacks(pair, project, tmp_path):
    store = BlobStore(tmp_path / "store")
    sent, total = upload(pair, project, store)
    big = (project / "data" / "big.bin").stat().st_size
    assert sent == big + len(b"print('hi')\n")  # the copy and the empty file add no blob bytes
    job = tmp_path / "job"
    materialise(scan(project, cache=DigestCache(None)), store, job)
    for rel in ("train.py", "data/big.bin", "data/copy.bin", "empty.txt"):
        assert (job / rel).read_bytes() == (project / rel).read_bytes()
    assert os.access(job / "train.py", os.X_OK)
    write(project / "notes.md", b"new")
    assert upload(pair, project, store) == (3, total + 3)  # a resubmit sends the new file only


def test_a_truncated_upload_leaves_nothing(pair, project, tmp_path):
    store = BlobStore(tmp_path / "store")
    manifest = scan(project, cache=DigestCache(None))
    digest = manifest.blobs()
    big = next(d for d, size in digest.items() if size > transfer.CHUNK)

    def client_side():
        messages = transfer.blob_messages(manifest, [big], 1)
        pair.client.send(*next(messages))  # the first chunk only, then the submitter vanishes
        pair.client.sock.shutdown(socket.SHUT_WR)

    with pytest.raises(ConnectionError):
        pair.run_beside(client_side, lambda: transfer.receive_blobs(pair.peer, store, {big: digest[big]}))
    assert store.missing(digest) == list(digest)
    assert list((tmp_path / "store" / "tmp").iterdir()) == []


def test_a_file_changed_after_the_scan_is_not_stored(pair, project, tmp_path):
    store = BlobStore(tmp_path / "store")
    manifest = scan(project, cache=DigestCache(None))
    (project / "train.py").write_bytes(b"print('ho')\n")  # same size, other content
    blobs = manifest.blobs()
    with pytest.raises(FolderError, match="does not match its digest"):
        pair.run_beside(lambda: transfer.push_blobs(pair.client, manifest, list(blobs), 1),
                        lambda: transfer.receive_blobs(pair.peer, store, blobs))
    assert blake3(b"print('hi')\n").hexdigest() in store.missing(blobs)
    assert all(blake3(store.path(d).read_bytes()).hexdigest() == d for d, _ in store.blobs())


def test_a_blob_not_asked_for_is_refused(pair, project, tmp_path):
    store = BlobStore(tmp_path / "store")
    manifest = scan(project, cache=DigestCache(None))
    wanted, other = sorted(manifest.blobs())[:2]
    with pytest.raises(FolderError, match="not asked for"):
        pair.run_beside(lambda: transfer.push_blobs(pair.client, manifest, [other], 1),
                        lambda: transfer.receive_blobs(pair.peer, store, {wanted: manifest.blobs()[wanted]}))
    assert store.missing(manifest.blobs()) == list(manifest.blobs())


# --- fetch ---------------------------------------------------------------------------------------


@pytest.fixture
def job(tmp_path) -> Path:
    folder = tmp_path / "job"
    write(folder / "ckpt" / "last.pt", os.urandom(transfer.CHUNK + 17))
    write(folder / "ckpt" / "run.sh", b"#!/bin/sh\n", 0o755)
    write(folder / "logs" / "empty.log", b"")
    (folder / "etc").symlink_to("/etc")
    write(tmp_path / "secret.txt", b"not yours")
    (folder / "up").symlink_to("..")
    return folder


def fetch(pair: Pair, job: Path, paths: list[str], dest: Path, force: bool = False):
    return pair.run_beside(lambda: transfer.send_files(pair.peer, job, paths, 7),
                           lambda: transfer.receive_files(pair.client, dest, force))


def test_fetch_brings_files_back_byte_exact(pair, job, tmp_path):
    dest = tmp_path / "back"
    sent, written = fetch(pair, job, ["ckpt", "logs/empty.log"], dest)
    assert written == ["ckpt/last.pt", "ckpt/run.sh", "logs/empty.log"]
    assert sent == (job / "ckpt" / "last.pt").stat().st_size + len(b"#!/bin/sh\n")
    for rel in written:
        assert (dest / rel).read_bytes() == (job / rel).read_bytes()
    assert os.access(dest / "ckpt" / "run.sh", os.X_OK)
    assert sorted(p.name for p in (dest / "ckpt").iterdir()) == ["last.pt", "run.sh"]  # no partial left


def test_fetch_never_overwrites_unless_forced(pair, job, tmp_path):
    dest = tmp_path / "back"
    write(dest / "ckpt" / "run.sh", b"mine")
    with pytest.raises(FolderError, match=r"would overwrite ckpt/run\.sh"):
        fetch(pair, job, ["ckpt"], dest)
    assert (dest / "ckpt" / "run.sh").read_bytes() == b"mine" and not (dest / "ckpt" / "last.pt").exists()
    again = Pair()  # the refused stream is mid-way: its connection is closed, another one is used
    try:
        fetch(again, job, ["ckpt"], dest, force=True)
    finally:
        again.close()
    assert (dest / "ckpt" / "run.sh").read_bytes() == b"#!/bin/sh\n"


@pytest.mark.parametrize("path, problem", [
    ("../../etc/passwd", "goes up"), ("/etc/passwd", "absolute"), ("etc/passwd", "leads out"),
    ("up/secret.txt", "leads out"), ("nope", "no such file"),
])
def test_fetch_refuses_paths_that_leave_the_jobs_folder(pair, job, tmp_path, path, problem):
    dest = tmp_path / "back"
    with pytest.raises(FolderError, match=f"the peer stopped the fetch: .*{problem}"):
        fetch(pair, job, [path], dest)
    assert not dest.exists() or list(dest.rglob("*")) == []


@pytest.mark.parametrize("files, problem", [
    ([["../escape", 1, False]], "goes up"), ([["/tmp/escape", 1, False]], "absolute"),
    ([["a", 1, False], ["a", 1, False]], "twice"), ([["a", -1, False]], "lists"),
    ([["link/x", 1, False]], "leads out"),
])
def test_a_hostile_fetch_header_writes_nothing(pair, tmp_path, files, problem):
    dest = tmp_path / "back"
    dest.mkdir()
    (dest / "link").symlink_to(tmp_path)
    pair.peer.send({"t": messages.FILE, "id": 7, "files": files})
    with pytest.raises(FolderError, match=problem):
        transfer.receive_files(pair.client, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["link"]
    assert not (tmp_path / "escape").exists() and not (tmp_path / "x").exists()


def test_receivers_work_inline_as_on_the_event_loop(project, tmp_path):
    """The peer's event loop feeds BlobReceiver itself (no disk thread) with copies of what
    blob_messages gives; the same for FileReceiver with file_messages (each chunk a buffer of its own, as
    the peer's `Pool` gives them)."""
    store = BlobStore(tmp_path / "store")
    manifest = scan(project, cache=DigestCache(None))
    receiver = transfer.BlobReceiver(store, manifest.blobs())
    for msg, buffers in transfer.blob_messages(manifest, list(manifest.blobs()), 1):
        receiver.feed(msg, [bytearray(b) for b in buffers])
    receiver.finish()
    assert receiver.done and store.missing(manifest.blobs()) == []
    job = tmp_path / "job"
    materialise(manifest, store, job)
    back = transfer.FileReceiver(tmp_path / "back")
    files = transfer.listing(job, ["."])
    for msg, buffers in transfer.file_messages(job, files, 2, allocate=lambda n: memoryview(bytearray(n))):
        back.feed(msg, buffers)
    back.finish()
    assert back.done
    for rel, _, _ in files:
        assert (tmp_path / "back" / rel).read_bytes() == (project / rel).read_bytes()


def test_the_jobs_folder_is_built_while_its_blobs_come(project, tmp_path):
    """As the peer receives an upload, each file is placed in the job's folder once its blob is stored, on
    the disk thread, not copied after the last one; the files whose blob the store had already are placed
    at the end. The folder is whole and byte-exact; an upload dropped half way leaves nothing of it."""
    store = BlobStore(tmp_path / "store")
    manifest = scan(project, cache=DigestCache(None))
    write(tmp_path / "had.py", b"print('hi')\n")
    with open(tmp_path / "had.py", "rb") as f, store.writer(manifest.entries[-1].digest, 12) as writer:
        writer.write(f.read())
        writer.commit()  # train.py's content: in the store before the upload
    need = store.missing(manifest.blobs())
    assert len(need) == 2  # big.bin (with its copy) and the empty file
    dests = [tmp_path / "jobs" / name / "work" for name in ("a", "b")]  # an array of two
    for dest in dests:
        dest.parent.mkdir(parents=True)
    placed = []

    class Recorded(Builder):
        def stored(self, digest: str) -> None:
            super().stored(digest)
            placed.append(sorted(p.name for p in (tmp_path / "jobs").rglob("*") if p.is_file()))

    builder = Recorded(manifest, store, lambda: dests)
    receiver = transfer.BlobReceiver(store, {d: manifest.blobs()[d] for d in need}, transfer.DiskThread(),
                                     builder=builder)
    for msg, buffers in transfer.blob_messages(manifest, need, 1):
        receiver.feed(msg, [bytearray(b) for b in buffers])
    receiver.finish()
    assert placed == [["empty.txt", "empty.txt"], ["big.bin", "big.bin", "copy.bin", "copy.bin", "empty.txt",
                                                   "empty.txt"]]  # each blob's files as it was stored
    builder.finish()
    for dest in dests:
        assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
            "data/big.bin", "data/copy.bin", "empty.txt", "train.py"]
        for rel in ("train.py", "data/big.bin", "data/copy.bin", "empty.txt"):
            assert (dest / rel).read_bytes() == (project / rel).read_bytes()
        assert os.access(dest / "train.py", os.X_OK) and not os.access(dest / "data" / "big.bin", os.X_OK)
    dropped = tmp_path / "dropped" / "work"
    dropped.parent.mkdir()
    half = Builder(manifest, store, lambda: [dropped])
    half.stored(manifest.entries[0].digest)
    half.abort()
    assert list(dropped.parent.iterdir()) == []


def test_a_disk_thread_with_on_room_never_blocks_and_says_when_it_has_room_again():
    """The peer's event loop hands an upload's chunks to a DiskThread with `on_room`: `run` never blocks it
    (it stops reading while `full`), and `on_room` comes once the bytes waiting fall below the limit."""
    gate, roomy = threading.Event(), threading.Event()
    disk = transfer.DiskThread(limit=100, on_room=roomy.set)
    done = []
    for i in range(3):  # 150 bytes wait behind a gated first piece: over the limit, and run did not block
        disk.run(lambda i=i: (gate.wait(TIMEOUT), done.append(i)), 50)
    assert disk.full and not roomy.is_set()
    gate.set()
    assert roomy.wait(TIMEOUT)
    disk.finish()
    assert done == [0, 1, 2] and not disk.full



def test_a_disk_threads_work_beside_runs_at_the_same_time_and_hands_back_its_error():
    """A chunk is hashed beside its write (`DiskThread.beside`): the two run at once (here the disk work
    waits for what only the work beside it does), the waiter hands back the work's error, and `finish`
    ends the second thread too."""
    disk = transfer.DiskThread()
    met, outcome, threads = threading.Event(), [], []

    def meet() -> None:
        threads.append(threading.current_thread())
        met.set()

    def work() -> None:
        threads.append(threading.current_thread())
        waiter = disk.beside(meet)
        outcome.append(met.wait(TIMEOUT))  # True only if the work beside ran while this one waited
        waiter()
        failing = disk.beside(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing()
        outcome.append("raised")

    disk.run(work)
    disk.finish()
    assert outcome == [True, "raised"]
    assert len(set(threads)) == 2 and not any(t.is_alive() for t in threads)

GOOD = blake3(b"x").hexdigest()


@pytest.mark.parametrize("msg, buffers, problem", [
    ({"t": messages.BLOB, "d": "../x", "off": 0, "size": 1}, [b"x"], "needs 'd'"),
    ({"t": messages.BLOB, "d": GOOD, "off": -1, "size": 1}, [b"x"], "needs 'd'"),
    ({"t": messages.BLOB, "pack": [[GOOD, True]]}, [b"x"], "'pack' lists"),
    ({"t": messages.BLOB, "pack": {"a": 1}}, [b"x"], "'pack' lists"),
    ({"t": messages.BLOB, "d": GOOD, "off": 0, "size": 1}, [b"x", b"y"], "at most one buffer"),
    ({"t": messages.FILE, "n": 0, "off": 0}, [b"x"], "expected a BLOB"),
    ({"t": messages.BLOB, "pack": [[GOOD, 2]]}, [b"xx"], "not asked for"),
    ({"t": messages.BLOB, "d": GOOD, "off": 0, "size": 1}, [b"xy"], "more than the 1 bytes"),
])
def test_malformed_blob_messages_are_refused(tmp_path, msg, buffers, problem):
    store = BlobStore(tmp_path / "store")
    with pytest.raises(FolderError, match=problem):
        transfer.BlobReceiver(store, {GOOD: 1}).feed(msg, buffers)
    assert store.missing({GOOD: 1}) == [GOOD] and list((tmp_path / "store" / "tmp").iterdir()) == []


@pytest.mark.parametrize("msg, buffers, problem", [
    ({"t": messages.FILE, "n": 0, "off": 0}, [b"x"], "starts with a FILE header"),
    ({"t": messages.FILE, "files": [["a", 1, False]]}, [b"x"], "with no buffer"),
    ({"t": messages.FILE, "files": "a"}, [], "header lists"),
    ({"t": messages.BLOB, "files": []}, [], "expected a FILE"),
])
def test_malformed_file_messages_write_nothing(tmp_path, msg, buffers, problem):
    with pytest.raises(FolderError, match=problem):
        transfer.FileReceiver(tmp_path / "back").feed(msg, buffers)
    assert not (tmp_path / "back").exists()
