"""A fault-injecting TCP relay (this kernel has no tc netem): delay, random cuts, one stall.

    python lan_relay.py --route LISTEN=TARGET [--route ...] [--delay-ms 2] [--seed N] [--record FILE]

LISTEN and TARGET are host:port (port 0: any free one). It prints {"ports": [...]} once
listening, then obeys JSON lines on stdin, one reply a line on stdout:

    {"op": "chaos", "cut_prob": 0.5, "every": [0.2, 0.6], "max_cuts": 10, "stalls": 1,
     "stall_after": 1.0, "min_age": 0.2, "active_within": 5.0, "max_seconds": 120}
        every `every` seconds, with probability cut_prob, cut a random established connection
        (past the handshake, older than min_age, carrying bytes within active_within seconds;
        both sides get a reset); and stall `stalls` of them after stall_after seconds (bytes
        stop flowing both ways while the sockets stay open)
    {"op": "calm"}    stop injecting (and cut the stalled connection)
    {"op": "cut_all"} reset every connection now
    {"op": "stats"}   counters: connections, cuts, stalls, bytes, the delay seen
    {"op": "trap", "route": 0, "min_up": 300, "hold": "down"}
        the next connection of that route whose client sends a unit (a frame before the handshake's
        end, a sealed record after it: 4-byte big-endian length, then the bytes) of at least min_up
        bytes is trapped at the chunk that starts it: with "down", the chunk goes on and nothing
        more comes back (the request reached the peer, its answer is held); with "both", it is held
        and nothing more flows either way (a stall); "trapped" in the stats says when
    {"op": "cut_trapped"}  reset the trapped connection
    {"op": "release"}      let the trapped connection flow again: what it held is delivered, in order
    {"op": "replay"}       an on-path attacker's replay: every byte the trapped connection's client
        sent up to its trap, sent again on a fresh connection to its target; the reply says what
        came back (the frames before the handshake's end, decoded) and whether the target closed it
    {"op": "refuse", "route": 0}   reset every connection of the route now, and each later one as soon as its
        client sends (its AUTH, after the target's HELLO came back): a path that breaks in the handshake
    {"op": "exit"}

--record FILE appends every byte relayed, both ways, to FILE (what an eavesdropper on the path sees).

Delay: every chunk is forwarded `delay` after it arrived, in order, in both directions, so
a round trip gains twice the delay while throughput is not limited. Every loop is bounded.
Used inside a namespace (on its loopback), between a submitter and peers: the static-peer path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import struct
import sys
import time

import msgpack

CHUNK = 65536
MAX_HELD = 8 << 20  # bytes a stalled direction keeps before it stops reading
MAX_KEPT = 1 << 20  # bytes of a connection's client kept for a replay
REPLAY_S = 5.0  # a replay waits this long at most for its target to answer and close


class Units:
    """One direction's bytes cut into its units: a 4-byte big-endian length, then that many bytes (the
    handshake's frames, then the secure channel's records, ADR 0008)."""

    def __init__(self) -> None:
        self.header = b""
        self.left = 0  # bytes of the current unit still to come

    def feed(self, data: bytes) -> list[int]:
        """The lengths of the units that start in `data`."""
        sizes, at = [], 0
        while at < len(data):
            if self.left:
                step = min(self.left, len(data) - at)
                self.left, at = self.left - step, at + step
                continue
            take = 4 - len(self.header)
            self.header, at = self.header + data[at:at + take], at + take
            if len(self.header) == 4:
                self.left, self.header = int.from_bytes(self.header, "big"), b""
                sizes.append(self.left)
        return sizes


class Pipe:
    """One relayed connection: client <-> target."""

    def __init__(self, relay: Relay, route: int, creader, cwriter, treader, twriter):
        self.relay = relay
        self.route = route
        self.sides = [(creader, twriter, "up"), (treader, cwriter, "down")]
        self.writers = (cwriter, twriter)
        self.opened = self.active = time.monotonic()
        self.bytes = {"up": 0, "down": 0}
        self.stalled = False
        self.held = {"up": False, "down": False}  # a trap's hold, one direction or both
        self.units = Units()  # the client's units (what a trap looks for)
        self.sent = bytearray()  # the client's bytes up to its trap (MAX_KEPT at most): what a replay sends
        self.closed = False
        self.tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        self.tasks = [asyncio.create_task(self.pump(r, w, d)) for r, w, d in self.sides]
        await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        self.close()
        for task in self.tasks:
            task.cancel()

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        sender = asyncio.create_task(self.send(queue, writer, direction))
        try:
            held = 0
            while not self.closed:
                if (self.stalled or self.held[direction]) and held > MAX_HELD:
                    await asyncio.sleep(0.05)
                    continue
                data = await reader.read(CHUNK)
                if not data:
                    break
                if direction == "up" and self.route in self.relay.refused:  # the peer's HELLO came: a broken handshake
                    self.relay.cuts[self.route] += 1
                    self.cut()
                    break
                if direction == "up":
                    self.check_trap(data)
                held += len(data) if self.stalled or self.held[direction] else 0
                queue.put_nowait((time.monotonic() + self.relay.delay, data))
            queue.put_nowait((time.monotonic() + self.relay.delay, b""))
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()

    async def send(self, queue: asyncio.Queue, writer: asyncio.StreamWriter, direction: str) -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            while (self.stalled or self.held[direction]) and not self.closed:
                await asyncio.sleep(0.05)
            if not data or self.closed:
                return
            writer.write(data)
            if self.relay.record is not None:
                self.relay.record.write(data)
                self.relay.record.flush()
            self.active = time.monotonic()
            self.bytes[direction] += len(data)
            self.relay.bytes[direction] += len(data)
            await writer.drain()

    def check_trap(self, data: bytes) -> None:
        """Keep the client's bytes (for a replay) until its trap; spring the route's trap (`Relay.traps`) when
        a unit of its size starts in `data` (within the connection's first MAX_KEPT bytes)."""
        trap = self.relay.traps.get(self.route)
        if self.relay.trapped is self or len(self.sent) + len(data) > MAX_KEPT:
            return
        self.sent += data
        sizes = self.units.feed(data)  # always: a trap armed later must find the units' boundaries
        if trap is None or not any(size >= trap["min_up"] for size in sizes):
            return
        del self.relay.traps[self.route]
        self.relay.trapped = self
        self.held = {"up": trap["hold"] == "both", "down": True}

    def cut(self) -> None:
        """Reset both sides, as a broken path would (RST, not a polite FIN)."""
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except (OSError, AttributeError):
                pass
        self.close(abort=True)

    def close(self, abort: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        for writer in self.writers:
            try:
                writer.transport.abort() if abort else writer.close()
            except Exception:
                pass
        self.relay.pipes.discard(self)


class Relay:
    def __init__(self, routes: list[tuple[tuple[str, int], tuple[str, int]]], delay: float, seed: int,
                 record=None):
        self.routes = routes
        self.record = record  # a binary file that every relayed byte is appended to, or None
        self.delay = delay
        self.rng = random.Random(seed)
        self.pipes: set[Pipe] = set()
        self.servers = []
        self.connections = [0] * len(routes)
        self.bytes = {"up": 0, "down": 0}
        self.cuts = [0] * len(routes)
        self.stalls = [0] * len(routes)
        self.connect_failures = 0
        self.chaos_task: asyncio.Task | None = None
        self.traps: dict[int, dict] = {}  # route -> {"min_up", "hold"}: armed, not sprung yet
        self.trapped: Pipe | None = None  # the connection the last trap caught
        self.refused: set[int] = set()  # routes whose connections are reset at their client's first bytes

    async def start(self) -> list[int]:
        ports = []
        for index, (listen, _target) in enumerate(self.routes):
            server = await asyncio.start_server(lambda r, w, i=index: self.accept(i, r, w), listen[0], listen[1])
            self.servers.append(server)
            ports.append(server.sockets[0].getsockname()[1])
        return ports

    async def accept(self, route: int, creader, cwriter) -> None:
        target = self.routes[route][1]
        try:
            treader, twriter = await asyncio.wait_for(asyncio.open_connection(*target), 5)
        except (OSError, asyncio.TimeoutError):
            self.connect_failures += 1
            cwriter.close()
            return
        for writer in (cwriter, twriter):
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections[route] += 1
        pipe = Pipe(self, route, creader, cwriter, treader, twriter)
        self.pipes.add(pipe)
        await pipe.run()

    async def chaos(self, cut_prob=0.5, every=(0.2, 0.6), max_cuts=10, stalls=1, stall_after=1.0, min_age=0.2,
                    active_within=5.0, max_seconds=120.0) -> None:
        started = time.monotonic()
        cuts = stalled = 0
        for _ in range(100_000):
            if time.monotonic() - started > max_seconds or (cuts >= max_cuts and stalled >= stalls):
                return
            await asyncio.sleep(self.rng.uniform(*every))
            now = time.monotonic()
            # established: old enough, and past the handshake (the peer has spoken)
            live = sorted((p for p in self.pipes if not p.closed and not p.stalled and now - p.opened >= min_age
                           and p.bytes["down"] > 0 and now - p.active <= active_within), key=lambda p: p.opened)
            if not live:
                continue
            if stalled < stalls and now - started >= stall_after:
                pipe = self.rng.choice(live)
                pipe.stalled = True
                stalled += 1
                self.stalls[pipe.route] += 1
            elif cuts < max_cuts and self.rng.random() < cut_prob:
                pipe = self.rng.choice(live)
                pipe.cut()
                cuts += 1
                self.cuts[pipe.route] += 1

    async def replay(self, trapped: Pipe) -> dict:
        """Send what the trapped connection's client sent, on a fresh connection to its target: what came back."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*self.routes[trapped.route][1]), 5)
        writer.write(bytes(trapped.sent))
        received, closed = bytearray(), False
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            async with asyncio.timeout(REPLAY_S):
                while data := await reader.read(CHUNK):
                    received += data
                closed = True
        writer.transport.abort()
        return {"sent": len(trapped.sent), "received": len(received), "closed": closed,
                "frames": handshake_frames(bytes(received))}

    def stats(self) -> dict:
        trapped = self.trapped
        return {"connections": self.connections, "cuts": self.cuts, "stalls": self.stalls, "bytes": self.bytes,
                "open": len(self.pipes), "connect_failures": self.connect_failures, "delay_ms": self.delay * 1000,
                "trapped": None if trapped is None else {"route": trapped.route, "closed": trapped.closed,
                                                         "held": trapped.held, "bytes": trapped.bytes}}


def handshake_frames(data: bytes) -> list:
    """The frames in `data` that are msgpack maps (the handshake's, in clear), their "t" and "code" only."""
    frames, at = [], 0
    while at + 4 <= len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        try:
            frame = msgpack.unpackb(data[at + 4:at + 4 + size])
        except ValueError:
            break
        frames.append({k: frame[k] for k in ("t", "code") if k in frame} if isinstance(frame, dict) else None)
        at += 4 + size
    return frames


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def main_async(args) -> None:
    routes = []
    for spec in args.route:
        listen, _, target = spec.partition("=")
        routes.append((parse_address(listen), parse_address(target)))
    relay = Relay(routes, args.delay_ms / 1000.0, args.seed, open(args.record, "ab") if args.record else None)
    ports = await relay.start()
    print(json.dumps({"ports": ports}), flush=True)
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        try:
            request = json.loads(line)
        except ValueError:
            continue
        op = request.pop("op", None)
        reply: dict = {}
        if op == "chaos":
            if relay.chaos_task is not None:
                relay.chaos_task.cancel()
            relay.chaos_task = asyncio.create_task(relay.chaos(**request))
        elif op == "calm":
            if relay.chaos_task is not None:
                relay.chaos_task.cancel()
                relay.chaos_task = None
            for pipe in list(relay.pipes):
                if pipe.stalled:
                    pipe.cut()
        elif op == "cut_all":
            for pipe in list(relay.pipes):
                pipe.cut()
                relay.cuts[pipe.route] += 1
        elif op == "delay":
            relay.delay = float(request["ms"]) / 1000.0
        elif op == "trap":
            relay.traps[int(request["route"])] = {"min_up": int(request["min_up"]), "hold": request["hold"]}
        elif op == "cut_trapped" and relay.trapped is not None:
            relay.trapped.cut()
            relay.cuts[relay.trapped.route] += 1
        elif op == "release" and relay.trapped is not None:
            relay.trapped.held = {"up": False, "down": False}
        elif op == "replay" and relay.trapped is not None:
            reply["replay"] = await relay.replay(relay.trapped)
        elif op == "refuse":
            relay.refused.add(int(request["route"]))
            for pipe in [p for p in relay.pipes if p.route in relay.refused]:
                pipe.cut()
                relay.cuts[pipe.route] += 1
        reply["stats"] = relay.stats()
        print(json.dumps(reply), flush=True)
        if op == "exit":
            break
    for pipe in list(relay.pipes):
        pipe.close(abort=True)
    for server in relay.servers:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--route", action="append", required=True, help="LISTEN=TARGET, host:port each")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", default=None, help="append every relayed byte to this file")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="exit after this long, whatever happens")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
