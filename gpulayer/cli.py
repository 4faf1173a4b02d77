"""`gpulayer`: resources detect | peers | join | invite | ray-node | demo | bench | dashboard | key init | key id,
and the job commands (jobs_cli.py): submit | jobs | logs | wait | stop | fetch | rm."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import ConfigError, GPULayerError
from .peer_table import format_peers


def _resources_detect(args) -> int:
    from .resources import detect

    res = detect.detect(args.python)
    if args.json:
        print(json.dumps({**res.to_dict(), "accelerator": res.accelerator}, indent=2))
    else:
        print(detect.format_resources(res, python_path=args.python or sys.executable))
    return 0


def _peers(args) -> int:
    from . import api

    client = api.default_client()
    rows = client.peers(wait=args.wait)
    directory = getattr(client, "directory", None)  # the LAN's (mDNS); a Ray backend has none
    if args.all and directory is not None:  # the peers of other clusters seen: their ids only
        rows += [{"name": peer_id, "peer_id": peer_id, "cluster": cluster, "state": "other cluster"}
                 for peer_id, cluster in sorted(directory.foreign().items())]
    note = directory.foreign_note() if directory is not None else ""
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if rows:
        print(format_peers(rows, grey=sys.stdout.isatty()))
    else:
        print("no peers found (is a peer running with the same cluster key? is multicast blocked? "
              "try GPULAYER_PEERS=host:port)")
    if note:
        print(note + ("" if args.all else "; `gpulayer peers --all` lists them"))
    return 0


def _ray_node(args) -> int:
    import shlex
    import subprocess

    from .backends.ray import TOKEN_ENV, node_environment, ray_start_command
    from .resources import detect

    if not args.head and not args.address:
        raise ConfigError("give --address HEAD_HOST:PORT to join a Ray cluster, or --head to start one")
    auth = node_environment(args.key_file, insecure=args.insecure)
    command = ray_start_command(detect.detect(args.python), name=args.name, head=args.head, address=args.address,
                                extra=[a for a in args.ray_args if a != "--"])
    if args.insecure:
        print("gpulayer: warning: Ray's token authentication is off (--insecure): anyone who reaches this node's "
              "ports can run code on it", file=sys.stderr)
    print(shlex.join([f"{name}={value}" for name, value in auth.items()] + command))
    if args.dry_run:
        return 0
    env = {name: value for name, value in os.environ.items() if name != TOKEN_ENV}  # it would win over the file
    return subprocess.run(command, env={**env, **auth}).returncode


def _join(args) -> int:
    from .peer.__main__ import run

    return run(args)


def _invite(args) -> int:
    from . import api, invite
    from .discovery import advertised_addresses

    client = api.default_client()
    if getattr(client, "directory", None) is None:
        raise ConfigError("invite codes need GPUlayer's own peers (the Ray backend has none)")
    client.peers(wait=args.wait, probe=False)
    records = client.directory.records()
    if args.peer:
        chosen = [r for r in records if args.peer in (r.advert.name, r.advert.peer_id)]
    else:  # the peer of this machine
        here = set(advertised_addresses(None)) | {"127.0.0.1"}
        chosen = [r for r in records if any(host in here for host, _ in r.addresses)]
    if not chosen:
        raise ConfigError(f"no peer {'named ' + repr(args.peer) if args.peer else 'of this machine'} was found "
                          "(`gpulayer peers` lists them; name one with --peer)")
    record = chosen[0]
    reply = invite.request(client.key, record.addresses[0], args.ttl, args.uses)
    code = reply["code"]
    print(f"invite code: {code}  (peer {record.advert.name} at {record.address}; valid {args.ttl:.0f} s, "
          f"{reply['uses']} use{'s' if reply['uses'] > 1 else ''})")
    print(f"on the new machine: gpulayer join --invite {code}")
    print(f"where mDNS does not reach:  gpulayer join --invite {code} --seed {record.address}")
    return 0


def _ttl(text: str) -> float:
    from .invite import parse_ttl

    try:
        return parse_ttl(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _key_id(args) -> int:
    from .security import cluster_id, load_key

    print(cluster_id(load_key(args.key_file)))
    return 0


def _key_init(args) -> int:
    from .security import cluster_id, init_key

    path = init_key(args.path, force=args.force)
    print(f"wrote a new cluster key to {path} (mode 0600); cluster id {cluster_id(path.read_text().strip().encode())}")
    print("copy this file to every machine of the cluster (same path), or set GPULAYER_KEY there")
    return 0


def _demo(args) -> int:
    from .demo import run_demo

    return run_demo(tasks=args.tasks)


def _bench(args) -> int:
    from .benchmark import run

    return run(args)


def _dashboard(args) -> int:
    from . import api
    from .dashboard.server import Dashboard

    Dashboard(api.default_client(), args.host, args.port, args.allow_remote).serve_forever(args.open)
    return 0


def _version() -> str:
    from . import __version__
    from .protocol.messages import PROTOCOL_VERSION

    python = ".".join(map(str, sys.version_info[:3]))
    return f"gpulayer {__version__} (protocol v{PROTOCOL_VERSION}, Python {python} at {sys.executable})"


def build_parser() -> argparse.ArgumentParser:
    from .benchmark import add_arguments as add_bench_arguments
    from .jobs_cli import add_commands as add_job_commands
    from .peer.__main__ import add_arguments

    parser = argparse.ArgumentParser(prog="gpulayer", description="Peer-to-peer scheduler for the GPUs on a LAN.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    resources = sub.add_parser("resources", help="what this machine offers")
    res_sub = resources.add_subparsers(dest="action", required=True)
    detect = res_sub.add_parser("detect", help="detect devices, memory and frameworks")
    detect.add_argument("--json", action="store_true")
    detect.add_argument("--python", default=None, help="job interpreter to probe (default: this one)")
    detect.set_defaults(func=_resources_detect)

    peers = sub.add_parser("peers", help="list the peers of this cluster")
    peers.add_argument("--json", action="store_true")
    peers.add_argument("--all", action="store_true", help="also list the peers of other clusters seen (greyed)")
    peers.add_argument("--wait", type=float, default=None, help="seconds to listen for mDNS answers (default 1.5)")
    peers.set_defaults(func=_peers)

    join = sub.add_parser("join", help="run this machine's peer (same as python -m gpulayer.peer)")
    add_arguments(join)
    join.set_defaults(func=_join)

    invite = sub.add_parser("invite", help="print a short code with which a new machine joins (gpulayer join --invite)")
    invite.add_argument("--ttl", type=_ttl, default=600.0, help="how long the code is valid: 90s, 10m, 2h (default "
                                                                "10m, at most 24h)")
    invite.add_argument("--uses", type=int, default=1, help="machines that may join with it (default 1)")
    invite.add_argument("--peer", default=None, help="the peer that serves the code, by name or id (default: the "
                                                     "peer of this machine)")
    invite.add_argument("--wait", type=float, default=None, help="seconds to listen for mDNS answers (default 1.5)")
    invite.set_defaults(func=_invite)

    demo = sub.add_parser("demo", help="start a local peer on loopback and run real tasks on it")
    demo.add_argument("--tasks", type=int, default=16, help="items in the demo gl.map")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="latency, bandwidth and matmul TFLOPS of every peer")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)

    ray_node = sub.add_parser("ray-node", help="run `ray start` declaring this machine's GPUs and frameworks")
    ray_node.add_argument("--address", default=None, help="the Ray head to join, HOST:PORT")
    ray_node.add_argument("--head", action="store_true", help="start a Ray head node instead")
    ray_node.add_argument("--name", default=None, help="the node's name in tables (default: the host name)")
    ray_node.add_argument("--python", default=None, help="job interpreter to probe (default: this one)")
    ray_node.add_argument("--dry-run", action="store_true", help="print the ray start command, do not run it")
    ray_node.add_argument("--key-file", default=None,
                          help="the cluster key that Ray's token is derived from (default: GPULAYER_KEY, else "
                               "~/.config/gpulayer/key)")
    ray_node.add_argument("--insecure", action="store_true",
                          help="start Ray without token authentication: anyone who reaches it runs code on it")
    ray_node.add_argument("ray_args", nargs=argparse.REMAINDER, help="after --: more ray start options")
    ray_node.set_defaults(func=_ray_node)

    dash = sub.add_parser("dashboard", help="a live web page of the cluster's peers and tasks, on this machine")
    dash.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1, loopback)")
    dash.add_argument("--port", type=int, default=8265, help="port to serve on (default 8265)")
    dash.add_argument("--open", action="store_true", help="open the page in the default browser")
    dash.add_argument("--allow-remote", action="store_true",
                      help="allow a non-loopback --host (the page and its token then cross the network in clear "
                           "HTTP: whoever sees the token sees every task)")
    dash.set_defaults(func=_dashboard)

    key = sub.add_parser("key", help="cluster key")
    key_sub = key.add_subparsers(dest="action", required=True)
    init = key_sub.add_parser("init", help="create ~/.config/gpulayer/key (mode 0600)")
    init.add_argument("--path", default=None)
    init.add_argument("--force", action="store_true")
    init.set_defaults(func=_key_init)
    key_id = key_sub.add_parser("id", help="print the cluster id of the key (peers advertise it; a peer of another "
                                           "id is of another cluster)")
    key_id.add_argument("--key-file", default=None, help="the key file (default: GPULAYER_KEY, else "
                                                         "~/.config/gpulayer/key)")
    key_id.set_defaults(func=_key_id)
    add_job_commands(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except GPULayerError as exc:
        print(f"gpulayer: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
