"""Unit tests of key hygiene and session keys in gpulayer.security (issue 9, items 1 and 6).

Key files: modes readable by others are refused with the chmod fix, short keys are refused
wherever they come from, `init_key(force=True)` never writes into the old file. Session keys:
HKDF-SHA256 over the cluster key and the handshake transcript, one key per direction.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shlex
import stat

import msgpack
import pytest

from gpulayer import security
from gpulayer.errors import ConfigError

GOOD = "0123456789abcdef" * 4  # 64 hex characters: 256 bits


@pytest.fixture
def no_env_key(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(security.KEY_ENV, raising=False)


def key_file(path, text: str, mode: int = 0o600):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    return path


# ---- how a key's bits are counted -------------------------------------------------------------------

@pytest.mark.parametrize("text, bits", [
    (GOOD, 256),               # hex: 4 bits a character
    (GOOD[:32], 128),
    ("ab" * 32, 64),           # hex too, but of 2 distinct characters: 1 bit each
    ("A1b2C3d4E5f6" * 2, 96),  # hex in either case
    ("test-" + "0123456789abcdef" * 2, 148),  # other text: 4 bits a character too, no more
    ("Zm9vYmFyYmF6cXV4", 64),  # base64 gets no credit for its alphabet
    ("a" * 100, 0),            # one distinct character: nothing secret
    ("xy" * 40, 80),           # two: 1 bit a character
    ("abcd" * 30, 240),        # four: 2 bits a character
    ("", 0),
])
def test_key_bits(text, bits):
    assert security.key_bits(text.encode()) == pytest.approx(bits)


def test_key_bits_counts_characters_not_bytes():
    assert security.key_bits("éèêë".encode() * 10) == 80  # 40 characters (80 bytes) of 4 distinct: 2 bits each
    assert security.key_bits("αβγδεζηθικλμ".encode()) == 48


def test_key_bits_of_bytes_that_are_not_utf8():
    assert security.key_bits(bytes(range(128, 160))) == 128  # one character a byte


def test_init_key_makes_256_bits(no_env_key, tmp_path):
    path = security.init_key(tmp_path / "key")
    text = path.read_text()
    assert len(text.strip()) == 64 and set(text.strip()) <= set("0123456789abcdef") and text.endswith("\n")
    assert security.key_bits(security.load_key(path)) == security.KEY_BITS == 256


# ---- short keys ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["a", "test-key", "0123456789abcdef", "0f" * 15 + "0", "xy" * 60, "a" * 200])
def test_short_env_key_is_refused(no_env_key, monkeypatch, value):
    monkeypatch.setenv(security.KEY_ENV, value)
    with pytest.raises(ConfigError) as info:
        security.load_key()
    text = str(info.value)
    assert security.KEY_ENV in text and "128" in text and "gpulayer key init" in text
    assert len(value) < 8 or value not in text  # the message never echoes the key


def test_short_key_file_is_refused_with_its_path(no_env_key, tmp_path):
    path = key_file(tmp_path / "short.key", "hunter2\n")
    with pytest.raises(ConfigError, match="too weak") as info:
        security.load_key(path)
    assert str(path) in str(info.value) and "hunter2" not in str(info.value)


@pytest.mark.parametrize("value", [GOOD[:32], GOOD, "test-" + "0123456789abcdef" * 2,
                                   "correct horse battery staple, twice over"])
def test_keys_of_128_bits_or_more_are_accepted(no_env_key, monkeypatch, tmp_path, value):
    monkeypatch.setenv(security.KEY_ENV, f"  {value}\n")
    assert security.load_key() == value.encode()
    assert security.load_key(key_file(tmp_path / "key", value + "\n")) == value.encode()


def test_check_key_for_keys_given_in_code():
    assert security.check_key(GOOD.encode(), "configure(key=...)") == GOOD.encode()
    with pytest.raises(ConfigError, match=r"configure\(key=\.\.\.\)"):
        security.check_key(b"short", "configure(key=...)")


# ---- key file modes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o666, 0o660, 0o610, 0o601, 0o620, 0o602, 0o777])
def test_key_file_open_to_others_is_refused_with_the_fix(no_env_key, tmp_path, mode):
    path = key_file(tmp_path / "key", GOOD, mode)
    with pytest.raises(ConfigError) as info:
        security.load_key(path)
    text = str(info.value)
    assert f"chmod 600 {path}" in text
    assert f"{mode:04o}" in text


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700])
def test_owner_only_modes_are_accepted(no_env_key, tmp_path, mode):
    path = key_file(tmp_path / "key", GOOD, mode)
    assert security.load_key(path) == GOOD.encode()


def test_default_key_file_mode_is_checked_too(no_env_key, tmp_path):
    path = key_file(tmp_path / "xdg" / "gpulayer" / "key", GOOD, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        security.load_key()
    os.chmod(path, 0o600)
    assert security.load_key() == GOOD.encode()


def test_the_fix_quotes_a_path_with_spaces(no_env_key, tmp_path):
    path = key_file(tmp_path / "my keys" / "key", GOOD, 0o644)
    with pytest.raises(ConfigError) as info:
        security.load_key(path)
    assert f"chmod 600 {shlex.quote(str(path))}" in str(info.value)


def test_the_mode_is_checked_before_the_key_is_read(no_env_key, tmp_path):
    path = key_file(tmp_path / "key", "weak", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        security.load_key(path)


def test_the_mode_of_the_file_behind_a_symlink_counts(no_env_key, tmp_path):
    target = key_file(tmp_path / "real", GOOD, 0o644)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="chmod 600"):
        security.load_key(link)


# ---- init_key --force --------------------------------------------------------------------------------

def test_force_replaces_the_file_by_rename_never_writing_into_it(no_env_key, tmp_path):
    path = key_file(tmp_path / "key", "old-key-" + GOOD + "\n", 0o644)
    witness = tmp_path / "witness"
    os.link(path, witness)  # a second name of the old file: it must keep the old key
    old_inode = path.stat().st_ino
    assert security.init_key(path, force=True) == path
    assert path.stat().st_ino != old_inode
    assert witness.read_text() == "old-key-" + GOOD + "\n"
    assert stat.S_IMODE(witness.stat().st_mode) == 0o644  # the old file was not even chmod-ed
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert security.load_key(path) != b"old-key-" + GOOD.encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key", "witness"]  # no temporary file left


def test_force_with_a_permissive_umask_still_gives_0600(no_env_key, tmp_path):
    key_file(tmp_path / "key", GOOD, 0o666)
    old = os.umask(0)
    try:
        path = security.init_key(tmp_path / "key", force=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_failed_write_keeps_the_old_key_and_leaves_nothing(no_env_key, tmp_path, monkeypatch):
    path = key_file(tmp_path / "key", GOOD + "\n")

    def broken(_):
        raise OSError("disk full")

    monkeypatch.setattr(security.secrets, "token_hex", broken)
    with pytest.raises(OSError, match="disk full"):
        security.init_key(path, force=True)
    assert path.read_text() == GOOD + "\n"
    assert [p.name for p in tmp_path.iterdir()] == ["key"]


def test_init_without_force_still_refuses(no_env_key, tmp_path):
    path = key_file(tmp_path / "key", GOOD)
    with pytest.raises(ConfigError, match="--force"):
        security.init_key(path)
    assert path.read_text() == GOOD


# ---- session keys ------------------------------------------------------------------------------------

KEY = GOOD.encode()
NP, NS = b"p" * 32, b"s" * 32
HELLO = {"t": "hello", "nonce": NP, "peer": "alpha-1", "cluster": "abc", "advert": {"gm": "24", "acc": "cuda"}, "v": 2}


def transcript(**change) -> bytes:
    fields = {"version": 2, "peer_nonce": NP, "submitter_nonce": NS, "peer_id": "alpha-1",
              "hello": security.hello_digest(HELLO), "client_id": "c-1", **change}
    return security.handshake_transcript(**fields)


def rfc5869(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out, i = out + block, i + 1
    return out[:length]


def test_directions_pair_up():
    s_send, s_recv = security.session_keys(KEY, transcript(), security.SUBMITTER)
    p_send, p_recv = security.session_keys(KEY, transcript(), security.PEER)
    assert s_send == p_recv and p_send == s_recv
    assert s_send != s_recv
    assert all(isinstance(k, bytes) and len(k) == security.SESSION_KEY_BYTES == 32 for k in (s_send, s_recv))


def test_session_keys_are_hkdf_sha256_of_key_and_transcript():
    t = transcript()
    okm = rfc5869(KEY, hashlib.sha256(t).digest(), b"gpulayer/v2/session-keys submitter->peer, peer->submitter", 64)
    assert security.session_keys(KEY, t, "submitter") == (okm[:32], okm[32:])


@pytest.mark.parametrize("change", [
    {"version": 3}, {"peer_nonce": b"q" * 32}, {"submitter_nonce": b"t" * 32}, {"peer_id": "alpha-2"},
    {"hello": security.hello_digest({**HELLO, "advert": {"gm": "80", "acc": "cuda"}})},
    {"peer_nonce": NS, "submitter_nonce": NP},  # the nonces swapped
    {"client_id": "c-2"},
])
def test_every_field_of_the_transcript_changes_both_keys(change):
    base = security.session_keys(KEY, transcript(), "submitter")
    other = security.session_keys(KEY, transcript(**change), "submitter")
    assert base[0] != other[0] and base[1] != other[1]


def test_another_cluster_key_gives_other_keys():
    assert security.session_keys(KEY, transcript(), "peer") != security.session_keys(KEY[:-1] + b"0", transcript(), "peer")


def test_the_transcript_encoding_is_unambiguous():
    a = transcript(peer_id="ab", hello=b"c" * 32)
    b = security.handshake_transcript(2, NP, NS, "a", b"b" + b"c" * 32, "c-1")
    assert a != b
    assert transcript(peer_nonce=NP + b"x", submitter_nonce=NS) != transcript(peer_nonce=NP, submitter_nonce=b"x" + NS)


@pytest.mark.parametrize("role", ["client", "", None, "Submitter"])
def test_a_bad_role_is_refused(role):
    with pytest.raises(ValueError, match="role"):
        security.session_keys(KEY, transcript(), role)


@pytest.mark.parametrize("bad", [b"", "text", None])
def test_a_bad_transcript_is_refused(bad):
    with pytest.raises(ValueError, match="transcript"):
        security.session_keys(KEY, bad, "peer")


def test_hello_digest_is_the_same_on_both_sides():
    wire_copy = msgpack.unpackb(msgpack.packb(HELLO), raw=False)  # what the submitter decodes
    reordered = dict(reversed(list(HELLO.items())))
    reordered["advert"] = dict(reversed(list(HELLO["advert"].items())))
    digest = security.hello_digest(HELLO)
    assert security.hello_digest(wire_copy) == security.hello_digest(reordered) == digest
    assert len(digest) == 32


@pytest.mark.parametrize("change", [{"peer": "alpha-2"}, {"cluster": "abd"}, {"nonce": b"q" * 32},
                                    {"advert": {"gm": "24", "acc": "mps"}}, {"extra": 1}])
def test_hello_digest_sees_every_change(change):
    assert security.hello_digest({**HELLO, **change}) != security.hello_digest(HELLO)
