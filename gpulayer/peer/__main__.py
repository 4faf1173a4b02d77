"""`python -m gpulayer.peer` (also `gpulayer join`): run this machine's peer."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import GPULayerError
from ..taskenv import SLOT_ENV_PREFIX
from ..jobs.store import RETENTION_DAYS, RETENTION_GB

if TYPE_CHECKING:
    from .server import PeerConfig

INVITE_BROWSE_SECONDS = 1.5  # how long `--invite` listens for peers over mDNS (without --seed), the first time
INVITE_BROWSES = 3  # listens, each twice as long as the last, until a peer heard has the invite open


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=0, help="TCP port to listen on (default: any free port)")
    parser.add_argument("--interfaces", default=None,
                        help="comma-separated IPv4 addresses for TCP and mDNS (default: all; "
                             "GPULAYER_INTERFACES also sets it)")
    parser.add_argument("--name", default="", help="peer name shown to submitters (default: host name)")
    parser.add_argument("--python", default=sys.executable,
                        help="the job interpreter that runs tasks (default: this one)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="tasks at once per GPU (default 1), or in all on a CPU-only peer (default: cores)")
    parser.add_argument("--key-file", default=None, help="cluster key file (default: ~/.config/gpulayer/key)")
    parser.add_argument("--invite", default=None, metavar="CODE",
                        help="get the cluster key first with an invite code from `gpulayer invite` (written 0600 to "
                             "--key-file, default ~/.config/gpulayer/key), from the inviting peer found over mDNS "
                             "or at --seed")
    parser.add_argument("--seed", action="append", default=[], type=_seed, metavar="HOST:PORT",
                        help="a peer to gossip with at first, beyond mDNS (another subnet, say), and where --invite "
                             "looks; repeatable (GPULAYER_PEERS adds more)")
    parser.add_argument("--advertise-override", metavar="FILE", default=None,
                        help="JSON file replacing detected resources (operators and tests; see docs)")
    parser.add_argument("--measured-from", metavar="FILE", default=None,
                        help="JSON file of recorded utilisation readings used instead of measuring (tests; see docs)")
    parser.add_argument("--preload", default=None,
                        help="comma-separated modules each worker imports at start (default: the GPU frameworks)")
    parser.add_argument("--env", action="append", default=[], type=env_assignment, metavar="NAME=VALUE",
                        help="a variable in the environment of the peer and so of every worker and task, set "
                             "before the peer detects its devices and starts its workers; repeatable "
                             "(e.g. --env PYTORCH_ENABLE_MPS_FALLBACK=1)")
    parser.add_argument("--workdir", default=None, type=_workdir, metavar="DIR",
                        help="the folder tasks start in, kept (default: a scratch folder removed when the peer stops)")
    parser.add_argument("--state-dir", default=None, metavar="DIR",
                        help="the folder of this peer's jobs (default: the first free of ~/.local/state/gpulayer/peer, "
                             "peer-2, ...; $XDG_STATE_HOME moves it)")
    parser.add_argument("--job-retention-days", type=float, default=RETENTION_DAYS, metavar="DAYS",
                        help=f"ended jobs older than this are removed with their folder (default {RETENTION_DAYS:g})")
    parser.add_argument("--job-retention-gb", type=float, default=RETENTION_GB, metavar="GB",
                        help="the oldest ended jobs are removed while the jobs' folders come to more than this "
                             f"(default {RETENTION_GB:g})")
    parser.add_argument("--max-slots-per-user", type=_positive_int, default=None, metavar="N",
                        help="the most slots one user (user@host of the submitter) holds at once here, tasks and "
                             "jobs together; the others' work goes first (default: no cap)")
    parser.add_argument("--no-mdns", action="store_true", help="do not advertise (static GPULAYER_PEERS use only)")
    parser.add_argument("--no-pull", action="store_true",
                        help="never take over jobs queued on other peers (by default a free slot pulls one)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to let running tasks finish on SIGINT/SIGTERM")
    parser.add_argument("--ready-file", default=None, help="write {port, peer_id, name, instance} as JSON here once serving")
    parser.add_argument("--log-level", default="INFO")


def env_assignment(text: str) -> tuple[str, str]:
    """One --env NAME=VALUE. GPUlayer's own GPULAYER_* settings are refused: they have options
    (--key-file, --interfaces, ...) or are set by the peer for each slot."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    if name.startswith(SLOT_ENV_PREFIX):
        raise argparse.ArgumentTypeError(f"{name} is a GPUlayer setting, not a variable for tasks: use the "
                                         "peer's options, or its own environment")
    return name, value


def _seed(text: str) -> tuple[str, int]:
    from ..discovery import parse_address

    try:
        return parse_address(text)
    except GPULayerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def key_from_invite(args: argparse.Namespace) -> None:
    """Run an invite's exchange for `args.invite` with the peer at a --seed, else with the peers heard
    over mDNS; write the key 0600 to --key-file (default ~/.config/gpulayer/key), which must not exist
    yet, and point `args.key_file` at it."""
    from .. import invite, security
    from ..discovery import configured_interfaces
    from ..mdns import every_peer

    invite.parse_code(args.invite)  # a typo fails here, before any look-up
    path = Path(args.key_file) if args.key_file else security.default_key_path()
    if path.exists():
        raise GPULayerError(f"{path} exists already: this machine has a cluster key (remove the file to join "
                            "another cluster, or give --key-file)")
    interfaces = configured_interfaces(args.interfaces.split(",") if args.interfaces else None)
    for browse in range(INVITE_BROWSES):  # a peer slow to answer over mDNS is heard in a later, longer one
        try:
            key, name = invite.receive_key(args.invite, args.seed or every_peer(INVITE_BROWSE_SECONDS * 2 ** browse,
                                                                                 interfaces))
            break
        except invite.NoOpenInvite:
            if args.seed or browse == INVITE_BROWSES - 1:
                raise
    security.write_private_file(path, key.decode() + "\n")
    print(f"got the cluster key from peer {name}; wrote it to {path} (mode 0600), cluster id "
          f"{security.cluster_id(key)}", flush=True)
    args.key_file = str(path)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _workdir(text: str) -> str:
    """An existing, writable folder, made absolute."""
    path = os.path.abspath(os.path.expanduser(text))
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not a writable folder")
    return path


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    from .server import PeerConfig  # here and below: `gpulayer submit` and the other commands build this parser too
    from .. import discovery, security
    from ..protocol import framing
    from ..resources import detect, override
    from ..discovery import check_name, configured_interfaces

    name = check_name(args.name)  # before the slow part: a name that cannot be advertised fails at once
    if args.concurrency is not None and args.concurrency < 1:
        raise GPULayerError("--concurrency must be at least 1")
    framing.max_message_bytes()  # a bad GPULAYER_MAX_MESSAGE_MB fails here, not at the first submitter
    resources = detect.detect(args.python)
    if args.advertise_override:
        data = override.load_override(args.advertise_override)
        resources = override.apply_override(resources, data, f"override:{args.advertise_override}")
    return PeerConfig(
        key=security.load_key(args.key_file),
        resources=resources,
        port=args.port,
        interfaces=configured_interfaces(args.interfaces.split(",") if args.interfaces else None),
        name=name,
        python=args.python,
        concurrency=args.concurrency,
        preload=args.preload.split(",") if args.preload is not None else None,
        advertise=not args.no_mdns,
        pull=not args.no_pull,
        drain_timeout=args.drain_timeout,
        workdir=args.workdir,
        measured_from=args.measured_from,
        state_dir=args.state_dir,
        job_retention_days=args.job_retention_days,
        job_retention_gb=args.job_retention_gb,
        max_slots_per_user=args.max_slots_per_user,
        seeds=args.seed + discovery.static_peers(),
    )



def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s gpulayer-peer %(levelname)s %(message)s")
    os.environ.update(args.env)
    try:
        if args.invite:
            key_from_invite(args)
        config = config_from_args(args)
    except (GPULayerError, ValueError) as exc:
        print(f"gpulayer peer: {exc}", file=sys.stderr)
        return 2

    def ready(peer) -> None:
        print(f"gpulayer peer {peer.name} ({peer.peer_id}) ready on port {peer.port}: "
              f"{len(peer.slots)} slot(s) on {', '.join(sorted({s.device for s in peer.slots}))}", flush=True)
        if args.ready_file:  # written whole, then renamed: whoever waits for it never reads half of it
            partial = f"{args.ready_file}.partial"
            with open(partial, "w") as f:
                json.dump({"port": peer.port, "peer_id": peer.peer_id, "name": peer.name,
                           "instance": peer.instance}, f)
            os.replace(partial, args.ready_file)

    try:
        import asyncio

        from .server import run_peer

        asyncio.run(run_peer(config, ready))
    except GPULayerError as exc:
        print(f"gpulayer peer: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpulayer.peer", description="Run this machine's GPUlayer peer.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
