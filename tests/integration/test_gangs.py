"""Gangs (issue 29, ADR 0018): one function as N ranks on N distinct peers of one host, started
together with the rendezvous done (gloo's and MLX's ring collectives give the right sum on every
rank), stopped together when a rank dies, queued without deadlock when two gangs want the same
peers, refused with reasons when too few peers match, and run again whole under retries=."""

from __future__ import annotations

import os
import signal
import time

import pytest

from gpulayer.client import Client
from gpulayer.client.actors import ActorSpec
from gpulayer.errors import GangFailed, NoMatchingPeer
from gpulayer.matching import Requirements
from support import new_key, process_gone, wait_until, write_override

CPU = Requirements.build(accelerator="cpu")
REPEATS = int(os.environ.get("GPULAYER_GANG_REPEATS", "10"))  # the 50 on a machine of one's own


@pytest.fixture(scope="module")
def four(peer_factory):
    """Four one-slot CPU peers of one cluster, and a submitter of it."""
    key = new_key()
    peers = [peer_factory(f"g{i}", "--concurrency", "1", key=key) for i in range(4)]
    client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    client.start()
    assert client.directory.wait_for(lambda records: len(records) == 4, 30)
    yield client, peers
    client.close()


def allreduce(framework: str) -> dict:
    """Join the gang's group and sum rank + 1 over every rank; what this rank saw."""
    import os

    from gpulayer import distributed

    rank = int(os.environ["RANK"])
    if framework == "torch":
        import torch
        import torch.distributed as dist

        distributed.init()
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        value = total.item()
    else:
        import mlx.core as mx

        group = distributed.init("mlx")
        value = mx.distributed.all_sum(mx.array([rank + 1.0]), group=group).item()
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MLX_RANK")
    return {"sum": value, "peer": os.environ["GPULAYER_PEER_NAME"], "pid": os.getpid(),
            **{k: os.environ[k] for k in keys}, "hostfile": open(os.environ["MLX_HOSTFILE"]).read()}


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_a_gang_of_three_sums_over_every_rank(four, framework):
    client, _ = four
    ranks = client.submit_gang(allreduce, (framework,), {}, req=CPU, nodes=3).result(120)
    assert [r["sum"] for r in ranks] == [6.0] * 3  # 1 + 2 + 3 on every rank
    assert [r["RANK"] for r in ranks] == ["0", "1", "2"] == [r["MLX_RANK"] for r in ranks]
    assert {r["WORLD_SIZE"] for r in ranks} == {"3"} and {r["LOCAL_WORLD_SIZE"] for r in ranks} == {"1"}
    assert len({r["peer"] for r in ranks}) == 3  # three distinct peers
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks}) == 1  # one rendezvous, rank 0's
    assert len({r["hostfile"] for r in ranks}) == 1 and ranks[0]["hostfile"].count("127.0.0.1:") == 3


def stall_then_reduce(folder: str) -> float:
    """Note this rank's pid; rank 1 then waits (to be killed), the others block in all_reduce on it."""
    import os
    import time

    import torch
    import torch.distributed as dist

    from gpulayer import distributed

    rank = int(os.environ["RANK"])
    distributed.init()
    with open(os.path.join(folder, f"rank-{rank}"), "w") as out:
        out.write(str(os.getpid()))
    if rank == 1:
        time.sleep(600)
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def test_kill_9_of_one_rank_stops_the_gang_and_names_that_rank(four, tmp_path):
    client, _ = four
    gang = client.submit_gang(stall_then_reduce, (str(tmp_path),), {}, req=CPU, nodes=3)
    pids = wait_until(lambda: [int((tmp_path / f"rank-{r}").read_text()) for r in range(3)]
                      if all((tmp_path / f"rank-{r}").exists() for r in range(3)) else None, 120)
    killed = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(GangFailed) as failed:
        gang.result(60)  # gloo itself would wait 30 minutes for the dead rank
    print(f"the gang failed {time.monotonic() - killed:.3f} s after the kill")
    assert failed.value.rank == 1 and "rank 1" in str(failed.value) and failed.value.peer in str(failed.value)
    assert "died" in str(failed.value.cause)
    wait_until(lambda: all(process_gone(pid) for pid in pids), 30)  # no process of the gang survives


def note_pid_and_wait(folder: str) -> None:
    """Note this rank's pid, then wait to be stopped."""
    import os
    import time

    with open(os.path.join(folder, f"rank-{os.environ['RANK']}"), "w") as out:
        out.write(str(os.getpid()))
    time.sleep(600)


def test_cancelling_a_running_gang_stops_every_rank(four, tmp_path):
    client, _ = four
    gang = client.submit_gang(note_pid_and_wait, (str(tmp_path),), {}, req=CPU, nodes=3)
    pids = wait_until(lambda: [int((tmp_path / f"rank-{r}").read_text()) for r in range(3)]
                      if all((tmp_path / f"rank-{r}").exists() for r in range(3)) else None, 120)
    assert gang.cancel() and gang.cancelled()
    wait_until(lambda: all(process_gone(pid) for pid in pids), 30)  # every rank's worker ended
    assert len(set(client.submit_gang(whoami, (), {}, req=CPU, nodes=4).result(120))) == 4  # their slots are free


def whoami() -> str:
    import os

    return os.environ["GPULAYER_PEER_NAME"]


def test_two_gangs_of_three_on_four_peers_take_turns_without_deadlock(four):
    client, _ = four
    for _ in range(REPEATS):
        gangs = [client.submit_gang(whoami, (), {}, req=CPU, nodes=3) for _ in range(2)]
        for gang in gangs:
            assert len(set(gang.result(120))) == 3


def test_a_gang_larger_than_the_matching_peers_is_refused_with_reasons(four):
    client, _ = four
    with pytest.raises(NoMatchingPeer) as refused:
        client.submit_gang(whoami, (), {}, req=CPU, nodes=5).result(60)
    assert "needs 5 distinct matching peers; 4 match" in str(refused.value)
    gpu = Requirements.build(accelerator="cuda")
    with pytest.raises(NoMatchingPeer, match="task needs cuda"):
        client.submit_gang(whoami, (), {}, req=gpu, nodes=2).result(60)


class Holder:
    """An actor that only holds its slot."""

    def peer(self) -> str:
        import os

        return os.environ["GPULAYER_PEER_NAME"]


def test_a_gang_leaves_out_a_peer_held_by_the_submitters_own_actor_or_says_so_at_once(four):
    """A rank on a peer whose slot the submitter's own actor holds would wait for the caller itself:
    the gang takes the other peers, and with too few of them it is refused at once, naming the actor."""
    client, _ = four
    holder = client.create_actor(ActorSpec(Holder, (), {}, CPU)).result(60)
    try:
        held = holder.call("peer", (), {}, None).result(60)
        assert held not in client.submit_gang(whoami, (), {}, req=CPU, nodes=3).result(120)
        with pytest.raises(NoMatchingPeer, match=f"every slot of peer {held} holds an actor of this submitter "
                                                 r"\(Holder\)"):
            client.submit_gang(whoami, (), {}, req=CPU, nodes=4).result(60)  # it would wait ten minutes
    finally:
        holder.close()


def die_once(folder: str) -> int:
    """Rank 1 ends its own process the first time, once rank 0 has run (else the gang's stop may come before
    rank 0's call, as it did once in a loaded run); every rank counts its runs."""
    import os
    import time

    rank = int(os.environ["RANK"])
    marker = os.path.join(folder, f"ran-{rank}")
    runs = len(open(marker).read()) if os.path.exists(marker) else 0
    with open(marker, "a") as out:
        out.write("x")
    if rank == 1 and runs == 0:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(folder, "ran-0")) and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(3)
    return runs + 1


def test_retries_run_the_whole_gang_again(four, tmp_path):
    client, _ = four
    assert client.submit_gang(die_once, (str(tmp_path),), {}, req=CPU, nodes=2, retries=1).result(120)[1] == 2
    assert (tmp_path / "ran-0").read_text() == "xx"  # the rank that did not die ran again too
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(GangFailed, match="rank 1"):  # without retries, the death is the gang's error
        client.submit_gang(die_once, (str(fresh),), {}, req=CPU, nodes=2).result(120)


def train_rank(num_nodes: int, batch_size: int, devices: int = 1) -> dict:
    """Fit a small regressor (seed 0) with glt.Trainer(num_nodes=...) on CPU; its weights."""
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import gpulayer.torch as glt

    class Regressor(glt.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, generator=g)
    data = TensorDataset(x, 3 * x[:, :1] - 2 * x[:, 1:])
    torch.manual_seed(0)
    model = Regressor()
    glt.Trainer(accelerator="cpu", num_nodes=num_nodes, devices=devices, max_epochs=2, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False).fit(model, DataLoader(data, batch_size))
    return {name: value.tolist() for name, value in model.state_dict().items()}


def test_the_trainer_over_a_gang_of_two_matches_one_process_with_twice_the_batch(four):
    """DDP over 2 peers, each rank on every other sample of batches of 8: the weights of one process
    on batches of 16 (to float tolerance), on both ranks."""
    import torch

    client, _ = four
    ranks = client.submit_gang(train_rank, (2, 8), {}, req=CPU, nodes=2).result(300)
    single = train_rank(1, 16)
    for weights in ranks:
        for name, value in single.items():
            torch.testing.assert_close(torch.tensor(weights[name]), torch.tensor(value), rtol=1e-5, atol=1e-6)


def test_the_trainer_over_a_gang_of_two_with_two_devices_each_matches_one_process_with_four_times_the_batch(four):
    """DDP over 2 ranks of 2 CPU processes each (Lightning's num_nodes x devices), each process on
    every fourth sample of batches of 4: the weights of one process on batches of 16, on both ranks."""
    import torch

    client, _ = four
    ranks = client.submit_gang(train_rank, (2, 4, 2), {}, req=CPU, nodes=2).result(300)
    single = train_rank(1, 16)
    for weights in ranks:
        for name, value in single.items():
            torch.testing.assert_close(torch.tensor(weights[name]), torch.tensor(value), rtol=1e-5, atol=1e-6)


def ring_of_this_rank() -> tuple[str, str, list]:
    """What an MLX rank reads: its device, MLX_RANK and the ring hostfile."""
    import json
    import os

    return os.environ["GPULAYER_DEVICE"], os.environ["MLX_RANK"], json.load(open(os.environ["MLX_HOSTFILE"]))


def test_an_mlx_gang_of_two_apple_peers_gets_a_ring_hostfile_of_both(peer_factory, tmp_path):
    """Two Macs emulated through the override seam: each rank has the MPS slot, its MLX_RANK, and the
    same hostfile naming both peers' addresses with a port of each."""
    key = new_key()
    mlx = [{"name": "mlx", "version": "0.21.0", "capabilities": ["mlx.cpu", "mlx.metal"]}]
    for name in ("mac1", "mac2"):
        peer_factory(name, "--advertise-override", str(write_override(tmp_path / f"{name}.json", "mps",
                                                                      frameworks=mlx)), key=key)
    client = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    try:
        req = Requirements.build(accelerator="mps", frameworks={"mlx": ""})
        ranks = client.submit_gang(ring_of_this_rank, (), {}, req=req, nodes=2).result(120)
    finally:
        client.close()
    assert [(device, rank) for device, rank, _ in ranks] == [("mps", "0"), ("mps", "1")]
    hostfile = ranks[0][2]
    assert ranks[1][2] == hostfile and len(hostfile) == 2 and all(len(entry) == 1 for entry in hostfile)
    assert [entry[0].rsplit(":", 1)[0] for entry in hostfile] == ["127.0.0.1"] * 2
    assert len({entry[0] for entry in hostfile}) == 2  # a port of each rank's own
