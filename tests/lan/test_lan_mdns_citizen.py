"""GPUlayer next to the system's mDNS responder (issue 30, item 4): avahi-daemon still answers the
unicast queries sent to this host's port 5353 while a peer runs beside it, the peer is still found and
used, and the peer announces itself on RFC 6762 section 8.3's schedule."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from lanlab import HERE, lan_env, new_lan
from support import new_key, wait_until

from gpulayer.mdns import ANNOUNCEMENTS, LEGACY_UNICAST_TTL

AVAHI_CONF = """[server]
host-name={name}
use-ipv4=yes
use-ipv6=no
enable-dbus=no
allow-interfaces=eth0
[publish]
publish-addresses=yes
publish-hinfo=no
publish-workstation=no
"""


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    lan = new_lan(tmp_path_factory.mktemp("citizen"))
    try:
        yield lan
    finally:
        lan.close()
    assert not lan.leftovers()
LEGACY_QUERY = """
import json, socket, time
from zeroconf import DNSIncoming, DNSOutgoing, DNSQuestion
query = DNSOutgoing(0, multicast=False, id_=4242)
query.add_question(DNSQuestion("_gpulayer._tcp.local.", 12, 1))
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", 0))  # an ephemeral port: a legacy unicast query (RFC 6762 section 6.7)
for packet in query.packets():
    sock.sendto(packet, ("224.0.0.251", 5353))
sock.settimeout(2.0)
answer = DNSIncoming(sock.recv(9000))
print(json.dumps([[r.name, r.type, r.ttl] for r in answer.answers()]))
"""


def answer(asker, host, name: str) -> str:
    """`dig -p 5353 @HOST NAME.local A` from `asker`: the address that came back, or why none did."""
    done = asker.run(["dig", "-p", "5353", f"@{host.ip}", f"{name}.local", "A", "+time=1", "+tries=1", "+short"])
    return done.stdout.strip() or "no answer"


def test_avahi_keeps_answering_unicast_queries_while_a_peer_runs_next_to_it(net):
    if not (shutil.which("avahi-daemon") and shutil.which("dig")):
        pytest.skip("needs avahi-daemon and dig (apt-get install avahi-daemon dnsutils; .ci/run installs them)")
    host, asker = net.add_host("avahi"), net.add_host("asker")
    conf = net.workdir / "avahi-daemon.conf"
    conf.write_text(AVAHI_CONF.format(name=host.ns))
    # its own /run (the pid file and socket of the host's avahi, if any, stay untouched)
    host.popen(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /run && exec avahi-daemon -f "
                f"{conf} --no-drop-root --no-chroot --no-rlimits"], lan_env(None),
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: answer(asker, host, host.ns) == host.ip, 30, interval=0.2)

    key = new_key()
    host.start_peer("beside-avahi", key, 1).wait_ready()
    assert answer(asker, host, host.ns) == host.ip  # still avahi's: the peer took none of its unicast queries

    agent = asker.agent(key, name="finds-it")
    agent.call("configure")
    assert agent.call("wait_names", present=["beside-avahi"], timeout=10)["ok"]
    ran = agent.call("run", fn="where", peer="beside-avahi")
    assert ran["ok"] and ran["value"] == "beside-avahi", ran


def test_answers_to_a_legacy_unicast_query_carry_ttls_of_ten_seconds_at_most(net):
    host, asker = net.add_host("answerer"), net.add_host("legacy")
    host.start_peer("answerer", new_key(), 1).wait_ready()
    done = asker.run([sys.executable, "-c", LEGACY_QUERY], env=lan_env(None))
    assert done.returncode == 0, done.stderr
    records = json.loads(done.stdout)
    assert {kind for _, kind, _ in records} >= {12, 33, 16, 1}, records  # PTR, SRV, TXT, A: all of it came
    assert all(0 < ttl <= LEGACY_UNICAST_TTL for _, _, ttl in records), records


def test_a_peer_announces_itself_at_least_a_second_apart_the_gaps_doubling(net):
    listener, host = net.add_host("listener"), net.add_host("announcer")
    capture = listener.popen([sys.executable, str(HERE / "lan_mdns_capture.py"), "--seconds", "60", "--source",
                              host.ip, "--count", str(ANNOUNCEMENTS), "--responses"], lan_env(None), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert json.loads(capture.stdout.readline())["ready"]
    host.start_peer("announcer", new_key(), 1).wait_ready()
    packets = json.loads(capture.stdout.readline())["packets"]
    capture.wait(10)
    times = [t for t, _ in packets]
    assert len(times) == ANNOUNCEMENTS, packets  # within a minute
    gaps = [b - a for a, b in zip(times, times[1:])]
    # sleeps are never shorter than asked; 20 ms allows for the capture's own clock reading
    assert gaps[0] >= 1.0 - 0.02 and all(later >= 2 * earlier - 0.02 for earlier, later in zip(gaps, gaps[1:])), gaps


BUS_CONF = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig><type>system</type><listen>unix:path=/run/dbus/system_bus_socket</listen><auth>EXTERNAL</auth>
<policy context="default"><allow user="*"/><allow own="*"/><allow send_destination="*"/>
<allow receive_sender="*"/></policy></busconfig>
"""
# in a mount namespace of its own, with its own /run: a system bus, avahi-daemon on it once the bus listens,
# and avahi-browse asked until it resolves a service (50 tries, 0.2 s apart) or gives up
BROWSE = """mount -t tmpfs tmpfs /run && mkdir -p /run/dbus || exit 1
dbus-daemon --config-file={bus} --nofork --nopidfile >/dev/null 2>&1 & BUS=$!
for i in $(seq 50); do [ -S /run/dbus/system_bus_socket ] && break; sleep 0.1; done
avahi-daemon -f {conf} --no-drop-root --no-chroot --no-rlimits >/dev/null 2>&1 & AVAHI=$!
for i in $(seq 50); do avahi-browse -rpt _gpulayer._tcp > {out} 2>&1 && grep -q '^=' {out} && break; sleep 0.2; done
kill $AVAHI $BUS; cat {out}"""


def test_avahi_browse_resolves_a_peer(net):
    if not (shutil.which("avahi-daemon") and shutil.which("avahi-browse") and shutil.which("dbus-daemon")):
        pytest.skip("needs avahi-daemon, avahi-utils and dbus (.ci/run installs avahi-daemon)")
    peer = net.add_host("browsed").start_peer("browsed", new_key(), 1).wait_ready()
    host = net.add_host("avahi-browse")
    conf, bus, out = net.workdir / "avahi-browse.conf", net.workdir / "bus.conf", net.workdir / "browse.out"
    conf.write_text(AVAHI_CONF.format(name=host.ns).replace("enable-dbus=no", "enable-dbus=yes"))
    bus.write_text(BUS_CONF)
    done = host.run(["unshare", "-m", "sh", "-c", BROWSE.format(bus=bus, conf=conf, out=out)], timeout=60,
                    env=lan_env(None))
    resolved = [line.split(";") for line in done.stdout.splitlines() if line.startswith("=")]
    # avahi resolves the host name to any of its addresses: the IPv4 one or, at times, the link-local IPv6
    # one that the peer's host announces too
    link_local = peer.host.run(["ip", "-6", "-o", "addr", "show", "scope", "link"]).stdout
    addresses = {peer.host.ip, *(word.split("/")[0] for word in link_local.split() if word.startswith("fe80:"))}
    found = [(r[2], r[7], r[8]) for r in resolved if r[3].startswith("browsed-")]  # the module's other peers run too
    assert len(found) == 1 and found[0][0] == "IPv4" and found[0][1] in addresses and found[0][2] == str(peer.port), \
        done.stdout + done.stderr
