"""A peer that appears while our tasks wait in another peer's queue takes them (issue 26, item 12;
ADR 0011): four tasks queued on a one-slot peer, a two-slot peer joins, and it runs two of them
at once (and may take the last one at the end);
each task runs exactly once, and the makespan is about two task lengths instead of four."""

from __future__ import annotations

import time

import pytest

from gpulayer.client import Client
from gpulayer.matching import Requirements
from support import new_key, wait_until

TASK_S = 3.0
CPU = Requirements.build(accelerator="cpu")


def nap(gate: str, path: str, seconds: float) -> str:
    """Wait (60 s at most) for the file `gate`, sleep `seconds`, note this peer's name in `path`."""
    import os
    import time

    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(seconds)
    name = os.environ["GPULAYER_PEER_NAME"]
    with open(path, "a") as out:
        out.write(name + "\n")
    return name


@pytest.mark.parametrize("heard", ["at once", "by the heartbeat"])
def test_a_peer_that_joins_takes_the_tasks_queued_elsewhere_and_each_runs_once(peer_factory, tmp_path, heard):
    key = new_key()
    peer_factory("alone", "--concurrency", "1", key=key)
    client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    if heard == "by the heartbeat":  # as when its advert came before our tasks queued (a fresh submitter's
        client.directory.on_new = None  # first burst): then the next heartbeat offers it the waiting work
    try:
        client.start()
        assert client.directory.wait_for(lambda records: len(records) == 1, 30)
        gate, paths = str(tmp_path / "gate"), [str(tmp_path / f"task-{i}") for i in range(4)]
        futures = [client.submit(nap, (gate, path, TASK_S), req=CPU) for path in paths]
        # the first runs (held at the gate), the three others wait in the only peer's queue
        wait_until(lambda: client.status(client.directory.records()[0])["load"][1] == 3, 30)
        peer_factory("joiner", "--concurrency", "2", key=key)
        assert client.directory.wait_for(lambda records: len(records) == 2, 30)
        started = time.monotonic()
        open(gate, "w").close()
        names = [f.result(120) for f in futures]
        makespan = time.monotonic() - started
    finally:
        client.close()
    runs = [open(path).read().split() for path in paths]
    assert all(len(ran) == 1 for ran in runs), runs  # each task ran exactly once
    assert names.count("joiner") >= 2, names  # the two tasks that waited longest moved to its two slots
    print(f"{heard}: makespan {makespan:.2f} s for 4 tasks of {TASK_S:g} s on 1 + 2 slots: "
          f"{makespan / (2 * TASK_S):.2f}x the ideal of two task lengths")
