"""Unit tests of gpulayer.protocol.records: the secure channel's record layer (issue 9, item 1).

Round trips of many message shapes through Sealer -> Opener -> framing.MessageReader with arbitrary
receive chunking, the record format itself, and the attacks of an on-path adversary without the
session key: replay, reorder, drop, injection, bit flips anywhere, truncation, reflection (the
wrong direction's key). Each must raise ChannelError and open nothing from the bad record on.
"""

from __future__ import annotations

import os
import random
import struct

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulayer import security
from gpulayer.errors import ProtocolError
from gpulayer.protocol import framing, records
from gpulayer.protocol.messages import RESULT
from gpulayer.protocol.records import ChannelError, Opener, Sealer

CLUSTER_KEY = b"0123456789abcdef" * 4
TRANSCRIPT = security.handshake_transcript(2, b"p" * 32, b"s" * 32, "alpha", b"h" * 32, "client")
SUBMITTER_SEND, SUBMITTER_RECV = security.session_keys(CLUSTER_KEY, TRANSCRIPT, security.SUBMITTER)
PEER_SEND, PEER_RECV = security.session_keys(CLUSTER_KEY, TRANSCRIPT, security.PEER)
KEY = SUBMITTER_SEND


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 7919 + n).randbytes(n)


def messages(shapes) -> list[tuple[dict, list]]:
    """Messages numbered by "i", each with buffers of the given sizes."""
    return [({"t": RESULT, "i": i}, [payload(n, i * 31 + j) for j, n in enumerate(sizes)])
            for i, sizes in enumerate(shapes)]


def seal_all(sealer: Sealer, msgs, *, stream: bool = False) -> list[bytes]:
    out = []
    for msg, buffers in msgs:
        parts = framing.encode(dict(msg), buffers)
        out.extend(bytes(r) for r in (sealer.stream(parts) if stream else sealer.seal(parts)))
    return out


def push(opener: Opener, data: bytes, chunks, sink) -> None:
    """Feed `data` to the opener in pieces of the sizes `chunks` gives (cycled), as recv_into would."""
    view, sizes, i = memoryview(data), list(chunks) or [len(data) or 1], 0
    while view:
        room = opener.buffer()
        k = min(len(room), len(view), sizes[i % len(sizes)])
        i += 1
        room[:k] = view[:k]
        sink(k)
        view = view[k:]


class CountingReader(framing.MessageReader):
    """A MessageReader that counts the plaintext bytes it was given."""

    def __init__(self):
        super().__init__(1 << 30)
        self.fed = 0

    def feed(self, n: int) -> None:
        self.fed += n
        super().feed(n)


class Receiver:
    """One direction's receiving end: Opener -> MessageReader, via feed_into or feed + deliver."""

    def __init__(self, key=KEY, *, into: bool = True, max_record: int = records.RECORD_MAX):
        self.opener = Opener(key, max_record=max_record)
        self.reader = CountingReader()
        self.into = into

    @property
    def plaintext(self) -> int:
        return self.reader.fed

    def sink(self, n: int) -> None:
        if self.into:
            self.opener.feed_into(n, self.reader)
        else:
            for piece in self.opener.feed(n):
                records.deliver(self.reader, piece)

    def receive(self, data: bytes, chunks=(1 << 20,)) -> None:
        push(self.opener, data, chunks, self.sink)

    def got(self) -> list[tuple[int, list[bytes]]]:
        return [(msg["i"], [bytes(b) for b in bufs]) for msg, bufs in self.reader.messages]


def expect(msgs) -> list[tuple[int, list[bytes]]]:
    return [(msg["i"], list(bufs)) for msg, bufs in msgs]


# ---- round trips --------------------------------------------------------------------------------------

SIZES = st.one_of(st.integers(0, 40), st.integers(0, 70_000),
                  st.sampled_from([records.RECORD_MAX - 1, records.RECORD_MAX, records.RECORD_MAX + 1,
                                   2 * records.RECORD_MAX + 5, 16 << 10, (16 << 10) - 1]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(st.lists(SIZES, max_size=4), min_size=1, max_size=6),
       chunks=st.lists(st.integers(1, 300_000), min_size=1, max_size=8),
       into=st.booleans(), stream=st.booleans())
def test_round_trip_with_any_chunking(shapes, chunks, into, stream):
    msgs = messages(shapes)
    receiver = Receiver(into=into)
    data = b"".join(seal_all(Sealer(KEY), msgs, stream=stream))
    receiver.receive(data, [max(c, len(data) // 2000) for c in chunks])  # bounded time: at most ~2,000 pieces
    receiver.opener.eof()
    assert receiver.got() == expect(msgs)
    assert not receiver.opener.mid_record


@settings(max_examples=40, deadline=None)
@given(record_max=st.sampled_from([1, 2, 7, 100, 4096, 20_000]),
       shapes=st.lists(st.lists(st.integers(0, 50_000), max_size=3), min_size=1, max_size=4),
       chunks=st.lists(st.integers(1, 9_000), min_size=1, max_size=5))
def test_round_trip_with_small_records(record_max, shapes, chunks):
    msgs = messages(shapes)
    sealed = seal_all(Sealer(KEY, record_max=record_max), msgs)
    assert all(len(r) - records.OVERHEAD <= record_max for r in sealed)
    receiver = Receiver(max_record=record_max)
    receiver.receive(b"".join(sealed), chunks)
    assert receiver.got() == expect(msgs)


def test_byte_by_byte():
    msgs = messages([[0], [3, 100], [], [70_000]])
    receiver = Receiver()
    receiver.receive(b"".join(seal_all(Sealer(KEY), msgs)), [1])
    assert receiver.got() == expect(msgs)


def test_big_buffer_in_bounded_records_and_receive_views():
    big = payload(3 * records.RECORD_MAX + 12345)
    sealed = [bytes(r) for r in Sealer(KEY).stream(framing.encode({"t": RESULT, "i": 0}, [big]))]
    assert max(len(r) for r in sealed) == records.RECORD_MAX + records.OVERHEAD
    opener, reader = Opener(KEY), framing.MessageReader(1 << 30)
    for record in sealed:  # a big record is received on its own: the view ends where it ends
        view = opener.buffer()
        view[:4] = record[:4]
        opener.feed_into(4, reader)
        if len(record) > 64 << 10:
            assert len(opener.buffer()) == len(record) - 4 == opener.remaining
        push(opener, record[4:], [len(record)], lambda n: opener.feed_into(n, reader))
    assert [bytes(b) for b in reader.messages[0][1]] == [big]


def test_the_receive_buffer_starts_small_and_grows_to_the_limit_only():
    opener = Opener(KEY)
    assert len(opener.buffer()) <= 64 << 10
    sealer = Sealer(KEY)
    receiver = Receiver()
    receiver.opener = opener
    receiver.receive(b"".join(bytes(r) for r in sealer.seal(framing.encode({"t": RESULT, "i": 0}, [payload(1 << 20)]))))
    assert len(opener._buf) <= records.RECORD_MAX + records.OVERHEAD


# ---- the record format --------------------------------------------------------------------------------

def test_a_small_message_is_one_record_of_one_aead_call():
    parts = framing.encode({"t": RESULT, "i": 1}, [b"x" * 1000, b"y" * 3000])
    sealer = Sealer(KEY)
    (record,) = sealer.seal(parts)
    plain = b"".join(bytes(p) for p in parts)
    (length,) = struct.unpack(">I", record[:4])
    assert length == len(record) - 4 == len(plain) + 16
    nonce = bytes(4) + (0).to_bytes(8, "big")
    assert AESGCM(KEY).decrypt(nonce, bytes(record[4:]), bytes(record[:4])) == plain
    assert sealer.counter == 1


def test_the_counter_is_the_nonce_and_counts_records():
    sealer = Sealer(KEY)
    sealed = seal_all(sealer, messages([[]] * 3))
    for counter, record in enumerate(sealed):
        nonce = b"\0\0\0\0" + counter.to_bytes(8, "big")
        AESGCM(KEY).decrypt(nonce, record[4:], record[:4])
    assert sealer.counter == 3


def test_large_buffers_are_sealed_from_their_memory_in_pieces():
    buf = bytearray(payload(records.RECORD_MAX * 2 + 100))
    parts = framing.encode({"t": RESULT, "i": 0}, [buf, b"tail"])
    sealed = Sealer(KEY).seal(parts)
    # [frame + header of buf], 2 full pieces of buf, [its last 100 bytes + header + "tail"]
    assert [len(r) - records.OVERHEAD for r in sealed] == [len(parts[0]) + 4, records.RECORD_MAX,
                                                           records.RECORD_MAX, 100 + 4 + 4]


def test_stream_and_seal_give_the_same_records():
    msgs = messages([[5, 300_000, 20_000, 0]])
    assert seal_all(Sealer(KEY), msgs) == seal_all(Sealer(KEY), msgs, stream=True)


def test_parts_of_other_formats_are_sealed_as_bytes():
    import array

    floats = array.array("d", [1.5, 2.5, 3.5])
    (record,) = Sealer(KEY).seal([b"ab", memoryview(floats), bytearray(b"cd")])
    opener = Opener(KEY)
    view = opener.buffer()
    view[:len(record)] = record
    (piece,) = opener.feed(len(record))
    assert bytes(piece) == b"ab" + floats.tobytes() + b"cd"


def test_nothing_to_seal_makes_no_record():
    sealer = Sealer(KEY)
    assert sealer.seal([b"", b""]) == [] and list(sealer.stream([])) == []
    assert sealer.counter == 0


@pytest.mark.parametrize("into", [True, False])
def test_an_empty_record_opens_as_nothing(into):
    header = struct.pack(">I", 16)
    record = header + AESGCM(KEY).encrypt(bytes(12), b"", header)
    receiver = Receiver(into=into)
    receiver.receive(record)
    assert receiver.opener.counter == 1 and receiver.plaintext == 0 and not receiver.got()


@pytest.mark.parametrize("bad", [b"short", b"k" * 16, b"k" * 33])
def test_session_keys_have_32_bytes(bad):
    with pytest.raises(ValueError):
        Sealer(bad)
    with pytest.raises(ValueError):
        Opener(bad)


@pytest.mark.parametrize("limit", [0, -1, 1 << 32])
def test_limits_are_checked(limit):
    with pytest.raises(ValueError):
        Sealer(KEY, record_max=limit)
    with pytest.raises(ValueError):
        Opener(KEY, max_record=limit)


def test_feeding_more_than_the_buffer_offered_is_a_bug():
    opener = Opener(KEY)
    n = len(opener.buffer())
    with pytest.raises(ValueError):
        opener.feed(n + 1)


def test_channel_error_is_a_protocol_error():
    assert issubclass(ChannelError, ProtocolError) and ChannelError.code == "channel"


# ---- attacks: each raises, and nothing is opened from the bad record on ---------------------------------

MSGS = messages([[], [10], [2000, 3], [], [50_000]])  # records: 0, 1, 2, 3, then 4 and 5 (the 50 KB buffer)


def legit() -> list[bytes]:
    return seal_all(Sealer(KEY), MSGS)


def attack(stream: bytes, *, key=KEY, chunks=(1 << 20,), into=True) -> Receiver:
    """Receive a tampered stream; it must fail (while receiving or at EOF) and fail for good."""
    receiver = Receiver(key, into=into)
    with pytest.raises(ChannelError):
        receiver.receive(stream, chunks)
        receiver.opener.eof()
    for again in (receiver.opener.buffer, lambda: receiver.opener.feed(0), receiver.opener.eof):
        with pytest.raises(ChannelError, match="failed earlier"):
            again()
    return receiver


def opened_prefix(receiver: Receiver, good: int) -> None:
    """Nothing but plaintext of the first `good` (untouched) records came through, and in order."""
    assert receiver.plaintext <= sum(len(r) - records.OVERHEAD for r in legit()[:good])
    got = receiver.got()
    assert got == expect(MSGS[:len(got)])


def test_the_legit_stream_has_the_records_the_attacks_assume():
    assert len(legit()) == 6


@pytest.mark.parametrize("into", [True, False])
@pytest.mark.parametrize("index", range(6))
def test_replay_of_any_record(index, into):
    rs = legit()
    stream = b"".join(rs[:index + 1]) + rs[index] + b"".join(rs[index + 1:])
    opened_prefix(attack(stream, chunks=[1 << 20], into=into), index + 1)


def test_replay_of_the_whole_stream():
    rs = legit()
    opened_prefix(attack(b"".join(rs) * 2), len(rs))


@pytest.mark.parametrize("a, b", [(0, 1), (1, 2), (2, 3), (3, 5), (0, 5)])
def test_reorder(a, b):
    rs = legit()
    rs[a], rs[b] = rs[b], rs[a]
    opened_prefix(attack(b"".join(rs)), a)


@pytest.mark.parametrize("index", range(5))
def test_drop(index):
    rs = legit()
    del rs[index]
    opened_prefix(attack(b"".join(rs)), index)


def test_drop_of_the_last_record_is_for_the_protocol():
    # the record layer cannot see that records are missing at the end: the half message stays
    # unread (and BYE / liveness above it tell a clean end from a cut)
    rs = legit()
    receiver = Receiver()
    receiver.receive(b"".join(rs[:-1]))
    receiver.opener.eof()
    assert receiver.got() == expect(MSGS[:-1])


@pytest.mark.parametrize("forgery", ["random", "other key", "other session", "valid length"])
@pytest.mark.parametrize("index", [0, 2, 6])
def test_injection(forgery, index):
    rs = legit()
    if forgery == "random":
        fake = os.urandom(60)
    elif forgery == "other key":
        fake = seal_all(Sealer(os.urandom(32)), MSGS)[index % 6]
    elif forgery == "other session":
        other = security.session_keys(CLUSTER_KEY, TRANSCRIPT + b"!", security.SUBMITTER)[0]
        fake = seal_all(Sealer(other), MSGS)[index % 6]
    else:
        body = os.urandom(40)
        fake = struct.pack(">I", len(body)) + body
    rs.insert(index, fake)
    opened_prefix(attack(b"".join(rs)), index)


def test_reflection_of_own_records_fails():
    # a relay sends the submitter's own records back to it: its receive key is the other one
    stream = b"".join(seal_all(Sealer(SUBMITTER_SEND), MSGS))
    attack(stream, key=SUBMITTER_RECV)
    assert SUBMITTER_RECV == PEER_SEND
    receiver = Receiver(PEER_RECV)  # the right direction opens them
    receiver.receive(stream)
    assert receiver.got() == expect(MSGS)


def test_records_of_the_other_direction_fail():
    peer_records = b"".join(seal_all(Sealer(PEER_SEND), MSGS))
    attack(peer_records, key=PEER_RECV)  # the peer's own records, reflected back to it
    attack(peer_records, key=SUBMITTER_SEND)  # a side that opens with its send key opens nothing


@pytest.mark.parametrize("target", [2, 4])
def test_every_bit_flip_in_a_record(target):
    rs = legit()
    record = rs[target]
    before = sum(map(len, rs[:target]))
    positions = range(len(record) * 8) if len(record) < 200 else \
        sorted(set(range(0, 64)) | set(range(len(record) * 8 - 200, len(record) * 8)) |
               set(random.Random(1).sample(range(len(record) * 8), 200)))
    for bit in positions:
        tampered = bytearray(b"".join(rs))
        tampered[before + bit // 8] ^= 1 << (bit % 8)
        opened_prefix(attack(bytes(tampered), chunks=[997]), target)


@pytest.mark.parametrize("where", ["header", "ciphertext", "tag"])
def test_flips_in_each_field_of_the_first_record(where):
    rs = legit()
    record = bytearray(rs[0])
    offset = {"header": 3, "ciphertext": 4, "tag": len(record) - 1}[where]
    record[offset] ^= 0x80
    opened_prefix(attack(bytes(record) + b"".join(rs[1:])), 0)


@pytest.mark.parametrize("index", [0, 2, 5])
def test_truncation_inside_a_record(index):
    rs = legit()
    record = rs[index]
    cuts = sorted({1, 3, 4, 5, len(record) // 2, len(record) - 17, len(record) - 16, len(record) - 1})
    for cut in cuts:
        receiver = attack(b"".join(rs[:index]) + record[:cut])
        opened_prefix(receiver, index)


def test_a_shortened_length_header_fails():
    rs = legit()
    record = bytearray(rs[2])
    (length,) = struct.unpack(">I", record[:4])
    record[:4] = struct.pack(">I", length - 5)  # the record cut short at its header: tag and AAD disagree
    opened_prefix(attack(b"".join(rs[:2]) + bytes(record[:-5])), 2)


@pytest.mark.parametrize("length", [0, 1, 15, records.RECORD_MAX + 17, 1 << 31, (1 << 32) - 1])
def test_a_length_outside_the_limits_fails_at_its_header(length):
    opener = Opener(KEY)
    view = opener.buffer()
    view[:4] = struct.pack(">I", length)
    with pytest.raises(ChannelError, match="outside the limit"):
        opener.feed(4)  # before any of the body came, and before any memory is set aside for it


def test_max_record_is_configurable():
    (record,) = Sealer(KEY, record_max=101).seal([payload(101)])
    assert len(record) == 101 + records.OVERHEAD
    ok = Opener(KEY, max_record=101)
    push(ok, bytes(record), [7], lambda n: ok.feed(n))
    assert ok.counter == 1
    small = Opener(KEY, max_record=100)
    with pytest.raises(ChannelError, match="outside the limit"):
        push(small, bytes(record), [7], lambda n: small.feed(n))
    assert small.counter == 0


def test_opening_stops_at_a_bad_record_within_one_feed():
    rs = legit()
    bad = bytearray(rs[1])
    bad[-1] ^= 1
    receiver = Receiver(into=False)
    view = receiver.opener.buffer()
    data = rs[0] + bytes(bad) + rs[2]
    view[:len(data)] = data
    with pytest.raises(ChannelError):
        receiver.opener.feed(len(data))
    assert receiver.opener.counter == 1  # record 0 opened, record 1 failed, record 2 never tried


# ---- the counter's end ----------------------------------------------------------------------------------

def test_the_sealer_refuses_to_wrap_its_counter():
    sealer = Sealer(KEY)
    sealer.counter = records.COUNTER_LIMIT - 1
    last = sealer.seal([b"last"])
    with pytest.raises(ChannelError, match="counter"):
        sealer.seal([b"one too many"])
    with pytest.raises(ChannelError, match="counter"):
        list(sealer.stream([b"again"]))
    opener = Opener(KEY)
    opener.counter = records.COUNTER_LIMIT - 1
    view = opener.buffer()
    view[:len(last[0])] = last[0]
    assert [bytes(p) for p in opener.feed(len(last[0]))] == [b"last"]


def test_the_opener_refuses_to_wrap_its_counter():
    opener = Opener(KEY)
    opener.counter = records.COUNTER_LIMIT
    (record,) = Sealer(KEY).seal([b"x"])
    view = opener.buffer()
    view[:len(record)] = record
    with pytest.raises(ChannelError, match="counter"):
        opener.feed(len(record))


def test_nonces_never_repeat_across_a_long_run():
    sealer = Sealer(KEY)
    seen = set()
    for record in seal_all(sealer, messages([[]] * 500)):
        seen.add(record)
    assert len(seen) == 500 and sealer.counter == 500


def test_a_worker_imports_nothing_of_cryptography():
    """Workers run in the job interpreter, which needs only msgpack and cloudpickle: no records there."""
    import subprocess
    import sys

    code = ("import sys, gpulayer.worker.__main__; "
            "print('cryptography' in sys.modules or 'gpulayer.protocol.records' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
