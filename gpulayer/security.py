"""The cluster key: where it comes from, the cluster id derived from it, and the HMAC proofs."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from .errors import ConfigError

KEY_ENV = "GPULAYER_KEY"
NONCE_BYTES = 32
_SUBMITTER_LABEL = b"gpulayer/v1/submitter"
_PEER_LABEL = b"gpulayer/v1/peer"


def default_key_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "gpulayer" / "key"


def load_key(key_file: str | os.PathLike | None = None) -> bytes:
    """The cluster key: an explicit `key_file` (--key-file), else GPULAYER_KEY, else ~/.config/gpulayer/key.

    A blank GPULAYER_KEY counts as unset. Raises ConfigError with the way out when there is none.
    """
    key = b"" if key_file else os.environ.get(KEY_ENV, "").strip().encode()
    if key:
        return key
    path = Path(key_file) if key_file else default_key_path()
    try:
        key = path.read_text().strip().encode()
    except FileNotFoundError:
        raise ConfigError(
            f"no cluster key: {path} does not exist and {KEY_ENV} is unset. "
            "Run `gpulayer key init` on one machine and copy the key file to the others."
        ) from None
    if not key:
        raise ConfigError(f"the cluster key file {path} is empty")
    return key


def init_key(path: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """Create a random key file readable by its owner only (mode 0600)."""
    path = Path(path) if path else default_key_path()
    if path.exists() and not force:
        raise ConfigError(f"{path} exists already; pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    return path


def cluster_id(key: bytes) -> str:
    """A short public id that scopes discovery. It is not authentication."""
    return hashlib.sha256(b"gpulayer/cluster-id/" + key).hexdigest()[:12]


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def submitter_proof(key: bytes, peer_nonce: bytes, submitter_nonce: bytes) -> bytes:
    return hmac.new(key, _SUBMITTER_LABEL + peer_nonce + submitter_nonce, hashlib.sha256).digest()


def peer_proof(key: bytes, peer_nonce: bytes, submitter_nonce: bytes) -> bytes:
    return hmac.new(key, _PEER_LABEL + peer_nonce + submitter_nonce, hashlib.sha256).digest()


def proofs_equal(a, b) -> bool:
    """Constant-time comparison that tolerates wrong types from the wire."""
    return isinstance(a, bytes) and isinstance(b, bytes) and hmac.compare_digest(a, b)
