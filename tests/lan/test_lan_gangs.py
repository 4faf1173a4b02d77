"""Gangs across hosts (issue 29): three peers in network namespaces on one bridge, real mDNS, a
submitter on a host of its own. gl.run(allreduce, nodes=3) gives every rank the right sum with
gloo and with MLX's ring, over the addresses the hosts reach each other by (never loopback)."""

from __future__ import annotations

import json
import sys
import textwrap

from lanlab import lan_env

LAN_PEERS = 3
LAN_CONCURRENCY = 1

SUBMITTER = textwrap.dedent("""
    import json, os
    import gpulayer as gl

    def allreduce(framework):
        import os
        rank = int(os.environ["RANK"])
        if framework == "torch":
            import torch, torch.distributed as dist
            gl.distributed.init()
            total = torch.tensor([float(rank + 1)])
            dist.all_reduce(total)
            value = total.item()
        else:
            import mlx.core as mx
            value = mx.distributed.all_sum(mx.array([rank + 1.0]), group=gl.distributed.init("mlx")).item()
        return {"sum": value, "peer": os.environ["GPULAYER_PEER_NAME"], "master": os.environ["MASTER_ADDR"],
                "hostfile": json.load(open(os.environ["MLX_HOSTFILE"]))}

    for framework in ("torch", "mlx"):
        print(json.dumps(gl.run(allreduce, framework, nodes=3, accelerator="cpu")), flush=True)
""")


def test_a_gang_of_three_hosts_sums_with_gloo_and_mlx_ring(lan, tmp_path):
    script = tmp_path / "submitter.py"
    script.write_text(SUBMITTER)
    host = lan.add_host("gang-sub")
    done = host.run([sys.executable, str(script)], timeout=300, env=lan_env(lan.key))
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        ranks = json.loads(line)
        assert [r["sum"] for r in ranks] == [6.0] * 3, ranks
        assert sorted(r["peer"] for r in ranks) == sorted(lan.names)
        hosts = [entry[0].rsplit(":", 1)[0] for entry in ranks[0]["hostfile"]]
        assert len(set(hosts)) == 3 and all(h.startswith("10.77.") for h in hosts), hosts
        assert {r["master"] for r in ranks} == {hosts[0]}
