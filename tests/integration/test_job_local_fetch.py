"""A fetch on one host (issue 27, ADR 0016): files pass as descriptors on the connection's local link.

One real peer in a subprocess, one job that wrote a big file of random bytes, three of just over 1 MiB, many small ones
and an empty one; fetched into fresh folders by the Job API of this process, once the local way and once
with GPULAYER_SHM=0 (over the secure channel, as from another host). Which way the files came is the
submitter's own debug line; both are byte-exact.
"""

from __future__ import annotations

import logging
import random
import re

import pytest

from support import new_key

BIG = 24 << 20
SMALL = 300
SCRIPT = (
    "import os, random\n"
    f"open('big.bin', 'wb').write(random.Random(7).randbytes({BIG}))\n"
    "os.makedirs('small', exist_ok=True)\n"
    f"for i in range({SMALL}):\n"
    "    open(f'small/{i}.txt', 'w').write(str(i) * (i % 17 + 1))\n"
    "open('empty', 'w').close()\n"
    "for i in range(3):\n"
    "    open(f'mid{i}.bin', 'wb').write(bytes([i]) * ((1 << 20) + i))\n"
)


def expected() -> dict[str, bytes]:
    files = {"big.bin": random.Random(7).randbytes(BIG), "empty": b""}
    files.update({f"mid{i}.bin": bytes([i]) * ((1 << 20) + i) for i in range(3)})
    files.update({f"small/{i}.txt": (str(i) * (i % 17 + 1)).encode() for i in range(SMALL)})
    return files


@pytest.fixture(scope="module")
def ended_job(peer_factory, tmp_path_factory):
    from gpulayer.client import Client
    from gpulayer.client.jobs import Jobs
    from gpulayer.matching import Requirements

    key = new_key()
    peer_factory("shmfetch", "--concurrency", "1", "--state-dir", str(tmp_path_factory.mktemp("state")), key=key)
    project = tmp_path_factory.mktemp("project")
    (project / "make.py").write_text(SCRIPT)
    client = Client(key=key.encode(), echo_output=False)
    job = Jobs(client).submit(["python", "make.py"], project, Requirements.build(accelerator="cpu"))
    assert job.wait(120) == "succeeded", job.logs()
    yield job
    client.close()


def fetched(job, to, caplog) -> int:
    """Fetch everything the job made or changed into `to`; how many files came by descriptor."""
    with caplog.at_level(logging.DEBUG, logger="gpulayer.client"):
        caplog.clear()
        written = job.fetch(None, to)
    assert sorted(str(p.relative_to(to)) for p in written) == sorted(expected())
    for rel, data in expected().items():
        assert (to / rel).read_bytes() == data, rel
    said = [r.getMessage() for r in caplog.records if "by descriptor" in r.getMessage()]
    assert len(said) == 1, said
    return int(re.search(r"(\d+) by descriptor", said[0]).group(1))


def test_a_fetch_on_one_host_passes_every_file_by_descriptor(ended_job, tmp_path, caplog):
    assert fetched(ended_job, tmp_path / "local", caplog) == 4  # those of 1 MiB or more; small ones as chunks
    assert not list((tmp_path / "local").rglob(".*partial*"))


def test_with_shared_memory_off_the_same_fetch_goes_over_the_channel(ended_job, tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("GPULAYER_SHM", "0")
    assert fetched(ended_job, tmp_path / "tcp", caplog) == 0
