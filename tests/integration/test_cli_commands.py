"""The gpulayer command line: resources detect, key init, peers, demo, and clear start-up errors."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest

from support import new_key


def gpulayer(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpulayer.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_resources_detect_prints_the_report_and_json():
    torch = pytest.importorskip("torch")
    out = gpulayer("resources", "detect")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("host      ")
    assert "device    none (CPU only)" in lines
    assert any(line.startswith(f"framework torch {torch.__version__}: torch.cpu") for line in lines)
    data = json.loads(gpulayer("resources", "detect", "--json").stdout)
    assert data["accelerator"] == "cpu" and data["devices"] == []
    assert {f["name"] for f in data["frameworks"]} >= {"torch"}


def test_key_init_writes_a_private_key_once(tmp_path):
    path = tmp_path / "key"
    out = gpulayer("key", "init", "--path", str(path))
    assert out.returncode == 0 and "cluster id" in out.stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text().strip()) == 64
    again = gpulayer("key", "init", "--path", str(path))
    assert again.returncode == 1 and "--force" in again.stderr


def test_a_peer_without_a_key_says_how_to_make_one(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gpulayer.peer"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path)})
    assert out.returncode == 2 and "gpulayer key init" in out.stderr


def test_a_bad_override_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"devices": [{"kind": "tpu", "name": "x", "memory_gb": 1}]}))
    out = subprocess.run([sys.executable, "-m", "gpulayer.peer", "--advertise-override", str(bad)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "GPULAYER_KEY": new_key()})
    assert out.returncode == 2 and "bad.json" in out.stderr and "tpu" in out.stderr


@pytest.mark.parametrize("name, value, says", [("GPULAYER_SHM", "7", "must be 0 or 1"),
                                               ("GPULAYER_SHM_POOL_MB", "lots", "must be a number"),
                                               ("GPULAYER_SHM_POOL_IDLE_S", "-1", "must be a finite number >= 0")])
def test_a_bad_shared_memory_setting_stops_the_peer_at_start_with_a_clear_error(name, value, says):
    out = subprocess.run([sys.executable, "-m", "gpulayer.peer", "--no-mdns", "--port", "0"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "GPULAYER_KEY": new_key(), name: value})
    assert out.returncode == 1 and f"{name} {says}" in out.stderr and "Traceback" not in out.stderr


def test_peers_lists_the_cluster_as_a_table_and_json(peer_factory):
    key = new_key()
    peer_factory("listed", key=key)
    env = {"GPULAYER_KEY": key}
    table = gpulayer("peers", env=env)
    assert table.returncode == 0
    header, row = table.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "ADDRESS", "VERIFIED", "FOUND", "ACCEL", "MEMORY", "FRAMEWORKS", "SLOTS", "UTIL",
                              "HELD", "JOBS", "STATE"]
    assert row.startswith("listed") and row.split()[2:4] == ["yes", "mdns"] and row.rstrip().endswith("up")
    assert re.search(r" cpu [0-9]+% ", row), row  # the peer's measured utilisation (a CPU peer: no GPU figure)
    rows = json.loads(gpulayer("peers", "--json", env=env).stdout)
    assert [(r["name"], r["state"], r["busy"], r["verified"]) for r in rows] == [("listed", "up", 0, True)]
    assert 0 <= rows[0]["util"]["cpu_percent"] <= 100 and rows[0]["util"]["gpus"] == []


def test_demo_runs_a_real_round_trip_on_an_embedded_peer():
    out = gpulayer("demo", "--tasks", "8")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gl.run(whoami) ->" in out.stdout and "all correct" in out.stdout
    assert "demo-peer" in out.stdout and "the peer withdrew its mDNS record and stopped" in out.stdout


def test_version_and_python_dash_m_gpulayer():
    import importlib.metadata

    import gpulayer

    installed = importlib.metadata.version("gpulayer")
    assert installed == gpulayer.__version__
    for command in ([sys.executable, "-m", "gpulayer", "--version"], [sys.executable, "-m", "gpulayer.cli", "--version"]):
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"gpulayer {installed} (protocol v"), out.stdout
    out = subprocess.run([sys.executable, "-m", "gpulayer", "resources", "detect", "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "accelerator" in json.loads(out.stdout), out.stderr
