"""The dashboard against real peers on loopback: its JSON API, the page in a real headless Chromium,
the loopback rules, the token that keeps other local users out, and the cleaning of hostile STATUS
fields."""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import re
import select
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support import DUMPS_STACKS, interrupt, new_key, wait_until, write_override

from gpulayer.client import Client
from gpulayer.dashboard.server import Dashboard, check_host
from gpulayer.dashboard.status import clean_status
from gpulayer.errors import ConfigError, NoMatchingPeer, TaskRejected
from gpulayer.matching import Requirements

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def hold(release_file: str) -> str:
    """A task that runs until `release_file` exists (bounded: 60 s)."""
    import os
    import time

    deadline = time.monotonic() + 60
    while not os.path.exists(release_file) and time.monotonic() < deadline:
        time.sleep(0.02)
    return "released"


def get(url: str, host: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def api(dashboard: Dashboard, name: str):
    return json.loads(get(dashboard.url_for("api/" + name))[1])


@pytest.fixture(scope="module")
def site(peer_factory, tmp_path_factory):
    """Two peers (a fake 80 GB CUDA one and a CPU one), a Client of their cluster and a dashboard on it."""
    key = new_key()
    override = write_override(tmp_path_factory.mktemp("dash") / "cuda.json", "cuda", memory_gb=80.0)
    peers = {"dash-gpu": peer_factory("dash-gpu", "--concurrency", "1", "--advertise-override", str(override),
                                      key=key),
             "dash-cpu": peer_factory("dash-cpu", "--concurrency", "1", key=key)}
    client = Client(key=key.encode(), echo_output=False)
    dashboard = Dashboard(client, port=0, interval=0.2).start()
    try:
        yield dashboard, client, peers
    finally:
        dashboard.close()
        client.close()


def peers_by_name(dashboard: Dashboard) -> dict[str, dict]:
    return {row["name"]: row for row in api(dashboard, "peers")}


def both_up_and_sampled(dashboard: Dashboard):
    rows = peers_by_name(dashboard)
    ready = {"dash-gpu", "dash-cpu"} <= rows.keys() and all(
        rows[n]["state"] == "up" and rows[n]["cpu_percent"] is not None for n in ("dash-gpu", "dash-cpu"))
    return rows if ready else None


def test_api_shows_peers_tasks_timeline_and_refusals(site, tmp_path):
    dashboard, client, _ = site
    rows = wait_until(lambda: both_up_and_sampled(dashboard), timeout=60)
    gpu, cpu = rows["dash-gpu"], rows["dash-cpu"]
    assert gpu["accelerator"] == "cuda" and gpu["memory_kind"] == "dedicated"
    assert [d["total_gb"] for d in gpu["devices"]] == [80.0]
    assert cpu["accelerator"] == "cpu" and cpu["devices"] == [] and 0 < cpu["ram_available_gb"] <= cpu["ram_gb"] + 1
    assert gpu["python"] and gpu["slots"] == 1 and gpu["busy"] == 0
    assert 0 <= gpu["cpu_percent"] <= 100 and gpu["util_age_s"] < 10

    release = tmp_path / "release"
    future = client.submit(hold, (str(release),), req=Requirements.build(accelerator="cuda", gpu_memory_gb=20))
    running = wait_until(lambda: [t for t in api(dashboard, "tasks")["running"] if t["name"].endswith("hold")],
                         timeout=30)
    assert running[0]["peer"] == "dash-gpu" and running[0]["submitter"] == "127.0.0.1"
    assert running[0]["device"] == "cuda:0" and running[0]["elapsed_s"] >= 0
    reserved = wait_until(lambda: peers_by_name(dashboard)["dash-gpu"]["devices"][0]["unreserved_gb"] == 60.0,
                          timeout=30)  # the 20 GB the running task declared are held back
    assert reserved
    release.touch()
    assert future.result(30) == "released"
    finished = wait_until(lambda: [t for t in api(dashboard, "tasks")["finished"] if t["name"].endswith("hold")],
                          timeout=30)
    assert finished[-1]["outcome"] == "ok" and finished[-1]["end"] >= finished[-1]["start"]

    trace = api(dashboard, "trace")
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].endswith("hold")]
    assert spans and spans[0]["dur"] > 0
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"dash-gpu", "cuda:0"} <= names

    # a REJECT of the peer's own (only the peer knows its other distributions) shows as a refusal
    with pytest.raises((NoMatchingPeer, TaskRejected)):
        client.submit(hold, (str(release),), req=Requirements.build(
            frameworks={"surely-not-installed-dist": ">=1"}, peer="dash-cpu")).result(30)
    refusals = wait_until(lambda: [r for r in api(dashboard, "tasks")["refusals"]
                                   if "surely-not-installed-dist" in r["message"]], timeout=30)
    assert refusals[0]["code"] == "no-match" and refusals[0]["peer"] == "dash-cpu"
    assert any("surely-not-installed-dist" in r["reason"] for r in api(dashboard, "tasks")["submitter_refusals"])


def test_api_shows_jobs_with_their_state_elapsed_time_and_log_tail(site, tmp_path):
    from gpulayer.client.jobs import Jobs

    dashboard, client, _ = site
    release = tmp_path / "release-job"
    script = (f"import os, time\nprint('epoch 1 loss 0.5', flush=True)\n"
              f"while not os.path.exists({str(release)!r}): time.sleep(0.02)\nprint('done')")
    job = Jobs(client).submit(["python", "-c", script], None, Requirements.build(accelerator="cpu"), name="dash-job")
    shown = wait_until(lambda: [j for j in api(dashboard, "tasks")["jobs"]
                                if j["id"] == job.id and "epoch 1 loss 0.5" in j["tail"]], timeout=60)
    assert shown[0]["state"] == "running" and shown[0]["name"] == "dash-job" and shown[0]["peer"] == "dash-cpu"
    assert shown[0]["started"] is not None and shown[0]["ended"] is None and shown[0]["elapsed_s"] is not None
    release.touch()
    ended = wait_until(lambda: [j for j in api(dashboard, "tasks")["jobs"]
                                if j["id"] == job.id and j["state"] == "succeeded"], timeout=60)
    assert ended[0]["exit_code"] == 0 and ended[0]["tail"].endswith("done\n")
    assert shown[0]["peak_memory_bytes"] is None and ended[0]["peak_memory_bytes"] == job.refresh().peak_memory > 0
    peers = {p["name"]: p for p in api(dashboard, "peers")}
    assert peers["dash-cpu"]["job_isolation"] in ("cgroup", "process-group")


class Page:
    """A page in headless Chromium, driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
    JSON messages ending in NUL, Chromium reading fd 3 and writing fd 4): nothing listens on a port."""

    def __init__(self, url: str, profile):
        to_chrome, self._out = os.pipe()
        self._in, from_chrome = os.pipe()
        argv = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--remote-debugging-pipe", f"--user-data-dir={profile}", "--window-size=1400,900", "about:blank"]
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{to_chrome} 4>&{from_chrome}', "chromium", *argv],
                                     pass_fds=(to_chrome, from_chrome), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_chrome)
        os.close(from_chrome)
        self._ids = 0
        self._buffer = b""
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def call(self, method: str, session: str | None = None, **params):
        self._ids += 1
        msg = {"id": self._ids, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            while b"\0" not in self._buffer:
                ready, _, _ = select.select([self._in], [], [], max(deadline - time.monotonic(), 0))
                chunk = os.read(self._in, 1 << 20) if ready else b""
                assert chunk, f"Chromium did not answer {method}"
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._ids:
                assert "error" not in reply, reply
                return reply["result"]
        raise AssertionError(f"no answer to {method} within 30 s")

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", self.session, expression=expression, returnByValue=True)
        return result["result"].get("value")

    def screenshot(self, path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", self.session, format="png")["data"]))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self._in)
        os.close(self._out)


STATE_OF = 'document.querySelector(\'tr[data-peer="%s"]\')?.dataset.state'


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on this machine (.ci/run installs the distribution's "
                                            "chromium package where apt-get exists)")
def test_page_in_headless_chromium(site, tmp_path):
    dashboard, client, peers = site
    wait_until(lambda: both_up_and_sampled(dashboard), timeout=60)
    release = tmp_path / "release"
    future = client.submit(hold, (str(release),), req=Requirements.build(accelerator="cuda", gpu_memory_gb=20))
    page = Page(dashboard.url, tmp_path / "chromium-profile")
    try:
        wait_until(lambda: page.js("[...document.querySelectorAll('#running td.task-name')]"
                                   ".some(td => td.textContent === 'hold')") and "reserved" in page.js(
            'document.querySelector(\'tr[data-peer="dash-gpu"] td.memory\').textContent'), timeout=30, interval=0.2)
        assert page.js(STATE_OF % "dash-gpu") == "up" and page.js(STATE_OF % "dash-cpu") == "up"
        assert page.js("location.href") == dashboard.base_url  # the token is off the address bar: in a cookie
        gpu_row = page.js('document.querySelector(\'tr[data-peer="dash-gpu"]\').textContent')
        assert "free of 80 GB (20 GB reserved) dedicated" in gpu_row and "NVIDIA H100 80GB HBM3" in gpu_row
        cpu_memory = page.js('document.querySelector(\'tr[data-peer="dash-cpu"] td.memory\').textContent')
        assert re.fullmatch(r"[0-9.]+ GB host, [0-9.]+ GB free", cpu_memory), cpu_memory
        running = page.js("[...document.querySelectorAll('#running tr.task')].map(tr => tr.textContent)")
        assert any(row.startswith("dash-gpucuda:0hold127.0.0.1") for row in running), running
        page.screenshot(tmp_path / "dashboard.png")
        assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000
        release.touch()
        assert future.result(30) == "released"

        # the same page, never reloaded, follows the cluster: a stopped peer turns down
        before = int(page.js("document.getElementById('updated').dataset.refreshes"))
        peers["dash-cpu"].stop()
        wait_until(lambda: page.js(STATE_OF % "dash-cpu") == "down", timeout=30, interval=0.2)
        assert page.js(STATE_OF % "dash-gpu") == "up"
        assert int(page.js("document.getElementById('updated').dataset.refreshes")) > before
        assert wait_until(lambda: page.js("document.querySelectorAll('#timeline .span').length"), timeout=10)
        page.screenshot(tmp_path / "dashboard-after-stop.png")
    finally:
        release.touch()
        page.close()


def test_loopback_only_unless_allowed(site):
    dashboard = site[0]
    with pytest.raises(ConfigError, match="--allow-remote"):
        check_host("0.0.0.0", allow_remote=False)
    with pytest.raises(ConfigError, match="SSH tunnel"):
        check_host("192.0.2.7", allow_remote=False)
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_host(host, allow_remote=False)
    check_host("0.0.0.0", allow_remote=True)
    # a page elsewhere that rebinds its own name to 127.0.0.1 sends its own Host: refused
    status, body = get(dashboard.url_for("api/peers"), host="evil.example:8265")
    assert status == 403 and b"loopback Host" in body
    assert get(dashboard.url_for("api/peers"), host="localhost")[0] == 200
    assert get(dashboard.url_for("nothing-here"))[0] == 404
    status, page = get(dashboard.url)
    assert status == 200 and b'src="/app.js"' in page and b"http" not in page.split(b"<body>")[0].lower()


def test_hostile_status_fields_are_cleaned():
    bad = "\x1b[31mred\x07" + "x" * 10_000
    clean = clean_status({
        "now": math.inf, "load": ["1", None], "slots": True, "draining": "yes",
        "running": [{"name": bad, "submitter": 7, "device": ["cuda"], "start": 5.0},
                    {"name": "no start"}, "not a dict", {"name": "t", "start": math.nan}] * 2000,
        "finished": [{"name": "n", "start": 10.0, "end": 5.0}, {"name": "ok", "start": 1.0, "end": 2.0,
                                                                  "outcome": "\n" * 50}],
        "refusals": [{"t": -1}, {"t": 3.0, "code": None, "message": bad}],
        "actors": {"not": "a list"},
        "jobs": [{"id": bad, "state": "running", "submitted": 1.0, "tail": "ok\n\x1b[2J" + bad,
                  "peak_memory_bytes": -5},
                 {"id": "x", "state": "exploded", "submitted": 1.0}, {"state": "queued"}],
        "unreserved_gb": {"cuda:0": 8.0, "cuda:1": -3, "\x00": 1.0, 5: 2.0, "cuda:2": "x"},
        "job_isolation": "<script>", "job_isolation_reason": bad,
        "util": {"t": 1.0, "cpu_percent": 1e9, "ram_total_gb": -4, "source": "<script>",
                 "gpus": [{"index": 0, "util_percent": math.nan, "memory_used_gb": 3}, 5] * 100},
    })
    assert clean["now"] is None and clean["busy"] is None and clean["slots"] is None and clean["draining"] is False
    assert len(clean["running"]) == 1024 // 4  # the newest 1024 entries, a quarter of them usable
    first = clean["running"][0]
    assert first["name"].startswith("[31mredxx") and len(first["name"]) == 200
    assert first["submitter"] == "" and first["device"] == ""
    assert [t["name"] for t in clean["finished"]] == ["ok"] and clean["finished"][0]["outcome"] == "?"
    assert len(clean["refusals"]) == 1 and clean["refusals"][0]["code"] == "?"
    assert len(clean["refusals"][0]["message"]) == 1000 and "\x1b" not in clean["refusals"][0]["message"]
    assert clean["actors"] == [] and clean["unreserved_gb"] == {"cuda:0": 8.0}
    assert clean["job_isolation"] is None and len(clean["job_isolation_reason"]) == 200
    assert "\x1b" not in clean["job_isolation_reason"]
    assert len(clean["jobs"]) == 1 and len(clean["jobs"][0]["id"]) == 40
    assert "\x1b" not in clean["jobs"][0]["tail"] and len(clean["jobs"][0]["tail"]) <= 2000
    assert clean["jobs"][0]["peak_memory_bytes"] is None
    util = clean["util"]
    assert util["cpu_percent"] is None and util["ram_total_gb"] is None and util["source"] is None
    assert len(util["gpus"]) == 32 and util["gpus"][0] == {"index": 0, "util_percent": None, "memory_used_gb": 3.0,
                                                           "memory_total_gb": None}
    assert clean_status("garbage")["running"] == [] and clean_status(None)["util"] is None


# ---- the token: other local users read nothing --------------------------------------------------------

def secret_named_task() -> str:
    return "done"


# Run as another local account: the ways into the dashboard it can try without the token.
INTRUDE = """
import json, sys, urllib.error, urllib.request
base, cookie = sys.argv[1], sys.argv[2]
tries = [("", {}), ("index.html", {}), ("api/tasks", {}), ("api/peers?token=guess", {}),
         ("api/tasks", {"Cookie": cookie + "=guess"}), ("api/trace?token=", {})]
answers = []
for path, headers in tries:
    try:
        with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers), timeout=10) as reply:
            answers.append([path, reply.status, reply.read().decode(errors="replace")])
    except urllib.error.HTTPError as exc:
        answers.append([path, exc.code, exc.read().decode(errors="replace")])
print(json.dumps(answers))
"""


def start_cli_dashboard(key: str, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`gpulayer dashboard --port 0` of the cluster of `key`, and the URL it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "gpulayer", "dashboard", "--port", "0", *args],
                            env={**os.environ, "GPULAYER_KEY": key, **DUMPS_STACKS, **(env or {})},
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    found = re.search(r"http://\S+", line)
    if found is None:
        stop_cli_dashboard(proc)
        raise AssertionError(f"gpulayer dashboard printed no URL: {line!r}")
    return proc, found.group(0)


def stop_cli_dashboard(proc: subprocess.Popen) -> str:
    """Ctrl-C, as its user stops it; what it wrote on its standard error."""
    return interrupt(proc, 30)[1]


def test_another_local_user_without_the_token_reads_nothing(peer_factory, other_user):
    key = new_key()
    peer = peer_factory("dash-private", "--concurrency", "1", key=key)
    client = Client(key=key.encode(), peers=peer.address, mdns=False, echo_output=False)
    proc, url = start_cli_dashboard(key, env={"GPULAYER_PEERS": peer.address})
    errors = ""
    try:
        assert client.submit(secret_named_task, req=Requirements.build()).result(30) == "done"
        base, _, token = url.partition("?token=")
        # the owner, with the URL printed: the page sets the cookie that the page's own requests carry
        owner = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
        with owner.open(url, timeout=10) as reply:
            assert reply.status == 200 and b'src="/app.js"' in reply.read()
        wait_until(lambda: [t for t in json.loads(owner.open(base + "api/tasks", timeout=10).read())["finished"]
                            if t["name"].endswith("secret_named_task")], timeout=30)
        # another local account: neither the page nor the API, nor with a guessed token or cookie
        port = base.rstrip("/").rsplit(":", 1)[1]
        intruder = other_user.run(INTRUDE, base, f"gpulayer-dashboard-{port}", timeout=60)
        assert intruder.returncode == 0, intruder.stderr
        answers = json.loads(intruder.stdout)
        assert [status for _, status, _ in answers] == [403] * len(answers), answers
        assert all("secret_named_task" not in body and "needs its token" in body for _, _, body in answers)
        assert token, f"no token in the URL printed: {url}"
        # nor can it read the token where any account may look: the dashboard's command line
        assert token not in Path(f"/proc/{proc.pid}/cmdline").read_text()
    finally:
        errors = stop_cli_dashboard(proc)
        client.close()
    assert token not in errors


def test_the_token_is_in_no_log(site, caplog):
    dashboard = site[0]
    with caplog.at_level(logging.DEBUG, "gpulayer.dashboard"):
        assert get(dashboard.url_for("api/peers"))[0] == 200
        assert get(dashboard.base_url + "api/peers")[0] == 403
    assert any("GET /api/peers?token=<token>" in line for line in caplog.messages), caplog.messages
    assert not any(dashboard.token in line for line in caplog.messages)


def test_open_gives_the_browser_a_private_page_not_the_token(tmp_path):
    """`--open`: a browser's command line is every local account's to read (/proc/PID/cmdline), so the
    browser is given a file of the user's own (0600) that leads on to the URL with the token."""
    seen = tmp_path / "seen"
    browser = tmp_path / "browser"
    browser.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {seen}.argv\nstat -c %a "${{1#file://}}" > {seen}.mode\n'
                       f'cat "${{1#file://}}" > {seen}.page\n')
    browser.chmod(0o700)
    proc, url = start_cli_dashboard(new_key(), "--open", env={"BROWSER": str(browser), "GPULAYER_PEERS": ""})
    try:
        wait_until(lambda: Path(f"{seen}.page").exists() and Path(f"{seen}.page").read_text(), timeout=30)
    finally:
        stop_cli_dashboard(proc)
    token = url.partition("?token=")[2]
    argv = Path(f"{seen}.argv").read_text().split()
    assert token and len(argv) == 1 and argv[0].startswith("file://") and token not in argv[0]
    assert Path(f"{seen}.mode").read_text().strip() == "600"
    assert f'url={url}"' in Path(f"{seen}.page").read_text()
    assert not Path(argv[0].removeprefix("file://")).exists()  # removed when the dashboard stopped
