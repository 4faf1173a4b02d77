"""A job's submit through a relay that cuts, stalls and replays it (issue 27; docs/jobs.md, "A lost answer").

The submitter (an agent, mDNS off) reaches the LAN's two peers only through tests/lan/lan_relay.py in
its own namespace, one route a peer. The relay's trap catches the first connection of a route whose
client sends a record of at least MIN_UP bytes: a JOB_SUBMIT (an AUTH, a PING or a job request is
smaller). It holds what comes back (the submit reached the peer, its answer is held), or everything
(a stall); the test then waits on the peer's log, not on time, before it cuts or releases. Each test
shows that its retry happened: the peer's log says the submit (its token) came again, the submit
succeeded while its first connection was still held, or the relay counted the reset it made.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from lanlab import RelayProcess, lan_env
from support import wait_until

LAN_PEERS = 2
LAN_CONCURRENCY = 1
MIN_UP = 200  # bytes: a JOB_SUBMIT's record (about 250 with an empty folder) and not an AUTH (about 100)
SILENCE_S = 2.0  # the agent's wait for a silent peer before it sends the submit again (client/jobs.py: 15 s)
LOOPBACK = "127.0.0.1"  # where the relay's routes to the peers listen, on the agent's host


@pytest.fixture(scope="module")
def relayed(lan):
    """A relay in front of each peer (route i: lan.peers[i]), and an agent that knows the peers only through it.

    The peers' routes listen on the agent's host's loopback (as an SSH tunnel's ports would): addresses valid
    only there, which a gang's watcher (rank 0's peer) must not dial. The last route is another path to
    lan.peers[0], on the host's LAN address (for a peer cache that goes stale)."""
    host = lan.add_host("relay-sub")
    relay = RelayProcess(host, [*((LOOPBACK + ":0", p.address) for p in lan.peers), (f"{host.ip}:0", lan.peers[0].address)])
    static = ",".join(f"{LOOPBACK}:{port}" for port in relay.ports[:-1])
    agent = lan.submitter("relay-jobs", host=host, mdns=False, peers=static)
    assert agent.call("wait_names", present=lan.names, timeout=15)["ok"]
    yield relay, agent
    relay.close()


def recorded(peer, marker: str) -> list[str]:
    """The ids of the jobs (ranks, gang records) whose command echoes `marker`, as the peer's log recorded them."""
    return re.findall(rf"job (\S+) recorded from \S+: sh -c 'echo {marker}'", peer.log())


def came_again(peer, job_id: str) -> int:
    """How often the peer answered a submit of `job_id` again (its token was known: nothing new recorded)."""
    return peer.log().count(f"job {job_id}: its submit came again")


def submit(agent, marker: str, **options) -> None:
    agent.call("submit_job", tag=marker, command=["sh", "-c", f"echo {marker}"], name=marker, **options)


def outcome(agent, marker: str) -> dict:
    out = agent.call("wait", tags=[marker], timeout=60)["outcomes"][marker]
    assert out is not None and out["ok"], out
    return out


def trapped(relay) -> dict:
    return relay.call("stats")["stats"]["trapped"]


def ran_once(agent, job_id: str, marker: str) -> list[str]:
    """Wait for the job's end: it succeeded and printed `marker` once; its ranks' ids (a gang's)."""
    ended = agent.call("job", job_id=job_id)
    assert ended["state"] == "succeeded", ended
    for rank in ended["ranks"]:
        assert agent.call("job", job_id=rank)["log"] == f"{marker}\n"
    assert ended["ranks"] or ended["log"] == f"{marker}\n"
    return ended["ranks"]


@pytest.fixture(scope="module")
def cut_off(lan, relayed):
    """A job submitted to lan.peers[0] whose JOB_INFO the relay held, then cut (reset both ways) once the peer had
    recorded the job: the submit's outcome, and the job's id as the peer's log recorded it."""
    relay, agent = relayed
    peer, marker = lan.peers[0], "cut-single"
    relay.call("trap", route=0, min_up=MIN_UP, hold="down")
    submit(agent, marker, peer=peer.name)
    job_id, = wait_until(lambda: recorded(peer, marker), 30)  # recorded there; its JOB_INFO is held
    assert trapped(relay)["held"] == {"up": False, "down": True} and not trapped(relay)["closed"]
    relay.call("cut_trapped")
    return outcome(agent, marker), job_id


def test_a_submit_whose_answer_is_cut_off_is_sent_again_and_recorded_once(lan, relayed, cut_off):
    _, agent = relayed
    out, job_id = cut_off
    assert out["value"] == job_id  # the job recorded before the cut: its token was known
    assert came_again(lan.peers[0], job_id) == 1  # the retry happened, over a new connection
    assert agent.call("jobs", name="cut-single")["ids"] == [job_id]
    ran_once(agent, job_id, "cut-single")


def test_a_replayed_submit_is_refused_and_records_nothing(lan, relayed, cut_off):
    """An on-path attacker sends the cut connection's bytes (its handshake, then the sealed submit) again, on a
    connection of its own: the peer's HELLO carries a fresh nonce, so the replayed AUTH fails and the peer
    closes the connection before it opens a record."""
    relay, agent = relayed
    _, job_id = cut_off
    replay = relay.call("replay", timeout=15)["replay"]
    assert replay["frames"] == [{"t": "hello"}, {"t": "error", "code": "auth"}] and replay["closed"], replay
    assert recorded(lan.peers[0], "cut-single") == [job_id] and came_again(lan.peers[0], job_id) == 1
    assert agent.call("jobs", name="cut-single")["ids"] == [job_id]


def test_a_gang_whose_submitter_reaches_its_peers_only_on_its_loopback_runs_each_rank_once(lan, relayed):
    """The agent knows both peers only at 127.0.0.1 of its own host (the relay's routes): rank 0's peer reaches
    the ranks by what it knows of their ids, and by what each rank's peer said of itself, never at those; each
    rank's rendezvous addresses are its peer's LAN address."""
    _, agent = relayed
    marker = "loopback-gang"
    agent.call("submit_job", tag=marker, name=marker, nodes=2,
               command=["sh", "-c", f"echo {marker} $RANK $MASTER_ADDR $GPULAYER_RANK_ADDR"])
    gang_id = outcome(agent, marker)["value"]
    ended = agent.call("job", job_id=gang_id)
    assert ended["state"] == "succeeded", ended
    lines = [agent.call("job", job_id=rank)["log"].splitlines() for rank in ended["ranks"]]
    assert all(len(printed) == 1 for printed in lines), lines  # each rank ran once
    said = {rank: (master, own) for _, rank, master, own in (printed[0].split() for printed in lines)}
    assert sorted(said) == ["0", "1"]
    assert sorted(own for _, own in said.values()) == sorted(p.host.ip for p in lan.peers)
    assert {master for master, _ in said.values()} == {said["0"][1]}
    assert sorted(agent.call("jobs", name=marker)["ids"]) == sorted([gang_id, *ended["ranks"]])


def test_a_gang_rank_whose_answer_is_cut_off_is_recorded_once(lan, relayed):
    relay, agent = relayed
    peer, marker = lan.peers[1], "cut-gang"
    relay.call("trap", route=1, min_up=MIN_UP, hold="down")
    submit(agent, marker, nodes=2)
    rank_id, *_ = wait_until(lambda: recorded(peer, marker), 30)  # the first record there: its rank
    assert trapped(relay)["route"] == 1 and trapped(relay)["held"]["down"]
    relay.call("cut_trapped")
    gang_id = outcome(agent, marker)["value"]
    assert came_again(peer, rank_id) == 1
    ranks = ran_once(agent, gang_id, marker)
    assert rank_id in ranks and len(ranks) == 2
    assert sorted(agent.call("jobs", name=marker)["ids"]) == sorted([gang_id, *ranks])  # one job a rank


def test_a_gang_rank_whose_submit_stalls_is_sent_again_and_the_late_one_records_nothing(lan, relayed):
    """The relay holds a rank's submit and everything after it, both ways, past the submitter's wait for a silent
    peer: the submitter sends it again on a new connection and the gang goes on; then the relay delivers the
    held submit (its token), which the peer answers with the rank recorded."""
    relay, agent = relayed
    peer, marker = lan.peers[0], "stalled-gang"
    relay.call("trap", route=0, min_up=MIN_UP, hold="both")
    submit(agent, marker, nodes=2, silence_s=SILENCE_S)
    gang_id = outcome(agent, marker)["value"]
    held = trapped(relay)  # the retry went through while the first connection was held, still open
    assert held["route"] == 0 and held["held"] == {"up": True, "down": True} and not held["closed"], held
    rank_id, *_ = recorded(peer, marker)
    assert came_again(peer, rank_id) == 0  # the held submit never reached the peer
    relay.call("release")
    wait_until(lambda: came_again(peer, rank_id) == 1, 30)  # the late submit came, and was answered
    ranks = ran_once(agent, gang_id, marker)
    assert rank_id in ranks
    assert sorted(agent.call("jobs", name=marker)["ids"]) == sorted([gang_id, *ranks])


CACHE_PEER = """
import sys
from gpulayer.client import Client
from gpulayer.matching import Requirements
client = Client(peers=sys.argv[1], mdns=False, echo_output=False)
client.wait_for_match(Requirements.build(peer=sys.argv[2]))
client.close()  # the peer cache now has the peer at that address
"""


def test_a_job_goes_past_its_peers_stale_cached_path_to_the_address_discovery_finds(lan, relayed, tmp_path):
    """The peer cache has the peer at an address whose path is broken (the relay resets its handshakes);
    mDNS finds the same peer (its id unchanged) at its LAN address: the submit (pinned to that peer) tries the
    cached path first, then waits for discovery and records the job at the address found."""
    relay, _ = relayed
    host, peer, marker = relay.host, lan.peers[0], "stale-cache"
    stale = f"{host.ip}:{relay.ports[-1]}"
    env = lan_env(lan.key, GPULAYER_CACHE="1", XDG_CACHE_HOME=str(tmp_path), GPULAYER_DISCOVERY_TIMEOUT="10")
    cached = host.run([sys.executable, "-c", CACHE_PEER, stale, peer.name], env=env)
    assert cached.returncode == 0, cached.stderr
    entries = next(iter(json.loads((tmp_path / "gpulayer" / "peers.json").read_text()).values()))
    assert [e["addresses"] for e in entries if e["txt"]["n"] == peer.name] == [[[host.ip, relay.ports[-1]]]]
    relay.call("refuse", route=len(relay.ports) - 1)  # reset in the handshake, after the peer's HELLO
    before = relay.call("stats")["stats"]["cuts"][-1]
    out = host.run([sys.executable, "-m", "gpulayer.cli", "submit", "--peer", peer.name, "--name", marker, "--",
                    "sh", "-c", f"echo {marker}"], env=env, timeout=60)
    assert relay.call("stats")["stats"]["cuts"][-1] > before  # the cached path was tried, and reset
    assert out.returncode == 0, out.stderr
    assert recorded(peer, marker) == [out.stdout.strip()]
