"""Hostile input: hypothesis against the frame and message codec and the v2 handshake (in process),
and a scripted raw-socket attacker (lan_attacker.py, in a namespace of its own) against a live peer
on the LAN, while an honest submitter in another namespace keeps using that peer. The attacker
also holds a stolen key for its post-handshake attacks: garbage in clear, garbage sealed, and
records replayed, reordered, flipped, reflected or taken from another connection."""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from lanlab import HERE, BackgroundSampler, lan_env
from support import built_or_refused, new_key, wait_until

from gpulayer import security
from gpulayer.errors import GPULayerError, ProtocolError
from gpulayer.protocol import framing, handshake, messages
from gpulayer.resources.model import PROTOCOL_VERSION
from gpulayer.transport import blocking

LAN_PEERS = 1
LAN_CONCURRENCY = 2
LAN_PEER_ENV = {"GPULAYER_MAX_MESSAGE_MB": "8"}
ATTACK_SECONDS = 30.0
FD_SLACK = 8  # descriptors the peer may hold beyond those it had before the attack
RSS_GROWTH_BOUND = 128 << 20  # 256 pending handshakes with their buffers, and slack
HEADER = struct.Struct(">I")
SLOW_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


# ---- hypothesis: the codec, in process ------------------------------------------------------------------

@pytest.fixture
def no_unpickling(monkeypatch):
    """Any unpickling during the test fails it (the peer side never unpickles; the codec never does)."""
    calls = []

    def forbidden(*args, **kwargs):
        calls.append(args[:1])
        raise AssertionError("something was unpickled")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    yield calls
    assert not calls


def feed_all(reader: framing.MessageReader, data: bytes, chunks: list[int]) -> list[dict]:
    """Feed `data` in chunks of the given sizes (cycled); return the messages, or raise ProtocolError."""
    out = []
    pos, i = 0, 0
    while pos < len(data):
        size = max(1, chunks[i % len(chunks)]) if chunks else len(data)
        i += 1
        piece = data[pos:pos + size]
        view = reader.buffer()
        n = min(len(piece), len(view))
        view[:n] = piece[:n]
        pos += n
        reader.feed(n)
        while reader.messages:
            out.append(reader.messages.popleft()[0])
    return out


def valid_message(msg: dict) -> bool:
    return isinstance(msg, dict) and msg.get("t") in messages.MESSAGE_TYPES and msg.get("v") == PROTOCOL_VERSION


@settings(max_examples=300, deadline=None, suppress_health_check=SLOW_OK)
@given(data=st.binary(max_size=12_000), chunks=st.lists(st.integers(1, 5000), max_size=8))
def test_any_bytes_before_auth_give_messages_or_a_protocol_error_and_nothing_else(no_unpickling, data, chunks):
    reader = framing.MessageReader()  # the pre-auth limit
    tracemalloc.start()
    try:
        try:
            msgs = feed_all(reader, data, chunks)
        except ProtocolError as exc:
            assert exc.code in ("protocol", "too-large", "version")
            msgs = []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(valid_message(m) for m in msgs)
    assert peak < 64 * 1024 + 8 * len(data)  # nothing sized by a length prefix: frames are bounded before auth


msgpack_leaves = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats()
                  | st.text(max_size=40) | st.binary(max_size=40))
msgpack_values = st.recursive(msgpack_leaves, lambda inner: st.lists(inner, max_size=4)
                              | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
any_type = st.sampled_from(sorted(messages.MESSAGE_TYPES)) | st.text(max_size=12)
any_map = st.builds(lambda t, rest, v: {**rest, "t": t, "v": v}, any_type,
                    st.dictionaries(st.text(max_size=8), msgpack_values, max_size=5),
                    st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, PROTOCOL_VERSION + 1, None, "1"]))


@st.composite
def mutated_streams(draw):
    """Valid-looking frames, then damaged: bit flips, a cut, a forged length, a spliced-in frame."""
    frames = [HEADER.pack(len(b)) + b for b in (msgpack.packb(m) for m in draw(st.lists(any_map, min_size=1,
                                                                                         max_size=4)))]
    data = bytearray(b"".join(frames))
    for _ in range(draw(st.integers(0, 4))):
        pos = draw(st.integers(0, len(data) - 1))
        data[pos] ^= 1 << draw(st.integers(0, 7))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    if draw(st.booleans()):
        pos = draw(st.integers(0, len(data)))
        data[pos:pos] = HEADER.pack(draw(st.sampled_from([0, 1, 4096, 4097, 1 << 20, 0xFFFFFFFF])))
    return bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=SLOW_OK)
@given(data=mutated_streams(), chunks=st.lists(st.integers(1, 64), max_size=6))
def test_damaged_frames_give_valid_messages_or_a_protocol_error(no_unpickling, data, chunks):
    reader = framing.MessageReader()
    try:
        msgs = feed_all(reader, data, chunks)
    except ProtocolError:
        return
    assert all(valid_message(m) for m in msgs)


HELLO_KEY = new_key().encode()


@settings(max_examples=300, deadline=None)
@given(msg=any_map, nonce_s=st.binary(min_size=0, max_size=40), mac=st.binary(max_size=40) | msgpack_values,
       advert=st.dictionaries(st.text(max_size=4), st.text(max_size=8), max_size=3))
def test_random_proofs_never_pass_auth(msg, nonce_s, mac, advert):
    """check_auth(AUTH, key, HELLO) with a proof that is not of this handshake (any nonce, any mac) fails."""
    key = HELLO_KEY
    hello = handshake.hello(os.urandom(32), "peer-1", security.cluster_id(key), advert)
    assert handshake.check_auth({**msg, "nonce": nonce_s, "mac": mac}, key, hello) is None


@settings(max_examples=300, deadline=None)
@given(msg=any_map, nonce_s=st.binary(min_size=security.NONCE_BYTES, max_size=security.NONCE_BYTES),
       client=st.text(max_size=20), advert=st.dictionaries(st.text(max_size=4), st.text(max_size=8), max_size=3))
def test_only_the_proof_of_this_whole_handshake_passes_auth(msg, nonce_s, client, advert):
    """check_auth(AUTH, key, HELLO): the right proof passes only for the HELLO it answered (its nonce, peer
    id and advert), its client name and the key, and gives the session keys."""
    key = HELLO_KEY
    hello = handshake.hello(os.urandom(32), "peer-1", security.cluster_id(key), advert)
    request, transcript = handshake.auth(hello, key, client, nonce_s)
    good = {**msg, **request}  # any other fields the AUTH carries do not matter
    checked = handshake.check_auth(good, key, hello)
    assert checked is not None
    reply, (send_key, recv_key) = checked
    assert reply["t"] == messages.AUTH_OK and reply["mac"] == security.peer_proof(key, transcript)
    assert (recv_key, send_key) == security.session_keys(key, transcript, security.SUBMITTER)
    assert send_key != recv_key
    # a proof of this handshake fails every other one
    assert handshake.check_auth(good, key, {**hello, "nonce": os.urandom(32)}) is None  # replayed to another connection
    assert handshake.check_auth(good, key, {**hello, "peer": "peer-2"}) is None  # relayed to another peer
    assert handshake.check_auth(good, key, {**hello, "advert": {**advert, "sl": "64"}}) is None  # HELLO changed on the way
    assert handshake.check_auth({**good, "client": client + "x"}, key, hello) is None  # the client name changed
    assert handshake.check_auth(good, new_key().encode(), hello) is None  # another cluster's key


@settings(max_examples=150, deadline=None)
@given(replies=st.lists(any_map, min_size=1, max_size=3), raw=st.binary(max_size=200), close=st.booleans())
def test_the_submitters_handshake_against_a_hostile_peer_fails_cleanly(replies, raw, close):
    """A fake peer that sends any messages (or bytes): the submitter raises a GPUlayer error or
    ConnectionError, and never believes a peer that did not prove the key."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5)
    key = HELLO_KEY

    def fake_peer():
        try:
            for m in replies:
                theirs.sendall(HEADER.pack(len(b := msgpack.packb(m))) + b)
            theirs.sendall(raw)
        except OSError:
            pass
        finally:
            if close:
                theirs.close()

    thread = threading.Thread(target=fake_peer)
    thread.start()
    try:
        try:
            handshake.client_handshake(blocking.BlockingConnection(ours), key, "me")
        except (GPULayerError, ConnectionError, TimeoutError, socket.timeout):
            pass
        else:
            raise AssertionError(f"the handshake succeeded against {replies!r}")
    finally:
        thread.join(5)
        ours.close()
        theirs.close()


@settings(max_examples=300, deadline=None)
@given(data=st.dictionaries(st.sampled_from(["acc", "mem", "fw", "cap", "dev", "x"]), msgpack_values, max_size=5)
       | msgpack_values)
@example({"acc": "cuda", "mem": 8, "fw": [["torch", ">=2"]], "cap": ["torch.cuda"], "dev": 2})  # built
def test_requirements_from_the_wire_are_built_or_refused_with_value_error(data):
    event(built_or_refused(data))


# ---- a live peer on the LAN under attack -------------------------------------------------------------------

class PeerWatch(BackgroundSampler):
    """The target daemon's RSS, open descriptors and liveness, every 100 ms."""

    def __init__(self, peer):
        import psutil

        super().__init__()
        self.proc = psutil.Process(peer.pid)
        self.base_rss = self.proc.memory_info().rss
        self.base_fds = self.proc.num_fds()
        self.peak_rss, self.peak_fds, self.samples = self.base_rss, self.base_fds, 0
        self.died = False

    def sample(self) -> bool | None:
        import psutil

        try:
            self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
            self.peak_fds = max(self.peak_fds, self.proc.num_fds())
            self.samples += 1
        except psutil.NoSuchProcess:
            self.died = True
            return False
        return None


@pytest.fixture(scope="module")
def attacked(lan, reliability, tmp_path_factory):
    """One bounded attack on the LAN's peer, with an honest submitter working throughout."""
    target = lan.peers[0]
    honest = lan.submitter("honest")
    assert honest.call("wait_names", present=[target.name], timeout=10)["ok"]
    assert honest.call("run", fn="echo", args=[1])["value"] == 1
    attacker = lan.add_host("attacker")
    marker = tmp_path_factory.mktemp("hostile") / "unpickled"
    cfg = {"host": target.host.ip, "port": target.port, "key": lan.key, "marker": str(marker),
           "seconds": ATTACK_SECONDS, "max_rounds": 50_000, "flood": 2000, "flood_every": 8.0, "seed": 7}
    log = lan.workdir / "attacker.log"

    honest.call("loop_start", fn="echo", pause=0.02, call_timeout=15, max_seconds=ATTACK_SECONDS + 60)
    with PeerWatch(target) as watch, open(log, "ab") as err:
        proc = attacker.popen([sys.executable, str(HERE / "lan_attacker.py"), json.dumps(cfg)], lan_env(None),
                              stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        try:
            out, _ = proc.communicate(timeout=ATTACK_SECONDS + 90)
        finally:
            proc.kill()
    served = honest.call("loop_stop")["stats"]
    assert proc.returncode == 0, log.read_text()[-3000:]
    report = json.loads(out.decode().strip().splitlines()[-1])

    # afterwards: every hostile connection is closed again (a refused one lingers 1 s at most: Peer.refuse's
    # close_gracefully), and the peer still does honest work
    if target.alive():
        wait_until(lambda: watch.proc.num_fds() <= watch.base_fds + FD_SLACK, 30)
    fds_after = watch.proc.num_fds() if target.alive() else None
    rss_after = watch.proc.memory_info().rss if target.alive() else None
    after = honest.call("run", fn="echo", args=[2])
    result = {"target": target, "marker": marker, "report": report, "served": served, "watch": watch,
              "fds_after": fds_after, "rss_after": rss_after, "after": after}
    mib = 2 ** 20
    reliability.record(
        "hostile_input_live_peer", attack_seconds=round(report["seconds"], 1), attack_rounds=report["rounds"],
        attacker_connections=report["connections"], faults_injected={"hostile_connections": report["connections"]},
        reactions=report["reactions"], violations=report["violation_count"], connect_errors=report["errors"],
        unpickled_before_auth=marker.exists(), peer_crashed=watch.died or not target.alive(),
        peer_rss_base_mib=round(watch.base_rss / mib, 1), peer_rss_peak_mib=round(watch.peak_rss / mib, 1),
        peer_rss_after_mib=round(rss_after / mib, 1) if rss_after else None,
        rss_growth_bound_mib=RSS_GROWTH_BOUND // mib,
        peer_fds_base=watch.base_fds, peer_fds_peak=watch.peak_fds, peer_fds_after=fds_after,
        honest_calls=served["calls"], honest_ok=served["ok"], honest_failures=len(served["failures"]),
        honest_p50_ms=round((served["p50_latency"] or 0) * 1000, 2),
        honest_p99_ms=round((served["p99_latency"] or 0) * 1000, 2),
        honest_max_ms=round(served["max_latency"] * 1000, 1),
        tasks_completed=served["ok"] + bool(after.get("ok")), duplicates=0, lost=0)
    return result


def test_a_live_peer_under_attack_never_crashes_never_unpickles_and_keeps_serving(attacked):
    target, report, served, watch = attacked["target"], attacked["report"], attacked["served"], attacked["watch"]
    assert target.alive() and not watch.died, target.log()[-3000:]
    assert not attacked["marker"].exists(), "attacker data was unpickled"
    assert report["violation_count"] == 0, report["violations"]
    assert report["rounds"] >= 200 and report["connections"] >= 5000, report
    assert not served["failures"], served["failures"][:10]
    assert served["ok"] >= 100, served
    assert attacked["after"]["ok"] and attacked["after"]["value"] == 2, attacked["after"]
    assert attacked["fds_after"] <= watch.base_fds + FD_SLACK, (watch.base_fds, attacked["fds_after"])  # no leak


def test_a_live_peer_under_attack_keeps_its_memory_bounded(attacked):
    """At most 256 handshakes are pending at once, so pre-auth memory should stay small."""
    watch = attacked["watch"]
    assert watch.peak_fds < 1024, watch.peak_fds
    growth = watch.peak_rss - watch.base_rss
    assert growth < RSS_GROWTH_BOUND, (f"peer RSS grew by {growth / 2 ** 20:.0f} MiB under unauthenticated input "
                                       f"(from {watch.base_rss / 2 ** 20:.0f} MiB to {watch.peak_rss / 2 ** 20:.0f})")
