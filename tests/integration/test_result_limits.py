"""Issue 24, item 10: a result that the wire cannot carry fails its task at once with a ValueError that
names its size, the limit and GPULAYER_MAX_MESSAGE_MB, through the peer and through a lease, and its
worker lives on; a peer handed a frame over 4 GiB answers the task and never hangs its submitter."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gpulayer.client import Client
from gpulayer.errors import TaskRejected
from gpulayer.matching import Requirements
from gpulayer.protocol import messages
from gpulayer.transport import shm
from support import new_key, wait_until

CPU = Requirements.build(accelerator="cpu")
LIMIT_MB = 32


def forty_eight_mib():
    return np.ones(48 << 20, dtype=np.uint8)


def segments_of(pid: int, size: int) -> list[str]:
    """The shared-memory segments of `size` bytes that process `pid` holds open."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:") and \
                    os.stat(f"/proc/{pid}/fd/{fd}").st_size == size:
                found.append(fd)
        except OSError:  # closed meanwhile
            pass
    return found


@pytest.fixture(scope="module")
def peer(peer_factory):
    return peer_factory("limited", "--no-mdns", "--concurrency", "1", key=new_key(),
                        env={"GPULAYER_MAX_MESSAGE_MB": str(LIMIT_MB)})


@pytest.fixture(params=["through-the-peer", "leased"])
def client(request, peer, monkeypatch):
    """A submitter with the same lowered limit, sending through the peer or on a lease of its worker."""
    monkeypatch.setenv("GPULAYER_MAX_MESSAGE_MB", str(LIMIT_MB))
    c = Client(key=peer.key.encode(), peers=peer.address, mdns=False, echo_output=False,
               leases=request.param == "leased")
    if request.param == "leased":
        wait_until(lambda: c.submit(os.getpid, req=CPU).result(30) and c.leases.by_peer.get(peer.peer_id), 30)
    yield c
    c.close()


def test_a_result_over_the_message_limit_fails_its_task_at_once_and_the_worker_lives_on(client, peer):
    worker = client.submit(os.getpid, req=CPU).result(30)
    with pytest.raises(ValueError) as info:
        client.submit(forty_eight_mib, req=CPU).result(30)
    message = str(info.value)
    assert "48.0 MiB" in message and f"{LIMIT_MB} MiB" in message and "GPULAYER_MAX_MESSAGE_MB" in message
    assert client.submit(os.getpid, req=CPU).result(30) == worker  # the same warm worker: it did not die
    assert not segments_of(worker, 48 << 20)  # and it keeps no segment of the refused result
    assert client.submit(np.ones, (1 << 20,), req=CPU).result(30).nbytes == 8 << 20  # under the limit: fine
    assert peer.alive()


def send_a_result_over_4_gib():
    """What a worker of another build, or a task that writes on its worker's socket, could send: a RESULT
    whose buffer is a 5 GiB sealed segment (sparse: no memory behind it) for the task that runs now;
    then the worker exits, so that its own answer never comes (the peer starts another)."""
    import os
    import sys

    from gpulayer.protocol import messages
    from gpulayer.transport import shm

    frame = sys._getframe()
    while frame.f_code.co_name != "_run":  # the worker's receiver: the stream and the message it runs
        frame = frame.f_back
    conn, task_id = frame.f_locals["stream"].conn, frame.f_locals["msg"]["id"]
    size = 5 << 30
    segment = shm.Handle(shm._memfd(size), size).map()
    conn.send({"t": "result", "id": task_id, "data": b""}, [segment])
    os._exit(0)


@pytest.mark.skipif(not shm.SUPPORTED, reason="the 5 GiB buffer is a sparse memfd")
def test_a_peer_handed_a_frame_over_4_gib_answers_the_task_and_serves_on(peer, monkeypatch):
    monkeypatch.setenv("GPULAYER_SHM", "0")  # the peer must send it inline: a frame of 5 GiB
    c = Client(key=peer.key.encode(), peers=peer.address, mdns=False, echo_output=False, leases=False)
    try:
        worker = c.submit(os.getpid, req=CPU).result(30)
        with pytest.raises(TaskRejected) as info:
            c.submit(send_a_result_over_4_gib, req=CPU).result(30)
        assert info.value.code == "too-large" and "4 GiB" in str(info.value)
        wait_until(lambda: not segments_of(peer.pid, 5 << 30), 10)  # and it let go of the segment
        status = c.connection_to(peer.peer_id, [("127.0.0.1", peer.port)]).request
        wait_until(lambda: status(messages.status_request(), 10)["devices"][0]["pid"] not in (None, worker), 30)
        assert c.submit(int, "7", req=CPU).result(30) == 7  # the connection and the peer serve on
        assert peer.alive()
    finally:
        c.close()
