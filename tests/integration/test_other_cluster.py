"""A wrong cluster key does not look like no peer at all (issue 26, item 6): adverts of other
cluster ids are counted (their ids only), NoMatchingPeer and `gpulayer peers` say how many and
this key's cluster id, `gpulayer key id` prints it, and `gpulayer peers --all` lists them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from gpulayer.client import Client
from gpulayer.errors import NoMatchingPeer
from gpulayer.matching import Requirements
from gpulayer.security import cluster_id
from support import new_key

NOTE = re.compile(r"(\d+) peers? of another cluster \(ids ([0-9a-f, ]+)\) (?:was|were) seen; "
                  r"this key's cluster id is ([0-9a-f]+) \(`gpulayer key id`\)")


def gpulayer(*args: str, key: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpulayer.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GPULAYER_KEY": key})


@pytest.fixture(scope="module")
def keys(peer_factory):
    """Two peers, each of its own cluster, and a key that neither has."""
    keys = {"first": new_key(), "second": new_key(), "wrong": new_key()}
    for name in ("first", "second"):
        peer_factory(name, "--concurrency", "1", key=keys[name])
    return keys


def ids(keys: dict[str, str], *names: str) -> set[str]:
    return {cluster_id(keys[name].encode()) for name in names}


def test_no_matching_peer_counts_the_peers_of_other_clusters_and_gives_this_keys_id(keys):
    client = Client(key=keys["wrong"].encode(), echo_output=False, interfaces=["127.0.0.1"], discovery_timeout=3)
    try:
        with pytest.raises(NoMatchingPeer) as caught:
            client.submit(pow, (2, 3), req=Requirements.build(accelerator="cpu"))
    finally:
        client.close()
    message = str(caught.value)
    assert "no peers were discovered" in message
    found = NOTE.search(message)
    assert found is not None, message
    count, seen, own = int(found[1]), set(found[2].split(", ")), found[3]
    # other engineers' peers on this loopback may be seen too: ours are among them
    assert count >= 2 and seen >= ids(keys, "first", "second") and own == cluster_id(keys["wrong"].encode()), message


def test_key_id_prints_the_cluster_id_and_peers_all_lists_the_other_clusters(keys):
    out = gpulayer("key", "id", key=keys["wrong"])
    assert out.returncode == 0 and out.stdout.strip() == cluster_id(keys["wrong"].encode()), out
    plain = gpulayer("peers", key=keys["wrong"])
    assert plain.returncode == 0 and plain.stdout.startswith("no peers found"), plain
    found = NOTE.search(plain.stdout)
    assert found is not None and set(found[2].split(", ")) >= ids(keys, "first", "second"), plain.stdout
    assert "`gpulayer peers --all` lists them" in plain.stdout
    listed = gpulayer("peers", "--all", key=keys["first"])
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:] if line.strip() and "  " in line}
    assert rows["first"].rstrip().endswith("up"), listed.stdout  # its own peer, as always
    others = [line for line in rows.values() if "other cluster" in line]
    assert cluster_id(keys["second"].encode()) in " ".join(others), listed.stdout
    assert cluster_id(keys["first"].encode()) not in " ".join(others), listed.stdout
    assert "second" not in listed.stdout  # ids only: nothing of the other cluster's adverts (its name)
