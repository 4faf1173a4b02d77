"""A job's working folder: what ships (scan), where the peer keeps it (BlobStore), how it is rebuilt.

The submitter `scan`s the folder into a `Manifest`: one `Entry` per file (relative posix path, size,
executable bit, BLAKE3 digest of the content), honouring `.gitignore` files (root and nested, git's rules,
through `pathspec`) and `--exclude` patterns, never shipping `.git`, and refusing a symlink that leaves
the folder or a folder over the size limit before anything is sent. The peer keeps file contents once,
by digest, in a `BlobStore`; the submitter sends only the blobs it lacks (`BlobStore.missing`), each
verified before it is stored. A blob received for a job becomes a file of that job's folder itself (a hard
link: its bytes are written once); every other file of a job's folder is a copy (`materialise`). The store
notes each blob's identity, so a blob that a job wrote into through its link counts as missing from then
on (ADR 0025). After the job, `changed_files` says what it created or changed, and `resolve_inside` keeps
every fetched path inside the job's folder.

Symlinks: one inside the folder that points to a file or folder inside it ships as a copy of its
target (the peer never makes a symlink); a dangling one ships nothing; one whose target is outside the
folder is refused with `FolderError`, unless an ignore pattern leaves it out. Special files (sockets,
FIFOs, devices) are skipped.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import itertools
import json
import os
import re
import secrets
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, NamedTuple, TypeGuard, Union

if TYPE_CHECKING:
    import blake3
    import pathspec

from ..errors import ConfigError, GPULayerError
from ..security import cache_home, write_private_file

DIGEST = "blake3"  # the content digest (ADR 0023): 4.2 GB/s on one core here, against 1.7 for SHA-256 with SHA-NI
DIGEST_HEX = 64
READ_CHUNK = 4 << 20  # bytes read at once when hashing or copying
DEFAULT_LIMIT = 1 << 30  # the most bytes a working folder may ship
LIMIT_ENV = "GPULAYER_JOB_FOLDER_LIMIT_MB"
MAX_ENTRIES = 200_000  # files in one manifest
MAX_PATH = 4096  # bytes of one relative path (UTF-8); a name at most 255
IGNORE_FILE = ".gitignore"
NEVER_SHIPPED = ".git"

PathLike = Union[str, "os.PathLike[str]"]
Identity = tuple[int, int, int]  # what says a file is unchanged: size, mtime_ns, inode (`_identity`)


class Place(NamedTuple):
    """Where an upload writes a blob: its name in an open folder (`folder_fd`; None for a path of the store's
    own), and the file's mode."""

    folder_fd: int | None
    name: str
    mode: int


class FolderError(GPULayerError):
    """A working folder, a manifest or a path that cannot be shipped, stored or served safely."""


class FolderTooLarge(FolderError):
    """The files to ship come to more than the limit (GPULAYER_JOB_FOLDER_LIMIT_MB)."""


def folder_limit() -> int:
    """The most bytes a working folder may ship: GPULAYER_JOB_FOLDER_LIMIT_MB MiB, default 1 GiB."""
    value = os.environ.get(LIMIT_ENV)
    if value is None or not value.strip():
        return DEFAULT_LIMIT
    if not value.strip().isdigit() or int(value) < 1:
        raise ConfigError(f"{LIMIT_ENV} must be a positive whole number of MiB, not {value!r}")
    return int(value) << 20


class Entry(NamedTuple):
    """One file of a working folder (a NamedTuple: a manifest makes thousands, and a frozen dataclass took
    three times as long to make)."""

    path: str  # relative, posix, normalised ("a/b.py")
    size: int
    executable: bool
    digest: str  # BLAKE3 of the content, lowercase hex (DIGEST_HEX digits)


@dataclass(frozen=True)
class Manifest:
    """The files a working folder ships, sorted by path.

    `sources` (submitter side only) maps each path to the file its bytes are read from (a symlink's
    target); `hashed_bytes` is how much this scan had to hash (the rest came from the digest cache).
    """

    entries: tuple[Entry, ...]
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    hashed_bytes: int = field(default=0, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def blobs(self) -> dict[str, int]:
        """Each distinct content: digest -> size."""
        return {e.digest: e.size for e in self.entries}

    def source_of(self) -> dict[str, str]:
        """Digest -> a file to read it from (submitter side)."""
        return {e.digest: self.sources[e.path] for e in reversed(self.entries)}

    def to_wire(self) -> list[list[Any]]:
        """[[path, size, executable, digest], ...] for a msgpack message."""
        return [[e.path, e.size, e.executable, e.digest] for e in self.entries]

    @classmethod
    def from_wire(cls, value: Any, limit_bytes: int | None = None) -> Manifest:
        """A manifest received from the other side, checked entry by entry (FolderError on any fault):
        safe relative paths, no duplicates, no file where another needs a folder, sizes within the limit."""
        limit = folder_limit() if limit_bytes is None else limit_bytes
        if not isinstance(value, list) or len(value) > MAX_ENTRIES:
            raise FolderError(f"a manifest is a list of at most {MAX_ENTRIES} entries")
        entries = []
        total = 0
        for item in value:
            if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)
                    and isinstance(item[1], int) and not isinstance(item[1], bool) and item[1] >= 0
                    and isinstance(item[2], bool) and is_digest(item[3])):
                raise FolderError(f"a manifest entry is [path, size >= 0, executable, {DIGEST} hex]")
            check_parts(item[0], strict=True)
            total += item[1]
            entries.append(Entry(item[0], item[1], item[2], item[3]))
        if total > limit:
            raise FolderTooLarge(f"the manifest's files come to {total} bytes, over this side's limit of "
                                 f"{limit} bytes ({LIMIT_ENV})")
        entries.sort(key=lambda e: e.path)
        _check_tree(entries)
        return cls(tuple(entries))


_HEX_DIGEST = re.compile(f"[0-9a-f]{{{DIGEST_HEX}}}")


def is_digest(value: Any) -> TypeGuard[str]:
    """Whether `value` is a content digest (BLAKE3) in lowercase hex."""
    return isinstance(value, str) and _HEX_DIGEST.fullmatch(value) is not None


def check_relpath(relpath: str, strict: bool = False) -> PurePosixPath:
    """The path as a PurePosixPath; FolderError for an absolute path, a `..` in it, a NUL or an empty one.

    `strict` (a manifest's paths) also refuses what is not already normalised (`./a`, `a//b`, `a/`),
    a name over 255 bytes or a path over MAX_PATH, and `.git`."""
    check_parts(relpath, strict)
    return PurePosixPath(relpath)


def check_parts(relpath: str, strict: bool = False) -> list[str]:
    """`check_relpath`'s checks, without making a PurePosixPath (the hot path of a manifest): its names."""
    if not isinstance(relpath, str) or "\x00" in relpath:
        raise FolderError(f"not a path: {relpath!r}")
    if relpath.startswith("/"):
        raise FolderError(f"{relpath!r} is an absolute path: only paths inside the job's folder are allowed")
    parts = relpath.split("/")
    if ".." in parts:
        raise FolderError(f"{relpath!r} goes up with '..': only paths inside the job's folder are allowed")
    if strict:
        if "" in parts or "." in parts or len(relpath) > 63 and (  # only a long path can have a long name
                len(relpath) > MAX_PATH // 4 and len(relpath.encode()) > MAX_PATH
                or any(len(part) > 63 and len(part.encode()) > 255 for part in parts)):
            raise FolderError(f"{relpath!r} is not a normalised relative path of a file")
        if NEVER_SHIPPED in parts:
            raise FolderError(f"{relpath!r} is inside {NEVER_SHIPPED}/, which is never shipped")
    return parts


def _check_tree(entries: list[Entry]) -> None:
    """Entries name each file once, and no file is also a folder of another."""
    files = {e.path for e in entries}
    if len(files) != len(entries):
        raise FolderError("a manifest names the same path twice")
    folders = set()
    for e in entries:
        cut = e.path.rfind("/")
        while cut > 0 and e.path[:cut] not in folders:
            folders.add(e.path[:cut])
            cut = e.path.rfind("/", 0, cut)
    clash = files & folders
    if clash:
        folder = min(clash)
        child = next(e.path for e in entries if e.path.startswith(folder + "/"))
        raise FolderError(f"{folder!r} is a file, and {child!r} needs it as a folder")


# --- the submitter's side: scan -------------------------------------------------------------------


def _identity(st: os.stat_result) -> Identity:
    """What says a file is unchanged since it was hashed (the digest cache) or stored (`BlobStore`): size,
    mtime_ns, inode."""
    return st.st_size, st.st_mtime_ns, st.st_ino


class DigestCache:
    """What a scan of one folder learnt, for the next: the digests of the files hashed, keyed by (real
    path, size, mtime_ns, inode), and the ignore rules' decisions, keyed by the rules (`_Rules.key`) and
    the path; a JSON file (0600).

    A rescan of an unchanged folder hashes nothing and compiles no ignore rule (pathspec is not even
    imported). With `path=None` it lives in memory only (one object serves the scans of a process either way).
    """

    FORMAT = 3  # a file of another format (or none) starts empty: one rehash (3: BLAKE3 digests)

    def __init__(self, path: Path | None):
        self.path = path
        # what the last scan saw (or the file held), and what this scan has seen: digests, and decisions
        self._known: dict[str, list[Any]] = {}
        self._seen: dict[str, list[Any]] = {}
        self._decided: dict[str, dict[str, Any]] = {}
        self._deciding: dict[str, dict[str, bool]] = {}
        if path is not None:
            try:
                loaded = json.loads(path.read_text())
            except (OSError, ValueError):
                loaded = None
            if isinstance(loaded, dict) and loaded.get("format") == self.FORMAT and \
                    isinstance(loaded.get("digests"), dict) and isinstance(loaded.get("ignored"), dict):
                self._known, self._decided = loaded["digests"], loaded["ignored"]
        self._on_disk = self._known, self._decided

    @classmethod
    def for_folder(cls, real_root: str) -> DigestCache:
        """The cache of one folder, under $XDG_CACHE_HOME (or ~/.cache)/gpulayer/digests/."""
        name = hashlib.sha256(real_root.encode()).hexdigest()[:32]
        return cls(cache_home() / "digests" / f"{name}.json")

    def get(self, real: str, st: os.stat_result) -> str | None:
        hit = self._known.get(real)
        if isinstance(hit, list) and len(hit) == 4 and tuple(hit[:3]) == _identity(st) and is_digest(hit[3]):
            self._seen[real] = hit
            return str(hit[3])
        return None

    def put(self, real: str, st: os.stat_result, digest: str) -> None:
        self._seen[real] = [*_identity(st), digest]

    def decision(self, rules: str, name: str) -> bool | None:
        """Whether `name` was ignored under the rules named `rules`, as decided before; None if never."""
        verdict = self._decided.get(rules, {}).get(name)
        return verdict if isinstance(verdict, bool) else None

    def decide(self, rules: str, name: str, verdict: bool) -> None:
        self._deciding.setdefault(rules, {})[name] = verdict

    def save(self) -> None:
        """End a scan: what it saw is what the next one starts from (files gone, and rules no longer in
        force, are dropped), and it is written to the file when it changed; a failure to write only costs
        a rehash."""
        seen = self._seen, self._deciding
        self._known, self._decided = seen
        self._seen, self._deciding = {}, {}
        if self.path is None or seen == self._on_disk:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump({"format": self.FORMAT, "digests": seen[0], "ignored": seen[1]}, out)
            os.replace(tmp, self.path)
            self._on_disk = seen
        except OSError:
            return


def new_digest() -> blake3.blake3:
    """A fresh content hasher (BLAKE3): `update` (which lets go of the GIL), `hexdigest`."""
    from blake3 import blake3  # only where content is hashed: a rescan of an unchanged folder never imports it

    return blake3()


def hash_file(path: PathLike) -> str:
    """The content digest of a file, read in READ_CHUNK pieces into one reused buffer."""
    digest = new_digest()
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


class _Rules:
    """The ignore rules in force in one folder of a walk: the .gitignore files from the root down to it,
    as (base prefix, text); `key` names them exactly, with the excludes and the pathspec installed."""

    def __init__(self, key: str, files: tuple[tuple[str, str], ...] = ()):
        self.key, self.files = key, files

    def adding(self, base: str, text: str) -> _Rules:
        """These rules and the ignore file of the folder `base` (its text)."""
        key = hashlib.sha256(f"{self.key}\0{base}\0{text}".encode()).hexdigest()[:32]
        return _Rules(key, (*self.files, (base, text)))


class _Ignores:
    """git's ignore rules for one walk: --exclude patterns first, then .gitignore files, deepest first.

    A decision that `cache` holds for the same rules and path is taken from it; pathspec is imported, and
    the rules compiled, only for a path it lacks (a new file, or any change to the rules)."""

    def __init__(self, excludes: Iterable[str], cache: DigestCache):
        self.excludes = list(excludes)
        self.cache = cache
        root = json.dumps([_pathspec_identity(), self.excludes])
        self.root = _Rules(hashlib.sha256(root.encode()).hexdigest()[:32])  # no ignore file yet
        self._specs: dict[tuple[str, ...], pathspec.GitIgnoreSpec] = {}  # compiled, by their lines

    def ignored(self, rel: str, is_dir: bool, rules: _Rules) -> bool:
        """Whether `rel` (relative to the root) is left out under `rules`."""
        if not rules.files and not self.excludes:
            return False
        name = rel + "/" if is_dir else rel
        verdict = self.cache.decision(rules.key, name)
        if verdict is None:
            verdict = self._decide(name, rules)
        self.cache.decide(rules.key, name, verdict)
        return verdict

    def _decide(self, name: str, rules: _Rules) -> bool:
        if self.excludes:
            verdict = self._spec(self.excludes).check_file(name).include
            if verdict is not None:
                return verdict
        for base, text in reversed(rules.files):
            verdict = self._spec(text.splitlines()).check_file(name[len(base):]).include
            if verdict is not None:
                return verdict
        return False

    def _spec(self, lines: list[str]) -> pathspec.GitIgnoreSpec:
        spec = self._specs.get(tuple(lines))
        if spec is None:
            import pathspec  # here: a folder whose decisions are all known never pays for it

            spec = self._specs[tuple(lines)] = pathspec.GitIgnoreSpec.from_lines(lines)
        return spec


def _pathspec_identity() -> list[Any]:
    """The installed pathspec, without importing it: its __init__.py's path, size and mtime (an upgrade
    decides afresh)."""
    import importlib.util

    found = importlib.util.find_spec("pathspec")
    if found is None or found.origin is None:
        return []
    try:
        st = os.stat(found.origin)
    except OSError:
        return [found.origin]
    return [found.origin, st.st_size, st.st_mtime_ns]


def _inside(path: str, real_root: str) -> bool:
    return path == real_root or path.startswith(real_root.rstrip(os.sep) + os.sep)


def _read_ignore_file(real_dir: str) -> str | None:
    """The text of the folder's .gitignore, None if it has none."""
    path = os.path.join(real_dir, IGNORE_FILE)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as exc:
        raise FolderError(f"cannot read {path}: {exc}") from None


def _walk(real_root: str, ignores: _Ignores | None,
          start: str | None = None) -> Iterator[tuple[str, str, os.stat_result]]:
    """(path relative to `real_root`, real file, its stat) of every file under `start` (default the root),
    in no particular order. With `ignores`, .gitignore files and the excludes leave files out; without,
    every file counts. A symlink is followed only to a target inside `real_root` (else FolderError)."""
    start = real_root if start is None else start
    prefix = "" if start == real_root else os.path.relpath(start, real_root).replace(os.sep, "/") + "/"
    # each pending folder: its real path, its relative prefix, the ignore rules above it, the real folders it is in
    pending: list[tuple[str, str, _Rules, tuple[str, ...]]] = \
        [(start, prefix, _Rules("") if ignores is None else ignores.root, (real_root, start))]
    while pending:
        real_dir, prefix, rules, chain = pending.pop()
        text = _read_ignore_file(real_dir) if ignores is not None else None
        if text is not None:
            rules = rules.adding(prefix, text)
        try:
            listing = sorted(os.scandir(real_dir), key=lambda d: d.name)
        except OSError as exc:
            raise FolderError(f"cannot list {real_dir}: {exc}") from None
        for item in listing:
            if item.name == NEVER_SHIPPED:
                continue
            rel = prefix + item.name
            if item.is_symlink():
                target = os.path.realpath(item.path)
                try:
                    st = os.stat(target)
                except OSError:
                    st = None
                if ignores is not None and ignores.ignored(rel, st is not None and stat.S_ISDIR(st.st_mode), rules):
                    continue
                if not _inside(target, real_root):
                    raise FolderError(f"{rel} is a symlink to {target}, outside the folder {real_root}: GPUlayer "
                                      "never follows a symlink out of it (copy the file in, or leave the link "
                                      "out with --exclude or .gitignore)")
                if st is None:
                    continue  # dangling, inside: nothing to ship
                if stat.S_ISDIR(st.st_mode):
                    if target in chain:
                        raise FolderError(f"{rel} is a symlink to {target}, a folder that contains it: a loop")
                    pending.append((target, rel + "/", rules, (*chain, target)))
                elif stat.S_ISREG(st.st_mode):
                    yield rel, target, st
            elif item.is_dir(follow_symlinks=False):
                if ignores is None or not ignores.ignored(rel, True, rules):
                    pending.append((item.path, rel + "/", rules, (*chain, item.path)))
            elif item.is_file(follow_symlinks=False) and (ignores is None or not ignores.ignored(rel, False, rules)):
                yield rel, item.path, item.stat(follow_symlinks=False)


def scan(root: PathLike, excludes: Iterable[str] = (), limit_bytes: int | None = None,
         cache: DigestCache | None = None) -> Manifest:
    """The manifest of the working folder `root`: what a job ships.

    Honours `.gitignore` files (root and nested, git's rules) and `excludes` (gitignore patterns
    relative to the root, which win over the files; `!pattern` takes a file back); never ships `.git`.
    Raises FolderError for a symlink out of the folder, and FolderTooLarge, before hashing anything,
    when the files come to more than `limit_bytes` (default GPULAYER_JOB_FOLDER_LIMIT_MB, 1 GiB).
    Digests come from `cache` (default: this folder's DigestCache.for_folder) when a file's size,
    mtime and inode are unchanged.
    """
    limit = folder_limit() if limit_bytes is None else limit_bytes
    real_root = os.path.realpath(root)
    if not os.path.isdir(real_root):
        raise FolderError(f"the working folder {os.fspath(root)!r} is not a folder")
    cache = DigestCache.for_folder(real_root) if cache is None else cache
    found = sorted(_walk(real_root, _Ignores(excludes, cache)))
    if len(found) > MAX_ENTRIES:
        raise FolderTooLarge(f"{os.fspath(root)} has {len(found)} files to ship, over the {MAX_ENTRIES} a job "
                             "may take: leave some out with --exclude or .gitignore")
    total = sum(st.st_size for _, _, st in found)
    if total > limit:
        largest = sorted(found, key=lambda f: -f[2].st_size)[:3]
        names = ", ".join(f"{rel} ({st.st_size / 2**20:.1f} MiB)" for rel, _, st in largest)
        raise FolderTooLarge(f"the working folder {os.fspath(root)} has {total / 2**20:.1f} MiB to ship, over "
                             f"the limit of {limit / 2**20:.0f} MiB ({LIMIT_ENV}); the largest: {names}. Leave "
                             "files out with --exclude or .gitignore")
    entries, sources, hashed = [], {}, 0
    for rel, real, st in found:
        digest = cache.get(real, st)
        if digest is None:
            digest = hash_file(real)
            hashed += st.st_size
            if _identity(os.stat(real)) == _identity(st):  # not changed while it was read
                cache.put(real, st, digest)
        entries.append(Entry(rel, st.st_size, bool(st.st_mode & 0o111), digest))
        sources[rel] = real
    cache.save()
    return Manifest(tuple(entries), sources, hashed)


# --- the peer's side: blobs, and the job's folder ------------------------------------------------


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
_TMP_COUNT = itertools.count()  # the names of blobs being written (`BlobStore.tmp_path`)


def _not_its_digest(digest: str) -> FolderError:
    return FolderError(f"blob {digest[:16]} does not match its digest (changed while it was sent?)")


class BlobWriter:
    """Receives one blob in pieces; `commit` checks its size and digest, then enters it into the store.

    Anything short of a successful commit (a truncated or wrong upload, an exception, `abort`) leaves
    nothing, in the store or `at`. Use it as a context manager, or call `abort` on failure. With
    `caller_hashes` the caller hashes the very bytes it writes (on another thread, say) and gives `commit`
    that digest. With `at`, the blob is written there (a job's file) and the store links to it
    (`BlobStore.enter`); `at`'s folder must stay open until the commit or the abort.
    """

    def __init__(self, store: BlobStore, digest: str, size: int, caller_hashes: bool = False, at: Place | None = None):
        self.store, self.digest, self.size = store, digest, size
        self.written = 0
        self._hash = None if caller_hashes else new_digest()
        self._at = store.new_file(digest, at)
        self._fd: int | None = os.open(self._at.name, _NEW_FILE, self._at.mode, dir_fd=self._at.folder_fd)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append a piece; FolderError (and nothing kept) if it goes past the announced size."""
        if self._fd is None:
            raise FolderError(f"blob {self.digest[:16]} is closed")
        view = memoryview(data).cast("B")
        if self.written + view.nbytes > self.size:
            self.abort()
            raise FolderError(f"blob {self.digest[:16]} got more than the {self.size} bytes announced")
        if self._hash is not None:
            self._hash.update(view)
        self.written += view.nbytes
        while view:
            view = view[os.write(self._fd, view):]

    def commit(self, hashed: str | None = None) -> None:
        """Check the size and digest (`hashed`: the caller's, with `caller_hashes`), then store the blob
        (`BlobStore.enter`); FolderError, and nothing kept, if either is wrong."""
        if self._fd is None:
            raise FolderError(f"blob {self.digest[:16]} is closed")
        if self.written != self.size:
            self.abort()
            raise FolderError(f"blob {self.digest[:16]} is truncated: {self.written} of {self.size} bytes came")
        if (self._hash.hexdigest() if self._hash is not None else hashed) != self.digest:
            self.abort()
            raise _not_its_digest(self.digest)
        identity = _seal(self._fd)
        os.close(self._fd)
        self._fd = None
        self.store.enter(self._at, self.digest, identity)

    def abort(self) -> None:
        """Drop what was written."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            with contextlib.suppress(OSError):  # gone already, or with its job's folder
                os.unlink(self._at.name, dir_fd=self._at.folder_fd)

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class BlobStore:
    """The peer's file contents, once each, by content digest (BLAKE3): `<dir>/<2 hex>/<digest>` (0700
    folders, 0600 files: 0700 where one is a job's executable), and `<dir>/index`, the identity each blob had
    when it was stored.

    A blob may be the very file of the job it came for (an upload writes it there, and the store links to
    it: `Builder.first`): a job that writes into that file changes the blob. So each blob gets a unique mtime
    as it is stored, and its identity (size, mtime, inode) is noted in memory and appended to the index; a
    blob whose file no longer has it (written to since, or of an earlier release's store) counts as missing,
    and a copy out of it (`_place`) is refused. `prune` frees what no retained job needs; `recover`, at the
    peer's start, removes what is not intact and rewrites the index.
    """

    def __init__(self, directory: PathLike):
        self.directory = Path(directory)
        self._root = str(self.directory)
        self.tmp = str(self.directory / "tmp")
        (self.directory / "tmp").mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.directory, 0o700)
        self._index = self.directory / INDEX_FILE
        self._lock = threading.Lock()  # the index: its file and `_known` change together
        self._known: dict[str, Identity] = _read_index(self._index)
        self._index_file = _append_to(self._index)

    def close(self) -> None:
        self._index_file.close()

    def recover(self) -> None:
        """At the peer's start, with no upload running: remove the partial uploads of a peer that died and the
        blobs that are not intact (written to by a job, or never noted: a crash between the two, an earlier
        release's), and write the index afresh."""
        for stale in (self.directory / "tmp").iterdir():
            stale.unlink(missing_ok=True)
        self._rewrite_index(remove_others=True)

    def path(self, digest: str) -> Path:
        return Path(self.blob_path(digest))

    def blob_path(self, digest: str) -> str:
        """Where a blob lives (a str: the hot path of an upload); FolderError for what is not a digest."""
        if not is_digest(digest):
            raise FolderError(f"not a {DIGEST} digest: {str(digest)[:80]!r}")
        return f"{self._root}/{digest[:2]}/{digest}"

    def intact(self, digest: str, size: int, st: os.stat_result | None = None) -> bool:
        """Whether the blob is stored, `size` bytes long, readable, and its file has the identity noted when it was
        stored (`st`: its stat, if the caller has it). A job may make its linked file unreadable (chmod): the blob
        is then missing, and sent again, rather than stored but unusable."""
        known = self._known.get(digest)
        if known is None or known[0] != size:
            return False
        if st is None:
            try:
                st = os.stat(self.blob_path(digest))
            except FileNotFoundError:
                return False
        return _identity(st) == known and bool(st.st_mode & stat.S_IRUSR)

    def missing(self, blobs: Mapping[str, int]) -> list[str]:
        """The digests of `blobs` (digest -> size: a checked manifest's `blobs()`) the store lacks intact, in
        their order. Only the blobs the index notes are looked at on disk (`intact`), one by one: a fresh folder
        costs no system call, however large the store. (What is not a digest is never noted: it is missing, and
        writing it fails.)"""
        return [digest for digest, size in blobs.items() if not self.intact(digest, size)]

    def new_file(self, digest: str, at: Place | None) -> Place:
        """Where a blob being written goes: `at`, or a new name in the store's tmp folder (its digest's start,
        this process, a count: no random bytes to ask the kernel for, per small blob)."""
        return at or Place(None, f"{self.tmp}/{digest[:16]}.{os.getpid()}.{next(_TMP_COUNT)}", 0o600)

    def enter(self, at: Place, digest: str, identity: Identity) -> None:
        """Make the checked blob written `at` (sealed: `_seal`'s identity) the store's, and note its identity in
        the same step, under the lock (the index then names the file at the blob's path). A job's file is linked
        in, so its bytes are written once (ADR 0027); where a blob is there already (another upload's, or one a
        job wrote into), through a tmp name (`_beside`) renamed over it. The store's own tmp file is renamed in
        (atomic)."""
        final = self.blob_path(digest)
        if at.folder_fd is not None:
            with self._lock:
                try:
                    _into_folder(partial(os.link, at.name, src_dir_fd=at.folder_fd, follow_symlinks=False), final)
                except OSError:
                    pass
                else:
                    return self._note(digest, identity)
            at, identity = self._beside(at, digest, identity)
        with self._lock:
            _into_folder(partial(os.replace, at.name), final)
            self._note(digest, identity)

    def _beside(self, at: Place, digest: str, identity: Identity) -> tuple[Place, Identity]:
        """The job's file `at` under a new name in the store's tmp folder, and its identity: a link, or where the
        filesystem has no hard links a copy of its own (sealed)."""
        tmp = self.new_file(digest, None)
        try:
            os.link(at.name, tmp.name, src_dir_fd=at.folder_fd, follow_symlinks=False)
        except OSError:
            return tmp, _copied(at, tmp.name, identity[0])
        return tmp, identity

    def _note(self, digest: str, identity: Identity) -> None:
        self._known[digest] = identity
        self._index_file.write(_index_line(digest, identity).encode())

    def put(self, digest: str, data: memoryview, at: Place | None = None) -> None:
        """Store a whole blob held in memory (one of a pack's small ones), checked against its digest first:
        FolderError, and nothing kept, if it does not match. With `at`, it is written there, as a job's file
        (`enter`). BlobWriter's checks, without its object: 25 KiB blobs 52 -> 38 us each here."""
        self.blob_path(digest)  # FolderError for what is not a digest
        hasher = new_digest()
        hasher.update(data)
        if hasher.hexdigest() != digest:
            raise _not_its_digest(digest)
        at = self.new_file(digest, at)
        fd = os.open(at.name, _NEW_FILE, at.mode, dir_fd=at.folder_fd)
        try:
            while data:
                data = data[os.write(fd, data):]
            identity = _seal(fd)
        except BaseException:
            os.unlink(at.name, dir_fd=at.folder_fd)
            raise
        finally:
            os.close(fd)
        self.enter(at, digest, identity)

    def writer(self, digest: str, size: int, caller_hashes: bool = False, at: Place | None = None) -> BlobWriter:
        """A writer for one blob of `size` bytes and this digest (`BlobWriter`)."""
        self.path(digest)
        if not isinstance(size, int) or size < 0:
            raise FolderError(f"a blob's size is a whole number of bytes, not {size!r}")
        return BlobWriter(self, digest, size, caller_hashes, at)

    def blobs(self) -> Iterator[tuple[str, int]]:
        """(digest, size) of every stored blob."""
        for sub in self.directory.iterdir():
            if len(sub.name) == 2 and sub.is_dir():
                for blob in sub.iterdir():
                    if is_digest(blob.name):
                        yield blob.name, blob.stat().st_size

    def total_bytes(self) -> int:
        """What the stored blobs take, for retention."""
        return sum(size for _, size in self.blobs())

    def prune(self, keep: Collection[str],
              lock: contextlib.AbstractContextManager[object] = contextlib.nullcontext()) -> int:
        """Remove every blob not in `keep` (the digests of the jobs retained and of uploads in progress), and
        write the index afresh; returns the bytes freed. `keep` is looked at under `lock` right before each
        removal: what another thread adds to it under `lock` while this runs is kept (peer/janitor.py)."""
        freed = 0
        for digest, size in list(self.blobs()):
            with lock:
                if digest in keep:
                    continue
                self.path(digest).unlink(missing_ok=True)
            freed += size
        self._rewrite_index()
        return freed

    def _rewrite_index(self, remove_others: bool = False) -> None:
        """The index with one line per blob stored and intact (written beside it, then renamed over it);
        `remove_others`: the blobs that are not intact are removed."""
        with self._lock:
            known = {}
            for digest, size in list(self.blobs()):
                if self.intact(digest, size):
                    known[digest] = self._known[digest]
                elif remove_others:
                    self.path(digest).unlink(missing_ok=True)
            self._known = known
            write_private_file(self._index, "".join(_index_line(digest, known[digest]) for digest in known))
            self._index_file.close()
            self._index_file = _append_to(self._index)


INDEX_FILE = "index"
_SEALED = itertools.count()  # makes each blob's mtime unique within this process


def _seal(fd: int) -> Identity:
    """Give the blob being stored (open as `fd`) an mtime of its own, and return its identity (size, mtime_ns,
    inode). A write into it later sets its mtime to the time of that write; copying another blob's mtime
    onto it (`cp -p`) gives it that blob's, which is not its own either."""
    stamp = time.time_ns() // 1000 * 1000 + next(_SEALED) % 1000  # a count in the nanoseconds
    os.utime(fd, ns=(stamp, stamp))
    return _identity(os.fstat(fd))


def _append_to(path: Path) -> io.FileIO:
    """The file `path` (made 0600 if missing), open for appends: each write one system call, at its end."""
    return open(path, "ab", buffering=0, opener=lambda name, flags: os.open(name, flags, 0o600))  # noqa: SIM115


def _copied(at: Place, path: str, size: int) -> Identity:
    """Copy the `size` bytes of the file `at` to a new file `path` (removed again on failure); its identity, sealed."""
    src = os.open(at.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=at.folder_fd)
    try:
        dst = os.open(path, _NEW_FILE, 0o600)
    except BaseException:
        os.close(src)
        raise
    try:
        copy_fd(src, dst, size)
        return _seal(dst)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(src)
        os.close(dst)


def _into_folder(make: Callable[[str], None], final: str) -> None:
    """`make(final)` (a link or a rename to a blob's path), making its two-hex folder first where it is missing."""
    try:
        make(final)
    except FileNotFoundError:  # the first blob of its two-hex folder
        with contextlib.suppress(FileExistsError):
            os.mkdir(os.path.dirname(final), 0o700)
        make(final)


def _index_line(digest: str, identity: Identity) -> str:
    return " ".join(map(str, (digest, *identity))) + "\n"


def _read_index(path: Path) -> dict[str, Identity]:
    """The identities an index file notes (the last line of a digest wins); lines that do not parse are left
    out (their blobs count as missing)."""
    known: dict[str, Identity] = {}
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return known
    for line in text.splitlines():
        parts = line.split(" ")
        if len(parts) == 4 and is_digest(parts[0]) and all(p.isdigit() for p in parts[1:]):
            known[parts[0]] = (int(parts[1]), int(parts[2]), int(parts[3]))
    return known


def copy_fd(src: int, dst: int, size: int) -> None:
    """Copy `size` bytes between descriptors, in the kernel where it can (copy_file_range, reflinks)."""
    left = size
    if hasattr(os, "copy_file_range"):
        try:
            while left:
                n = os.copy_file_range(src, dst, min(left, 1 << 30))
                if n == 0:
                    break
                left -= n
        except OSError:
            pass  # another filesystem, or no support: copy by hand from where it stopped
    if left:
        buf = bytearray(min(READ_CHUNK, left))
        view = memoryview(buf)
        while left:
            n = os.readv(src, [view[:min(left, len(buf))]])
            if n == 0:
                break
            out = view[:n]
            while out:
                out = out[os.write(dst, out):]
            left -= n
    if left:
        raise FolderError(f"the copy ended {left} bytes short of {size} (the file shrank)")


def _find_fclonefileat() -> Any:
    """macOS's fclonefileat(2), or None elsewhere (on Linux, copy_file_range makes reflinks where it can)."""
    if sys.platform != "darwin":
        return None
    import ctypes

    try:
        clone = ctypes.CDLL(None, use_errno=True).fclonefileat
    except (OSError, AttributeError):  # before macOS 10.12
        return None
    clone.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
    clone.restype = ctypes.c_int
    return clone


_fclonefileat = _find_fclonefileat()
_CLONE_FLAGS = 0x0001 | 0x0002  # CLONE_NOFOLLOW | CLONE_NOOWNERCOPY (sys/clonefile.h)


def clone_file(src: int, folder_fd: int, name: str) -> bool:
    """Make `name` in the open folder a clone of the file `src`: on APFS a new file that shares the blocks until
    either is written (so the store's blob stays as it is, and no byte is copied). True if made; False where no
    clone can be had (not macOS, another filesystem or volume): the caller copies. FileExistsError if `name`
    exists."""
    if _fclonefileat is None:
        return False
    if _fclonefileat(src, folder_fd, os.fsencode(name), _CLONE_FLAGS) == 0:
        return True
    import ctypes

    code = ctypes.get_errno()
    if code == errno.EEXIST:
        raise FileExistsError(code, os.strerror(code), name)
    return False  # ENOTSUP, EXDEV, EINVAL (an older macOS's flags), ...: a copy does instead


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def materialise(manifest: Manifest, store: BlobStore, dest: PathLike) -> None:
    """Build the job's folder `dest` (which must not exist) from the manifest, copying from the store.

    The folder is built beside `dest` and renamed into place when complete: a failure (a blob the
    store lacks, a bad path) leaves nothing. Every path is checked again, and every folder is opened
    relative to its parent without following symlinks, so no entry lands outside `dest`.
    Folders are 0700, files 0600 (0700 when executable).
    """
    Builder(manifest, store, lambda: [Path(dest)]).finish()


class Builder:
    """Job folders (`materialise`'s: those `dests()` names, asked for at the first use) built while an upload
    comes in, on the upload's disk thread: `first(digest)` says where the upload writes a blob (its first file
    in the job's folder), `stored(digest)` places the blob's other files once it is stored; `finish` places
    the rest and renames each folder into place; `abort` leaves nothing of them.

    Off macOS, the first file of a blob this upload stored is the very file the store links to: those bytes
    are written once. Every other file is a copy (on APFS a clone, which shares the blob's blocks until either
    is written), so no two files of the jobs share their bytes (a job that writes into its own first file
    changes the blob, which the store then counts as missing). Not thread-safe: one thread at a time (the
    disk thread, then the one that calls `finish`).
    """

    def __init__(self, manifest: Manifest, store: BlobStore, dests: Callable[[], list[Path]]):
        self.manifest = manifest
        self.store = store
        self._dests = dests
        self.dests: list[Path] = []  # once asked for
        self._partials: list[Path] = []
        self._walkers: list[_Folders] = []
        self._waiting: dict[str, list[Entry]] | None = None  # digest -> its entries not placed yet, in path order
        self._written: dict[str, Entry] = {}  # digest -> the entry an upload writes it as, in the first folder only

    def _prepare(self) -> dict[str, list[Entry]]:
        """Check the manifest again and the folders to build (at the first use: on the thread that builds)."""
        if self._waiting is None:
            self.dests = self._dests()
            self._partials = [dest.with_name(f".{dest.name}.partial-{secrets.token_hex(6)}") for dest in self.dests]
            for dest in self.dests:
                if dest.exists() or dest.is_symlink():
                    raise FolderError(f"the job's folder {dest} exists already")
            entries = sorted(self.manifest.entries, key=lambda e: e.path)
            for e in entries:
                check_parts(e.path, strict=True)
                if not is_digest(e.digest):
                    raise FolderError(f"{e.path!r} has no valid digest")
            _check_tree(entries)
            self._waiting = {}
            for e in entries:
                self._waiting.setdefault(e.digest, []).append(e)
        return self._waiting

    def first(self, digest: str) -> Place | None:
        """Where this upload writes the blob `digest`: as its first file in the (first) job's folder, which then
        needs no copy (ADR 0027); None on macOS, where that file is a clone of the stored blob. Its folder stays
        open until this builder's next call."""
        entries = self._prepare().get(digest)
        if _fclonefileat is not None or not entries:
            return None
        entry = self._written[digest] = entries.pop(0)
        *folders, name = entry.path.split("/")
        return Place(self._folders()[0].open(folders), name, 0o700 if entry.executable else 0o600)

    def stored(self, digest: str) -> None:
        """This upload stored the blob `digest`: place its files still to place (copies), the one it was written as
        in the other folders (an array's) too."""
        entries = self._prepare().pop(digest, [])
        written = self._written.pop(digest, None)
        if written is not None:
            self._place([written], self._folders()[1:])
        self._place(entries)

    def finish(self) -> None:
        """Place every file not placed yet (its blob was in the store already), then move each folder into place."""
        try:
            waiting = self._prepare()
            self._place(sorted((e for entries in waiting.values() for e in entries), key=lambda e: e.path))
            waiting.clear()
            self.close()
            for partial_dir, dest in zip(self._partials, self.dests):
                os.rename(partial_dir, dest)
        except BaseException:
            self.abort()
            raise

    def close(self) -> None:
        """Close the folders it holds open (what it built stays)."""
        for walker in self._walkers:
            walker.close()

    def abort(self) -> None:
        """Remove what was built."""
        self.close()
        for partial_dir in self._partials:
            shutil.rmtree(partial_dir, ignore_errors=True)

    def _folders(self) -> list[_Folders]:
        """The open folders of each job's folder being built (made at the first use)."""
        if not self._walkers:
            for partial_dir in self._partials:
                os.mkdir(partial_dir, 0o700)
                self._walkers.append(_Folders(partial_dir))
        return self._walkers

    def _place(self, entries: list[Entry], walkers: list[_Folders] | None = None) -> None:
        """Place the entries in every folder (or those of `walkers`), as copies of the store's blobs."""
        try:
            walkers = self._folders() if walkers is None else walkers
            for e in entries:
                *folders, name = e.path.split("/")
                for walker in walkers:
                    _place(self.store, e, name, walker.open(folders))
        except BaseException:
            self.abort()
            raise


class _Folders:
    """The open folders of the last path placed under `root`, each opened relative to its parent without
    following symlinks (and made, 0700, where missing); the next path reuses what it shares with it."""

    def __init__(self, root: Path):
        self._opened: list[tuple[str, int]] = [("", os.open(root, _DIR_FLAGS))]

    def open(self, folders: list[str]) -> int:
        """The descriptor of the folder `folders` (names from the root)."""
        opened, depth = self._opened, 0
        while depth < len(folders) and depth + 1 < len(opened) and opened[depth + 1][0] == folders[depth]:
            depth += 1
        while len(opened) > depth + 1:
            os.close(opened.pop()[1])
        for folder in folders[depth:]:
            parent = opened[-1][1]
            try:
                os.mkdir(folder, 0o700, dir_fd=parent)
            except FileExistsError:
                pass
            opened.append((folder, os.open(folder, _DIR_FLAGS, dir_fd=parent)))
        return opened[-1][1]

    def close(self) -> None:
        while self._opened:
            os.close(self._opened.pop()[1])


def _place(store: BlobStore, entry: Entry, name: str, folder_fd: int) -> None:
    """Clone (`clone_file`) or copy one blob into the open folder as `name`, refusing a name that exists already,
    and a blob that is not intact before or after (a job wrote into the file it is)."""
    try:
        src = os.open(store.blob_path(entry.digest), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise FolderError(f"{entry.path}: the store lacks its blob {entry.digest[:16]} (not uploaded, or pruned)") \
            from None
    except PermissionError:  # a job made its linked file unreadable
        raise _not_intact(entry) from None
    try:
        _check_intact(store, entry, src)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        mode = 0o700 if entry.executable else 0o600
        try:
            if clone_file(src, folder_fd, name):
                os.chmod(name, mode, dir_fd=folder_fd)  # the clone has the blob's 0600
            else:
                dst = os.open(name, flags, mode, dir_fd=folder_fd)
                try:
                    copy_fd(src, dst, entry.size)
                finally:
                    os.close(dst)
        except FileExistsError:
            raise FolderError(f"{entry.path} comes twice in the manifest") from None
        _check_intact(store, entry, src)
    finally:
        os.close(src)


def _check_intact(store: BlobStore, entry: Entry, src: int) -> None:
    if not store.intact(entry.digest, entry.size, os.fstat(src)):
        raise _not_intact(entry)


def _not_intact(entry: Entry) -> FolderError:
    return FolderError(f"{entry.path}: the peer has no intact blob {entry.digest[:16]} of {entry.size} bytes (a job "
                       "wrote into its file since it was stored?): submit again, and it is sent anew")


def resolve_inside(root: PathLike, relpath: str) -> Path:
    """The real path of `relpath` inside the folder `root`; FolderError for an absolute path, a `..`,
    or a path that leaves `root` through a symlink. `"."` (or `""`) is the folder itself."""
    pure = check_relpath(relpath)
    real_root = os.path.realpath(root)
    target = os.path.realpath(os.path.join(real_root, *pure.parts))
    if not _inside(target, real_root):
        raise FolderError(f"{relpath!r} leads out of the job's folder (through a symlink, to {target})")
    return Path(target)


def files_under(root: PathLike, relpaths: Iterable[str]) -> list[str]:
    """The regular files that `relpaths` name in `root`, sorted, each checked by `resolve_inside`.

    A file is given as named (normalised: a symlink inside the folder keeps the link's name); a folder
    stands for every file under it, by the path of its real location, symlinks in it followed only
    while they stay inside `root` (FolderError otherwise)."""
    real_root = os.path.realpath(root)
    found: set[str] = set()
    for relpath in relpaths:
        target = str(resolve_inside(real_root, relpath))
        if os.path.isfile(target):
            found.add(str(check_relpath(relpath)))
        elif os.path.isdir(target):
            found.update(rel for rel, _, _ in _walk(real_root, None, target))
        else:
            raise FolderError(f"{relpath!r}: no such file in the job's folder")
    return sorted(found)


def changed_files(folder: PathLike, manifest: Manifest) -> list[str]:
    """What the job created or changed in its folder: regular files (not symlinks) absent from the
    manifest, or of another size or content; sorted relative posix paths. `.git` is left out."""
    shipped = {e.path: e for e in manifest.entries}
    real_root = os.path.realpath(folder)
    changed = []
    for dirpath, dirnames, filenames in os.walk(real_root):
        dirnames[:] = [d for d in dirnames if d != NEVER_SHIPPED]
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue
            rel = os.path.relpath(path, real_root).replace(os.sep, "/")
            entry = shipped.get(rel)
            if entry is None or entry.size != st.st_size or hash_file(path) != entry.digest:
                changed.append(rel)
    return sorted(changed)


def disk_usage(path: PathLike) -> int:
    """Bytes a job's folder takes on disk (its files' allocated blocks; symlinks not followed)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total
