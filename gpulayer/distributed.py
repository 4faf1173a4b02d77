"""Inside a gang's rank (docs/gangs.md, ADR 0018): the rendezvous variables and `init()`.

A gang runs one function as N ranks on N distinct peers. Each rank runs in a `Rank` actor that the
submitter created on its peer; the actor reports free ports of its host (`ports`), and `run` calls
the function with the rendezvous variables set: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT for torch.distributed, MLX_RANK and MLX_HOSTFILE (a ring hostfile) for
MLX, and GPULAYER_RANK_ADDR, the address this rank's peer is reached at. `init()` joins the
collective group; the group is torn down when the rank's function returns.

Torch-free and MLX-free until `init()` is called: a worker imports this module to run a rank.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import socket
import struct
import tempfile
from collections.abc import Callable
from typing import Any

from . import accelerators

SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address
SOCKET_IFNAME = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}  # where a backend binds, unless set
RANK_ADDR = "GPULAYER_RANK_ADDR"  # the address this rank's peer is reached at by the others
TORCH, MLX = "torch", "mlx"
_joined: list[str] = []  # the frameworks whose group this process joined (`init`), for `shutdown`


def free_port() -> int:
    """A TCP port free on this host now (the kernel's choice; it may be taken before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port: int = probe.getsockname()[1]
        return port


def rendezvous(rank: int, addresses: list[str], ports: list[tuple[int, int]]) -> dict[str, str]:
    """The variables of `rank` in a gang whose ranks' peers are at `addresses`, with two free `ports`
    each: (torch's store, MLX's ring). MLX_HOSTFILE is the hostfile's JSON here (`Rank.run` writes it
    to a file and names the file)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(len(addresses)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": addresses[0], "MASTER_PORT": str(ports[0][0]), "MLX_RANK": str(rank),
            "MLX_HOSTFILE": ring_hostfile(addresses, [ring for _, ring in ports]), RANK_ADDR: addresses[rank]}


def rank_addresses(per_peer: list[list[str]]) -> list[str]:
    """Each rank's peer address as the other ranks reach it, from its addresses (`per_peer`, the one it was
    reached at first): that one, unless it is a loopback address and some rank lives on another host (then
    its first other one)."""
    first = [hosts[0] for hosts in per_peer]
    if all(loopback(host) for host in first) or not any(loopback(host) for host in first):
        return first
    return [next((host for host in hosts if not loopback(host)), hosts[0]) for hosts in per_peer]


def loopback(host: str) -> bool:
    """Whether `host` (a name, an address, or an IPv6 one in brackets) is this machine's loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def ring_hostfile(addresses: list[str], ports: list[int]) -> str:
    """MLX's ring hostfile (as `mlx.launch` writes it): one list of "ip:port" per rank, in rank order."""
    return json.dumps([[f"{addr}:{port}"] for addr, port in zip(addresses, ports)])


class Rank:
    """The actor that holds one slot of a gang on its peer and runs the rank there."""

    def __init__(self) -> None:
        self._ports = (free_port(), free_port())

    def ports(self) -> tuple[int, int]:
        """Two ports free on this host: torch's store (used on rank 0) and this rank's MLX ring."""
        return self._ports

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            variables: dict[str, str]) -> Any:
        """fn(*args, **kwargs) with the rendezvous `variables` set; the group it joined is left after."""
        with tempfile.NamedTemporaryFile("w", prefix="gpulayer-hostfile-", suffix=".json", delete=False) as out:
            out.write(variables["MLX_HOSTFILE"])
        os.environ.update({**variables, "MLX_HOSTFILE": out.name})
        try:
            return fn(*args, **kwargs)
        finally:
            shutdown()
            os.unlink(out.name)


def init(framework: str = TORCH, backend: str | None = None) -> Any:
    """Join the gang's collective group, from inside a rank: torch.distributed's process group (nccl
    where this rank has CUDA, gloo otherwise, or `backend`), or MLX's ring group (framework="mlx",
    returned). The rank's end leaves it (`shutdown`)."""
    if "RANK" not in os.environ or RANK_ADDR not in os.environ:
        raise RuntimeError("gl.distributed.init() runs inside a rank of a gang: gl.run(fn, nodes=N)")
    if framework == MLX:
        import mlx.core as mx

        group = mx.distributed.init(strict=True, backend="ring")
        _joined.append(MLX)
        return group
    if framework != TORCH:
        raise ValueError(f"framework is {TORCH!r} or {MLX!r}, not {framework!r}")
    import torch.distributed as dist

    if backend is None:
        backend = "nccl" if os.environ.get(accelerators.ENV_DEVICE, "").startswith(accelerators.CUDA) else "gloo"
    interface, variable = interface_of(os.environ[RANK_ADDR]), SOCKET_IFNAME.get(backend)
    if interface is not None and variable is not None:  # its sockets on the address the other ranks reach
        os.environ.setdefault(variable, interface)
    dist.init_process_group(backend, init_method=f"tcp://{_host(os.environ['MASTER_ADDR'])}:{os.environ['MASTER_PORT']}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    _joined.append(TORCH)
    atexit.unregister(shutdown)  # once: a gang job's command (no Rank.run around it) leaves it as it exits,
    atexit.register(shutdown)  # else gloo may abort the process at exit ("terminate called ...")
    return None


def shutdown() -> None:
    """Leave the torch process group that `init` joined (MLX's ring ends with the rank's process)."""
    if TORCH in _joined:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _joined.clear()


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds the IPv4 `address` here (Linux), else None: gloo
    then takes the address of the host's name."""
    try:
        import fcntl
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address, or not Linux
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
