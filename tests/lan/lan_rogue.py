"""An attacker on the LAN WITHOUT the cluster key: rogue mDNS adverts and rogue TCP endpoints.

    ip netns exec NS python tests/lan/lan_rogue.py      (its environment has no GPULAYER_KEY)

Driven like lan_agent.py: one JSON request a line on stdin, one JSON reply a line on stdout.
Everything it uses is public on the LAN: the adverts (`snoop`), a peer's HELLO (`hello_of`),
the cluster id inside them. The ops:

    snoop(names, timeout)        browse _gpulayer._tcp and return the adverts heard, by instance name
    hello_of(address)            connect to a peer and return its HELLO (which carries its advert)
    register(instance, txt, port, address=None, server=None)
                                 advertise a service (as peers do: no probing)
    unregister(instance)         withdraw one of its own services (goodbyes, TTL 0)
    forge_goodbye(instance, txt, port, addresses, server)
                                 goodbyes for a service it never registered: someone else's
    flood_start(count, seconds, interval)
                                 `count` bogus service names as bare PTR records (no SRV, TXT or
                                 address behind them), multicast every `interval` and in answer to
                                 every query for the GPUlayer service
    flood_stop()
    listen(mode, ...)            a TCP endpoint, its port in the reply:
        "fake_peer": greets with a HELLO of its own (`hello_peer`, `advert`), answers AUTH with a
                     forged AUTH_OK ("bad_ok") or an ERROR (`error_message`), and records what
                     every connection sent: the frames it could decode and the bytes after AUTH
        "relay":     forwards to `target` unit by unit (a unit is 4 length bytes and a body: the
                     handshake's frames, then the records), recording what it could read, and
                     tampers as `tamper` says (set_tamper changes it for later connections):
                     "forward" (only relays), "inject_submit" (its own SUBMIT to the peer, in
                     clear, right after the peer's AUTH_OK; the peer's answer is held back until
                     the submitter's first record has passed), "inject_submit_fast" (the same,
                     with the answer `fast_delay` after AUTH_OK: the connection closes as the
                     submitter starts to use it), "inject_submit_coalesced" (AUTH_OK and the
                     peer's next record in one segment), "replace_result" (the peer's first
                     record is replaced by a RESULT of its own, in clear), "replay" (the
                     submitter's first record is sent twice), "flip" (a bit of it is flipped)
    endpoint(port)               what an endpoint recorded
    set_tamper(port, tamper, **cfg), cut_all(port)
    exit

Its pickles are bombs: unpickling one creates the file named in `peer_marker` (what it sends to
the peer) or `submitter_marker` (to the submitter), which the test then looks for. Every loop is
bounded in time; the process exits after MAX_SECONDS.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time

import msgpack
from lanserve import serve
from zeroconf import (BadTypeInNameException, DNSOutgoing, DNSPointer, DNSQuestionType, InterfaceChoice, IPVersion,
                      ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf)

SERVICE_TYPE = "_gpulayer._tcp.local."
PROTOCOL_VERSION = 3  # what the peers speak now (the rogue imports nothing of gpulayer: it is not a client)
HEADER = struct.Struct(">I")
_TYPE_PTR, _CLASS_IN, _FLAGS_RESPONSE = 12, 1, 0x8000 | 0x0400  # a PTR record; QR and AA set
MAX_SECONDS = 600.0
IO_TIMEOUT = 10.0  # a rogue connection lives this long at most
MAX_UNIT = (1 << 20) + 64  # the largest unit the relay handles (a record of RECORD_MAX, and slack)


class Bomb:
    """Unpickling this creates `path`: proof that someone unpickled attacker data."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "a"))


def frame(obj: dict) -> bytes:
    body = msgpack.packb({"v": PROTOCOL_VERSION, **obj})
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict | None:
    """The message a unit holds if it is a cleartext one (a map with a string "t"), else None."""
    try:
        msg = msgpack.unpackb(body, raw=False)
    except Exception:
        return None
    return msg if isinstance(msg, dict) and isinstance(msg.get("t"), str) else None


def read_unit(sock: socket.socket) -> bytes | None:
    """One length-prefixed unit (header included), or None at EOF."""
    head = read_exact(sock, 4)
    if head is None:
        return None
    (length,) = HEADER.unpack(head)
    if length > MAX_UNIT:
        raise ValueError(f"a unit of {length} bytes")
    body = read_exact(sock, length)
    return None if body is None else head + body


def read_exact(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def own_address() -> str:
    """This namespace's address on the LAN (eth0), as peers advertise theirs."""
    import ifaddr

    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ip.ip.startswith("127."):
                return ip.ip
    raise RuntimeError("no LAN address in this namespace")


class Collector(ServiceListener):
    def __init__(self):
        self.names: set[str] = set()

    def add_service(self, zc, type_, name):
        self.names.add(name)

    update_service = add_service

    def remove_service(self, zc, type_, name):
        pass


class Endpoint:
    """A rogue TCP listener; each connection is handled on a thread of its own, for IO_TIMEOUT at most."""

    def __init__(self, mode: str, cfg: dict):
        self.mode, self.cfg = mode, cfg
        self.tamper = cfg.get("tamper", "forward")
        self.server = socket.create_server(("0.0.0.0", 0), backlog=64)
        self.port = self.server.getsockname()[1]
        self.connections: list[dict] = []
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                sock, addr = self.server.accept()
            except OSError:
                return
            sock.settimeout(IO_TIMEOUT)
            record = {"from": addr[0], "frames": [], "bytes_after_auth": 0, "tamper": self.tamper,
                      "closed": False}
            with self.lock:
                self.connections.append(record)
                self.open.append(sock)
            handler = self.fake_peer if self.mode == "fake_peer" else self.relay
            threading.Thread(target=self.guard, args=(handler, sock, record), daemon=True).start()

    def guard(self, handler, sock: socket.socket, record: dict) -> None:
        try:
            handler(sock, record)
        except (OSError, ValueError) as exc:
            record["ended"] = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            record["closed"] = True
            sock.close()

    # ---- a peer that does not hold the key ------------------------------------------------------------

    def fake_peer(self, sock: socket.socket, record: dict) -> None:
        cfg = self.cfg
        sock.sendall(frame({"t": "hello", "nonce": os.urandom(32), "peer": cfg.get("hello_peer", "rogue"),
                            "cluster": cfg.get("cluster", ""), "advert": cfg.get("advert", {})}))
        authed = False
        deadline = time.monotonic() + IO_TIMEOUT
        while time.monotonic() < deadline:
            unit = read_unit(sock)
            if unit is None:
                return
            if authed:
                record["bytes_after_auth"] += len(unit)
            msg = decode(unit[4:])
            record["frames"].append(msg.get("t") if msg else f"opaque:{len(unit)}")
            if msg and msg.get("t") == "auth" and not authed:
                authed = True
                if cfg.get("reply") == "error":
                    sock.sendall(frame({"t": "error", "id": None, "code": "auth",
                                        "message": cfg.get("error_message", "no")}))
                else:  # a forged AUTH_OK: it cannot compute the proof
                    sock.sendall(frame({"t": "auth_ok", "mac": os.urandom(32)}))

    # ---- a relay in front of a real peer ---------------------------------------------------------------

    def relay(self, client: socket.socket, record: dict) -> None:
        target = self.cfg["target"]
        host, port = target.rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)), timeout=IO_TIMEOUT)
        with self.lock:
            self.open.append(upstream)
        tamper = record["tamper"]
        record.update(up_units=0, down_units=0, clear=[], clear_after_auth=0, watch_seen=False, injected=[])
        watch = self.cfg.get("watch", "").encode()
        to_peer = pickle.dumps(Bomb(self.cfg["peer_marker"]))  # what it would run on the peer
        to_submitter = pickle.dumps(Bomb(self.cfg["submitter_marker"]))  # what the submitter would unpickle
        send_lock = threading.Lock()

        def note(unit: bytes, index: int, handshake_units: int) -> None:
            if watch and watch in unit:
                record["watch_seen"] = True
            msg = decode(unit[4:])
            if index < handshake_units:
                record["clear"].append(msg.get("t") if msg else "?")
            elif msg is not None:
                record["clear_after_auth"] += 1  # a record that reads as a message in clear: must never be

        submitted = threading.Event()  # the submitter's first record went to the peer

        def down() -> None:  # peer -> submitter: HELLO, AUTH_OK, then records
            index, held = 0, b""
            while (unit := read_unit(upstream)) is not None:
                note(unit, index, 2)
                record["down_units"] += 1
                if index == 1 and tamper.startswith("inject_submit"):
                    with send_lock:  # the peer's channel is secure from here: its own SUBMIT, in clear
                        upstream.sendall(frame({"t": "submit", "id": 1, "fn": to_peer, "args": to_peer, "req": {},
                                                "timeout": None, "name": "rogue"}))
                    record["injected"].append("submit")
                if index == 1 and tamper == "inject_submit_coalesced":
                    held = unit  # AUTH_OK goes out with the peer's next record, in one segment
                elif index == 2 and held:
                    client.sendall(held + unit)
                    held = b""
                elif index == 2 and tamper == "replace_result":
                    client.sendall(frame({"t": "result", "id": 1, "data": to_submitter}))
                    record["injected"].append("result")
                else:
                    client.sendall(unit)
                if index == 1 and tamper == "inject_submit":
                    submitted.wait(3.0)  # the peer's answer waits until the submitter's SUBMIT has passed
                elif index == 1 and tamper == "inject_submit_fast":
                    time.sleep(self.cfg.get("fast_delay", 0.002))  # and then it comes at once
                index += 1
            client.shutdown(socket.SHUT_WR)

        def up() -> None:  # submitter -> peer: AUTH, then records
            index = 0
            while (unit := read_unit(client)) is not None:
                note(unit, index, 1)
                record["up_units"] += 1
                if index == 1 and tamper == "flip":
                    flipped = bytearray(unit)
                    flipped[len(flipped) // 2] ^= 0x10
                    unit = bytes(flipped)
                    record["injected"].append("flip")
                with send_lock:
                    upstream.sendall(unit)
                    if index == 1 and tamper == "replay":
                        upstream.sendall(unit)
                        record["injected"].append("replay")
                if index == 1:
                    submitted.set()
                index += 1
            upstream.shutdown(socket.SHUT_WR)

        threads = [threading.Thread(target=self.guard_half, args=(f, record), daemon=True) for f in (down, up)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(IO_TIMEOUT + 5)
        upstream.close()

    @staticmethod
    def guard_half(fn, record: dict) -> None:
        try:
            fn()
        except (OSError, ValueError) as exc:
            record.setdefault("ended", f"{type(exc).__name__}: {exc}"[:200])

    def cut_all(self) -> int:
        with self.lock:
            socks, self.open = self.open, []
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        return len(socks)

    def close(self) -> None:
        self.server.close()
        self.cut_all()


class Rogue:
    def __init__(self):
        self.zc = Zeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)
        self.ip = own_address()
        self.services: dict[str, ServiceInfo] = {}
        self.endpoints: dict[int, Endpoint] = {}
        self.flood_stop_event = threading.Event()
        self.flood_threads: list[threading.Thread] = []
        self.flood_sent = self.flood_answers = 0

    def op_whoami(self):
        return {"address": self.ip, "key_held": bool(os.environ.get("GPULAYER_KEY"))}

    # ---- public information ------------------------------------------------------------------------

    def op_snoop(self, names=(), timeout=10.0):
        """The adverts heard within `timeout` (until every instance whose TXT "n" is in `names` is)."""
        collector = Collector()
        browser = ServiceBrowser(self.zc, SERVICE_TYPE, collector, question_type=DNSQuestionType.QM)
        found: dict[str, dict] = {}
        refused: set[str] = set()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                for name in list(collector.names - set(found) - refused):
                    try:
                        info = self.zc.get_service_info(SERVICE_TYPE, name, timeout=1000)
                    except BadTypeInNameException:  # its own "gpu\x07box" advert, say
                        refused.add(name)
                        continue
                    if info is not None and info.port:
                        found[name] = {
                            "instance": name, "port": info.port, "server": info.server,
                            "addresses": info.parsed_addresses(IPVersion.V4Only),
                            "txt": {k.decode(): (v or b"").decode("utf-8", "replace")
                                    for k, v in info.properties.items()}}
                heard = {f["txt"].get("n") for f in found.values()}
                if names and all(n in heard for n in names):
                    break
                time.sleep(0.05)
        finally:
            browser.cancel()
        return {"adverts": list(found.values())}

    def op_hello_of(self, address):
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            unit = read_unit(sock)
        msg = decode(unit[4:]) if unit else None
        if msg is None or msg.get("t") != "hello":
            raise RuntimeError(f"no HELLO from {address}")
        return {"peer": msg["peer"], "cluster": msg["cluster"], "advert": msg["advert"]}

    # ---- adverts -------------------------------------------------------------------------------------

    def _info(self, instance, txt, port, addresses, server) -> ServiceInfo:
        name = instance if instance.endswith(SERVICE_TYPE) else f"{instance}.{SERVICE_TYPE}"
        return ServiceInfo(SERVICE_TYPE, name, port=port, properties=txt, server=server, parsed_addresses=addresses)

    def op_register(self, instance, txt, port, address=None, server=None):
        info = self._info(instance, txt, port, [address or self.ip], server or f"rogue-{len(self.services)}.local.")
        self.zc.register_service(info, cooperating_responders=True)
        self.services[info.name] = info
        return {"instance": info.name, "address": f"{address or self.ip}:{port}"}

    def op_unregister(self, instance):
        name = instance if instance.endswith(SERVICE_TYPE) else f"{instance}.{SERVICE_TYPE}"
        self.zc.unregister_service(self.services.pop(name))
        return {"instance": name}

    def op_forge_goodbye(self, instance, txt, port, addresses, server, repeat=2):
        """Goodbyes (PTR, SRV and TXT with TTL 0) for an instance this process never registered."""
        info = self._info(instance, txt, port, addresses, server)
        for i in range(repeat):
            self.zc.send(self.zc.generate_service_broadcast(info, ttl=0, broadcast_addresses=False))
            time.sleep(0.1)
        return {"instance": info.name}

    def op_flood_start(self, count=40, seconds=20.0, interval=0.25, tag="bogus"):
        """`count` bogus names, PTR records only: multicast every `interval`, and at once in answer to every
        query for the GPUlayer service (as a responder would), for `seconds` at most."""
        self.flood_stop_event.clear()
        pointers = [DNSPointer(SERVICE_TYPE, _TYPE_PTR, _CLASS_IN, 4500, f"{tag}{i:02d}-{os.urandom(4).hex()}."
                               f"{SERVICE_TYPE}") for i in range(count)]

        def send():
            out = DNSOutgoing(_FLAGS_RESPONSE)
            for pointer in pointers:
                out.add_answer_at_time(pointer, 0)
            self.zc.send(out)
            self.flood_sent += 1

        def flood():
            deadline = time.monotonic() + min(seconds, MAX_SECONDS)
            while not self.flood_stop_event.is_set() and time.monotonic() < deadline:
                send()
                self.flood_stop_event.wait(interval)

        def answer():
            """Queries are multicast to 5353; this socket gets a copy of each (SO_REUSEPORT, like zeroconf's)."""
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(("", 5353))
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                            socket.inet_aton("224.0.0.251") + socket.inet_aton(self.ip))
            sock.settimeout(0.2)
            deadline = time.monotonic() + min(seconds, MAX_SECONDS)
            with sock:
                while not self.flood_stop_event.is_set() and time.monotonic() < deadline:
                    try:
                        packet = sock.recv(9000)
                    except socket.timeout:
                        continue
                    is_query = len(packet) > 12 and not packet[2] & 0x80
                    if is_query and b"_gpulayer" in packet:
                        send()
                        self.flood_answers += 1

        self.flood_threads = [threading.Thread(target=f, daemon=True) for f in (flood, answer)]
        for thread in self.flood_threads:
            thread.start()
        return {"names": [p.alias for p in pointers]}

    def op_flood_sent(self):
        return {"packets": self.flood_sent}

    def op_flood_stop(self):
        self.flood_stop_event.set()
        for thread in self.flood_threads:
            thread.join(5)
        return {"packets": self.flood_sent, "answers": self.flood_answers}

    # ---- TCP endpoints -------------------------------------------------------------------------------

    def op_listen(self, mode, **cfg):
        if mode not in ("fake_peer", "relay"):
            raise ValueError(f"unknown mode {mode!r}")
        endpoint = Endpoint(mode, cfg)
        self.endpoints[endpoint.port] = endpoint
        return {"port": endpoint.port, "address": f"{self.ip}:{endpoint.port}"}

    def op_endpoint(self, port):
        endpoint = self.endpoints[port]
        with endpoint.lock:
            return {"connections": [dict(c) for c in endpoint.connections]}

    def op_set_tamper(self, port, tamper, **cfg):
        endpoint = self.endpoints[port]
        endpoint.tamper = tamper
        endpoint.cfg.update(cfg)  # fast_delay, say
        return {}

    def op_cut_all(self, port):
        return {"cut": self.endpoints[port].cut_all()}

    def op_exit(self):
        self.op_flood_stop()
        for endpoint in self.endpoints.values():
            endpoint.close()
        for info in list(self.services.values()):
            self.zc.unregister_service(info)
        self.zc.close()
        return {"bye": True}


def main() -> None:
    if os.environ.get("GPULAYER_KEY"):
        raise SystemExit("the rogue must not hold the cluster key")
    timer = threading.Timer(MAX_SECONDS, os._exit, (3,))
    timer.daemon = True
    timer.start()
    serve(Rogue)


if __name__ == "__main__":
    main()
