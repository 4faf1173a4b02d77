"""Unit tests of gpulayer.security: where the cluster key comes from, the cluster id, the HMAC proofs."""

from __future__ import annotations

import os
import re
import stat

import pytest

from gpulayer import security
from gpulayer.errors import ConfigError


@pytest.fixture
def config_home(tmp_path, monkeypatch):
    """A private XDG_CONFIG_HOME and no GPULAYER_KEY."""
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    monkeypatch.delenv(security.KEY_ENV, raising=False)
    return home


def write_key(path, text: str):
    """A key file as `gpulayer key init` leaves it: mode 0600 (others' modes are refused, see test_keys.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


# ---- load_key ---------------------------------------------------------------------------------------

def test_default_path_is_under_xdg_config_home(config_home):
    assert security.default_key_path() == config_home / "gpulayer" / "key"


def test_default_path_without_xdg_is_home_config(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert security.default_key_path() == tmp_path / ".config" / "gpulayer" / "key"


def test_empty_xdg_config_home_falls_back_to_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert security.default_key_path() == tmp_path / ".config" / "gpulayer" / "key"


def test_an_explicit_key_file_wins_then_env_then_default(config_home, tmp_path, monkeypatch):
    write_key(config_home / "gpulayer" / "key", "from-default-0123456789abcdef0123456789abcdef\n")
    key_file = write_key(tmp_path / "explicit.key", "from-file-0123456789abcdef0123456789abcdef\n")
    monkeypatch.setenv(security.KEY_ENV, "  from-env-0123456789abcdef0123456789abcdef \n")
    assert security.load_key(key_file) == b"from-file-0123456789abcdef0123456789abcdef"
    assert security.load_key() == b"from-env-0123456789abcdef0123456789abcdef"


def test_key_file_wins_over_default(config_home, tmp_path):
    write_key(config_home / "gpulayer" / "key", "from-default-0123456789abcdef0123456789abcdef\n")
    key_file = write_key(tmp_path / "explicit.key", "from-file-0123456789abcdef0123456789abcdef\n")
    assert security.load_key(key_file) == b"from-file-0123456789abcdef0123456789abcdef"
    assert security.load_key(str(key_file)) == b"from-file-0123456789abcdef0123456789abcdef"


def test_default_path_is_used_last(config_home):
    write_key(config_home / "gpulayer" / "key", "\n  from-default-0123456789abcdef0123456789abcdef  \n")
    assert security.load_key() == b"from-default-0123456789abcdef0123456789abcdef"
    assert security.load_key(None) == b"from-default-0123456789abcdef0123456789abcdef"


def test_empty_env_var_is_ignored(config_home, monkeypatch):
    write_key(config_home / "gpulayer" / "key", "from-default-0123456789abcdef0123456789abcdef")
    monkeypatch.setenv(security.KEY_ENV, "")
    assert security.load_key() == b"from-default-0123456789abcdef0123456789abcdef"


def test_missing_key_explains_the_way_out(config_home):
    with pytest.raises(ConfigError) as info:
        security.load_key()
    text = str(info.value)
    assert "gpulayer key init" in text
    assert str(config_home / "gpulayer" / "key") in text
    assert security.KEY_ENV in text


def test_missing_explicit_key_file(config_home, tmp_path):
    write_key(config_home / "gpulayer" / "key", "from-default-0123456789abcdef0123456789abcdef")  # not used as a fallback
    missing = tmp_path / "nope.key"
    with pytest.raises(ConfigError, match="gpulayer key init") as info:
        security.load_key(missing)
    assert str(missing) in str(info.value)


@pytest.mark.parametrize("content", ["", "\n", "   \n\t\n"])
def test_empty_key_file(config_home, tmp_path, content):
    key_file = write_key(tmp_path / "empty.key", content)
    with pytest.raises(ConfigError, match="empty") as info:
        security.load_key(key_file)
    assert str(key_file) in str(info.value)


@pytest.mark.parametrize("value", [" ", "\n", " \t "])
def test_blank_env_key_is_refused(config_home, monkeypatch, value):
    monkeypatch.setenv(security.KEY_ENV, value)
    try:
        key = security.load_key()
    except ConfigError:
        return
    assert key, f"GPULAYER_KEY={value!r} gave the empty key"


# ---- init_key -------------------------------------------------------------------------------------------

def test_init_key_creates_a_private_file(config_home, tmp_path):
    path = security.init_key(tmp_path / "sub" / "dir" / "key")
    assert path == tmp_path / "sub" / "dir" / "key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = security.load_key(path)
    assert re.fullmatch(rb"[0-9a-f]{64}", key)


def test_init_key_mode_ignores_a_permissive_umask(config_home, tmp_path):
    old = os.umask(0)
    try:
        path = security.init_key(tmp_path / "key")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_init_key_default_path(config_home):
    path = security.init_key()
    assert path == config_home / "gpulayer" / "key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert security.load_key() == path.read_text().strip().encode()


def test_init_key_refuses_to_overwrite(config_home, tmp_path):
    path = security.init_key(tmp_path / "key")
    before = path.read_text()
    with pytest.raises(ConfigError, match="--force"):
        security.init_key(path)
    assert path.read_text() == before


def test_init_key_force_replaces_and_tightens_the_mode(config_home, tmp_path):
    path = write_key(tmp_path / "key", "old-key\n")
    os.chmod(path, 0o644)
    assert security.init_key(path, force=True) == path
    assert path.read_text().strip() != "old-key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_init_key_makes_different_keys(config_home, tmp_path):
    a = security.load_key(security.init_key(tmp_path / "a"))
    b = security.load_key(security.init_key(tmp_path / "b"))
    assert a != b


# ---- cluster_id -------------------------------------------------------------------------------------

def test_cluster_id_is_deterministic_short_hex():
    key = b"0123456789abcdef" * 4
    cid = security.cluster_id(key)
    assert cid == security.cluster_id(key)
    assert re.fullmatch(r"[0-9a-f]{12}", cid)


def test_cluster_id_differs_per_key_and_does_not_reveal_it():
    keys = [os.urandom(16).hex().encode() for _ in range(50)] + [b"a", b"b", b"key", b"key "]
    ids = {security.cluster_id(k) for k in keys}
    assert len(ids) == len(keys)
    for k in keys[:50]:
        cid = security.cluster_id(k)
        assert cid not in k.decode() and k.decode()[:12] != cid
        assert k.decode() not in cid


def test_cluster_id_is_not_a_plain_hash_of_the_key():
    import hashlib

    key = b"the-key"
    assert security.cluster_id(key) != hashlib.sha256(key).hexdigest()[:12]


def test_ray_token_is_hkdf_of_the_key_under_its_own_label():
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    key = b"0123456789abcdef" * 4
    expected = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"gpulayer/ray-auth-token").derive(key)
    assert security.ray_token(key) == expected.hex() == security.ray_token(key)
    assert security.ray_token(key + b"0") != expected.hex()


# ---- proofs ---------------------------------------------------------------------------------------------

KEY = b"k" * 32
NP, NS = b"p" * 32, b"s" * 32
T = security.handshake_transcript(2, NP, NS, "peer-1", b"h" * 32, "c")


def test_proofs_are_hmac_sha256_digests():
    assert len(security.submitter_proof(KEY, T)) == 32
    assert len(security.peer_proof(KEY, T)) == 32
    assert security.submitter_proof(KEY, T) == security.submitter_proof(KEY, T)


def test_proofs_differ_by_role():
    assert security.submitter_proof(KEY, T) != security.peer_proof(KEY, T)


def test_proofs_differ_by_transcript_and_key():
    base = security.submitter_proof(KEY, T)
    for other in (security.handshake_transcript(2, b"q" * 32, NS, "peer-1", b"h" * 32, "c"),
                  security.handshake_transcript(2, NP, b"t" * 32, "peer-1", b"h" * 32, "c"),
                  security.handshake_transcript(2, NS, NP, "peer-1", b"h" * 32, "c"),  # the order of the nonces
                  security.handshake_transcript(2, NP, NS, "peer-2", b"h" * 32, "c")):
        assert base != security.submitter_proof(KEY, other)
        assert security.peer_proof(KEY, T) != security.peer_proof(KEY, other)
    assert base != security.submitter_proof(b"other", T)


def test_new_nonces_are_fresh():
    nonces = {security.new_nonce() for _ in range(100)}
    assert len(nonces) == 100
    assert all(isinstance(n, bytes) and len(n) == security.NONCE_BYTES == 32 for n in nonces)


def test_proofs_equal():
    mac = security.peer_proof(KEY, T)
    assert security.proofs_equal(mac, bytes(mac))
    assert not security.proofs_equal(mac, mac[:-1] + bytes([mac[-1] ^ 1]))
    assert not security.proofs_equal(mac, mac[:16])


@pytest.mark.parametrize("other", [None, "str", 0, 1.5, [1], {"a": 1}, bytearray(32), memoryview(b"x" * 32)])
def test_proofs_equal_tolerates_non_bytes(other):
    mac = security.peer_proof(KEY, T)
    assert security.proofs_equal(mac, other) is False
    assert security.proofs_equal(other, mac) is False
    assert security.proofs_equal(other, other) is False


def test_proofs_equal_with_a_str_of_the_same_text():
    assert security.proofs_equal("abc", "abc") is False  # str is not a proof, even when equal
