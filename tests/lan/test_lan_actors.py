"""Actors across hosts: network namespaces on one bridge, real mDNS multicast.

A submitter on a host of its own creates an actor on one peer and hands its handle to a task on
another peer, which calls the actor over the bridge with its own client (the key from the peer's
key file); then the actor's host falls off the network: the call in flight raises ActorDied, and
with restarts=1 the next call re-creates the actor on a peer that is still reachable.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from lanlab import lan_env

LAN_PEERS = 1

SUBMITTER = textwrap.dedent("""
    import json, os, sys, time
    import gpulayer as gl

    def say(**fields):
        print(json.dumps(fields), flush=True)

    class Recorder:
        def __init__(self):
            self.seen = []
        def record(self, value):
            self.seen.append(value)
            return len(self.seen)
        def history(self):
            return self.seen
        def where(self):
            return os.environ["GPULAYER_PEER_NAME"]
        def sleep(self, seconds):
            time.sleep(seconds)

    def call_it(handle, value):
        return handle.record(value), os.environ["GPULAYER_PEER_NAME"]

    Remote = gl.remote(Recorder)
    rec = Remote.options(peer="a1")()
    rec.record("from the submitter")
    length, ran_on = gl.run(call_it, rec, "from a task on a2", peer="a2")
    say(length=length, ran_on=ran_on, history=rec.history(), actor_on=rec.where())
    rec.close()

    moving = Remote.options(restarts=1)()
    moving.record("lost with its host")
    say(actor_on=moving.where())
    pending = moving.sleep.submit(60)
    sys.stdin.readline()  # the test cuts that host's link
    try:
        pending.result(60)
        say(pending="returned")
    except gl.ActorDied as exc:
        say(pending="ActorDied", message=str(exc))
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = moving.history()
    say(history=history, actor_on=moving.where(), warned=[str(w.message) for w in caught])
    moving.close()
""")


def test_a_handle_crosses_hosts_and_a_lost_host_moves_the_actor(lan, tmp_path):
    config = tmp_path / "config"
    (config / "gpulayer").mkdir(parents=True)
    (config / "gpulayer" / "key").write_text(lan.key)
    (config / "gpulayer" / "key").chmod(0o600)
    peers = {name: lan.start_peer(name, concurrency=1, env={"XDG_CONFIG_HOME": str(config)}) for name in ("a1", "a2")}
    script = tmp_path / "submitter.py"
    script.write_text(SUBMITTER)
    host = lan.add_host("actor-sub")
    proc = host.popen([sys.executable, str(script)], lan_env(lan.key), stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cut = None
    try:
        first = json.loads(proc.stdout.readline() or "{}")
        assert first == {"length": 2, "ran_on": "a2", "actor_on": "a1",
                         "history": ["from the submitter", "from a task on a2"]}, proc.stderr.read()
        placed = json.loads(proc.stdout.readline())["actor_on"]
        cut = peers.get(placed) or lan.peer(placed)
        cut.host.link_down()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        died = json.loads(proc.stdout.readline())
        assert died["pending"] == "ActorDied", died
        moved = json.loads(proc.stdout.readline())
        assert moved["history"] == [] and moved["actor_on"] != placed, moved
        assert any("re-created on peer" in w for w in moved["warned"]), moved
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        if cut is not None:
            cut.host.link_up()
        proc.kill()
        proc.wait()
