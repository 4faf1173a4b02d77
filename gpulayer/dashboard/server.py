"""`gpulayer dashboard`: the cluster's live page and its JSON API, served on this machine.

Standard library only (http.server's ThreadingHTTPServer); the page is three static files of the
package (no CDN), so it works on a LAN without the internet. It binds loopback by default and
refuses another address unless told so: the page shows every task's name and submitter. Loopback
is every local account's, so each request needs the dashboard's token, drawn afresh for each run
and printed in its URL (`?token=`, as Jupyter does); the page's own requests carry it in a cookie
set from it. On loopback it also refuses requests whose Host header is not a loopback name, so that
a web page elsewhere cannot read the API through DNS rebinding.

    /             the page            /api/peers   every peer (monitor.Monitor.peers)
    /app.js, /style.css               /api/tasks   running, finished, refusals (Monitor.tasks)
                                      /api/trace   Chrome trace JSON of the tasks (Perfetto)
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import tempfile
import threading
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..client import Client
from ..distributed import loopback
from ..errors import ConfigError
from .monitor import Monitor

log = logging.getLogger("gpulayer.dashboard")

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8265
STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/index.html": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"), "/style.css": ("style.css", "text/css; charset=utf-8")}


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse a non-loopback address unless `allow_remote`, saying why."""
    if not allow_remote and not loopback(host):
        raise ConfigError(
            f"refusing to serve the dashboard on {host}: the page shows every task and submitter of the "
            "cluster, and its token would cross the network in clear HTTP. Keep the default 127.0.0.1 (reach "
            "it from elsewhere with an SSH tunnel: ssh -L 8265:127.0.0.1:8265 HOST), or pass --allow-remote")


class Dashboard:
    """The HTTP server and the Monitor behind it; `start()` serves in a thread, `serve_forever()` here."""

    def __init__(self, client: Client, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 allow_remote: bool = False, interval: float = 1.0):
        check_host(host, allow_remote)
        self.monitor = Monitor(client, interval)
        self.token = secrets.token_urlsafe(32)  # this run's: shown only in the URL printed
        self.httpd = ThreadingHTTPServer((host.strip("[]"), port),
                                         _handler(self.monitor, not allow_remote, self.token))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """The dashboard's address, without its token."""
        host, port = self.httpd.server_address[:2]
        shown = host if isinstance(host, str) else host.decode()
        return f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/"

    def url_for(self, path: str = "") -> str:
        """The URL of `path` (say "api/peers") with the token: what a browser or a script may open."""
        return f"{self.base_url}{path}?token={self.token}"

    @property
    def url(self) -> str:
        """The page's URL, with the token."""
        return self.url_for()

    def start(self) -> Dashboard:
        self.monitor.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="gpulayer-dashboard-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self, open_browser: bool = False) -> None:
        self.monitor.start()
        print(f"gpulayer dashboard on {self.url} (Ctrl-C to stop)", flush=True)
        with tempfile.TemporaryDirectory(prefix="gpulayer-dashboard-") as folder:  # 0700, removed at the end
            if open_browser:
                webbrowser.open(_redirect_page(Path(folder), self.url).as_uri())
            self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        self.monitor.close()


def _redirect_page(folder: Path, url: str) -> Path:
    """A page of ours (0600) that sends the browser on to `url`: what the browser is given to open, so
    that the token never appears on a command line, which every local account can read (as Jupyter does)."""
    path = folder / "open.html"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as page:
        page.write(f'<!doctype html><meta http-equiv="refresh" content="0;url={url}">'
                   f'<p><a href="{url}">Open the GPUlayer dashboard</a></p>\n')
    return path


def _handler(monitor: Monitor, loopback_only: bool, token: str) -> type[BaseHTTPRequestHandler]:
    api = {"/api/peers": monitor.peers, "/api/tasks": monitor.tasks, "/api/trace": monitor.trace}

    class Handler(BaseHTTPRequestHandler):
        server_version = "gpulayer-dashboard"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urlsplit(self.path)
            path, offered = url.path, parse_qs(url.query).get("token", [])
            if loopback_only and not _loopback_host_header(self.headers.get("Host", "")):
                self._send(403, b"the dashboard answers only to a loopback Host (127.0.0.1, localhost)\n",
                           "text/plain; charset=utf-8")
            elif not any(_same(value, token) for value in offered + self._cookie_values()):
                self._send(403, b"this dashboard needs its token: open the URL that `gpulayer dashboard` printed "
                                b"(it ends in ?token=...)\n", "text/plain; charset=utf-8")
            elif path in STATIC:
                name, kind = STATIC[path]
                # the page's own requests carry the token in a cookie of this dashboard's port
                cookie = {"Set-Cookie": f"{self._cookie}={token}; Path=/; HttpOnly; SameSite=Strict"} \
                    if offered else {}
                self._send(200, (resources.files(__package__) / "static" / name).read_bytes(), kind, cookie)
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

        @property
        def _cookie(self) -> str:
            """The cookie's name: cookies are shared by every port of a host, tokens are not."""
            address = self.server.server_address
            return f"gpulayer-dashboard-{address[1] if isinstance(address, tuple) else 0}"

        def _cookie_values(self) -> list[str]:
            """What the request's cookies of this dashboard hold (a client may send several)."""
            pairs = (part.strip().partition("=") for part in self.headers.get("Cookie", "").split(";"))
            return [value for name, _, value in pairs if name == self._cookie]

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            log.debug("%s %s", self.address_string(), (format % args).replace(token, "<token>"))

    return Handler


def _same(offered: str, token: str) -> bool:
    """Whether `offered` is the token, in time that does not depend on where they differ."""
    return hmac.compare_digest(offered.encode("utf-8", "replace"), token.encode())


def _loopback_host_header(value: str) -> bool:
    host = value.rsplit(":", 1)[0] if not value.endswith("]") else value
    return loopback(host)  # localhost, 127.0.0.0/8, [::1]
