"""The cluster key: where it comes from, its checks, the cluster id, the HMAC proofs and the session keys."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import shlex
import stat
import struct
import tempfile
from pathlib import Path
from typing import Any, Mapping

import msgpack

from .errors import ConfigError

KEY_ENV = "GPULAYER_KEY"
NONCE_BYTES = 32
KEY_BITS = 256  # what `gpulayer key init` makes
MIN_KEY_BITS = 128
SESSION_KEY_BYTES = 32
SUBMITTER, PEER = "submitter", "peer"
_SUBMITTER_LABEL = b"gpulayer/v2/submitter"
_PEER_LABEL = b"gpulayer/v2/peer"
_FEW_DISTINCT = 8


def default_key_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "gpulayer" / "key"


def cache_home() -> Path:
    """GPUlayer's cache folder: $XDG_CACHE_HOME/gpulayer, or ~/.cache/gpulayer."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpulayer"


def key_bits(key: bytes) -> float:
    """A conservative count of the secret bits in a key, which is text.

    - Hex text (only 0-9, a-f, A-F, as `gpulayer key init` writes): 4 bits a character, which
      is exact for random hex.
    - Any other text also counts at most 4 bits a character, although random base64 carries 6
      and printable ASCII 6.6: the count gives no credit for an alphabet it cannot tell from
      words a person chose, so such a key needs 32 characters too.
    - A key of fewer than 8 distinct characters counts log2(distinct) bits a character, the most
      its alphabet can hold ("aaaa…" is 0 bits, "abab…" 1 bit a character).

    Characters are those of the UTF-8 text (bytes that are not UTF-8 count one character each).
    It is a floor against short and repetitive keys, not a strength meter: a long phrase of
    common words passes; keys from `gpulayer key init` (256 random bits) are what to use.
    """
    try:
        text = key.decode()
    except UnicodeDecodeError:
        text = key.decode("latin-1")
    distinct = len(set(text))
    per_char = 4.0 if distinct >= _FEW_DISTINCT else math.log2(distinct) if distinct else 0.0
    return per_char * len(text)


def check_key(key: bytes, source: str) -> bytes:
    """`key` itself, or ConfigError when it counts fewer than MIN_KEY_BITS (see `key_bits`).

    `source` names where it came from (a path, GPULAYER_KEY) for the message.
    """
    bits = key_bits(key)
    if bits < MIN_KEY_BITS:
        raise ConfigError(
            f"the cluster key from {source} is too weak: it counts {int(bits)} bits, and at least "
            f"{MIN_KEY_BITS} are needed (32 hex characters; a guessable key is found from the public "
            "cluster id). Make a random one with `gpulayer key init` and copy the file to every machine."
        )
    return key


def check_key_file_mode(path: Path, mode: int) -> None:
    """Refuse a key file that its group or others may read or write, as ssh does."""
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"the cluster key file {path} is accessible by others (mode {stat.S_IMODE(mode):04o}); "
            f"it must be readable by its owner only. Fix it with `chmod 600 {shlex.quote(str(path))}`"
        )


def load_key(key_file: str | os.PathLike[str] | None = None) -> bytes:
    """The cluster key: an explicit `key_file` (--key-file), else GPULAYER_KEY, else ~/.config/gpulayer/key.

    A blank GPULAYER_KEY counts as unset. Raises ConfigError with the way out when there is none,
    when the key file is readable by group or others, or when the key counts fewer than
    MIN_KEY_BITS (`key_bits`).
    """
    key = b"" if key_file else os.environ.get(KEY_ENV, "").strip().encode()
    if key:
        return check_key(key, KEY_ENV)
    path = Path(key_file) if key_file else default_key_path()
    try:
        with open(path, "rb") as f:
            check_key_file_mode(path, os.fstat(f.fileno()).st_mode)
            key = f.read().strip()
    except FileNotFoundError:
        raise ConfigError(
            f"no cluster key: {path} does not exist and {KEY_ENV} is unset. "
            "Run `gpulayer key init` on one machine and copy the key file to the others."
        ) from None
    if not key:
        raise ConfigError(f"the cluster key file {path} is empty")
    return check_key(key, str(path))


def init_key(path: str | os.PathLike[str] | None = None, *, force: bool = False) -> Path:
    """Create a key file of KEY_BITS random bits (hex), readable by its owner only (mode 0600).

    With `force`, the new key goes into a fresh 0600 file in the same directory, which then
    replaces the old file by rename: nothing is ever written into the old file, whatever its mode.
    """
    path = Path(path) if path else default_key_path()
    if path.exists() and not force:
        raise ConfigError(f"{path} exists already; pass --force to replace it")
    return write_private_file(path, secrets.token_hex(KEY_BITS // 8) + "\n")


def write_private_file(path: Path, text: str) -> Path:
    """Write `text` to `path` readable by its owner only (0600): into a fresh file in the same
    directory, fsynced, then renamed over `path`, so that a reader sees the old text or the new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def key_configured() -> bool:
    """Whether this machine names a cluster key (GPULAYER_KEY, or the default key file), good or not."""
    return bool(os.environ.get(KEY_ENV, "").strip()) or default_key_path().exists()


def cluster_id(key: bytes) -> str:
    """A short public id that scopes discovery. It is not authentication."""
    return hashlib.sha256(b"gpulayer/cluster-id/" + key).hexdigest()[:12]


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def submitter_proof(key: bytes, transcript: bytes) -> bytes:
    """AUTH's proof: HMAC-SHA256 over the submitter's label and the whole handshake transcript."""
    return hmac.new(key, _SUBMITTER_LABEL + transcript, hashlib.sha256).digest()


def peer_proof(key: bytes, transcript: bytes) -> bytes:
    """AUTH_OK's proof, under the peer's label: a reflected AUTH proof never passes for it."""
    return hmac.new(key, _PEER_LABEL + transcript, hashlib.sha256).digest()


def proofs_equal(a: object, b: object) -> bool:
    """Constant-time comparison that tolerates wrong types from the wire."""
    return isinstance(a, bytes) and isinstance(b, bytes) and hmac.compare_digest(a, b)


# ---- session keys for the secure channel ------------------------------------------------------------

def hello_digest(hello: Mapping[str, Any]) -> bytes:
    """SHA-256 of what a HELLO said, the same on both sides.

    The map is re-encoded canonically (msgpack, map keys sorted at every depth), so the peer (from
    the map it sent) and the submitter (from the map it decoded) get the same digest.
    """
    return hashlib.sha256(msgpack.packb(_canonical(hello))).digest()


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        items = sorted(((msgpack.packb(k), k, _canonical(v)) for k, v in value.items()), key=lambda kv: kv[0])
        return {k: v for _, k, v in items}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def handshake_transcript(version: int, peer_nonce: bytes, submitter_nonce: bytes, peer_id: str,
                         hello: bytes, client_id: str) -> bytes:
    """The handshake's transcript, for the proofs and `session_keys`: a label, then each field length-prefixed.

    `hello` is `hello_digest(HELLO)`; `client_id` is what AUTH names the submitter. Length
    prefixes make the encoding unambiguous: no two different handshakes give the same bytes.
    """
    fields = [b"gpulayer/transcript", struct.pack(">Q", version), peer_nonce, submitter_nonce,
              peer_id.encode(), hello, client_id.encode()]
    return b"".join(struct.pack(">I", len(f)) + f for f in fields)


def session_keys(key: bytes, transcript: bytes, role: str) -> tuple[bytes, bytes]:
    """(send_key, recv_key) of one connection, each SESSION_KEY_BYTES, for `role` "submitter" or "peer".

    HKDF-SHA256 (RFC 5869) with the cluster key as input, SHA-256 of the transcript as salt,
    expanded into two keys, one per direction: the submitter's send key is the peer's receive
    key and the other way round. Any difference in the transcript (a nonce, the version, the
    peer id, what HELLO said) gives unrelated keys, so a channel is bound to its handshake.
    """
    if role not in (SUBMITTER, PEER):
        raise ValueError(f"role must be {SUBMITTER!r} or {PEER!r}, not {role!r}")
    if not isinstance(transcript, (bytes, bytearray)) or not transcript:
        raise ValueError("the transcript must be non-empty bytes")
    okm = _hkdf(key, 2 * SESSION_KEY_BYTES, b"gpulayer/v2/session-keys submitter->peer, peer->submitter",
                salt=hashlib.sha256(transcript).digest())
    to_peer, to_submitter = okm[:SESSION_KEY_BYTES], okm[SESSION_KEY_BYTES:]
    return (to_peer, to_submitter) if role == SUBMITTER else (to_submitter, to_peer)


def invite_keys(shared: bytes, transcript: bytes) -> tuple[bytes, bytes, bytes]:
    """(joiner's proof key, peer's proof key, seal key) of an invite's exchange (invite.py): HKDF-SHA256
    of the SPAKE2 key with SHA-256 of the exchange's transcript as salt, under a label of its own."""
    okm = _hkdf(shared, 3 * SESSION_KEY_BYTES, b"gpulayer/v1/invite proof joiner, proof peer, seal",
                salt=hashlib.sha256(transcript).digest())
    return okm[:SESSION_KEY_BYTES], okm[SESSION_KEY_BYTES:2 * SESSION_KEY_BYTES], okm[2 * SESSION_KEY_BYTES:]


def ray_token(key: bytes) -> str:
    """The cluster's token for Ray's token authentication (docs/ray.md): 64 hex digits, HKDF-SHA256
    of the cluster key under a label of its own. Every key holder derives the same token, and
    the token (which Ray sends in clear) gives nothing towards the key or the session keys."""
    return _hkdf(key, 32, b"gpulayer/ray-auth-token").hex()


def _hkdf(key: bytes, length: int, info: bytes, salt: bytes | None = None) -> bytes:
    """HKDF-SHA256 (RFC 5869) of `key`."""
    from cryptography.hazmat.primitives import hashes  # here: workers import this module without cryptography
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(key)
