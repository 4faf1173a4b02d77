"""A real LAN on one machine: network namespaces joined by a Linux bridge, with processes inside.

Every name this module creates is `gl<id><kind><n>` with a random 5-hex `id` per LAN (at
most 15 characters, the kernel's limit): the bridge `gl<id>br` in the root namespace, one
namespace `gl<id>n<k>` per host, and the veth pair `gl<id>h<k>` (root side, a port of the
bridge) / `eth0` (inside the namespace, 10.77.0.<k>/16, with a 224.0.0.0/4 route so that
mDNS multicast crosses the bridge). The bridge carries no address and IPv6 is off on the
root-side interfaces, so the root namespace takes part in nothing: all traffic stays inside
the namespaces. The bridge's IGMP snooping is off so that 224.0.0.251 reaches every port.

Clean-up runs from the fixtures' finalizers, from an atexit hook, on SIGTERM/SIGHUP, and at
the next start for LANs whose owning process is gone (a crashed or SIGKILLed run). Every
process started in a namespace is ours; `ip netns pids` finds stragglers (workers included).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from support import PeerProcess

HERE = Path(__file__).resolve().parent
AGENT = HERE / "lan_agent.py"
OWNERS = Path(os.environ.get("GPULAYER_LAN_STATE", "/tmp/gpulayer-lan"))  # one <id>.pid file per live LAN
NAME = re.compile(r"^gl([0-9a-f]{5})(?:br|n\d{1,3}|h\d{1,3})(?:@.*)?$")
SUBNET_PREFIX = "10.77.0."
IPV6_PREFIX = "fd77::"
READY_TIMEOUT = 60.0
_live: dict[str, "Lan"] = {}
_live_lock = threading.Lock()


class LanUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no kernel support)."""


def ip(*args: str, check: bool = True, timeout: float = 15.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def why_unavailable() -> str | None:
    """None when namespaces can be made here, else the reason (for pytest.skip)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (run the suite as root, as CI does)"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (`ip`); .ci/run installs it"
    return None


def new_lan(workdir: Path, **options) -> Lan:
    """A Lan (`options` as Lan's), or a pytest skip that says why none can be made here."""
    import pytest

    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    try:
        return Lan(workdir, **options)
    except LanUnavailable as exc:
        pytest.skip(str(exc))


def lan_env(key: str | None, **extra: str) -> dict:
    """The environment of a process inside a namespace.

    GPULAYER_INTERFACES is removed (tests/conftest.py pins it to 127.0.0.1 for the host):
    inside a namespace every interface (its lo and its veth) is ours.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("GPULAYER_INTERFACES", "GPULAYER_PEERS", "GPULAYER_KEY")}
    env["GPULAYER_CACHE"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    if key is not None:
        env["GPULAYER_KEY"] = key
    env.update(extra)
    return env


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> int:
    """SIGKILL every process in a namespace of ours (peers, workers, agents, relays); returns how many."""
    killed = 0
    for _ in range(5):
        proc = ip("netns", "pids", ns, check=False)
        pids = [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return killed


def cleanup_stale() -> list[str]:
    """Remove the namespaces and links of LANs whose owning process is gone; returns what was removed."""
    owners: dict[str, bool] = {}

    def stale(lan_id: str) -> bool:
        if lan_id not in owners:
            try:
                pid = int((OWNERS / f"{lan_id}.pid").read_text().split()[0])
                owners[lan_id] = not _pid_alive(pid)
            except (OSError, ValueError, IndexError):
                owners[lan_id] = True
        return owners[lan_id]

    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = NAME.match(name)
        if m and stale(m.group(1)):
            _kill_namespace_processes(name)
            ip("netns", "del", name, check=False)
            removed.append(name)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = NAME.match(name)
        if m and stale(m.group(1)):
            ip("link", "del", name, check=False)
            removed.append(name)
    for lan_id, is_stale in owners.items():
        if is_stale:
            (OWNERS / f"{lan_id}.pid").unlink(missing_ok=True)
    return removed


def _cleanup_all(*_args) -> None:
    with _live_lock:
        lans = list(_live.values())
    for lan in lans:
        try:
            lan.close()
        except Exception:  # a best effort at exit
            pass


def _on_signal(signum, frame) -> None:
    _cleanup_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_safety_net_installed = False


def _install_safety_net() -> None:
    global _safety_net_installed
    if _safety_net_installed:
        return
    _safety_net_installed = True
    atexit.register(_cleanup_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)


class Lan:
    """One bridge and the hosts (namespaces) on it; `close()` removes all of it.

    Its hosts are `subnet`<k>/`prefix_len` (10.77.0.<k>/16 by default), with `ipv6` also fd77::<k>/64
    (without `ipv4`, only that and their link-local address); `add_router` joins two LANs
    of distinct subnets through a host that forwards unicast, and never multicast (no mrouted)."""

    def __init__(self, workdir: Path, subnet: str = SUBNET_PREFIX, prefix_len: int = 16, ipv4: bool = True,
                 ipv6: bool = False):
        reason = why_unavailable()
        if reason:
            raise LanUnavailable(reason)
        _install_safety_net()
        cleanup_stale()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.id = secrets.token_hex(3)[:5]
        self.bridge = f"gl{self.id}br"
        self.subnet, self.prefix_len = subnet, prefix_len
        self.ipv4, self.ipv6 = ipv4, ipv6  # the hosts' addresses: 10.77.0.<k>, fd77::<k> (link-local: always)
        self.routes: list[tuple[str, str]] = []  # (destination, gateway) that every host gets
        self.hosts: list[Host] = []
        self.procs: list[subprocess.Popen] = []
        self.closed = False
        self._count = 0
        self._lock = threading.Lock()
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / f"{self.id}.pid").write_text(f"{os.getpid()}\n")  # before anything exists: never stale by mistake
        with _live_lock:
            _live[self.id] = self
        try:
            ip("link", "add", self.bridge, "type", "bridge")
        except RuntimeError as exc:
            self.close()
            raise LanUnavailable(f"cannot create a bridge here: {exc}") from None
        ip("link", "set", self.bridge, "type", "bridge", "mcast_snooping", "0")
        _no_ipv6(self.bridge)
        ip("link", "set", self.bridge, "up")

    def add_host(self, label: str) -> Host:
        index = self.next_index()
        if index > 250:
            raise RuntimeError("at most 250 hosts on one LAN")
        host = Host(self, label, index)
        self.hosts.append(host)
        return host

    def next_index(self) -> int:
        with self._lock:
            self._count += 1
            return self._count

    def route(self, destination: str, gateway: str) -> None:
        """Send `destination` (a prefix) via `gateway`, from every host but the gateway, now and later."""
        self.routes.append((destination, gateway))
        for host in self.hosts:
            if host.ip != gateway:
                ip("-n", host.ns, "route", "add", destination, "via", gateway)

    def add_router(self, other: Lan) -> Host:
        """A host of this LAN with a second leg (eth1) on `other`'s bridge that forwards unicast between
        them: this LAN's hosts route `other`'s subnet through it, and `other`'s hosts all of 10.77.0.0/16
        (so that LANs joined to one hub reach each other); multicast stays put."""
        router = self.add_host("router")
        index = other.next_index()
        leg, address = f"gl{other.id}h{index}", f"{other.subnet}{index}"
        ip("link", "add", leg, "type", "veth", "peer", "name", "eth1", "netns", router.ns)
        _no_ipv6(leg)
        ip("link", "set", leg, "master", other.bridge)
        ip("link", "set", leg, "up")
        ip("-n", router.ns, "addr", "add", f"{address}/{other.prefix_len}", "dev", "eth1")
        ip("-n", router.ns, "link", "set", "eth1", "up")
        ip("netns", "exec", router.ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self.route(f"{other.subnet}0/{other.prefix_len}", router.ip)
        other.route("10.77.0.0/16", address)  # this LAN, and the others that it routes to
        return router

    def close(self) -> None:
        """Stop every process (gracefully first), then remove the namespaces, veths and the bridge."""
        if self.closed:
            return
        self.closed = True
        # in parallel: agents are asked to exit and peers get SIGTERM (goodbye, drain) all at once
        agents = [a for h in self.hosts for a in h.agents]
        peers = [p for h in self.hosts for p in h.peers]
        for agent in agents:
            agent.request_exit()
        for peer in peers:
            peer.terminate()
        deadline = time.monotonic() + 10
        for proc in [a.proc for a in agents] + [p.proc for p in peers if p.proc is not None]:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for peer in peers:
            peer.kill()
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for host in self.hosts:
            _kill_namespace_processes(host.ns)
            ip("link", "del", host.veth, check=False)
            ip("netns", "del", host.ns, check=False)
        ip("link", "del", self.bridge, check=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.leftovers():
            time.sleep(0.1)
        (OWNERS / f"{self.id}.pid").unlink(missing_ok=True)
        with _live_lock:
            _live.pop(self.id, None)

    def leftovers(self) -> list[str]:
        """Namespaces and links of this LAN that still exist."""
        found = [line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines()
                 if line.startswith(f"gl{self.id}")]
        for line in ip("-o", "link", "show", check=False).stdout.splitlines():
            parts = line.split(":")
            if len(parts) > 1 and parts[1].strip().startswith(f"gl{self.id}"):
                found.append(parts[1].strip().split("@")[0])
        return found


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the test process dies (kept across exec)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _no_ipv6(ifname: str) -> None:
    try:
        Path(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6").write_text("1")
    except OSError:
        pass


class Host:
    """A namespace on the LAN with one veth into the bridge."""

    def __init__(self, lan: Lan, label: str, index: int):
        self.lan = lan
        self.label = label
        self.index = index
        self.ns = f"gl{lan.id}n{index}"
        self.veth = f"gl{lan.id}h{index}"
        self.ip = f"{lan.subnet}{index}" if lan.ipv4 else f"{IPV6_PREFIX}{index:x}"
        self.peers: list[LanPeer] = []
        self.agents: list[Agent] = []
        ip("netns", "add", self.ns)
        ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        _no_ipv6(self.veth)
        ip("link", "set", self.veth, "master", lan.bridge)
        ip("link", "set", self.veth, "up")
        if lan.ipv6:  # no duplicate address detection: the addresses are usable at once
            self.run(["sysctl", "-qw", "net.ipv6.conf.eth0.accept_dad=0"], timeout=15).check_returncode()
            ip("-n", self.ns, "addr", "add", f"{IPV6_PREFIX}{index:x}/64", "dev", "eth0", "nodad")
        if lan.ipv4:
            ip("-n", self.ns, "addr", "add", f"{self.ip}/{lan.prefix_len}", "dev", "eth0")
        ip("-n", self.ns, "link", "set", "lo", "up")
        ip("-n", self.ns, "link", "set", "eth0", "up")
        if lan.ipv4:
            ip("-n", self.ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
        for destination, gateway in lan.routes:
            ip("-n", self.ns, "route", "add", destination, "via", gateway)

    def __repr__(self) -> str:
        return f"<Host {self.label} {self.ns} {self.ip}>"

    def popen(self, argv: list[str], env: dict, **kwargs) -> subprocess.Popen:
        """Start a process inside this namespace (in a session of its own; it dies with the test process)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], env=env, start_new_session=True,
                                preexec_fn=_die_with_parent, **kwargs)
        self.lan.procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 30.0, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True, text=True,
                              timeout=timeout, env=env)

    # ---- faults ---------------------------------------------------------------------------------

    def link_down(self) -> None:
        """Cut the cable: the bridge side goes down, so the namespace's eth0 loses its carrier."""
        ip("link", "set", self.veth, "down")

    def link_up(self) -> None:
        ip("link", "set", self.veth, "up")

    def rate_limit(self, rate: str = "20mbit", burst: str = "32kbit", latency: str = "50ms") -> None:
        """A token-bucket limit on what the bridge sends to this host (tc tbf; this kernel has no netem)."""
        subprocess.run(["tc", "qdisc", "replace", "dev", self.veth, "root", "tbf", "rate", rate, "burst", burst,
                        "latency", latency], check=True, capture_output=True, timeout=15)

    def clear_rate_limit(self) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", self.veth, "root"], capture_output=True, timeout=15)

    # ---- processes ------------------------------------------------------------------------------

    def start_peer(self, name: str, key: str, concurrency: int = 2, env: dict | None = None,
                   args: tuple = ()) -> LanPeer:
        peer = LanPeer(self, name, key, concurrency, env or {}, args)
        self.peers.append(peer)
        return peer.start(wait=False)

    def agent(self, key: str | None, name: str | None = None, env: dict | None = None, script: Path = AGENT) -> Agent:
        """A process driven by JSON lines: a submitter (lan_agent.py), or another `script` of that kind."""
        agent = Agent(self, name or f"agent-{self.label}-{len(self.agents)}", key, env or {}, script)
        self.agents.append(agent)
        return agent

    def stop_all(self) -> None:
        for agent in self.agents:
            agent.close()
        for peer in self.peers:
            peer.stop(timeout=10)
            peer.kill()


class LanPeer(PeerProcess):
    """`python -m gpulayer.peer` inside a namespace, on all of its interfaces (no --interfaces)."""

    def __init__(self, host: Host, name: str, key: str, concurrency: int, env: dict, args: tuple):
        super().__init__(host.lan.workdir, key, name, "--concurrency", str(concurrency), *args, interfaces=None)
        self.host = host
        self.host_address = host.ip
        self.concurrency = concurrency
        self.env = lan_env(key, **env)

    def _popen(self, log) -> subprocess.Popen:
        return self.host.popen(self.argv, self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)


class AgentError(RuntimeError):
    pass


class Agent:
    """A submitter process inside a namespace (tests/lan/lan_agent.py), driven by JSON lines.

    Other scripts that speak the same JSON lines (lan_rogue.py) run as agents too.
    """

    def __init__(self, host: Host, name: str, key: str | None, env: dict, script: Path = AGENT):
        import queue

        self.host = host
        self.name = name
        self.log_file = host.lan.workdir / f"{name}.log"
        self._replies: queue.Queue = queue.Queue()
        with open(self.log_file, "ab") as log:
            self.proc = host.popen([sys.executable, str(script)], lan_env(key, **env), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        threading.Thread(target=self._read, name=f"agent-{name}", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.strip()
            if line:
                try:
                    self._replies.put(json.loads(line))
                except ValueError:
                    self._replies.put({"exception": "BadReply", "message": line[:500]})
        self._replies.put({"exception": "AgentExited", "message": f"agent {self.name} exited"})

    def send(self, op: str, **args) -> None:
        if self.proc.poll() is not None:
            raise AgentError(f"agent {self.name} exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = 60.0) -> dict:
        import queue

        try:
            msg = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AgentError(f"agent {self.name}: no reply in {timeout} s:\n{self.log()[-3000:]}") from None
        if "exception" in msg:
            raise AgentError(f"agent {self.name}: {msg['exception']}: {msg.get('message')}\n"
                             f"{msg.get('traceback', '')}\n{self.log()[-3000:]}")
        return msg

    def call(self, op: str, reply_timeout: float | None = None, **args) -> dict:
        """Run one op; its reply is awaited for `reply_timeout` (default: the op's own timeout + 60 s)."""
        self.send(op, **args)
        return self.reply(reply_timeout or (args.get("timeout") or 60.0) + 60.0)

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def request_exit(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
            except (AgentError, OSError):
                pass

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(5)
            except (AgentError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def runs(folder: Path) -> list[dict]:
    """The run markers lan_tasks.marked left in `folder`: item, peer, token, and start or end."""
    out = []
    for path in folder.iterdir():
        item, peer, token, kind = path.name.split(".")
        out.append({"item": int(item), "peer": peer, "token": token, "kind": kind})
    return out


def start_peers(hosts_and_names: list[tuple[Host, str]], key: str, concurrency: int = 2,
                env: dict | None = None) -> list[LanPeer]:
    """Start several peers at once (each probes its interpreter for about 2 s) and wait for all."""
    peers = [host.start_peer(name, key, concurrency, env) for host, name in hosts_and_names]
    for peer in peers:
        peer.wait_ready()
    return peers


class RelayProcess:
    """tests/lan/lan_relay.py inside a namespace: routes LISTEN=TARGET, driven by JSON lines."""

    def __init__(self, host: Host, routes: list[tuple[str, str]], delay_ms: float = 0.0, seed: int = 0,
                 record: Path | None = None):
        self.host = host
        self.log_file = host.lan.workdir / f"relay-{host.label}.log"
        argv = [sys.executable, str(HERE / "lan_relay.py"), "--delay-ms", str(delay_ms), "--seed", str(seed)]
        argv += ["--record", str(record)] if record is not None else []
        for listen, target in routes:
            argv += ["--route", f"{listen}={target}"]
        with open(self.log_file, "ab") as log:
            self.proc = host.popen(argv, lan_env(None), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                   text=True, bufsize=1)
        self.ports = self._reply(20)["ports"]

    def _reply(self, timeout: float) -> dict:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise RuntimeError(f"relay: no reply in {timeout} s:\n{self.log_file.read_text()[-3000:]}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"relay exited:\n{self.log_file.read_text()[-3000:]}")
        return json.loads(line)

    def call(self, op: str, timeout: float = 10.0, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout)

    def close(self) -> dict:
        stats = {}
        if self.proc.poll() is None:
            try:
                stats = self.call("exit").get("stats", {})
                self.proc.wait(5)
            except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
        return stats


class BackgroundSampler:
    """Calls `sample()` every `interval` seconds on a thread while in a `with` block (10 minutes at most).

    `sample()` returns False to stop early.
    """

    interval = 0.1

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> bool | None:
        raise NotImplementedError

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.interval) and time.monotonic() - started < 600:
            if self.sample() is False:
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)
