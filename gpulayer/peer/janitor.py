"""The peer's deletions, off its event loop (docs/jobs.md, "Retention"): the folders of removed jobs and of
dropped uploads, and the blobs that no job needs any more.

The event loop decides and records (SQLite has one writer, the loop), then moves what goes into the state
folder's trash (`JobStore.discard`, one rename): a removed job is gone from `gpulayer jobs` and its folder
from its place at once, and a peer killed half way through a deletion leaves only the trash, which its
next start empties. The janitor's one thread then deletes, in order: the trash's entries (an `rmtree` of
a folder of 20,000 files takes 0.3 s, of a 10 GB checkpoint folder longer) and the blobs a prune finds
unused (a walk of the whole store). The loop meanwhile answers tasks, heartbeats, listings and uploads.

A prune must never delete a blob that an upload or a pull is about to use. The race: the prune computes
what is in use; an upload starts, finds blob X in the store and so does not ask for it; the prune deletes
X; the job's folder cannot be built. So the set of what to keep is live while the prune runs: the loop
adds an upload's (or a pull's) digests to it (`use`) before it looks which blobs the store lacks, and the
prune looks at the set again right before each unlink, under the same lock that `use` takes. Either the
unlink comes first (the upload then finds X missing and asks for it) or `use` does (X is kept). The loop
waits at most for one unlink; the walk itself holds no lock. A job recorded while the prune runs came
from an upload or a pull that was under way when it began (its digests are in the set) or that started
later (`use` added them), so its blobs are kept as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..jobs import folder
from ..jobs.store import pause_point

log = logging.getLogger("gpulayer.peer")

InUse = Callable[[], tuple[set[str], list[Path]]]  # the digests of the uploads and pulls, the kept jobs' manifests


class Janitor:
    """Deletes what the loop discarded, on one thread of its own, one piece of work at a time, in order."""

    def __init__(self, trash: Path, blobs: folder.BlobStore):
        self.trash = trash
        self.blobs = blobs
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="gpulayer-janitor")
        self._lock = threading.Lock()  # guards `_keep` while a prune runs
        self._keep: set[str] | None = None  # the running prune's digests to keep (None: no prune runs)
        self._emptying = False  # an emptying of the trash is queued and has not begun
        self._prune_again = False
        self._pruning: asyncio.Task[None] | None = None
        self._closed = False

    def empty_trash(self) -> None:
        """Have the thread delete what the trash holds (after the work queued before); at most one waits."""
        if not self._closed and not self._emptying:
            self._emptying = True
            self._thread.submit(self._empty)

    def _empty(self) -> None:
        self._emptying = False  # before the listing: what is discarded after it is emptied by the next one
        for entry in os.scandir(self.trash):
            pause_point("trash-emptying")
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)

    def prune(self, in_use: InUse) -> None:
        """Have the thread remove the blobs that no job needs. `in_use()`, called on the loop as the prune begins,
        gives the digests of the uploads and pulls under way and the manifest files of the jobs kept (read on
        the thread). One prune runs at a time; asked for while one runs, one more runs after it."""
        self._prune_again = True
        if self._pruning is None and not self._closed:
            self._pruning = asyncio.get_running_loop().create_task(self._prunes(in_use))

    def use(self, digests: Iterable[str]) -> None:
        """On the loop, before an upload or a pull looks which of these blobs the store lacks: a prune under way
        keeps them (see the module's docstring)."""
        with self._lock:
            if self._keep is not None:
                self._keep.update(digests)

    async def _prunes(self, in_use: InUse) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._prune_again and not self._closed:
                self._prune_again = False
                digests, manifests = in_use()
                with self._lock:
                    self._keep = digests
                try:
                    freed = await loop.run_in_executor(self._thread, self._prune, digests, manifests)
                    log.info("the blob store freed %.1f MiB of content that no kept job holds", freed / (1 << 20))
                except OSError as exc:
                    log.warning("the blob store could not be pruned: %s", exc)
                finally:
                    with self._lock:
                        self._keep = None
        finally:
            self._pruning = None

    def _prune(self, keep: set[str], manifests: list[Path]) -> int:
        shipped = set()
        for path in manifests:
            shipped.update(_digests(path))
        with self._lock:
            keep.update(shipped)
        pause_point("blobs-pruning")
        freed = self.blobs.prune(keep, self._lock)
        pause_point("blobs-pruned")
        return freed

    async def close(self) -> None:
        """The peer stops: the work under way ends, the rest is dropped (the trash is emptied at the next start,
        the blobs pruned when retention next removes a job)."""
        self._closed = True
        await asyncio.to_thread(self._thread.shutdown, wait=True, cancel_futures=True)
        if self._pruning is not None:
            await asyncio.gather(self._pruning, return_exceptions=True)


def _digests(manifest: Path) -> set[str]:
    """The digests a job's manifest file (peer/jobs.py's MANIFEST_FILE) names; none if it is gone or unreadable."""
    try:
        shipped = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return set()
    return {entry[3] for entry in shipped if isinstance(entry, list) and len(entry) == 4} \
        if isinstance(shipped, list) else set()
