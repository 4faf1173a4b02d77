"""Count the mDNS packets that reach one namespace's eth0 (a port of the bridge), for a bounded time.

    ip netns exec NS python lan_mdns_capture.py --seconds S [--interface eth0] [--source IP] [--count N] [--responses]

A raw AF_PACKET socket sees every frame the bridge floods to this port: multicast to
224.0.0.251:5353 from every host of the LAN (IGMP snooping is off), and unicast sent to this
host. The namespace runs nothing else, so what arrives is what the others sent. It prints one
JSON line when ready ({"ready": true}) and, after S seconds (at most 600), one with the arrival
time (time.monotonic()) and the size in bytes of each IPv4 UDP packet to or from port 5353 (sent
from IP only, with --source; only DNS responses, with --responses: a peer browses too, and its
queries are not announcements), ending early once it has N of them (--count).
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import time

ETH_P_IP = 0x0800
MAX_SECONDS = 600.0
MAX_PACKETS = 1_000_000


def mdns_size(frame: bytes, responses: bool = False) -> int | None:
    """The IP packet's size if the frame is IPv4 UDP to or from port 5353 (and, with `responses`, a DNS
    response: the header's QR bit), else None."""
    if len(frame) < 14 + 20 + 8 or struct.unpack_from("!H", frame, 12)[0] != ETH_P_IP:
        return None
    ihl = (frame[14] & 0x0F) * 4
    if frame[14 + 9] != socket.IPPROTO_UDP or len(frame) < 14 + ihl + 8:
        return None
    sport, dport = struct.unpack_from("!HH", frame, 14 + ihl)
    if 5353 not in (sport, dport):
        return None
    flags = 14 + ihl + 8 + 2
    if responses and (len(frame) <= flags or not frame[flags] & 0x80):
        return None
    return struct.unpack_from("!H", frame, 16)[0]


def capture(interface: str, seconds: float, source: str | None = None, count: int = MAX_PACKETS,
            responses: bool = False) -> list[list[float]]:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_IP))
    sock.bind((interface, 0))
    sock.settimeout(0.2)
    print(json.dumps({"ready": True}), flush=True)
    packets: list[list[float]] = []
    deadline = time.monotonic() + min(seconds, MAX_SECONDS)
    while time.monotonic() < deadline and len(packets) < min(count, MAX_PACKETS):
        try:
            frame = sock.recv(65536)
        except TimeoutError:
            continue
        size = mdns_size(frame, responses)
        if size is not None and (source is None or socket.inet_ntoa(frame[26:30]) == source):
            packets.append([time.monotonic(), size])
    sock.close()
    return packets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--interface", default="eth0")
    parser.add_argument("--source", default=None, help="only the packets sent from this IPv4 address")
    parser.add_argument("--count", type=int, default=MAX_PACKETS, help="stop once this many packets came")
    parser.add_argument("--responses", action="store_true", help="only DNS responses (no queries)")
    args = parser.parse_args()
    print(json.dumps({"packets": capture(args.interface, args.seconds, args.source, args.count, args.responses)}),
          flush=True)


if __name__ == "__main__":
    main()
