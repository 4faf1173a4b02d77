"""collect_facts and detect on this machine (CPU only, torch and mlx[cpu] installed)."""

import json
import platform
import socket

import pytest

from gpulayer.resources.detect import collect_facts, detect, parse_facts

torch = pytest.importorskip("torch")
pytest.importorskip("mlx.core")


@pytest.fixture(scope="module")
def facts():
    return collect_facts()


def test_detect_this_machine(facts):
    res = detect()
    assert json.loads(json.dumps(facts)) == facts
    assert (res.host, res.system, res.source) == (socket.gethostname(), platform.system(), "detected")
    assert res.python == platform.python_version()
    assert res.devices == [] and res.accelerator == "cpu"
    assert res.framework("torch").version == torch.__version__
    assert "torch.cpu" in res.framework("torch").capabilities
    assert "mlx.cpu" in res.framework("mlx").capabilities
    assert res.cpu_count >= 1 and res.memory_gb > 0


def test_recorded_facts_have_the_live_shape(facts, load_facts):
    """Guards the fixtures against drift from what collect_facts and probe.py really produce."""
    recorded = load_facts("mac_m2_max")
    assert recorded.keys() == facts.keys()
    live, mac = facts["probe"], recorded["probe"]
    assert live.keys() == mac.keys() and live["python"].keys() == mac["python"].keys()
    for section in ("cuda", "mps"):
        assert live["torch"][section].keys() == mac["torch"][section].keys()
    assert live["mlx"]["backends"] == {**mac["mlx"]["backends"], "metal": live["mlx"]["backends"]["metal"]}
    cuda_device = load_facts("linux_h200_recorded")["probe"]["torch"]["cuda"]["devices"][0]
    assert cuda_device.keys() == load_facts("linux_8x_h100")["probe"]["torch"]["cuda"]["devices"][0].keys()


def test_missing_interpreter_is_recorded_not_raised(tmp_path, caplog):
    facts = collect_facts(python=str(tmp_path / "no-python"))
    assert "FileNotFoundError" in facts["probe"]["error"]
    assert "probe: FileNotFoundError" in caplog.text
    assert parse_facts(facts).python == ""


def test_a_probe_that_times_out_still_gives_the_python_version(monkeypatch, tmp_path):
    from gpulayer.resources import detect as detection

    slow = tmp_path / "probe.py"
    slow.write_text("import time\ntime.sleep(30)\n")  # a probe stuck importing on a loaded machine
    monkeypatch.setattr(detection, "PROBE", slow)
    monkeypatch.setattr(detection, "PROBE_TIMEOUT_S", 0.5)
    facts = collect_facts()
    assert "TimeoutExpired" in facts["probe"]["error"]
    res = parse_facts(facts)
    assert res.python == platform.python_version()  # still matches tasks shipped by value
    assert res.frameworks == []  # nothing claimed that was not seen


def test_an_unchanged_interpreter_is_probed_once_and_an_install_or_the_switch_probes_again(monkeypatch, tmp_path):
    """The full probe (seconds: torch and mlx imported) is kept under $XDG_CACHE_HOME, 0600, and reused
    while the interpreter, its sys.path folders, the boot and the variables it sees are unchanged."""
    import stat

    from gpulayer.errors import ConfigError
    from gpulayer.resources import detect as detection

    (tmp_path / "count").mkdir()
    (tmp_path / "probe").mkdir()  # the probe's own folder is on its sys.path: the count is kept elsewhere
    runs = tmp_path / "count" / "runs"
    counting = tmp_path / "probe" / "probe.py"  # the real probe, counting its runs
    counting.write_text(detection.PROBE.read_text() + f"\nopen({str(runs)!r}, 'a').write('run\\n')\n")
    site = tmp_path / "site"  # a folder of the interpreter's sys.path, as site-packages is
    site.mkdir()
    monkeypatch.setattr(detection, "PROBE", counting)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", str(site))

    def probes() -> int:
        return len(runs.read_text().splitlines()) if runs.exists() else 0

    first = collect_facts()["probe"]
    assert probes() == 1 and first["torch"]["version"] == torch.__version__
    assert collect_facts()["probe"] == first and probes() == 1
    [kept] = (tmp_path / "cache" / "gpulayer" / "probes").iterdir()
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE(kept.parent.stat().st_mode) == 0o700

    (site / "newpkg-1.0.dist-info").mkdir()  # what a pip install into a sys.path folder does to it
    assert collect_facts()["probe"]["torch"] == first["torch"] and probes() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a variable the probe depends on
    collect_facts()
    assert probes() == 3
    monkeypatch.setenv("GPULAYER_PROBE_CACHE", "0")
    collect_facts()
    collect_facts()
    assert probes() == 5
    monkeypatch.setenv("GPULAYER_PROBE_CACHE", "yes")
    with pytest.raises(ConfigError, match="GPULAYER_PROBE_CACHE='yes': must be 1"):
        collect_facts()
