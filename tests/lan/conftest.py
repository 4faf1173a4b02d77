"""The `lan` fixture: peers in network namespaces on one bridge, found over real mDNS multicast.

A test module gets one LAN: N namespaces (module variable LAN_PEERS, 3 by default) joined by a
bridge, each running `python -m gpulayer.peer` (LAN_CONCURRENCY slots, LAN_PEER_ENV extra
environment), all with one fresh cluster key. Submitters run in namespaces of their own, as
agents (lan_agent.py) driven from the test. Everything is removed after the module, whether
its tests passed or not; lanlab.py also cleans up at exit, on SIGTERM, and after a crashed run.

The `reliability` fixture collects what the tests tried and what survived; at the end of the
session it is written to bench/results/reliability.json.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lanlab import Agent, Host, Lan, LanPeer, LanUnavailable, why_unavailable  # noqa: E402
from support import new_key  # noqa: E402

REPORT = Path(__file__).resolve().parents[2] / "bench" / "results" / "reliability.json"


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


class Reliability:
    """Sections of bench/results/reliability.json, filled by the tests that ran."""

    def __init__(self):
        self.sections: dict[str, dict] = {}
        self.outcomes: dict[str, str] = {}
        self.started = time.time()

    def record(self, section: str, **data) -> None:
        self.sections.setdefault(section, {"recorded": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).update(data)

    def write(self) -> None:
        if not self.sections:
            return
        try:
            report = json.loads(REPORT.read_text())
            if not isinstance(report, dict):
                report = {}
        except (OSError, ValueError):
            report = {}
        tests = report.get("tests", {}) if isinstance(report.get("tests"), dict) else {}
        tests.update(self.sections)
        totals = {"faults_injected": {}, "faults_injected_total": 0, "tasks_completed": 0, "duplicates": 0,
                  "lost": 0}
        for section in tests.values():
            faults = section.get("faults_injected")
            if isinstance(faults, dict):
                for kind, n in faults.items():
                    totals["faults_injected"][kind] = totals["faults_injected"].get(kind, 0) + n
                    totals["faults_injected_total"] += n
            for key in ("tasks_completed", "duplicates", "lost"):
                if isinstance(section.get(key), int):
                    totals[key] += section[key]
        outcomes = report.get("outcomes", {}) if isinstance(report.get("outcomes"), dict) else {}
        outcomes.update(self.outcomes)
        detection = {}
        words = ("detect", "discovered", "appeared", "disappeared", "found", "reused")
        for name, section in tests.items():
            for key, value in section.items():
                timed = isinstance(value, (int, float)) and not isinstance(value, bool) and key.endswith("_s")
                if timed and "bound" not in key and any(word in key for word in words):
                    detection[f"{name}.{key}"] = value
        report = {
            "what": "GPUlayer across hosts: peers in network namespaces on a bridge, real mDNS multicast, "
                    "kills, link cuts, a faulty relay, load, and hostile input (tests/lan)",
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
            "totals": totals,
            "detection_times_s": detection,
            "outcomes": dict(sorted(outcomes.items())),
            "tests": tests,
        }
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        tmp = REPORT.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
        tmp.replace(REPORT)


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
def reliability():
    yield _report
    _report.write()
