"""The options of every GPUlayer TCP connection, blocking or on the event loop."""

from __future__ import annotations

import socket

KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 10, 5, 3  # a dead link is seen in about 25 s
USER_TIMEOUT_MS = 30_000  # sent data unacknowledged this long closes the connection


def tune(sock: socket.socket) -> None:
    """Options for every GPUlayer TCP connection: no Nagle delay, keepalive, a bound on unacked data.

    Keepalive and TCP_USER_TIMEOUT notice a cut link or a vanished host even when no task is
    running (a frozen process still acknowledges: that is the heartbeat's job). Options the
    OS lacks are skipped.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
        option = getattr(socket, name, None)
        if option is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
            except OSError:
                pass
