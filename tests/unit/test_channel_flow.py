"""The event loop's secure channel (transport/channel.py) on a real socket pair: large messages sealed into
record buffers used again, the `sealed` callback that frees a sender's buffers, and `hold`, which stops
reading for a while (an upload's back-pressure) without losing or reordering anything."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

from gpulayer.protocol import messages, records
from gpulayer.transport.blocking import BlockingConnection
from gpulayer.transport.channel import AsyncChannel

KEYS = (os.urandom(32), os.urandom(32))
TIMEOUT = 30.0


def pair() -> tuple[socket.socket, BlockingConnection]:
    mine, theirs = socket.socketpair()
    other = BlockingConnection(theirs, max_frame=1 << 30)
    other.secure(KEYS[1], KEYS[0])
    return mine, other


def test_large_messages_sealed_into_reused_record_buffers_arrive_whole_and_free_their_buffers():
    pieces = [os.urandom(3 * records.RECORD_MAX + 777) for _ in range(4)]
    received: list[bytes] = []

    async def main() -> list[int]:
        mine, other = pair()
        reader = threading.Thread(target=lambda: received.extend(
            bytes(other.recv(None)[1][0]) for _ in pieces))
        reader.start()
        channel = AsyncChannel(mine, 1 << 30, lambda *_: None, lambda *_: None)
        channel.secure(*KEYS)
        freed: list[int] = []
        for index, piece in enumerate(pieces):  # one after another, each queued before the last is out
            channel.write({"t": messages.RESULT, "id": index}, [piece], lambda index=index: freed.append(index))
        await asyncio.wait_for(channel.drain(0), TIMEOUT)
        await asyncio.get_running_loop().run_in_executor(None, reader.join, TIMEOUT)
        channel.close()
        other.close()
        return freed

    assert asyncio.run(main()) == [0, 1, 2, 3]
    assert received == pieces


def test_a_held_channel_reads_nothing_until_it_reads_again_and_loses_nothing():
    async def main() -> tuple[list[int], list[int]]:
        mine, other = pair()
        got: list[int] = []
        arrived = asyncio.Event()

        def on_message(msg: messages.Message, _buffers: list) -> None:
            got.append(msg["id"])
            arrived.set()

        channel = AsyncChannel(mine, 1 << 30, on_message, lambda *_: None)
        channel.secure(*KEYS)
        other.send({"t": messages.PING, "id": 0})
        await asyncio.wait_for(arrived.wait(), TIMEOUT)
        channel.hold(True)
        for i in range(1, 4):
            other.send({"t": messages.PING, "id": i}, [os.urandom(30_000)])  # what the socket holds
        for _ in range(3):  # the loop polls its readers at each turn: nothing is read while held
            await asyncio.sleep(0)
        assert mine.recv(1 << 20, socket.MSG_PEEK)  # the messages wait in the socket, unread
        held = list(got)
        channel.hold(False)
        while len(got) < 4:
            arrived.clear()
            await asyncio.wait_for(arrived.wait(), TIMEOUT)
        channel.close()
        other.close()
        return held, got

    held, got = asyncio.run(main())
    assert held == [0]
    assert got == [0, 1, 2, 3]
