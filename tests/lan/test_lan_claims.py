"""Adverts that no GPUlayer peer sends, against real peers and submitters in LAN namespaces (issue 24,
items 3 to 5); the rogue (lan_rogue.py, WITHOUT the cluster key) sends them with real zeroconf.

- a service name with a control character (which zeroconf refuses to look up) stops no discovery:
  later joins and goodbyes still reach a running submitter, and `gpulayer peers` lists the peers;
- copies of a peer's advert (its id and name) at a closed port and at another peer's address never
  take the peer's row, status or place from a submitter that has not connected to it yet, and their
  goodbyes remove only themselves;
- a long or dotted `--name` goes out as one DNS label of at most 63 bytes, the whole name in TXT; a
  name that cannot be advertised stops the peer with one line and exit code 2.
"""

from __future__ import annotations

import json
import re
import sys

from lanlab import lan_env
from support import wait_until
from test_lan_adverts import by_name, canary, rogue  # noqa: F401 (rogue: the fixture)

from gpulayer.discovery import SERVICE_TYPE

LAN_PEERS = 2
LAN_CONCURRENCY = 2
CLOSED_PORT = 9  # nothing listens there in the rogue's namespace: a connection is refused
LABEL_MAX = 63  # bytes in one DNS label


def cli(host, key: str, *args: str):
    """`gpulayer peers ARGS` run inside `host`'s namespace, as a user would."""
    return host.run([sys.executable, "-m", "gpulayer.cli", "peers", "--wait", "2", *args], timeout=60,
                    env=lan_env(key))


# ---- item 3: a control character in an instance name ---------------------------------------------------------

def test_a_control_character_in_a_service_name_stops_no_discovery(lan, rogue, reliability):  # noqa: F811
    agent = lan.submitter("bell")
    assert agent.call("wait_names", present=lan.names, timeout=10)["ok"]
    # a bare PTR to "gpu\x07box...", multicast every 0.25 s and in answer to every query
    names = rogue.call("flood_start", count=1, seconds=90, interval=0.25, tag="gpu\x07box")["names"]
    try:
        wait_until(lambda: set(names) <= set(agent.call("heard")["names"]), timeout=10, interval=0.1)
        # joins and goodbyes after it still reach the running submitter: a rogue's advert and a real peer's
        barrier = canary(rogue, CLOSED_PORT, "after-bell")
        assert agent.call("wait_names", present=["after-bell"], timeout=10)["ok"]
        rogue.call("unregister", instance=barrier)
        assert agent.call("wait_names", absent=["after-bell"], timeout=10)["ok"]
        late = lan.start_peer("late-bell", wait=True)
        assert agent.call("wait_names", present=["late-bell"], timeout=10)["ok"]
        assert agent.call("run", fn="where", peer="late-bell")["value"] == "late-bell"
        late.stop(timeout=20)  # SIGTERM: its goodbye
        assert agent.call("wait_names", absent=["late-bell"], timeout=10)["ok"]
        # a fresh `gpulayer peers` hears the name too, and lists the peers
        printed = cli(agent.host, lan.key)
    finally:
        stopped = rogue.call("flood_stop")
    assert printed.returncode == 0 and "Traceback" not in printed.stderr, printed.stderr[-3000:]
    assert all(name in printed.stdout for name in lan.names), printed.stdout
    reliability.record("advert_control_character_in_name", packets=stopped["packets"], answers=stopped["answers"],
                       later_joins_seen=2, later_goodbyes_seen=2, cli_listed=len(lan.names),
                       faults_injected={"control_character_names": 1}, tasks_completed=1, duplicates=0, lost=0)


# ---- item 4: copies of a peer's advert ----------------------------------------------------------------------

def test_copies_of_an_advert_never_take_the_peers_row_status_or_place(lan, rogue, reliability):  # noqa: F811
    """The copies come after the peer's own advert, to submitters that have not connected to it yet:
    each keeps every claim, and a handshake decides which is the peer."""
    p1, p2 = lan.peers
    txt = rogue.adverts[p1.name]["txt"]
    busy = lan.submitter("copied")  # lists, probes and runs
    idle = lan.submitter("copied-idle")  # only lists: its claims are never tried
    for agent in (busy, idle):
        assert agent.call("wait_names", present=lan.names, timeout=10)["ok"]
    copies = [rogue.call("register", instance=f"{p1.name}-{txt['id']}-closed", txt=txt, port=CLOSED_PORT),
              rogue.call("register", instance=f"{p1.name}-{txt['id']}-other", txt=txt, port=p2.port,
                         address=p2.host.ip)]
    barrier = canary(rogue, CLOSED_PORT, "canary-copy")
    try:
        for agent in (busy, idle):
            assert agent.call("wait_names", present=["canary-copy"], timeout=10)["ok"]
        # gl.peers() probes each row over a connection that proved the row's id
        rows = by_name(busy.call("peers", wait=0)["peers"])
        for peer in lan.peers:
            row = rows[peer.name]
            assert (row["peer_id"], row["address"], row["state"], row["verified"]) == \
                (peer.peer_id, peer.address, "up", True), rows
        assert rows["canary-copy"]["state"] == "down" and not rows["canary-copy"]["verified"], rows
        for _ in range(3):
            assert busy.call("run", fn="where", peer=p1.name)["value"] == p1.name
        # a fresh `gpulayer peers --json` with the copies announced: the rows say which are verified
        printed = cli(busy.host, lan.key, "--json")
        assert printed.returncode == 0, printed.stderr[-3000:]
        listed = by_name(json.loads(printed.stdout))
        assert (listed[p1.name]["address"], listed[p1.name]["verified"]) == (p1.address, True), listed
        assert not listed["canary-copy"]["verified"], listed
    finally:
        for name in [c["instance"] for c in copies] + [barrier]:
            rogue.call("unregister", instance=name)
    # the copies' goodbyes removed only the copies: the peer stays, for the submitter that never connected too
    for agent in (busy, idle):
        assert agent.call("wait_names", absent=["canary-copy"], timeout=10)["ok"]
        held = agent.call("watch_names", names=[p1.name], seconds=1.0)
        assert held["missing"] == {p1.name: 0} and held["addresses"] == {p1.name: [p1.address]}, held
    assert by_name(busy.call("names")["records"])[p1.name]["verified"]
    assert busy.call("run", fn="where", peer=p1.name)["value"] == p1.name
    reliability.record("advert_copies_before_a_handshake", copies=len(copies), rows_verified=len(lan.peers),
                       faults_injected={"copied_adverts": len(copies), "goodbyes": len(copies)},
                       tasks_completed=4, duplicates=0, lost=0)


# ---- item 5: names that do not fit one DNS label ------------------------------------------------------------

LONG_NAME = "long-" + "\u00fc" * 40 + "-name-" + "x" * 20  # 111 bytes in UTF-8
DOTTED_NAME = "gpu.box.lab"


def test_a_long_or_dotted_name_goes_out_as_one_label_and_is_found_whole(lan, rogue, reliability):  # noqa: F811
    peers = [lan.start_peer(name, wait=False) for name in (LONG_NAME, DOTTED_NAME)]
    for peer in peers:
        peer.wait_ready()
    heard = {a["txt"]["n"]: a for a in rogue.call("snoop", names=[p.name for p in peers], timeout=10)["adverts"]}
    for peer in peers:
        instance = heard[peer.name]["instance"]  # as another mDNS browser sees it
        label = instance[:-len(SERVICE_TYPE) - 1]
        assert instance.endswith(f".{SERVICE_TYPE}") and "." not in label, instance
        # its tag keeps it unique: the 12 hex digits kept in its state folder (discovery.kept_tag)
        assert len(label.encode()) <= LABEL_MAX and re.fullmatch(r".+-[0-9a-f]{12}", label), label
    agent = lan.submitter("names")
    assert agent.call("wait_names", present=[p.name for p in peers], timeout=10)["ok"]
    for peer in peers:
        assert agent.call("run", fn="where", peer=peer.name)["value"] == peer.name
    reliability.record("advert_long_and_dotted_names", labels=[heard[p.name]["instance"] for p in peers],
                       tasks_completed=len(peers), duplicates=0, lost=0)


def test_a_name_that_cannot_be_advertised_stops_the_peer_with_one_line(lan):
    host = lan.peers[0].host
    for name in ("gpu\x07box", "x" * 300):
        out = host.run([sys.executable, "-m", "gpulayer.peer", "--name", name, "--port", "0"], timeout=60,
                       env=lan_env(lan.key))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert len(out.stderr.strip().splitlines()) == 1 and "name" in out.stderr, out.stderr
