"""The examples and `gpulayer bench`, run as subprocesses against a real loopback peer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import new_key

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def key(peer_factory) -> str:
    key = new_key()
    peer_factory("examples-peer", key=key)
    return key


def run(*args: str, key: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "GPULAYER_KEY": key})


def test_mlx_matmul_reports_tflops_from_the_peer(key):
    pytest.importorskip("mlx.core")
    out = run("examples/mlx_metal/matmul.py", "--accelerator", "cpu", "--size", "256", "--repeats", "2", key=key)
    assert out.returncode == 0, out.stdout + out.stderr
    line = re.search(r"matmul 256x256 float32 on peer examples-peer \(mlx [\d.]+, cpu\): .* ([\d.]+) TFLOPS",
                     out.stdout)
    assert line and float(line.group(1)) > 0, out.stdout


def sweep_cells(out: subprocess.CompletedProcess) -> list[list[str]]:
    """The sweep example's table: every config once, ranked by val_loss; the cells of its rows."""
    assert out.returncode == 0, out.stdout + out.stderr
    header, *rows = out.stdout.strip().splitlines()
    assert header.split() == ["rank", "lr", "hidden", "val_loss", "epochs", "device", "peer"]
    cells = [row.split() for row in rows]
    assert [int(c[0]) for c in cells] == list(range(1, 9))
    assert {(float(c[1]), int(c[2])) for c in cells} == {(lr, h) for lr in (3e-4, 1e-3, 3e-3, 1e-2) for h in (16, 64)}
    losses = [float(c[3]) for c in cells]
    assert losses == sorted(losses)
    return cells


def test_sweep_prints_every_config_sorted_by_val_loss(key):
    cells = sweep_cells(run("examples/remote_sweep/sweep.py", "--accelerator", "cpu", "--epochs", "2", key=key))
    assert {(c[4], c[5], c[6]) for c in cells} == {("2", "cpu", "examples-peer")}


def test_trainer_regression_example_trains_remotely(key):
    out = run("examples/trainer_regression/train.py", "--remote", "--accelerator", "cpu", "--epochs", "2", key=key)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "remote run on cpu:" in out.stdout
    final = re.search(r"final val_loss=([\d.]+) on cpu", out.stdout)
    assert final and float(final.group(1)) < 1.0, out.stdout


def test_bench_writes_figures_for_each_peer_and_a_plot(key, tmp_path):
    pytest.importorskip("matplotlib")
    report, png = tmp_path / "bench.json", tmp_path / "bench.png"
    out = run("-m", "gpulayer.cli", "bench", "--quick", "--json", str(report), "--plot", str(png), key=key)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[0].split()[:2] == ["PEER", "ACCEL"]
    data = json.loads(report.read_text())
    assert data["settings"]["quick"] and data["submitter"]["host"]
    (peer,) = data["peers"]
    assert peer["name"] == "examples-peer" and peer["accelerator"] == "cpu"
    assert 0 < peer["latency"]["p50_ms"] <= peer["latency"]["p99_ms"]
    assert peer["bandwidth"]["upload_gb_per_s"] > 0 and peer["bandwidth"]["download_gb_per_s"] > 0
    measured = {(m["framework"], m["device"]): m["tflops"] for m in peer["matmul"]}
    expected = {("torch", "cpu")} | ({("mlx", "cpu")} if "mlx" in peer["frameworks"] else set())
    assert set(measured) == expected and all(t > 0 for t in measured.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bench_without_peers_says_so_and_fails(key):
    out = run("-m", "gpulayer.cli", "bench", "--quick", key=new_key())
    assert out.returncode == 1
    assert "no peers found" in out.stderr and "gpulayer join" in out.stderr
    named = run("-m", "gpulayer.cli", "bench", "--peer", "nobody", key=key)
    assert named.returncode == 1 and "no peer named 'nobody'" in named.stderr and "examples-peer" in named.stderr


def quick_bench(name: str, tmp_path: Path) -> dict:
    """`bench/<name>.py --quick` with its JSON in `tmp_path`: its figures (its plot a PNG, drawn beside the JSON
    by default); nothing of bench/results is written."""
    results = REPO / "bench" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    report, png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    out = subprocess.run([sys.executable, f"bench/{name}.py", "--quick", "--json", str(report)],
                         cwd=REPO, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before  # a test run never writes there
    data = json.loads(report.read_text())
    assert data["settings"]["quick"] and data["machine"]["host"]
    return data


@pytest.mark.timeout(600)
def test_data_plane_bench_quick_writes_its_figures_elsewhere_than_bench_results(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("ray")
    sys.path.insert(0, str(REPO / "tests" / "lan"))
    from lanlab import why_unavailable

    data = quick_bench("data_plane", tmp_path)
    for way in ("raw", "gpulayer_shm", "gpulayer_tcp", "ray"):
        assert 0 < data["same_host"][way]["min"] <= data["same_host"][way]["median"]
    reason = why_unavailable()
    if reason:
        assert data["namespaces"] == {"skipped": reason}
    else:
        assert data["namespaces"]["echo"]["gpulayer"]["median"] > 0 and data["namespaces"]["echo"]["raw"]["median"] > 0
        chain = data["namespaces"]["chain"]
        nbytes = data["settings"]["mib"] << 20
        assert chain["gpulayer_keep"]["received_bytes"]["max"] < nbytes // 4  # the value went peer to peer
        assert chain["gpulayer_through_submitter"]["received_bytes"]["min"] >= nbytes
    if "skipped" not in data["small_tasks"]:
        assert all(data["small_tasks"]["p50_ms"][tree]["median"] > 0 for tree in ("now", "before"))
    assert set(data["summary"]["targets"]) >= {"same_host: gpulayer_shm >= ray"}


@pytest.mark.timeout(600)
def test_queue_bench_quick_measures_pulled_jobs_preemption_and_idle_bytes(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(REPO / "tests" / "lan"))
    from lanlab import why_unavailable

    data = quick_bench("queue", tmp_path)
    makespan = data["makespan"]
    assert sum(makespan["ran_on"].values()) == makespan["jobs"]
    assert makespan["pulled"] > 0 and len(makespan["ran_on"]) > 1  # jobs queued on one peer ran on others
    assert makespan["makespan_s"] >= makespan["ideal_s"] > 0
    assert data["preemption"]["sigterm_to_start_ms"]["n"] == data["settings"]["rounds"]
    reason = why_unavailable()
    assert data["idle"] == {"skipped": reason} if reason else data["idle"]["pull_bytes_per_min_per_peer"] > 0
