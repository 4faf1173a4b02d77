"""The `lan` fixture: peers in network namespaces on one bridge, found over real mDNS multicast.

A test module gets one LAN: N namespaces (module variable LAN_PEERS, 3 by default) joined by a
bridge, each running `python -m gpulayer.peer` (LAN_CONCURRENCY slots, LAN_PEER_ENV extra
environment), all with one fresh cluster key. Submitters run in namespaces of their own, as
agents (lan_agent.py) driven from the test. Everything is removed after the module, whether
its tests passed or not; lanlab.py also cleans up at exit, on SIGTERM, and after a crashed run.

The `reliability` fixture collects what the tests tried and what survived (lanreport.py); at
the end of the session it is written into pytest's temporary directory, or to
`--reliability-json PATH`, and the terminal summary names the file. Only bench/reliability.py
writes bench/results/reliability.json: a test run leaves the work tree as it was.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lanlab import Agent, Host, Lan, LanPeer, LanUnavailable, why_unavailable  # noqa: E402
from lanreport import Reliability  # noqa: E402
from support import new_key  # noqa: E402

REPORT_NAME = "reliability.json"


def pytest_addoption(parser):
    parser.addoption("--reliability-json", metavar="PATH", default=None,
                     help="where the LAN suite writes its reliability report (default: pytest's temporary "
                          "directory); bench/reliability.py sets it")


class LanCluster:
    """What the `lan` fixture yields: the LAN, its cluster key, and its peers (one per host)."""

    def __init__(self, net: Lan, key: str, peers: list[LanPeer]):
        self.net = net
        self.key = key
        self.peers = peers
        self.workdir = net.workdir

    def peer(self, name: str) -> LanPeer:
        return next(p for p in self.peers if p.name == name)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.peers]

    def add_host(self, label: str) -> Host:
        return self.net.add_host(label)

    def start_peer(self, name: str, key: str | None = None, concurrency: int = 2, env: dict | None = None,
                   wait: bool = True) -> LanPeer:
        """Another peer, on a host of its own (of this cluster unless `key` says otherwise)."""
        host = self.net.add_host(name)
        peer = host.start_peer(name, key or self.key, concurrency, env)
        return peer.wait_ready() if wait else peer

    def submitter(self, label: str = "submitter", key: str | None = None, env: dict | None = None,
                  host: Host | None = None, **configure) -> Agent:
        """An agent on a host of its own; configured with `configure` (nothing: all from the environment)."""
        host = host or self.net.add_host(label)
        agent = host.agent(key or self.key, name=label, env=env)
        agent.call("configure", **configure)
        return agent


@pytest.fixture(scope="module")
def lan(request, tmp_path_factory):
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    count = getattr(request.module, "LAN_PEERS", 3)
    concurrency = getattr(request.module, "LAN_CONCURRENCY", 2)
    env = getattr(request.module, "LAN_PEER_ENV", {})
    try:
        net = Lan(tmp_path_factory.mktemp("lan"))
    except LanUnavailable as exc:
        pytest.skip(str(exc))
    try:
        try:
            hosts = [net.add_host(f"p{i + 1}") for i in range(count)]
        except RuntimeError as exc:
            if "Operation not permitted" in str(exc) or "Permission denied" in str(exc):
                pytest.skip(f"network namespaces are not permitted here: {exc}")
            raise
        key = new_key()
        peers = [h.start_peer(h.label, key, concurrency, env) for h in hosts]
        for peer in peers:
            peer.wait_ready()
        yield LanCluster(net, key, peers)
    finally:
        net.close()
    left = net.leftovers()
    assert not left, f"the LAN left these behind: {left}"


_report = Reliability()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each LAN test's outcome for the report (a failed check is part of what was tried)."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and not rep.passed):
        name = item.nodeid.split("tests/lan/")[-1]
        _report.outcomes[name] = rep.outcome if rep.when == "call" else f"{rep.outcome} in setup"


@pytest.fixture(scope="session")
def reliability(request, tmp_path_factory):
    yield _report
    path = request.config.getoption("reliability_json", default=None)
    _report.write(Path(path) if path else tmp_path_factory.getbasetemp() / REPORT_NAME)


def pytest_terminal_summary(terminalreporter):
    if _report.written:
        terminalreporter.write_line(f"LAN reliability report: {_report.written}")
