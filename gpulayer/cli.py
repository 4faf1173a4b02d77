"""`gpulayer`: resources detect | peers | join | demo | bench | key init."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import GPULayerError
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

    rows = api.default_client().peers(wait=args.wait)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        print(format_peers(rows))
    else:
        print("no peers found (is a peer running with the same cluster key? is multicast blocked? "
              "try GPULAYER_PEERS=host:port)")
    return 0


def _join(args) -> int:
    from .peer.__main__ import run

    return run(args)


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


def _version() -> str:
    from . import __version__
    from .wire import PROTOCOL_VERSION

    python = ".".join(map(str, sys.version_info[:3]))
    return f"gpulayer {__version__} (protocol v{PROTOCOL_VERSION}, Python {python} at {sys.executable})"


def build_parser() -> argparse.ArgumentParser:
    from .benchmark import add_arguments as add_bench_arguments
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
    peers.add_argument("--wait", type=float, default=None, help="seconds to listen for mDNS answers (default 1.5)")
    peers.set_defaults(func=_peers)

    join = sub.add_parser("join", help="run this machine's peer (same as python -m gpulayer.peer)")
    add_arguments(join)
    join.set_defaults(func=_join)

    demo = sub.add_parser("demo", help="start a local peer on loopback and run real tasks on it")
    demo.add_argument("--tasks", type=int, default=16, help="items in the demo gl.map")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="latency, bandwidth and matmul TFLOPS of every peer")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)

    key = sub.add_parser("key", help="cluster key")
    key_sub = key.add_subparsers(dest="action", required=True)
    init = key_sub.add_parser("init", help="create ~/.config/gpulayer/key (mode 0600)")
    init.add_argument("--path", default=None)
    init.add_argument("--force", action="store_true")
    init.set_defaults(func=_key_init)
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
