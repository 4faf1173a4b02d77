"""Unit tests of gpulayer.jobs.folder (issue 27): a job's working folder, on real files in temp folders.

What ships (git's ignore rules, root and nested; --exclude; never .git; symlinks inside copied, out of
the folder refused; the size limit before anything is hashed; the digest cache), the peer's blob store
(a truncated, overlong or wrong upload leaves nothing), the job's folder rebuilt from it (hostile
manifests: `..`, absolute, duplicates, a file as a folder), what a job changed, and fetch's path checks.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from blake3 import blake3

from gpulayer.errors import ConfigError
from gpulayer.jobs import folder
from gpulayer.jobs.folder import (BlobStore, DigestCache, Entry, FolderError, FolderTooLarge, Manifest,
                                  changed_files, files_under, materialise, resolve_inside, scan)


def write(root: Path, rel: str, data: bytes | str = b"x", mode: int | None = None) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    if mode is not None:
        path.chmod(mode)
    return path


def sha(data: bytes) -> str:
    """The content digest, computed here by the library (BLAKE3), not by the code under test."""
    return blake3(data).hexdigest()


def paths(manifest: Manifest) -> list[str]:
    return [e.path for e in manifest.entries]


def memory_scan(root: Path, **kwargs) -> Manifest:
    return scan(root, cache=DigestCache(None), **kwargs)


@pytest.fixture
def project(tmp_path) -> Path:
    """A training project: a script, a local package, data, checkpoints and a virtualenv to leave out."""
    root = tmp_path / "project"
    write(root, "train.py", "print('hi')\n", mode=0o755)
    write(root, "pkg/__init__.py", "")
    write(root, "pkg/model.py", "W = 1\n")
    write(root, "data/train.csv", "a,b\n1,2\n")
    write(root, "data/big.bin", b"\0" * 5000)
    write(root, "ckpt/old.pt", b"old")
    write(root, "notes.log", "log")
    write(root, ".gitignore", "*.log\nckpt/\n/data/big.bin\n.venv/\n")
    write(root, ".venv/bin/python", "#!")
    write(root, ".git/HEAD", "ref: refs/heads/main\n")
    write(root, ".git/config", "[core]\n")
    return root


def test_scan_honours_gitignore_and_never_ships_git(project):
    manifest = memory_scan(project)
    assert paths(manifest) == [".gitignore", "data/train.csv", "pkg/__init__.py", "pkg/model.py", "train.py"]
    train = next(e for e in manifest.entries if e.path == "train.py")
    assert train == Entry("train.py", len("print('hi')\n"), True, sha(b"print('hi')\n"))
    assert not next(e for e in manifest.entries if e.path == "pkg/model.py").executable
    assert manifest.total_bytes == sum((project / p).stat().st_size for p in paths(manifest))


def test_nested_gitignore_follows_git_rules(tmp_path):
    root = tmp_path / "r"
    write(root, ".gitignore", "*.tmp\n")
    write(root, "a/.gitignore", "!keep.tmp\nlocal.txt\n/anchored.txt\n")
    for rel in ("x.tmp", "a/x.tmp", "a/keep.tmp", "keep.tmp", "a/local.txt", "a/b/local.txt", "local.txt",
                "a/anchored.txt", "a/b/anchored.txt", "anchored.txt"):
        write(root, rel, rel)
    # a deeper file wins over a shallower one; its patterns are relative to its own folder
    assert paths(memory_scan(root)) == [".gitignore", "a/.gitignore", "a/b/anchored.txt", "a/keep.tmp",
                                        "anchored.txt", "local.txt"]


def test_ignored_folder_is_not_entered(tmp_path):
    root = tmp_path / "r"
    write(root, ".gitignore", "build/\n!build/keep.txt\n")
    write(root, "build/keep.txt", "k")
    write(root, "build/out.o", "o")
    write(root, "src/build/x", "x")
    # git: a file inside an excluded folder cannot be taken back; `build/` matches at any depth
    assert paths(memory_scan(root)) == [".gitignore"]


def test_excludes_win_over_gitignore(project):
    manifest = memory_scan(project, excludes=["pkg/", "!notes.log"])
    assert paths(manifest) == [".gitignore", "data/train.csv", "notes.log", "train.py"]


def test_symlink_inside_ships_as_a_copy_and_dangling_ships_nothing(tmp_path):
    root = tmp_path / "r"
    write(root, "data/real.csv", "1,2\n")
    (root / "latest.csv").symlink_to("data/real.csv")
    (root / "alias").symlink_to("data")
    (root / ".#lock").symlink_to("user@host.123")  # an editor's lock file: dangling
    manifest = memory_scan(root)
    assert paths(manifest) == ["alias/real.csv", "data/real.csv", "latest.csv"]
    assert len(manifest.blobs()) == 1
    assert manifest.sources["latest.csv"] == str((root / "data/real.csv").resolve())


@pytest.mark.parametrize("target", ["/etc/passwd", "/etc", "../../outside.txt", "../.."])
def test_symlink_out_of_the_folder_is_refused_by_name(tmp_path, target):
    write(tmp_path, "outside.txt", "secret")
    root = tmp_path / "r"
    write(root, "ok.py", "")
    (root / "sub").mkdir()
    (root / "sub" / "escape").symlink_to(target)
    with pytest.raises(FolderError, match=r"sub/escape is a symlink to .*outside the folder"):
        memory_scan(root)
    # left out by an ignore pattern, it is not looked at
    assert paths(memory_scan(root, excludes=["sub/escape"])) == ["ok.py"]


def test_symlink_loop_is_refused(tmp_path):
    root = tmp_path / "r"
    write(root, "a/f", "f")
    (root / "a" / "up").symlink_to("..")
    with pytest.raises(FolderError, match="a loop"):
        memory_scan(root)


def test_over_the_limit_is_refused_before_hashing(tmp_path, monkeypatch):
    root = tmp_path / "r"
    write(root, "big.bin", b"\1" * (3 << 20))
    write(root, "small.py", "")
    hashed = []
    monkeypatch.setattr(folder, "hash_file", lambda path: hashed.append(path) or "0" * 64)
    with pytest.raises(FolderTooLarge, match=r"3\.0 MiB to ship, over the limit of 2 MiB.*big\.bin \(3\.0 MiB\)"):
        memory_scan(root, limit_bytes=2 << 20)
    monkeypatch.setenv("GPULAYER_JOB_FOLDER_LIMIT_MB", "2")
    with pytest.raises(FolderTooLarge, match="GPULAYER_JOB_FOLDER_LIMIT_MB"):
        memory_scan(root)
    assert hashed == []
    monkeypatch.setenv("GPULAYER_JOB_FOLDER_LIMIT_MB", "lots")
    with pytest.raises(ConfigError, match="GPULAYER_JOB_FOLDER_LIMIT_MB"):
        memory_scan(root)


def test_unchanged_rescan_hashes_nothing(project, tmp_path):
    first = scan(project)
    assert first.hashed_bytes == first.total_bytes > 0
    again = scan(project)
    assert again == first and again.hashed_bytes == 0
    write(project, "pkg/model.py", "W = 2\n")  # same size, new mtime
    third = scan(project)
    assert third.hashed_bytes == len("W = 2\n")
    assert dict((e.path, e.digest) for e in third.entries)["pkg/model.py"] == sha(b"W = 2\n")
    cache_files = list((Path(os.environ["XDG_CACHE_HOME"]) / "gpulayer" / "digests").iterdir())
    assert cache_files and all(f.stat().st_mode & 0o077 == 0 for f in cache_files)


def test_one_cache_object_serves_many_scans(project):
    cache = DigestCache(None)
    assert scan(project, cache=cache).hashed_bytes > 0
    assert scan(project, cache=cache).hashed_bytes == 0


# --- the ignore rules' decisions, remembered by the digest cache ---------------------------------


def count_compiles(monkeypatch) -> list[list[str]]:
    """The lines of every ignore spec pathspec compiles from now on."""
    import pathspec

    compiled: list[list[str]] = []
    original = pathspec.GitIgnoreSpec.from_lines.__func__

    def counting(cls, lines, *args, **kwargs):
        compiled.append(list(lines))
        return original(cls, lines, *args, **kwargs)

    monkeypatch.setattr(pathspec.GitIgnoreSpec, "from_lines", classmethod(counting))
    return compiled


def remembered_scan(root: Path, cache_file: Path, excludes: tuple[str, ...] = ()) -> list[str]:
    """The paths a scan ships with the decisions remembered in `cache_file` (read afresh, as a new process
    would), checked against pathspec's own (a cache that remembers nothing)."""
    remembered = paths(scan(root, excludes, cache=DigestCache(cache_file)))
    assert remembered == paths(memory_scan(root, excludes=excludes))
    return remembered


def test_remembered_decisions_are_pathspecs_as_the_folder_changes(tmp_path, monkeypatch):
    root, cache_file = tmp_path / "r", tmp_path / "cache.json"
    write(root, ".gitignore", "*.log\nbuild/\n!keep.log\n/data/*.bin\n")
    write(root, "sub/.gitignore", "*.tmp\n!important.tmp\ncache/\n")
    for rel in ("a.py", "x.log", "keep.log", "build/out.o", "data/a.bin", "data/a.csv", "sub/t.tmp",
                "sub/important.tmp", "sub/cache/c", "sub/deep/x.log", "sub/deep/y.py", "sub/data/a.bin"):
        write(root, rel, rel)
    first = remembered_scan(root, cache_file)
    assert first == [".gitignore", "a.py", "data/a.csv", "keep.log", "sub/.gitignore", "sub/data/a.bin",
                     "sub/deep/y.py", "sub/important.tmp"]
    compiled = count_compiles(monkeypatch)
    assert paths(scan(root, cache=DigestCache(cache_file))) == first
    assert compiled == []  # unchanged: every decision remembered, no spec compiled
    (root / "sub/t.tmp").rename(root / "sub/t.txt")  # a file renamed: a new path, decided by pathspec
    assert "sub/t.txt" in remembered_scan(root, cache_file) and compiled
    (root / "a.py").rename(root / "a.log")  # renamed to an ignored name
    assert "a.log" not in remembered_scan(root, cache_file)
    write(root, "sub/.gitignore", "*.tmp\n!important.tmp\ncache/\n!x.log\n")  # a negation added below
    assert "sub/deep/x.log" in remembered_scan(root, cache_file)
    write(root, "sub/deep/.gitignore", "*\n!y.py\n")  # a new ignore file deeper down
    assert [p for p in remembered_scan(root, cache_file) if p.startswith("sub/deep/")] == ["sub/deep/y.py"]
    (root / "data/a.csv").unlink()
    write(root, "data/a.csv/inner.txt", "a folder now")  # a file become a folder of the same name
    write(root, "data/b.bin/inner.txt", "a folder that /data/*.bin leaves out")
    shipped = remembered_scan(root, cache_file)
    assert "data/a.csv/inner.txt" in shipped and "data/b.bin/inner.txt" not in shipped
    assert "build/out.o" in remembered_scan(root, cache_file, ("!build/",))  # an exclude takes it back,
    assert "build/out.o" not in remembered_scan(root, cache_file)  # and without it, not
    (root / ".gitignore").unlink()  # the root's rules gone: what they left out ships
    assert {"build/out.o", "x.log", "data/a.bin"} <= set(remembered_scan(root, cache_file))
    write(root, ".gitignore", "sub/\n")
    assert [p for p in remembered_scan(root, cache_file) if p.startswith("sub")] == []
    compiled.clear()
    remembered_scan(root, cache_file)  # the reference scan compiles, the remembered one does not
    assert len(compiled) == 1


def replace(root: Path, rel: str, data: str) -> None:
    """Write the file `rel`, whatever was there or in its way (a folder of that name, a file as a folder)."""
    path = root / rel
    for parent in reversed(path.relative_to(root).parents):
        if (root / parent).is_file():
            (root / parent).unlink()
    if path.is_dir():
        shutil.rmtree(path)
    write(root, rel, data)


@pytest.mark.parametrize("seed", range(3))
def test_remembered_decisions_are_pathspecs_under_random_changes(tmp_path, seed):
    rng = random.Random(seed)
    root, cache_file = tmp_path / "r", tmp_path / "cache.json"
    folders, names = ["", "a/", "a/b/", "c/"], ["x.py", "y.log", "z.tmp", "keep.log", "b", "c"]
    patterns = ["*.log", "!keep.log", "*.tmp", "b/", "/c", "a/**/x.py", "!*.py", "z.*", "!b/", "**/b/x.py"]
    for _ in range(40):  # ignore files written and removed, files become folders and back
        where = rng.choice(folders)
        if rng.random() < 0.3:
            replace(root, where + ".gitignore", "\n".join(rng.sample(patterns, rng.randint(0, 3))) + "\n")
        elif rng.random() < 0.2:
            (root / where / ".gitignore").unlink(missing_ok=True)
        else:
            replace(root, where + rng.choice(names) + ("/f" if rng.random() < 0.3 else ""), "x")
        remembered_scan(root, cache_file, tuple(rng.sample(patterns, rng.randint(0, 1))))


def test_a_rescan_of_an_unchanged_folder_does_not_import_pathspec(project):
    first = scan(project)
    code = (f"import json, sys; from gpulayer.jobs.folder import scan; m = scan({str(project)!r}); "
            "print(json.dumps([[e.path, e.digest] for e in m.entries])); print('pathspec' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    listing, imported = out.stdout.splitlines()
    assert json.loads(listing) == [[e.path, e.digest] for e in first.entries]
    assert imported == "False"


def test_not_a_folder(tmp_path):
    with pytest.raises(FolderError, match="is not a folder"):
        memory_scan(tmp_path / "nope")


# --- the manifest from the wire -----------------------------------------------------------------

GOOD = sha(b"x")


@pytest.mark.parametrize("path, problem", [
    ("../../etc/passwd", "goes up"), ("/etc/passwd", "absolute"), ("a/../../b", "goes up"),
    ("./a", "normalised"), ("a//b", "normalised"), ("", "normalised"), ("a/", "normalised"),
    (".git/hooks/pre-commit", "never shipped"), ("a\x00b", "not a path"), ("x" * 256, "normalised"),
])
def test_manifest_from_wire_refuses_bad_paths(path, problem):
    with pytest.raises(FolderError, match=problem):
        Manifest.from_wire([[path, 1, False, GOOD]])


@pytest.mark.parametrize("value, problem", [
    ([["a", 1, False, GOOD], ["a", 1, False, GOOD]], "twice"),
    ([["a", 1, False, GOOD], ["a/b", 1, False, GOOD]], "needs it as a folder"),
    ([["a", -1, False, GOOD]], "entry is"),
    ([["a", 1, 1, GOOD]], "entry is"),
    ([["a", 1, False, "ab" * 16]], "entry is"),
    ([["a", 1, False, GOOD.upper()]], "entry is"),
    ({"a": 1}, "a list"),
    ([["a", 3 << 20, False, GOOD]], "over this side's limit"),
])
def test_manifest_from_wire_refuses_bad_entries(value, problem):
    with pytest.raises(FolderError, match=problem):
        Manifest.from_wire(value, limit_bytes=2 << 20)


def test_manifest_round_trip(project):
    manifest = memory_scan(project)
    assert Manifest.from_wire(manifest.to_wire()) == manifest


# --- the blob store --------------------------------------------------------------------------


def test_blob_store_keeps_verified_blobs_only(tmp_path):
    store = BlobStore(tmp_path / "store")
    data = os.urandom(3 << 20)
    digest = sha(data)
    assert store.missing({digest: len(data), GOOD: 1}) == [digest, GOOD]
    with store.writer(digest, len(data)) as w:
        for i in range(0, len(data), 1 << 20):
            w.write(memoryview(data)[i:i + (1 << 20)])
        w.commit()
    stored = store.path(digest)
    assert stored.read_bytes() == data and stored.stat().st_mode & 0o077 == 0
    assert store.missing({digest: len(data), GOOD: 1}) == [GOOD]
    assert store.missing({digest: len(data) - 1}) == [digest]  # another size: not this blob
    assert store.total_bytes() == len(data)
    assert (tmp_path / "store").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("upload, problem", [
    (lambda w, data: w.write(data[:-1]), "truncated"),
    (lambda w, data: w.write(data[:-1] + b"?"), "does not match its digest"),
])
def test_truncated_or_wrong_upload_leaves_nothing(tmp_path, upload, problem):
    store = BlobStore(tmp_path / "store")
    data = b"checkpoint" * 1000
    with store.writer(sha(data), len(data)) as w:
        upload(w, data)
        with pytest.raises(FolderError, match=problem):
            w.commit()
    assert store.missing({sha(data): len(data)}) == [sha(data)]
    assert sorted((tmp_path / "store").rglob("*")) == [tmp_path / "store" / "index", tmp_path / "store" / "tmp"]
    assert (tmp_path / "store" / "index").read_bytes() == b""


def test_overlong_upload_is_refused_at_once(tmp_path):
    store = BlobStore(tmp_path / "store")
    w = store.writer(GOOD, 1)
    with pytest.raises(FolderError, match="more than the 1 bytes"):
        w.write(b"xy")
    with pytest.raises(FolderError, match="closed"):
        w.commit()
    assert list((tmp_path / "store" / "tmp").iterdir()) == []


@pytest.mark.parametrize("digest", ["../../etc/passwd", "AB" * 32, "a" * 63])
def test_store_refuses_what_is_not_a_digest(tmp_path, digest):
    store = BlobStore(tmp_path / "store")
    with pytest.raises(FolderError, match="not a blake3 digest"):
        store.writer(digest, 1)


def test_prune_frees_what_no_job_keeps(tmp_path):
    store = BlobStore(tmp_path / "store")
    for data in (b"a", b"bb", b"ccc"):
        with store.writer(sha(data), len(data)) as w:
            w.write(data)
            w.commit()
    assert store.prune({sha(b"bb")}) == 4
    assert sorted(store.blobs()) == [(sha(b"bb"), 2)]


def upload_all(manifest: Manifest, store: BlobStore) -> None:
    sources = manifest.source_of()
    for digest in store.missing(manifest.blobs()):
        with store.writer(digest, manifest.blobs()[digest]) as w:
            w.write(Path(sources[digest]).read_bytes())
            w.commit()


# --- the job's folder ------------------------------------------------------------------------


def _materialised(project: Path, tmp_path: Path) -> tuple[Manifest, BlobStore, Path]:
    """The project uploaded to a new store and built into a job's folder; checked: every file's bytes and mode."""
    manifest = memory_scan(project)
    store = BlobStore(tmp_path / "store")
    upload_all(manifest, store)
    job = tmp_path / "jobs" / "j1"
    job.parent.mkdir()
    materialise(manifest, store, job)
    for e in manifest.entries:
        assert (job / e.path).read_bytes() == (project / e.path).read_bytes()
        assert (job / e.path).stat().st_mode & 0o777 == (0o700 if e.executable else 0o600)
    return manifest, store, job


def test_materialise_rebuilds_the_folder_as_copies(project, tmp_path):
    manifest, store, job = _materialised(project, tmp_path)  # on macOS, of clones (the test below)
    assert os.access(job / "train.py", os.X_OK) and job.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in job.parent.iterdir()) == ["j1"]
    (job / "pkg/model.py").write_text("changed by the job")  # the store is not touched
    assert store.path(sha(b"W = 1\n")).read_bytes() == b"W = 1\n"
    with pytest.raises(FolderError, match="exists already"):
        materialise(manifest, store, job)


def test_where_no_clone_can_be_made_each_file_is_copied(project, tmp_path, monkeypatch):
    """macOS's fclonefileat(2) refuses on another filesystem or volume (ENOTSUP, EXDEV): the file is copied
    instead. (On Linux there is no clone call: copy_file_range makes a reflink itself where it can.)"""
    import ctypes
    import errno

    tried = []

    def refused(src: int, folder_fd: int, name: bytes, flags: int) -> int:
        tried.append(name.decode())
        ctypes.set_errno(errno.ENOTSUP)
        return -1

    monkeypatch.setattr(folder, "_fclonefileat", refused)
    manifest, _, _ = _materialised(project, tmp_path)
    assert sorted(tried) == sorted(e.path.rsplit("/", 1)[-1] for e in manifest.entries)


@pytest.mark.skipif(sys.platform != "darwin", reason="macos only: APFS clones (fclonefileat)")
def test_on_macos_a_jobs_files_are_clones_of_the_stores_blobs(project, tmp_path, monkeypatch):
    """On APFS (a Mac's temporary folder) every file of the job's folder is a clone; that a job writing into one
    leaves the store's blob as it was is test_materialise_rebuilds_the_folder_as_copies's to check."""
    made = []
    clone = folder.clone_file
    monkeypatch.setattr(folder, "clone_file", lambda *args: made.append(clone(*args)) or made[-1])
    manifest, _, _ = _materialised(project, tmp_path)
    assert made == [True] * len(manifest.entries)


def _built_while_uploaded(manifest: Manifest, store: BlobStore, dests: list[Path]) -> None:
    """The folders built as a peer builds them during an upload: each blob written as its first file (a large
    blob's way, in pieces; and a small one's, whole), its other files placed as soon as it is stored."""
    builder = folder.Builder(manifest, store, lambda: dests)
    sources = manifest.source_of()
    for n, digest in enumerate(store.missing(manifest.blobs())):
        data = Path(sources[digest]).read_bytes()
        if n % 2:
            store.put(digest, memoryview(data), builder.first(digest))
        else:
            with store.writer(digest, len(data), at=builder.first(digest)) as w:
                w.write(data)
                w.commit()
        builder.stored(digest)
    builder.finish()


def test_a_blob_received_for_a_job_is_that_jobs_file_and_every_other_file_a_copy(project, tmp_path):
    """Its bytes are written once (ADRs 0025, 0027): the first job's file is the stored blob itself (written there,
    the store's entry a hard link to it; on macOS an APFS clone of it instead); a second folder of the same upload
    (an array's), and a second file of the same content, get copies."""
    write(project, "pkg/empty_too.py", "")  # the same content as pkg/__init__.py
    manifest = memory_scan(project)
    store = BlobStore(tmp_path / "store")
    first, second = tmp_path / "j1", tmp_path / "j2"
    _built_while_uploaded(manifest, store, [first, second])
    blob = store.path(sha(b"W = 1\n")).stat()
    if sys.platform != "darwin":
        assert (first / "pkg/model.py").stat().st_ino == blob.st_ino and blob.st_nlink == 2
    assert (second / "pkg/model.py").stat().st_ino != blob.st_ino
    inodes = {(first / name).stat().st_ino for name in ("pkg/__init__.py", "pkg/empty_too.py")}
    assert len(inodes) == 2
    for job in (first, second):
        for e in manifest.entries:
            assert (job / e.path).read_bytes() == (project / e.path).read_bytes()
            assert (job / e.path).stat().st_mode & 0o777 == (0o700 if e.executable else 0o600)
    assert store.missing(manifest.blobs()) == []  # a resubmit sends nothing


@pytest.mark.parametrize("entered", [(0, 1), (1, 0)], ids=["in-turn", "the-second-first"])
def test_two_uploads_of_the_same_content_never_share_a_file(tmp_path, entered):
    """Two submits of one new folder at once each write the blob as their own job's file; whichever the store takes
    last is its blob, the other job's file stays that job's alone (neither job's writes reach the other's), and the
    index names the file the store has."""
    data = b"W = 1\n"
    manifest = Manifest((Entry("model.py", len(data), False, sha(data)),))
    store = BlobStore(tmp_path / "store")
    builders = [folder.Builder(manifest, store, lambda name=name: [tmp_path / name]) for name in ("first", "second")]
    writers = [store.writer(sha(data), len(data), at=builder.first(sha(data))) for builder in builders]
    for w in writers:
        w.write(data)
    for n in entered:
        writers[n].commit()
    for builder in builders:
        builder.stored(sha(data))
        builder.finish()
    first, second = (os.stat(tmp_path / name / "model.py") for name in ("first", "second"))
    assert first.st_ino != second.st_ino
    assert (tmp_path / "first" / "model.py").read_bytes() == (tmp_path / "second" / "model.py").read_bytes() == data
    if sys.platform != "darwin":  # there both are clones of the store's own file
        last = (first, second)[entered[-1]]
        assert store.path(sha(data)).stat().st_ino == last.st_ino and last.st_nlink == 2
        assert (first, second)[entered[0]].st_nlink == 1
    assert store.missing(manifest.blobs()) == []


@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS a job's files are clones, never links to the store")
def test_without_hard_links_the_store_keeps_a_copy_of_the_jobs_file(project, tmp_path, monkeypatch):
    """On a filesystem without hard links (EPERM from link(2): some FUSE and FAT ones), an upload still writes each
    blob as its job's file, and the store gets a copy of its own: a job writing into its file leaves the blob
    intact."""
    def no_links(*args, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    manifest = memory_scan(project)
    store = BlobStore(tmp_path / "store")
    _built_while_uploaded(manifest, store, [tmp_path / "j1"])
    (tmp_path / "j1" / "pkg/model.py").write_text("W = 2\n")
    assert store.missing(manifest.blobs()) == [] and store.path(sha(b"W = 1\n")).read_text() == "W = 1\n"
    for e in manifest.entries:
        assert store.path(e.digest).stat().st_nlink == 1
    assert list((tmp_path / "store" / "tmp").iterdir()) == []


def _write_mapped(path: Path, data: bytes) -> None:
    """Write `data` over the file's start through a shared memory map, as numpy.memmap or torch's mmap'd tensors do
    (the store relies on the kernel giving such a write a new mtime too)."""
    import mmap

    with open(path, "r+b") as f, mmap.mmap(f.fileno(), len(data)) as mapped:
        mapped[:] = data


@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS a job's files are clones, never links to the store")
@pytest.mark.parametrize("change", [
    lambda path, other: path.write_text("W = 2\n"),  # same size, new bytes
    lambda path, other: (path.write_text("W = 2\n"), os.utime(path, ns=(other.st_atime_ns, other.st_mtime_ns))),
    lambda path, other: path.open("a").write("# more\n"),
    lambda path, other: _write_mapped(path, b"W = 2\n"),
    lambda path, other: path.chmod(0o200),
], ids=["rewritten", "rewritten-and-another-blobs-mtime-copied-onto-it", "appended", "written-through-mmap",
        "made-unreadable"])
def test_a_blob_a_job_wrote_into_is_missing_from_then_on(project, tmp_path, change):
    """The job's file is the blob: written to (even with `cp -p` giving it another blob's mtime, as a job could) or
    made unreadable, it counts as missing, so the next submit sends it again; a copy out of it is refused."""
    manifest = memory_scan(project)
    store = BlobStore(tmp_path / "store")
    job = tmp_path / "j1"
    _built_while_uploaded(manifest, store, [job])
    digest = sha(b"W = 1\n")
    change(job / "pkg/model.py", (job / "train.py").stat())
    assert store.missing(manifest.blobs()) == [digest]
    with pytest.raises(FolderError, match="pkg/model.py: the peer has no intact blob"):
        materialise(manifest, store, tmp_path / "j2")
    assert not (tmp_path / "j2").exists()
    _built_while_uploaded(manifest, store, [tmp_path / "j3"])  # sent again: stored anew, and that job's own
    assert (tmp_path / "j3" / "pkg/model.py").read_text() == "W = 1\n"
    assert (job / "pkg/model.py").stat().st_ino != store.path(digest).stat().st_ino  # the first job's is its own


def test_a_blob_written_to_while_it_is_copied_is_refused(project, tmp_path, monkeypatch):
    manifest = memory_scan(project)
    store = BlobStore(tmp_path / "store")
    _built_while_uploaded(manifest, store, [tmp_path / "j1"])
    copy = folder.copy_fd

    def copy_while_a_job_writes(src: int, dst: int, size: int) -> None:
        copy(src, dst, size)
        os.utime(src, ns=(1, 1))  # what a write into the blob's file does to it (its mtime)

    monkeypatch.setattr(folder, "copy_fd", copy_while_a_job_writes)
    monkeypatch.setattr(folder, "_fclonefileat", None)  # a copy, on macOS too
    with pytest.raises(FolderError, match="no intact blob"):
        materialise(manifest, store, tmp_path / "j2")
    assert not (tmp_path / "j2").exists()


def test_a_store_opened_again_knows_its_blobs_and_recover_drops_the_rest(project, tmp_path):
    """The index outlives the peer: intact blobs are still there for a resubmit. `recover` (at the peer's start)
    removes a partial upload, a blob a job wrote into, and one the index never noted (a crash between the
    two, or an earlier release's store)."""
    manifest = memory_scan(project)
    store = BlobStore(tmp_path / "store")
    job = tmp_path / "j1"
    _built_while_uploaded(manifest, store, [job])
    store.close()
    store.path(sha(b"W = 1\n")).write_text("W = 2\n")  # as a job writes into it through its link
    write(tmp_path / "store", str(store.path(sha(b"unnoted")).relative_to(tmp_path / "store")), b"unnoted")
    partial = tmp_path / "store" / "tmp" / "half"
    partial.write_bytes(b"half")
    reopened = BlobStore(tmp_path / "store")
    assert reopened.missing({**manifest.blobs(), sha(b"unnoted"): 7}) == [sha(b"W = 1\n"), sha(b"unnoted")]
    reopened.recover()
    assert sorted(d for d, _ in reopened.blobs()) == sorted(set(manifest.blobs()) - {sha(b"W = 1\n")})
    assert not partial.exists() and (job / "pkg/model.py").exists()
    lines = (tmp_path / "store" / "index").read_text().splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(d for d, _ in reopened.blobs())
    assert (tmp_path / "store" / "index").stat().st_mode & 0o777 == 0o600
    reopened.close()
    assert BlobStore(tmp_path / "store").missing(manifest.blobs()) == [sha(b"W = 1\n")]


@pytest.mark.parametrize("entries, problem", [
    ([Entry("../evil", 1, False, GOOD)], "goes up"),
    ([Entry("/tmp/evil", 1, False, GOOD)], "absolute"),
    ([Entry("a", 1, False, GOOD), Entry("a", 1, False, GOOD)], "twice"),
    ([Entry("a", 1, False, GOOD), Entry("a/b", 1, False, GOOD)], "needs it as a folder"),
    ([Entry("ok", 1, False, GOOD), Entry("z/missing", 2, False, sha(b"zz"))], "lacks its blob"),
    ([Entry("short", 5, False, GOOD)], "no intact blob .* of 5 bytes"),
])
def test_materialise_refuses_hostile_manifests_and_leaves_nothing(tmp_path, entries, problem):
    store = BlobStore(tmp_path / "store")
    with store.writer(GOOD, 1) as w:
        w.write(b"x")
        w.commit()
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    with pytest.raises(FolderError, match=problem):
        materialise(Manifest(tuple(entries)), store, jobs / "j")
    assert list(jobs.iterdir()) == []
    assert not (tmp_path / "evil").exists() and not Path("/tmp/evil").exists()


def test_changed_files_are_what_the_job_made_or_changed(project, tmp_path):
    manifest = memory_scan(project)
    store = BlobStore(tmp_path / "store")
    upload_all(manifest, store)
    job = tmp_path / "job"
    materialise(manifest, store, job)
    assert changed_files(job, manifest) == []
    write(job, "ckpt/last.pt", b"weights")
    write(job, "pkg/model.py", "W = 9\n")  # same size, new content
    write(job, "data/train.csv", "longer,content\n")
    (job / "link.pt").symlink_to("ckpt/last.pt")
    write(job, ".git/index", "x")
    assert changed_files(job, manifest) == ["ckpt/last.pt", "data/train.csv", "pkg/model.py"]


# --- fetch's paths -------------------------------------------------------------------------------


@pytest.fixture
def job_folder(tmp_path) -> Path:
    job = tmp_path / "job"
    write(job, "ckpt/last.pt", b"w")
    write(job, "ckpt/epoch1.pt", b"e")
    (job / "ckpt" / "best.pt").symlink_to("last.pt")
    (job / "etc").symlink_to("/etc")
    (job / "up").symlink_to("..")
    write(tmp_path, "secret.txt", "s")
    return job


@pytest.mark.parametrize("relpath, problem", [
    ("../../etc/passwd", "goes up"), ("/etc/passwd", "absolute"), ("etc/passwd", "leads out"),
    ("etc", "leads out"), ("up/secret.txt", "leads out"), ("ckpt/../../secret.txt", "goes up"),
])
def test_resolve_inside_refuses_paths_that_leave(job_folder, relpath, problem):
    with pytest.raises(FolderError, match=problem):
        resolve_inside(job_folder, relpath)


def test_resolve_inside_allows_links_that_stay(job_folder):
    assert resolve_inside(job_folder, "ckpt/best.pt") == (job_folder / "ckpt/last.pt").resolve()
    assert resolve_inside(job_folder, "./ckpt//last.pt") == (job_folder / "ckpt/last.pt").resolve()
    assert resolve_inside(job_folder, ".") == job_folder.resolve()


def test_files_under_expands_folders_and_refuses_escapes(job_folder):
    assert files_under(job_folder, ["ckpt"]) == ["ckpt/best.pt", "ckpt/epoch1.pt", "ckpt/last.pt"]
    assert files_under(job_folder, ["ckpt/best.pt"]) == ["ckpt/best.pt"]
    with pytest.raises(FolderError, match="outside the folder"):
        files_under(job_folder, ["."])
    with pytest.raises(FolderError, match="no such file"):
        files_under(job_folder, ["ckpt/nope.pt"])
