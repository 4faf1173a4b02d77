"""Unit tests of gpulayer.protocol (framing, messages, handshake) and transport.blocking: the frame codec,
its limits, and the HMAC handshake.

No network: the codec is sans-IO and is fed from memory; the handshake runs over socket.socketpair().
"""

from __future__ import annotations

import mmap
import random
import socket
import struct
import threading
import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulayer import security
from gpulayer.errors import AuthError, FrameTooLarge, GPULayerError, ProtocolError, VersionMismatch
from gpulayer.protocol import framing, handshake, messages
from gpulayer.resources.model import PROTOCOL_VERSION
from gpulayer.transport import blocking

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux: no swap or memory reserved for it

HEADER = struct.Struct(">I")
BIG = (1 << 17) + 1  # the first frame size that takes the reader's "own bytearray" path


# ---- helpers ------------------------------------------------------------------------------------------

def stream_of(*messages) -> tuple[bytes, list[int]]:
    """Encode (msg, buffers) pairs into one byte stream; also return every frame boundary offset."""
    out = bytearray()
    boundaries = []
    for msg, buffers in messages:
        parts = framing.encode(dict(msg), buffers)
        for part in parts:
            out += part
            boundaries.append(len(out))
    return bytes(out), boundaries


def feed(reader: framing.MessageReader, data, chunk_sizes=None) -> None:
    """Feed `data` as a socket would: into reader.buffer(), at most one chunk (and one buffer) at a time."""
    data = memoryview(data)
    sizes = list(chunk_sizes or [len(data) or 1])
    pos = i = 0
    while pos < len(data):
        chunk_end = min(len(data), pos + max(1, sizes[i % len(sizes)]))
        i += 1
        while pos < chunk_end:
            target = reader.buffer()
            assert len(target) > 0, "the reader offered no room"
            n = min(len(target), chunk_end - pos)
            target[:n] = data[pos:pos + n]
            pos += n
            reader.feed(n)


def drain(reader: framing.MessageReader) -> list[tuple[dict, list]]:
    out = list(reader.messages)
    reader.messages.clear()
    return out


def expected(msg: dict, buffers) -> dict:
    e = dict(msg, v=PROTOCOL_VERSION)
    if buffers:
        e["nb"] = len(buffers)
    return e


def raw_frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def packed(obj) -> bytes:
    return raw_frame(msgpack.packb(obj))


def decode_one(frame: bytes, max_frame: int = framing.PRE_AUTH_MAX_FRAME):
    reader = framing.MessageReader(max_frame)
    feed(reader, frame)
    return drain(reader)


# ---- encode / MessageReader round trip ----------------------------------------------------------------

def test_round_trip_of_one_message():
    reader = framing.MessageReader()
    data, _ = stream_of(({"t": messages.PING, "id": 7}, ()))
    feed(reader, data)
    assert drain(reader) == [({"t": "ping", "id": 7, "v": PROTOCOL_VERSION}, [])]


def test_encode_frames_are_length_prefixed_msgpack_maps_with_version():
    parts = framing.encode({"t": messages.LOG, "id": 1, "text": "hi"})
    assert len(parts) == 1
    (length,) = HEADER.unpack_from(parts[0])
    assert length == len(parts[0]) - 4
    assert msgpack.unpackb(parts[0][4:]) == {"t": "log", "id": 1, "text": "hi", "v": PROTOCOL_VERSION}


def test_out_of_band_buffers_are_own_frames_sent_from_their_memory():
    payload = bytearray(b"x" * 1000)
    parts = framing.encode({"t": messages.RESULT, "id": 3}, [payload, b"", memoryview(b"abc")])
    assert msgpack.unpackb(parts[0][4:])["nb"] == 3
    # header, then the buffer itself (no copy), for each buffer
    assert [bytes(p) for p in parts[1:]] == [HEADER.pack(1000), bytes(payload), HEADER.pack(0), b"",
                                            HEADER.pack(3), b"abc"]
    assert isinstance(parts[2], memoryview) and parts[2].obj is payload


@pytest.mark.parametrize("sizes", [[10], [0, 0], [70_000], [BIG], [300_000, 5, BIG + 1000]])
def test_round_trip_with_out_of_band_buffers(sizes):
    rng = random.Random(len(sizes))
    buffers = [rng.randbytes(n) for n in sizes]
    msg = {"t": messages.SUBMIT, "id": 1, "fn": b"f", "args": b"a"}
    reader = framing.MessageReader(1 << 20)
    data, _ = stream_of((msg, buffers), ({"t": messages.PING}, ()))
    feed(reader, data, [4096])
    (got, got_buffers), (ping, none) = drain(reader)
    assert got == expected(msg, buffers)
    assert [bytes(b) for b in got_buffers] == buffers
    assert ping == expected({"t": messages.PING}, ()) and none == []


def test_numpy_buffer_round_trip():
    np = pytest.importorskip("numpy")
    arr = np.arange(50_000, dtype=np.float64).reshape(250, 200)
    reader = framing.MessageReader(1 << 22)
    data, _ = stream_of(({"t": messages.RESULT}, [arr]))
    feed(reader, data)
    [(_, [buf])] = drain(reader)
    assert np.array_equal(np.frombuffer(buf, dtype=np.float64).reshape(250, 200), arr)


def test_big_frames_arrive_in_their_own_bytearray():
    reader = framing.MessageReader(1 << 20)
    data, _ = stream_of(({"t": messages.RESULT}, [b"\x01" * BIG]))
    feed(reader, data, [1000])
    [(_, [buf])] = drain(reader)
    assert isinstance(buf, bytearray) and len(buf) == BIG


@pytest.mark.parametrize("size", [64 * 1024, 100_000, 1 << 17])
def test_out_of_band_buffers_arrive_writable_whatever_their_size(size):
    reader = framing.MessageReader(1 << 20)
    data, _ = stream_of(({"t": messages.RESULT}, [b"\x00" * size]))
    feed(reader, data)
    [(_, [buf])] = drain(reader)
    assert not memoryview(buf).readonly


def test_a_message_body_larger_than_the_small_buffer_decodes():
    blob = random.Random(1).randbytes(600_000)
    reader = framing.MessageReader(1 << 20)
    data, _ = stream_of(({"t": messages.SUBMIT, "fn": blob}, ()))
    feed(reader, data, [65536, 1, 7])
    [(msg, [])] = drain(reader)
    assert msg["fn"] == blob


def test_byte_by_byte_feeding():
    msgs = [({"t": messages.LOG, "id": i, "text": "line %d" % i}, [b"b%d" % i] * (i % 3)) for i in range(5)]
    reader = framing.MessageReader()
    data, _ = stream_of(*msgs)
    feed(reader, data, [1])
    got = drain(reader)
    assert [m for m, _ in got] == [expected(m, b) for m, b in msgs]
    assert [[bytes(x) for x in bufs] for _, bufs in got] == [list(b) for _, b in msgs]


def test_partial_frame_waits_for_more():
    reader = framing.MessageReader()
    data, _ = stream_of(({"t": messages.PING, "id": 1}, ()))
    feed(reader, data[:-1])
    assert not reader.messages
    feed(reader, data[-1:])
    assert len(reader.messages) == 1


def test_message_waits_for_all_its_buffers():
    reader = framing.MessageReader()
    data, bounds = stream_of(({"t": messages.RESULT}, [b"aa", b"bb"]))
    feed(reader, data[:bounds[-2]])  # everything but the last buffer's body
    assert not reader.messages
    feed(reader, data[bounds[-2]:])
    [(_, bufs)] = drain(reader)
    assert bufs == [b"aa", b"bb"]


def test_frame_of_exactly_the_limit_is_accepted():
    msg = {"t": messages.LOG, "text": ""}
    pad = 0
    while len(msgpack.packb(expected(dict(msg, text="x" * pad), ()))) < framing.PRE_AUTH_MAX_FRAME:
        pad += 1
    msg["text"] = "x" * pad
    data, _ = stream_of((msg, ()))
    assert len(data) == framing.PRE_AUTH_MAX_FRAME + 4
    assert decode_one(data)[0][0]["text"] == msg["text"]
    with pytest.raises(FrameTooLarge):
        decode_one(stream_of((dict(msg, text=msg["text"] + "x"), ()))[0])


# ---- hypothesis: any messages, any chunking ------------------------------------------------------------

msgpack_leaves = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1)
                  | st.floats(allow_nan=False) | st.text(max_size=50) | st.binary(max_size=50))
msgpack_values = st.recursive(
    msgpack_leaves,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
message_maps = st.builds(
    lambda t, rest: {**rest, "t": t},
    st.sampled_from(sorted(messages.MESSAGE_TYPES)),
    st.dictionaries(st.text(max_size=12).filter(lambda k: k not in ("t", "v", "nb")), msgpack_values, max_size=6),
)
buffer_sizes = st.one_of(st.integers(0, 300), st.integers(60_000, 70_000), st.integers(BIG - 2, 300_000))


@st.composite
def messages_with_buffers(draw, max_messages=4, max_buffers=3):
    seed = draw(st.integers(0, 2 ** 32))
    rng = random.Random(seed)
    out = []
    for msg in draw(st.lists(message_maps, min_size=1, max_size=max_messages)):
        sizes = draw(st.lists(buffer_sizes, max_size=max_buffers))
        out.append((msg, [rng.randbytes(n) for n in sizes]))
    return out


@st.composite
def chunkings(draw, total: int, boundaries: list[int]):
    """Chunk sizes cutting the stream at random points, and right around some frame boundaries
    (so that headers and bodies are split, and chunks span boundaries)."""
    cuts = set(draw(st.lists(st.integers(0, total), max_size=12)))
    for b in draw(st.lists(st.sampled_from(boundaries), max_size=8, unique=True)) if boundaries else ():
        delta = draw(st.sampled_from([-3, -1, 0, 1, 2, 3, 5]))
        cuts.update({b + delta, b + delta + 1})
    points = sorted(c for c in cuts if 0 < c < total)
    sizes = [b - a for a, b in zip([0, *points], [*points, total])]
    return [s for s in sizes if s > 0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_any_messages_in_any_chunking_decode_exactly(data):
    msgs = data.draw(messages_with_buffers())
    stream, boundaries = stream_of(*msgs)
    chunks = data.draw(chunkings(len(stream), boundaries))
    reader = framing.MessageReader(1 << 20)
    feed(reader, stream, chunks or None)
    got = drain(reader)
    assert [m for m, _ in got] == [expected(m, b) for m, b in msgs]
    assert [[bytes(x) for x in bufs] for _, bufs in got] == [b for _, b in msgs]
    assert reader.buffer() is not None and not reader.messages


@settings(max_examples=40, deadline=None)
@given(msgs=st.lists(st.tuples(message_maps, st.lists(st.binary(max_size=40), max_size=3)), min_size=1, max_size=4))
def test_small_messages_fed_one_byte_at_a_time(msgs):
    stream, _ = stream_of(*msgs)
    reader = framing.MessageReader()
    feed(reader, stream, [1])
    got = drain(reader)
    assert [m for m, _ in got] == [expected(m, b) for m, b in msgs]
    assert [[bytes(x) for x in bufs] for _, bufs in got] == [b for _, b in msgs]


# ---- limits --------------------------------------------------------------------------------------------

def test_pre_auth_limit_is_4096():
    assert framing.PRE_AUTH_MAX_FRAME == 4096
    assert framing.MessageReader().max_frame == 4096
    assert blocking.BlockingConnection(None).reader.max_frame == 4096


@pytest.mark.parametrize("max_frame, length", [(4096, 4097), (4096, 2 ** 32 - 1), (1 << 20, (1 << 20) + 1),
                                               (1 << 20, 2 ** 31)])
def test_oversized_frame_is_refused_at_its_header(max_frame, length):
    reader = framing.MessageReader(max_frame)
    header = HEADER.pack(length)
    feed(reader, header[:3])  # not yet a header
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLarge) as info:
            feed(reader, header[3:])  # the header completes: no body has been sent
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code == "too-large"
    assert str(length) in str(info.value)
    assert peak < 64 * 1024  # nothing was allocated for the body


def test_a_frame_at_the_limit_allocates_no_more_than_the_limit():
    max_frame = 1 << 20
    reader = framing.MessageReader(max_frame)
    tracemalloc.start()
    try:
        feed(reader, HEADER.pack(max_frame) + b"\x00" * 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert max_frame <= peak < max_frame + 64 * 1024


def test_buffers_summing_over_the_limit_are_refused():
    reader = framing.MessageReader(1000)
    data, _ = stream_of(({"t": messages.RESULT}, [b"a" * 600, b"b" * 600]))
    with pytest.raises(FrameTooLarge) as info:
        feed(reader, data)
    assert info.value.code == "too-large"
    assert not reader.messages


def test_the_message_frame_counts_toward_the_buffer_limit():
    msg = {"t": messages.RESULT, "pad": "x" * 400}
    frame_len = len(framing.encode(dict(msg), [b""])[0]) - 4
    ok = 1000 - frame_len
    [(got, [buf])] = decode_one(stream_of((msg, [b"a" * ok]))[0], 1000)
    assert len(buf) == ok
    with pytest.raises(FrameTooLarge):
        decode_one(stream_of((msg, [b"a" * (ok + 1)]))[0], 1000)


def test_buffers_over_the_limit_are_refused_at_the_crossing_header():
    reader = framing.MessageReader(1000)
    data, bounds = stream_of(({"t": messages.RESULT}, [b"a" * 600, b"b" * 600]))
    # bounds: [message frame, header 1, body 1, header 2, body 2]; stop right after the second header
    with pytest.raises(FrameTooLarge):
        feed(reader, data[:bounds[3]])


def test_a_frame_header_says_at_most_4_gib_and_refuses_more():  # issue 24, item 10
    assert framing.frame_header(2 ** 32 - 1) == HEADER.pack(2 ** 32 - 1) == b"\xff\xff\xff\xff"
    with pytest.raises(FrameTooLarge) as info:
        framing.frame_header(2 ** 32)
    assert info.value.code == "too-large" and str(2 ** 32) in str(info.value) and "4 GiB" in str(info.value)


def test_a_buffer_over_4_gib_is_refused_by_encode_before_anything_is_sent():
    """A real 4 GiB + 1 buffer, reserved but never touched (no memory behind it)."""
    big = mmap.mmap(-1, 2 ** 32 + 1, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    try:
        with pytest.raises(FrameTooLarge):
            framing.encode({"t": messages.RESULT, "id": 1, "data": b""}, [b"small", big])
        assert [len(p) for p in framing.encode({"t": messages.RESULT}, [memoryview(big)[:2 ** 32 - 1]])][1:] == \
            [4, 2 ** 32 - 1]  # exactly 4 GiB less a byte: one frame
    finally:
        big.close()


@pytest.mark.parametrize("frames, named", [([100, 33 << 20], "33.0 MiB, over the 32 MiB message limit"),
                                           ([(32 << 20) - 100], "32.0 MiB, over the 32 MiB message limit"),
                                           ([1, 2 ** 32], "over the 4 GiB that one frame can carry")])
def test_a_message_the_wire_would_refuse_is_a_value_error_naming_its_size(monkeypatch, frames, named):
    monkeypatch.setenv("GPULAYER_MAX_MESSAGE_MB", "32" if frames[-1] < 2 ** 32 else "8192")
    with pytest.raises(ValueError, match="GPULAYER_MAX_MESSAGE_MB" if "limit" in named else "split it") as info:
        framing.check_size("the task's result", frames)
    assert named in str(info.value)
    framing.check_size("the task's result", [1 << 20, 30 << 20])  # room to spare: no error


def test_max_message_bytes_from_environment(monkeypatch):
    monkeypatch.delenv("GPULAYER_MAX_MESSAGE_MB", raising=False)
    assert framing.max_message_bytes() == 4096 << 20
    monkeypatch.setenv("GPULAYER_MAX_MESSAGE_MB", "3")
    assert framing.max_message_bytes() == 3 << 20


# ---- malformed input -----------------------------------------------------------------------------------

def test_error_classes():
    assert issubclass(FrameTooLarge, ProtocolError) and issubclass(VersionMismatch, ProtocolError)
    assert issubclass(ProtocolError, GPULayerError)
    assert (ProtocolError.code, FrameTooLarge.code, VersionMismatch.code) == ("protocol", "too-large", "version")


V = PROTOCOL_VERSION


@pytest.mark.parametrize("frame", [
    raw_frame(b"\xc1"),                            # a byte msgpack never uses
    raw_frame(b""),                                # empty body
    raw_frame(b"\x81\xa1t"),                       # truncated map inside a complete frame
    raw_frame(msgpack.packb({"t": "ping", "v": V}) + b"\x00"),  # trailing data
    packed([1, 2, 3]),                             # not a map
    packed("ping"),
    packed(None),
    packed({"v": V}),                              # no "t"
    packed({"t": 1, "v": V}),                      # "t" not a string
    packed({"t": b"ping", "v": V}),
    packed({1: "ping", "v": V}),                   # non-string key
    packed({"t": "nope", "v": V}),                 # unknown type
    packed({"t": "PING", "v": V}),
    packed({"t": "x" * 1000, "v": V}),
], ids=lambda f: repr(f[4:20]))
def test_malformed_frames_raise_protocol_error(frame):
    with pytest.raises(ProtocolError) as info:
        decode_one(frame)
    assert type(info.value) is ProtocolError
    assert info.value.code == "protocol"


@pytest.mark.parametrize("v", [None, 0, V + 1, "1", [1], -1])
def test_wrong_version_raises_version_mismatch(v):
    msg = {"t": "ping"} if v is None else {"t": "ping", "v": v}
    with pytest.raises(VersionMismatch) as info:
        decode_one(packed(msg))
    assert info.value.code == "version"
    assert isinstance(info.value, ProtocolError)


def test_unknown_type_message_is_truncated_in_the_error():
    with pytest.raises(ProtocolError) as info:
        decode_one(packed({"t": "x" * 1000, "v": V}))
    assert len(str(info.value)) < 200


@pytest.mark.parametrize("nb", [-1, "2", 1.5, framing.MAX_BUFFERS + 1, 2 ** 40, [1], None])
def test_bad_buffer_count_raises(nb):
    with pytest.raises(ProtocolError, match="buffer count") as info:
        decode_one(packed({"t": "result", "v": V, "nb": nb}))
    assert info.value.code == "protocol"


def test_zero_buffer_count_is_a_plain_message():
    [(msg, bufs)] = decode_one(packed({"t": "result", "v": V, "nb": 0}))
    assert bufs == [] and msg["nb"] == 0


def test_garbage_after_good_messages():
    good, _ = stream_of(({"t": messages.PING, "id": 1}, ()), ({"t": messages.PONG, "id": 1}, ()))
    reader = framing.MessageReader()
    with pytest.raises(ProtocolError):
        feed(reader, good + raw_frame(b"\xc1"))
    assert [m["t"] for m, _ in reader.messages] == ["ping", "pong"]


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=3000), chunks=st.lists(st.integers(1, 600), max_size=8),
       max_frame=st.sampled_from([framing.PRE_AUTH_MAX_FRAME, 1 << 16]))
def test_random_bytes_only_ever_raise_protocol_errors(data, chunks, max_frame):
    reader = framing.MessageReader(max_frame)
    try:
        feed(reader, data, chunks or None)
    except ProtocolError:
        pass
    for msg, _ in reader.messages:
        assert isinstance(msg, dict) and msg["t"] in messages.MESSAGE_TYPES


@st.composite
def hostile_streams(draw):
    """Plausible framing around hostile content: headers of any length, valid-looking maps, garbage."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["header", "frame", "map", "garbage"]))
        if kind == "header":
            out += HEADER.pack(draw(st.integers(0, 2 ** 32 - 1)))
        elif kind == "frame":
            out += raw_frame(draw(st.binary(max_size=200)))
        elif kind == "map":
            msg = draw(st.dictionaries(st.sampled_from(["t", "v", "nb", "id", "x"]),
                                       st.none() | st.integers(-3, 5) | st.sampled_from(sorted(messages.MESSAGE_TYPES))
                                       | st.binary(max_size=8) | st.text(max_size=8), max_size=4))
            out += packed(msg)
        else:
            out += draw(st.binary(max_size=100))
    return bytes(out)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=hostile_streams(), chunks=st.lists(st.integers(1, 300), max_size=6),
       max_frame=st.sampled_from([framing.PRE_AUTH_MAX_FRAME, 1 << 16]))
def test_hostile_streams_raise_only_protocol_errors_and_stay_bounded(stream, chunks, max_frame):
    reader = framing.MessageReader(max_frame)
    tracemalloc.start()
    try:
        try:
            feed(reader, stream, chunks or None)
        except ProtocolError as exc:
            assert exc.code in ("protocol", "too-large", "version")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Headers may claim up to 4 GiB; nothing near that may be allocated.
    assert peak < 4 * max_frame + (1 << 20)


# ---- handshake over a socketpair --------------------------------------------------------------------

KEY = b"the-cluster-key"


class FakePeer(threading.Thread):
    """The peer's half of the handshake, hand-rolled from handshake.hello and handshake.check_auth."""

    def __init__(self, sock, key=KEY, answer=None):
        super().__init__(daemon=True)
        self.conn = blocking.BlockingConnection(sock)
        self.key = key
        self.answer = answer  # None: the real check; else a function(auth_msg, hello) -> reply
        self.nonce = security.new_nonce()
        self.hello = handshake.hello(self.nonce, "peer-1", security.cluster_id(self.key), {"n": "box"})
        self.keys = None
        self.auth_reply = "unset"
        self.auth_msg = None
        self.error = None

    def run(self):
        try:
            self.conn.send(self.hello)
            self.auth_msg, _ = self.conn.recv()
            checked = handshake.check_auth(self.auth_msg, self.key, self.hello)
            self.auth_reply, self.keys = checked if checked is not None else (None, None)
            reply = self.answer(self.auth_msg, self.hello) if self.answer else self.auth_reply
            self.conn.send(reply if reply is not None else messages.error("auth", "bad key"))
            if reply is self.auth_reply and self.keys is not None:
                self.conn.secure(*self.keys)
        except Exception as exc:  # reported by the test
            self.error = exc


@pytest.fixture
def socket_pair():
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


def run_handshake(socket_pair, client_key=KEY, **peer_kwargs):
    client_sock, peer_sock = socket_pair
    peer = FakePeer(peer_sock, **peer_kwargs)
    peer.start()
    try:
        return peer, handshake.client_handshake(blocking.BlockingConnection(client_sock), client_key, "client-1")
    finally:
        peer.join(10)
        assert not peer.is_alive()


def test_handshake_success_returns_the_hello(socket_pair):
    peer, hello = run_handshake(socket_pair)
    assert peer.error is None
    assert hello["t"] == messages.HELLO and hello["v"] == PROTOCOL_VERSION
    assert hello["nonce"] == peer.nonce
    assert hello["peer"] == "peer-1" and hello["cluster"] == security.cluster_id(KEY)
    assert hello["advert"] == {"n": "box"}
    # the peer saw a well-formed AUTH and proved itself back
    assert peer.auth_msg["t"] == messages.AUTH and peer.auth_msg["client"] == "client-1"
    assert len(peer.auth_msg["nonce"]) == security.NONCE_BYTES
    assert peer.auth_reply["t"] == messages.AUTH_OK


def test_after_the_handshake_both_directions_are_sealed_with_keys_bound_to_it(socket_pair):
    client_sock, peer_sock = socket_pair
    peer = FakePeer(peer_sock)
    peer.start()
    client = blocking.BlockingConnection(client_sock)
    handshake.client_handshake(client, KEY, "client-1")
    peer.join(10)
    client.send({"t": messages.PING, "id": 5})
    assert peer.conn.recv()[0] == {"t": messages.PING, "id": 5, "v": PROTOCOL_VERSION}
    peer.conn.send({"t": messages.PONG, "id": 5}, [b"x" * 100])
    msg, buffers = client.recv()
    assert msg["t"] == messages.PONG and bytes(buffers[0]) == b"x" * 100
    client_sock.sendall(b"".join(bytes(p) for p in framing.encode({"t": messages.PING, "id": 6})))  # a frame in clear
    with pytest.raises(ProtocolError):
        peer.conn.recv()


def test_wrong_key_fails_on_both_sides(socket_pair):
    client_sock, peer_sock = socket_pair
    peer = FakePeer(peer_sock)
    peer.start()
    with pytest.raises(AuthError, match="refused authentication"):
        handshake.client_handshake(blocking.BlockingConnection(client_sock), b"another-key", "c")
    peer.join(10)
    assert peer.error is None and peer.auth_reply is None


@pytest.mark.parametrize("answer", [
    lambda auth, hello: {"t": messages.AUTH_OK, "mac": b"\x00" * 32},
    lambda auth, hello: {"t": messages.AUTH_OK},
    lambda auth, hello: {"t": messages.AUTH_OK, "mac": "not bytes"},
    # replaying the submitter's own proof is not a peer proof
    lambda auth, hello: {"t": messages.AUTH_OK, "mac": auth["mac"]},
    # a proof under another key
    lambda auth, hello: {"t": messages.AUTH_OK,
                         "mac": security.peer_proof(b"other", handshake.transcript(hello, auth["nonce"], auth["client"]))},
    # a valid-looking reply of the wrong type
    lambda auth, hello: {"t": messages.ACCEPT,
                         "mac": security.peer_proof(KEY, handshake.transcript(hello, auth["nonce"], auth["client"]))},
], ids=["zero-mac", "no-mac", "str-mac", "replayed-submitter-mac", "other-key", "wrong-type"])
def test_client_demands_the_peer_proof(socket_pair, answer):
    with pytest.raises(AuthError, match="failed to prove"):
        run_handshake(socket_pair, answer=answer)


def test_client_rejects_a_bad_hello(socket_pair):
    client_sock, peer_sock = socket_pair
    blocking.BlockingConnection(peer_sock).send({"t": messages.HELLO, "nonce": b"short"})
    with pytest.raises(ProtocolError, match="HELLO"):
        handshake.client_handshake(blocking.BlockingConnection(client_sock), KEY, "c")


def test_client_reports_a_refusal_before_hello(socket_pair):
    client_sock, peer_sock = socket_pair
    blocking.BlockingConnection(peer_sock).send(messages.error("busy", "go away"))
    with pytest.raises(ProtocolError, match="go away"):
        handshake.client_handshake(blocking.BlockingConnection(client_sock), KEY, "c")


def _hello(nonce_p=b"p" * 32, peer="peer-1"):
    return handshake.hello(nonce_p, peer, security.cluster_id(KEY), {"n": "box"})


def _auth(key=KEY, hello=None, **over):
    msg, _ = handshake.auth(hello or _hello(), key, "c", b"s" * 32)
    msg.update(over)
    return msg


def test_check_auth_accepts_a_good_proof_and_gives_the_peers_session_keys():
    reply, keys = handshake.check_auth(_auth(), KEY, _hello())
    proven = handshake.transcript(_hello(), b"s" * 32, "c")
    assert reply == {"t": messages.AUTH_OK, "mac": security.peer_proof(KEY, proven)}
    assert keys == security.session_keys(KEY, proven, security.PEER)


@pytest.mark.parametrize("over", [
    {"mac": "a string"},
    {"mac": None},
    {"mac": 12345},
    {"mac": [1, 2]},
    {"mac": b""},
    {"mac": b"\x00" * 32},
    {"nonce": b"short"},
    {"nonce": b"s" * 33},
    {"nonce": "s" * 32},
    {"nonce": None},
    {"t": messages.HELLO},
    {"t": messages.AUTH_OK},
])
def test_check_auth_rejects_bad_input_without_raising(over):
    assert handshake.check_auth(_auth(**over), KEY, _hello()) is None


def test_check_auth_rejects_a_proof_of_another_handshake():
    msg = _auth()
    del msg["mac"]
    assert handshake.check_auth(msg, KEY, _hello()) is None
    assert handshake.check_auth(_auth(), KEY, _hello(nonce_p=b"q" * 32)) is None  # another peer nonce
    assert handshake.check_auth(_auth(), KEY, _hello(peer="peer-2")) is None  # relayed from another peer
    assert handshake.check_auth(_auth(client="someone-else"), KEY, _hello()) is None  # a changed client id
    assert handshake.check_auth(_auth(), b"other", _hello()) is None


def test_blocking_recv_raises_connection_error_at_eof(socket_pair):
    a, b = socket_pair
    conn = blocking.BlockingConnection(a)
    b.sendall(b"".join(bytes(p) for p in framing.encode({"t": messages.PING})))
    b.sendall(b"\x00\x00")  # half a header, then EOF
    b.shutdown(socket.SHUT_WR)
    assert conn.recv()[0]["t"] == messages.PING
    with pytest.raises(ConnectionError):
        conn.recv()


def test_blocking_send_and_recv_with_buffers(socket_pair):
    a, b = socket_pair
    left, right = blocking.BlockingConnection(a, 1 << 20), blocking.BlockingConnection(b, 1 << 20)
    payload = random.Random(5).randbytes(200_000)
    t = threading.Thread(target=left.send, args=({"t": messages.RESULT, "id": 9}, [payload, b"x"]))
    t.start()
    msg, bufs = right.recv()
    t.join(10)
    assert msg == {"t": "result", "id": 9, "v": PROTOCOL_VERSION, "nb": 2}
    assert bytes(bufs[0]) == payload and bufs[1] == b"x"
    left.close()
    left.close()  # idempotent


def test_a_connection_reader_refuses_buffers_until_authentication_raises_its_limit():
    data, _ = stream_of(({"t": messages.AUTH, "id": 1}, [b"x" * 10] * 3))
    reader = framing.connection_reader(framing.PRE_AUTH_MAX_FRAME)
    with pytest.raises(ProtocolError, match="not allowed before authentication"):
        feed(reader, data)
    reader = framing.connection_reader(framing.PRE_AUTH_MAX_FRAME)
    reader.allow(1 << 20)
    feed(reader, data)
    assert [len(b) for b in drain(reader)[0][1]] == [10, 10, 10]
