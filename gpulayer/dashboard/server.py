"""`gpulayer dashboard`: the cluster's live page and its JSON API, served on this machine.

Standard library only (http.server's ThreadingHTTPServer); the page is three static files of the
package (no CDN), so it works on a LAN without the internet. It binds loopback by default and
refuses another address unless told so: the page needs no login, and shows every task's name and
submitter. On loopback it also refuses requests whose Host header is not a loopback name, so that
a web page elsewhere cannot read the API through DNS rebinding.

    /             the page            /api/peers   every peer (monitor.Monitor.peers)
    /app.js, /style.css               /api/tasks   running, finished, refusals (Monitor.tasks)
                                      /api/trace   Chrome trace JSON of the tasks (Perfetto)
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from ..client import Client
from ..errors import ConfigError
from .monitor import Monitor

log = logging.getLogger("gpulayer.dashboard")

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8265
STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/index.html": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"), "/style.css": ("style.css", "text/css; charset=utf-8")}
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse a non-loopback address unless `allow_remote`, saying why."""
    if not allow_remote and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve the dashboard on {host}: the page has no login and shows every task and "
            "submitter of the cluster to whoever reaches it. Keep the default 127.0.0.1 (reach it from "
            "elsewhere with an SSH tunnel: ssh -L 8265:127.0.0.1:8265 HOST), or pass --allow-remote")


class Dashboard:
    """The HTTP server and the Monitor behind it; `start()` serves in a thread, `serve_forever()` here."""

    def __init__(self, client: Client, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 allow_remote: bool = False, interval: float = 1.0):
        check_host(host, allow_remote)
        self.monitor = Monitor(client, interval)
        self.httpd = ThreadingHTTPServer((host.strip("[]"), port), _handler(self.monitor, not allow_remote))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        shown = host if isinstance(host, str) else host.decode()
        return f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/"

    def start(self) -> Dashboard:
        self.monitor.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="gpulayer-dashboard-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self, open_browser: bool = False) -> None:
        self.monitor.start()
        print(f"gpulayer dashboard on {self.url} (Ctrl-C to stop)", flush=True)
        if open_browser:
            webbrowser.open(self.url)
        self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.monitor.close()


def _handler(monitor: Monitor, loopback_only: bool) -> type[BaseHTTPRequestHandler]:
    api = {"/api/peers": monitor.peers, "/api/tasks": monitor.tasks, "/api/trace": monitor.trace}

    class Handler(BaseHTTPRequestHandler):
        server_version = "gpulayer-dashboard"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if loopback_only and not _loopback_host_header(self.headers.get("Host", "")):
                self._send(403, b"the dashboard answers only to a loopback Host (127.0.0.1, localhost)\n",
                           "text/plain; charset=utf-8")
            elif path in STATIC:
                name, kind = STATIC[path]
                self._send(200, (resources.files(__package__) / "static" / name).read_bytes(), kind)
            elif path in api:
                extra = {"Content-Disposition": 'attachment; filename="gpulayer-trace.json"'} \
                    if path == "/api/trace" else {}
                self._send(200, json.dumps(api[path]()).encode(), "application/json", extra)
            else:
                self._send(404, b"not found\n", "text/plain; charset=utf-8")

        def _send(self, code: int, body: bytes, kind: str, extra: dict[str, str] | None = None) -> None:
            self.send_response(code)
            headers = {"Content-Type": kind, "Content-Length": str(len(body)), "Cache-Control": "no-store",
                       "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                       "Content-Security-Policy": "default-src 'self'; style-src 'self'; script-src 'self'",
                       **(extra or {})}
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


def _loopback_host_header(value: str) -> bool:
    host = value.rsplit(":", 1)[0] if not value.endswith("]") else value
    return host in LOOPBACK_NAMES or is_loopback(host)
