"""The data plane (ADR 0009) against real peers on loopback: shared-memory segments on one host,
byte-exact round trips around every size threshold, the checks on descriptors a submitter hands
over, no leftovers after kill -9, and the memory bound."""

from __future__ import annotations

import errno
import fcntl
import gc
import hashlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import numpy as np
import psutil
import pytest

from gpulayer import serialization
from gpulayer.client import Client
from gpulayer.errors import GPULayerError
from gpulayer.matching import Requirements
from gpulayer.protocol import framing, handshake, messages, records
from gpulayer.transport import blocking, shm
from support import new_key, wait_until

ANY = Requirements.build()
MiB = 1 << 20
pytestmark = pytest.mark.skipif(not shm.SUPPORTED, reason="memfd and SCM_RIGHTS are Linux's")


def digest_and_echo(array):
    return hashlib.sha256(array).hexdigest(), array


def side_effect(path):
    open(path, "w").close()
    return "ran"


@pytest.fixture(scope="module")
def peer(peer_factory):
    return peer_factory("plane", "--no-mdns", "--concurrency", "1", key=new_key())


@pytest.fixture(params=["shared-memory", "tcp"])
def client(request, peer, monkeypatch):
    """A submitter of the same host and user, with its local link (shared memory), or without (GPULAYER_SHM=0)."""
    if request.param == "tcp":
        monkeypatch.setenv("GPULAYER_SHM", "0")
    c = Client(key=peer.key.encode(), peers=peer.address, mdns=False, echo_output=False)
    c.mode = request.param
    yield c
    c.close()


def only_connection(client: Client):
    return wait_until(lambda: next(iter(client.pool.own.values()), None), 10)


SIZES = sorted({1, serialization.OUT_OF_BAND_MIN - 1, serialization.OUT_OF_BAND_MIN,
                serialization.OUT_OF_BAND_MIN + 1, 128 << 10, (128 << 10) + 1, shm.SHM_MIN - 1, shm.SHM_MIN,
                shm.SHM_MIN + 1, records.RECORD_MAX + 17, 5 * MiB + 3})


@pytest.mark.parametrize("size", SIZES)
def test_arrays_round_trip_byte_exact_around_every_threshold(client, size):
    array = np.frombuffer(os.urandom(size), dtype=np.uint8).copy()
    digest, back = client.submit(digest_and_echo, (array,), req=ANY).result(60)
    assert digest == hashlib.sha256(array).hexdigest()  # what the worker saw
    assert back.dtype == array.dtype and np.array_equal(back, array)  # what came back
    assert back.flags.writeable


def test_256_mib_round_trips_through_shared_memory_on_one_host_and_through_tcp_without(client):
    array = np.random.default_rng(3).integers(0, 2**63, size=(256 * MiB) // 8, dtype=np.int64)
    digest, back = client.submit(digest_and_echo, (array,), req=ANY).result(120)
    assert digest == hashlib.sha256(array).hexdigest() and np.array_equal(back, array)
    conn = only_connection(client)
    if client.mode == "shared-memory":
        assert conn._wire.link is not None
        assert conn._wire.received < MiB  # the 256 MiB came back by descriptor, not over TCP
    else:
        assert conn._wire.link is None and conn._wire.received > 256 * MiB


@pytest.mark.skipif(psutil.virtual_memory().available < 8 << 30, reason="a 1 GiB round trip needs about 4 GiB free")
def test_a_1_gib_array_round_trips_byte_exact(client):
    array = np.arange((1 << 30) // 8, dtype=np.int64)
    digest, back = client.submit(digest_and_echo, (array,), req=ANY).result(300)
    assert digest == hashlib.sha256(array).hexdigest() and np.array_equal(back, array)


def test_numpy_arrays_and_cpu_tensors_are_pickled_without_copies():
    torch = pytest.importorskip("torch")
    array = np.arange(MiB, dtype=np.float32)
    tensor = torch.arange(MiB, dtype=torch.bfloat16)
    data, buffers = serialization.dumps((array, tensor))
    assert len(data) < 1024 and [b.nbytes for b in buffers] == [array.nbytes, tensor.nbytes]
    addresses = [np.frombuffer(b, dtype=np.uint8).ctypes.data for b in buffers]
    assert addresses == [array.ctypes.data, tensor.data_ptr()]  # views of their memory, not copies
    received = [bytearray(b) for b in buffers]  # what a reader hands over
    back, back_tensor = serialization.loads(data, received)
    assert np.shares_memory(back, np.frombuffer(received[0], dtype=np.uint8))  # rebuilt in place
    assert back_tensor.data_ptr() == np.frombuffer(received[1], dtype=np.uint8).ctypes.data
    assert np.array_equal(back, array) and torch.equal(back_tensor, tensor)


# ---- descriptors a submitter hands over -----------------------------------------------------------

def authenticated(peer) -> blocking.BlockingConnection:
    sock = socket.create_connection(("127.0.0.1", peer.port), timeout=10)
    conn = blocking.BlockingConnection(sock)
    handshake.client_handshake(conn, peer.key.encode(), "attacker")
    return conn


def local_offer(conn: blocking.BlockingConnection) -> dict:
    conn.send({"t": messages.LOCAL, "id": 1})
    reply, _ = conn.recv(time.monotonic() + 10)
    assert reply["t"] == messages.LOCAL and reply["addr"].startswith("\0gpulayer-")
    return reply


def submit_with_descriptor(conn: blocking.BlockingConnection, fd: int, size: int, marker: Path) -> dict:
    """A SUBMIT whose one buffer is descriptor `fd`, sent on the connection's link: the peer's answer."""
    socket.send_fds(conn.link, [b"F\x00\x01"], [fd])
    msg = messages.submit(1, serialization.dumps(side_effect)[0], serialization.dumps(((str(marker),), {}))[0],
                          {}, None, "pwn")
    msg["fds"] = [[0, size]]
    conn.send(msg)
    reply, _ = conn.recv(time.monotonic() + 10)
    return reply


def sealed_memfd(size: int, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) -> int:
    fd = os.memfd_create("gpulayer-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def as_user(uid: int, fn) -> str:
    """fn() run in a forked child that has become `uid` (no exec: the venv's interpreter may be out of
    that user's reach); what it returned, as text."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(write, str(fn()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child of uid {uid} failed"
    return out


def memfd_of_nobody(size: int) -> int:
    """A sealed memfd created by a process of uid 65534, received here over a socket pair."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def make_and_send() -> str:
        fd = sealed_memfd(size)
        socket.send_fds(theirs, [b"x"], [fd])
        return "sent"

    assert as_user(65534, make_and_send) == "sent"
    theirs.close()
    _, fds, _, _ = socket.recv_fds(ours, 16, 1)
    ours.close()
    return fds[0]


@pytest.mark.skipif(os.getuid() != 0, reason="making a process of another uid needs root")
@pytest.mark.parametrize("case", ["etc-passwd", "unsealed", "wrong-size", "another-uid"])
def test_a_descriptor_that_is_not_our_sealed_segment_is_refused_and_runs_nothing(peer, tmp_path, case):
    marker = tmp_path / "ran"
    conn = authenticated(peer)
    offer = local_offer(conn)
    conn.link = shm.open_link(offer["addr"], offer["token"])
    assert conn.link is not None  # same host, same user: the link is granted
    size = 4096
    if case == "etc-passwd":
        fd, size = os.open("/etc/passwd", os.O_RDONLY), os.path.getsize("/etc/passwd")
    elif case == "unsealed":  # could be truncated under the peer's mapping (SIGBUS)
        fd = sealed_memfd(size, seals=0)
    elif case == "wrong-size":
        fd = sealed_memfd(size)
        size *= 2
    else:
        fd = memfd_of_nobody(size)
    reply = submit_with_descriptor(conn, fd, size, marker)
    os.close(fd)
    expected = {"etc-passwd": "not a sealed memfd", "unsealed": "not a memfd sealed", "wrong-size": "bytes where",
                "another-uid": "belongs to uid 65534"}[case]
    assert reply["t"] == messages.ERROR and reply["code"] == "protocol" and expected in reply["message"], reply
    conn.close()
    assert not marker.exists()
    assert peer.alive()


def test_descriptors_without_a_local_link_are_refused(peer, tmp_path):
    conn = authenticated(peer)
    msg = messages.submit(1, serialization.dumps(side_effect)[0],
                          serialization.dumps(((str(tmp_path / "ran"),), {}))[0], {}, None, "pwn")
    msg["fds"] = [[0, 4096]]
    conn.send(msg)
    reply, _ = conn.recv(time.monotonic() + 10)
    assert reply["t"] == messages.ERROR and "no local link" in reply["message"]
    conn.close()
    assert not (tmp_path / "ran").exists()


def peer_local_address(peer) -> str:
    """The abstract name the peer listens on, as anyone on the host can read it in /proc/net/unix."""
    conn = authenticated(peer)
    try:
        return local_offer(conn)["addr"]
    finally:
        conn.close()


def try_link(address: str, token: bytes, uid: int | None = None) -> str:
    """Connect to the peer's local socket (in a child process, as `uid`), present `token`: what the peer answered."""
    def attempt() -> str:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        try:
            s.connect(address)
            s.send(token)
            return repr(s.recv(1))
        except OSError as exc:
            return type(exc).__name__

    return as_user(os.getuid() if uid is None else uid, attempt)


def test_a_local_link_needs_a_live_token_of_this_connection(peer):
    address = peer_local_address(peer)
    assert try_link(address, os.urandom(shm.TOKEN_BYTES)) == "b''"  # no key, so no token: closed, no ACK
    conn = authenticated(peer)
    offer = local_offer(conn)
    assert try_link(offer["addr"], offer["token"]) == repr(b"\x01")  # the token of a live connection
    assert try_link(offer["addr"], offer["token"]) == "b''"  # once only


@pytest.mark.skipif(os.getuid() != 0, reason="making a process of another uid needs root")
def test_a_process_of_another_user_gets_no_local_link(peer):
    conn = authenticated(peer)
    offer = local_offer(conn)
    assert try_link(offer["addr"], offer["token"], uid=65534) in ("b''", "ConnectionResetError", "BrokenPipeError")
    wait_until(lambda: "refused a local link from another user" in peer.log(), 10)
    conn.close()


# ---- nothing left behind ----------------------------------------------------------------------

def gpulayer_segments(pid: int) -> int:
    """How many gpulayer memfds process `pid` holds open or mapped (none once it has exited: a worker
    listed a moment ago may be gone, replaced by the peer)."""
    try:
        links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir() if fd.is_symlink()]
        maps = Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return sum(link.startswith("/memfd:gpulayer") for link in links) + maps.count("/memfd:gpulayer")


def shm_names() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if "gpulayer" in name}


def hold(array, seconds):
    import time

    time.sleep(seconds)
    return array


SUBMITTER = textwrap.dedent("""
    import sys, numpy as np
    from gpulayer.client import Client
    from gpulayer.matching import Requirements
    def hold(array, seconds):
        import time
        time.sleep(seconds)
        return array
    c = Client(key=sys.argv[1].encode(), peers=sys.argv[2], mdns=False, echo_output=False)
    c.submit(hold, (np.ones(64 << 20, dtype=np.uint8), 0.0), req=Requirements.build()).result(60)
    print("first", flush=True)
    c.submit(hold, (np.ones(64 << 20, dtype=np.uint8), 60.0), req=Requirements.build()).result(120)
""")


def test_no_segment_is_left_after_kill_9_of_worker_submitter_or_peer(peer_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("GPULAYER_SHM_POOL_IDLE_S", "0.5")  # live processes keep what they made only so long
    before = shm_names()
    gc.collect()
    ours = gpulayer_segments(os.getpid())  # what earlier tests of this process still map
    key = new_key()
    victim = peer_factory("victim", "--no-mdns", "--concurrency", "1", key=key,
                          env={"GPULAYER_SHM_POOL_IDLE_S": "0.5"})
    client = Client(key=key.encode(), peers=victim.address, mdns=False, echo_output=False)
    try:
        array = np.ones(32 * MiB, dtype=np.uint8)
        assert np.array_equal(client.submit(hold, (array, 0.0), req=ANY).result(60), array)
        assert only_connection(client)._wire.link is not None
        # the worker killed while it holds a segment
        future = client.submit(hold, (array, 60.0), req=ANY)
        worker = wait_until(lambda: [p for p in victim.workers() if gpulayer_segments(p)], 30)[0]
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(GPULayerError):
            future.result(60)
        wait_until(lambda: gpulayer_segments(victim.pid) == 0, 10)
        # a submitter killed while its task holds a segment
        submitter = subprocess.Popen([sys.executable, "-c", SUBMITTER, key, victim.address], stdout=subprocess.PIPE,
                                     text=True)
        assert submitter.stdout.readline().strip() == "first"
        wait_until(lambda: any(gpulayer_segments(p) for p in victim.workers()), 30)
        submitter.kill()
        submitter.wait(10)
        submitter.stdout.close()
        wait_until(lambda: all(gpulayer_segments(p) == 0 for p in [victim.pid, *victim.workers()]), 30)
        # the peer itself killed while its worker holds one
        future = client.submit(hold, (array, 60.0), req=ANY)
        wait_until(lambda: any(gpulayer_segments(p) for p in victim.workers()), 30)
        victim.kill()
        with pytest.raises(GPULayerError):
            future.result(60)
        gc.collect()
        wait_until(lambda: gpulayer_segments(os.getpid()) <= ours, 10)  # nor in the submitter, once its results are gone
    finally:
        client.close()
    assert shm_names() == before  # memfds have no names: nothing under /dev/shm, ever


# ---- the pool ------------------------------------------------------------------------------------

def inode(handle: shm.Handle) -> int:
    return os.fstat(handle.fd).st_ino


def test_the_pool_writes_a_segment_again_only_once_no_process_and_no_mapping_holds_it(monkeypatch):
    monkeypatch.setenv("GPULAYER_SHM_POOL_IDLE_S", "60")
    size = 3 * MiB + 5  # a size no other test pools
    first, kept = shm.create(size)
    assert kept is None  # a fresh segment
    # another process holds a descriptor of it, as a worker does (kill -9 lets go of it)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=[first.fd])
    try:
        taken = inode(first)
        first.close()
        second, kept = shm.create(size)
        assert kept is None and inode(second) != taken  # held elsewhere: not written over
    finally:
        holder.kill()
        holder.wait(10)
    # a mapping of this process holds it as long as it lives
    other = inode(second)
    mapping = second.map()
    del second
    third, kept = shm.create(size)
    assert kept is not None and inode(third) == taken  # the first one, free again once its holder died
    fresh = shm.copy_in(memoryview(b"x" * size))
    assert inode(fresh) not in (taken, other)  # both are held: a new one
    del mapping
    third.close()
    fourth, kept = shm.create(size)
    assert kept is not None and inode(fourth) in (taken, other)


def test_results_a_submitter_keeps_are_never_written_over_by_later_transfers(client):
    arrays = [np.full(2 * MiB, i, dtype=np.uint8) for i in range(4)]
    results = [client.submit(digest_and_echo, (a,), req=ANY).result(60)[1] for a in arrays]
    for i, (array, back) in enumerate(zip(arrays, results)):
        assert np.array_equal(back, array), i
    results[1:] = []  # let go of all but the first: the next ones may reuse their segments
    again = [client.submit(digest_and_echo, (np.full(2 * MiB, 9 + i, dtype=np.uint8),), req=ANY).result(60)[1]
             for i in range(3)]
    assert np.array_equal(results[0], arrays[0])
    assert [int(a[0]) for a in again] == [9, 10, 11] and all(len(set(a[::4096])) == 1 for a in again)


def double_in_place(array, whole):
    array *= 2
    return array if whole else array[1:]


def segment_of(array) -> shm.Segment | None:
    """The shared-memory segment an array's memory is a mapping of, if any."""
    base = array
    while base is not None and not isinstance(base, shm.Segment):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return base


@pytest.mark.parametrize("whole", [True, False])
def test_a_result_that_is_its_argument_comes_back_in_the_argument_segment(client, monkeypatch, whole):
    monkeypatch.setenv("GPULAYER_SHM_POOL_IDLE_S", "60")
    array = np.arange(MiB, dtype=np.int32)
    back = client.submit(double_in_place, (array, whole), req=ANY).result(60)
    assert np.array_equal(back, (array * 2)[0 if whole else 1:]) and np.array_equal(array[:3], [0, 1, 2])
    segment = segment_of(back)
    if client.mode == "tcp":
        assert segment is None
        return
    with shm.POOL._lock:
        ours = {os.fstat(kept.fd).st_ino for kept in shm.POOL._kept}  # what this submitter copied arguments into
    # the whole argument returned goes back as it came (no copy in the worker); a part of it is copied
    assert (inode(segment.handle) in ours) is whole


def make_array(nbytes):
    return np.ones(nbytes, dtype=np.uint8)


def test_a_result_is_freed_as_soon_as_the_caller_drops_it(client):
    gc.collect()
    gc.disable()  # no collector run: only reference counts free it
    try:
        result = client.submit(make_array, (2 * MiB,), req=ANY).result(60)
        gone = weakref.ref(result)
        del result
        assert gone() is None
    finally:
        gc.enable()


def test_the_pool_keeps_within_its_bound_and_lets_go_when_idle(monkeypatch):
    before = gpulayer_segments(os.getpid())
    monkeypatch.setenv("GPULAYER_SHM_POOL_MB", "0")
    assert shm.POOL.lend(2 * MiB) is None  # off
    monkeypatch.setenv("GPULAYER_SHM_POOL_MB", "5")
    monkeypatch.setenv("GPULAYER_SHM_POOL_IDLE_S", "60")
    assert shm.POOL.lend(6 * MiB) is None  # beyond the bound: not pooled
    for size in (2 * MiB + 1, 2 * MiB + 2, 2 * MiB + 3):
        shm.create(size)[0].close()
    assert gpulayer_segments(os.getpid()) - before <= 2  # 5 MiB holds two of them
    held = shm.create(2 * MiB + 4)[0]
    assert shm.POOL.drop_free() == 2 * MiB + 3  # a peer short of memory takes back what no one holds (not `held`)
    held.close()
    monkeypatch.setenv("GPULAYER_SHM_POOL_IDLE_S", "0.2")
    wait_until(lambda: gpulayer_segments(os.getpid()) <= before, 15)  # idle: let go
    monkeypatch.setenv("GPULAYER_SHM_POOL_MB", "lots")
    with pytest.raises(ValueError, match="GPULAYER_SHM_POOL_MB must be a number"):
        shm.create(2 * MiB)


def test_where_ofd_locks_fail_every_segment_is_fresh_and_whole(monkeypatch):
    monkeypatch.setattr(shm.POOL, "working", True)  # restored after the test

    def no_locks(fd, kind):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(shm, "_ofd_lock", no_locks)
    data = os.urandom(2 * MiB + 7)
    handle = shm.copy_in(memoryview(data))
    assert not shm.POOL.working and bytes(handle.map()) == data  # the pool turned itself off


def test_big_copies_into_a_pooled_segment_are_byte_exact_on_two_threads_and_on_one(monkeypatch):
    monkeypatch.setenv("GPULAYER_SHM_POOL_IDLE_S", "60")
    size = shm._PARALLEL_COPY_MIN + 4099  # split in two, at no page boundary of the end
    shm.copy_in(memoryview(bytes(size))).close()  # the pool keeps it: the next copies go into its mapping
    writable = np.random.default_rng(1).integers(0, 255, size=size, dtype=np.uint8)
    read_only = writable[::-1].copy()
    read_only.flags.writeable = False  # no address for ctypes: copied on one thread
    for array in (writable, read_only):
        handle = shm.copy_in(memoryview(array))
        assert bytes(handle.map()) == array.tobytes()
        handle.close()


# ---- the memory bound ---------------------------------------------------------------------------

def test_a_message_bigger_than_free_memory_is_refused_with_the_numbers_before_it_is_received(peer_factory,
                                                                                            monkeypatch):
    monkeypatch.setenv("GPULAYER_SHM", "0")  # over TCP: shared memory takes no new memory on the peer
    key = new_key()
    small = peer_factory("small", "--no-mdns", "--concurrency", "1", key=key,
                         env={"GPULAYER_MEMORY_HEADROOM_MB": str(10 << 20)})  # keep 10 TiB free: never
    client = Client(key=key.encode(), peers=small.address, mdns=False, echo_output=False)
    try:
        assert client.submit(len, (b"fits",), req=ANY).result(30) == 4
        rss = small.rss()
        with pytest.raises(GPULayerError) as info:
            client.submit(len, (np.zeros(256 * MiB, dtype=np.uint8),), req=ANY).result(120)
        message = str(info.value)
        assert "not received" in message and "at least 256 MiB" in message and "GPULAYER_MEMORY_HEADROOM_MB" in message
        assert small.rss() < rss + 64 * MiB  # dropped as it came, never held
        assert client.submit(len, (b"still",), req=ANY).result(30) == 5  # the same connection goes on
    finally:
        client.close()


def test_pickled_protocol_stays_loadable():  # the refusal marker never reaches a worker's unpickler
    assert pickle.loads(pickle.dumps(framing.REFUSED)) == "_refused"


# ---- held results on one host -----------------------------------------------------------------------

def make_held(nbytes):
    return np.arange(nbytes // 8, dtype=np.int64)


def add_one(array):
    array += 1
    return int(array[0])


def first_and_writeable(array):
    return int(array[0]), bool(array.flags.writeable)


def test_a_held_argument_used_in_place_is_read_only_so_the_held_result_never_changes(client):
    held = client.submit(make_held, (4 * MiB,), req=ANY, keep=True)
    with pytest.raises(ValueError, match="read-only"):  # numpy's own words
        client.submit(add_one, (held,), req=ANY).result(60)
    assert client.submit(first_and_writeable, (held,), req=ANY).result(60) == (0, False)
    assert held.result(60)[0] == 0 and held.result(60).flags.writeable  # fetched: the submitter's own copy
    held.release()


def digest_of(array) -> str:
    return hashlib.sha256(array).hexdigest()


def test_a_held_result_fetched_by_another_peer_of_the_host_arrives_byte_exact(peer_factory, peer):
    other = peer_factory("plane-b", "--no-mdns", "--concurrency", "1", key=peer.key)
    c = Client(key=peer.key.encode(), peers=f"{peer.address},{other.address}", mdns=False, echo_output=False)
    try:
        held = c.submit(make_held, (24 * MiB,), req=Requirements.build(peer="plane"), keep=True)
        expected = hashlib.sha256(np.arange(3 * MiB, dtype=np.int64)).hexdigest()
        assert c.submit(digest_of, (held,), req=Requirements.build(peer="plane-b")).result(60) == expected
        assert c.received_bytes() < MiB  # fetched by plane-b from plane, not through here
        held.release()
    finally:
        c.close()
