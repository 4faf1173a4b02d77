"""Gossip next to an older peer of the same protocol version (issue 30): a peer of main before gossip
(OLDER, from this repository's history) refuses the unknown PEERS and closes the connection that sent
it, so a submitter asks, and a peer sends its list to, only the peers whose advert names PEERS among its
features ("ft"). The older peer still runs tasks, and a gossiping peer still verifies it and lists it.
OLDER spoke protocol 2; version 3 changed only the digests of jobs, which OLDER has none of, so its
version is set to this one's: an older release of the same version, the case "ft" is for."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from gpulayer.client import Client
from gpulayer.client.gossip import ASK_EVERY
from gpulayer.matching import Requirements
from gpulayer.peer.gossip import GOSSIP_ROUND
from gpulayer.protocol import handshake, messages
from gpulayer.transport.blocking import BlockingConnection
from support import PeerProcess, new_key, wait_until

OLDER = "ed301ba"  # main when protocol/ landed, before invite codes and gossip: protocol v2 without PEERS
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def older_tree(tmp_path_factory) -> Path:
    """The gpulayer package of OLDER, unpacked from git (skipped where the history is not there)."""
    tree = tmp_path_factory.mktemp("older")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", OLDER, "gpulayer"], capture_output=True, timeout=60)
    if archive.returncode != 0:
        pytest.skip(f"no commit {OLDER} in this checkout: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=60)
    source = tree / "gpulayer/protocol/messages.py"
    text = source.read_text()
    assert "PEERS" not in text and "\nPROTOCOL_VERSION = 2 " in text
    source.write_text(text.replace("\nPROTOCOL_VERSION = 2 ", f"\nPROTOCOL_VERSION = {messages.PROTOCOL_VERSION} "))
    return tree


class OlderPeer(PeerProcess):
    """A peer of the code in `tree` (run from there: `python -m` puts its folder first on the path)."""

    def __init__(self, tree: Path, *args, **kwargs):
        super().__init__(*args, env={"PYTHONPATH": str(tree)}, **kwargs)
        self.tree = tree

    def _popen(self, log) -> subprocess.Popen:
        return subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=self.tree)

    def imports_from_tree(self) -> bool:
        """Whether gpulayer, imported as this peer imports it, is the one in `tree`."""
        found = subprocess.run([self.argv[0], "-c", "import gpulayer; print(gpulayer.__file__)"], env=self.env,
                               cwd=self.tree, capture_output=True, text=True, timeout=60)
        return found.stdout.strip() == str(self.tree / "gpulayer" / "__init__.py")


@pytest.fixture
def peers(tmp_path, older_tree):
    """start(name, older, *args) -> a started peer of this cluster, of OLDER's code when `older`."""
    key = new_key()
    started: list[PeerProcess] = []

    def start(name: str, older: bool, *args: str) -> PeerProcess:
        peer = OlderPeer(older_tree, tmp_path, key, name, "--concurrency", "1", *args) if older \
            else PeerProcess(tmp_path, key, name, "--concurrency", "1", *args)
        started.append(peer.start())
        return peer

    yield start
    for peer in started:
        peer.stop(timeout=10)
        peer.kill()


def listed(peer: PeerProcess) -> list[str]:
    """The peer ids of `peer`'s PEERS list, asked as a key holder."""
    conn = BlockingConnection(socket.create_connection(("127.0.0.1", peer.port), 5))
    try:
        handshake.client_handshake(conn, peer.key.encode(), "lister", 5)
        conn.send(messages.peers(1, []))
        reply, _ = conn.recv(time.monotonic() + 5)
        return [peer_id for peer_id, _, _ in messages.check_peers(reply)[0]]
    finally:
        conn.close()


def test_a_submitter_keeps_its_connection_to_an_older_peer_through_its_gossip_asks(peers):
    older = peers("older", True)
    assert older.imports_from_tree()
    client = Client(key=older.key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    try:
        cpu = Requirements.build(accelerator="cpu")
        assert client.submit(time.sleep, (2.5 * ASK_EVERY,), req=cpu).result(60) is None  # a task through two asks
        assert client.submit(pow, (2, 10), req=cpu).result(60) == 1024
    finally:
        client.close()
    assert "unknown message type" not in older.log()


def test_a_peer_verifies_and_lists_an_older_peer_that_it_has_as_its_seed(peers):
    older = peers("older", True)
    newer = peers("newer", False, "--seed", older.address)
    assert wait_until(lambda: older.peer_id in listed(newer), timeout=4 * GOSSIP_ROUND + 10)
    assert "unknown message type" not in older.log()
