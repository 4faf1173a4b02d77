"""Issue 24, item 9: the segments a worker pools (ADR 0009) keep no submitter's data for another's tasks.

A task of submitter B, on the worker that made submitter A's results, reads every shared-memory
segment it can reach in its process (its descriptors, opened again, and its mappings) and finds none
of A's bytes, whether A let go of its result or the peer still holds it; A's held result is intact.
A segment is written again only for the submitter whose data it held."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from gpulayer.client import Client
from gpulayer.matching import Requirements
from gpulayer.transport import shm
from support import new_key

pytestmark = pytest.mark.skipif(not shm.POOL_SUPPORTED, reason="the pool needs memfd, /proc and OFD locks")
CPU = Requirements.build(accelerator="cpu")
MiB = 1 << 20
MARK = b"<submitter A's own bytes>"


def marked(nbytes: int):
    """A's result: its mark over and over."""
    return np.frombuffer(MARK * (nbytes // len(MARK) + 1), dtype=np.uint8)[:nbytes].copy()


def segments_with(mark: bytes) -> int:
    """How many shared-memory segments that this process can reach hold `mark`: those among its
    descriptors (opened again, which no lock stops) and those it maps (read through /proc/self/mem)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        path = f"/proc/self/fd/{fd}"
        try:
            if os.readlink(path).startswith("/memfd:"):
                with open(path, "rb") as segment:
                    found += mark in segment.read()
        except OSError:  # a descriptor closed meanwhile (the listing's own, say)
            continue
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb") as mem:
        for line in maps:
            if "/memfd:" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                mem.seek(start)
                found += mark in mem.read(end - start)
    return found


@pytest.fixture(scope="module")
def peer(peer_factory):
    return peer_factory("pooled", "--no-mdns", "--concurrency", "1", key=new_key())


def test_a_task_of_another_submitter_reads_no_earlier_result_from_its_workers_pool(peer):
    a, b = (Client(key=peer.key.encode(), peers=peer.address, mdns=False, echo_output=False, leases=False)
            for _ in range(2))
    try:
        held = a.submit(marked, (3 * MiB,), req=CPU, keep=True)  # the peer holds it, in the worker's segment
        dropped = a.submit(marked, (2 * MiB,), req=CPU).result(30)  # A had it, and let go of it
        assert np.array_equal(dropped, marked(2 * MiB))
        del dropped
        gc.collect()
        worker = a.submit(os.getpid, req=CPU).result(30)
        assert a.submit(segments_with, (MARK,), req=CPU).result(30) >= 2  # A's own tasks may: they are A's

        assert b.submit(os.getpid, req=CPU).result(30) == worker  # the same warm worker
        assert b.submit(segments_with, (MARK,), req=CPU).result(30) == 0
        assert np.array_equal(held.result(30), marked(3 * MiB))  # let go of, not wiped: A still has it
        assert np.array_equal(a.submit(marked, (2 * MiB,), req=CPU).result(30), marked(2 * MiB))
    finally:
        a.close()
        b.close()


def test_a_pooled_segment_is_written_again_only_for_its_own_submitter():
    """Even for a process that kept it open without the lock (opened again through /proc)."""
    pool = shm.Pool()
    handle, kept = pool.lend(MiB, "a")
    assert kept is None  # a fresh one
    os.pwrite(handle.fd, marked(MiB), 0)
    lingering = os.open(f"/proc/self/fd/{handle.fd}", os.O_RDONLY)
    try:
        handle.close()
        other, kept = pool.lend(MiB, "b")
        assert kept is None  # not A's segment, free as it is
        os.pwrite(other.fd, b"b" * MiB, 0)
        other.close()
        pool.serve("b")  # a task of B's starts here
        assert os.pread(lingering, MiB, 0) == bytes(MiB)  # A's bytes wiped; B's never written there
        again, kept = pool.lend(MiB, "a")
        assert kept is not None  # A's own segment, for A again
        again.close()
    finally:
        os.close(lingering)
        with pool._lock:
            pool.clear()
