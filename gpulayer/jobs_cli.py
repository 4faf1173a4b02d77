"""`gpulayer submit | jobs | logs | wait | stop | fetch | rm`: jobs from the shell (docs/jobs.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .errors import ConfigError
from .peer_table import format_bytes
from .taskenv import check_env


def _jobs() -> Any:
    from .client.jobs import Jobs
    from .runtime import default_client

    return Jobs(default_client())


def _env(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def _array(text: str) -> tuple[int, int, int]:
    """'0-99%8' as (0, 99, 8): indices 0 to 99, at most 8 running at once; '5' is one index, no % no limit."""
    span, _, limit = text.partition("%")
    first, _, last = span.partition("-")
    try:
        values = int(first), int(last or first), int(limit or 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIRST-LAST or FIRST-LAST%LIMIT (e.g. 0-99%8)") from None
    if min(values) < 0 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: the indices are 0 or more and FIRST is at most LAST")
    return values


def _framework(text: str) -> tuple[str, str]:
    """'torch>=2.4' as ("torch", ">=2.4"); a bare name asks for any version."""
    cut = next((i for i, ch in enumerate(text) if ch in "<>=!~"), len(text))
    return text[:cut].strip(), text[cut:].strip()


def _follow(job: Any) -> int:
    """Stream the job's output until it ends; its exit status. Ctrl-C detaches (the job goes on)."""
    from .client.jobs import exit_status
    from .jobs.store import ENDED

    try:
        job.logs(follow=True, out=sys.stdout.buffer)
    except KeyboardInterrupt:
        print(f"\ngpulayer: detached; job {job.id} goes on (gpulayer logs -f {job.id})", file=sys.stderr)
        return 130
    if job.state not in ENDED:  # a followed log's end brings the job's state with it
        job.refresh()
    if job.state != "succeeded":
        print(f"gpulayer: job {job.id} {job.state}{': ' + job.reason if job.reason else ''}", file=sys.stderr)
    return exit_status(job)


def _submit(args: argparse.Namespace) -> int:
    from .api import submit_job

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ConfigError("give the command after --, e.g. gpulayer submit -- python train.py")
    options: dict[str, Any] = {"env": check_env(dict(args.env)) or None, "timeout": args.timeout,
                               "retries": args.retries}
    for name in ("accelerator", "gpu_memory_gb", "peer", "nodes"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.frameworks:
        options["frameworks"] = dict(_framework(spec) for spec in args.frameworks)
    job = submit_job(command, args.working_dir, excludes=args.exclude, name=args.name, priority=args.priority,
                     array=args.array, preemptible=args.preemptible, grace=args.grace,
                     keep_link=args.follow, **options)  # the follow goes over the submit's connection
    print(job.id, flush=True)
    what = f"array {job.id} of {args.array[1] - args.array[0] + 1} jobs" if args.array else f"job {job.id}"
    peers = ", ".join(rank.peer for rank in job.ranks) or job.peer
    print(f"gpulayer: {what} recorded on peer{'s' if job.ranks else ''} {peers}", file=sys.stderr)
    return _follow(job) if args.follow else 0


def _when(stamp: Any) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(stamp)) if isinstance(stamp, (int, float)) else "-"


def _list(args: argparse.Namespace) -> int:
    rows = _jobs().rows(include_old=args.all)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no jobs")
        return 0
    header = ("ID", "NAME", "STATE", "PRI", "PEER", "SUBMITTER", "SUBMITTED", "STARTED", "ENDED", "EXIT", "PEAK MEM")
    table = [header] + [(str(r.get("id")), str(r.get("name") or "")[:24], str(r.get("state")),
                         str(r.get("priority") or 0), str(r.get("peer")), str(r.get("submitter") or "")[:24],
                         _when(r.get("submitted")), _when(r.get("started")), _when(r.get("ended")),
                         "" if r.get("exit_code") is None else str(r.get("exit_code")),
                         format_bytes(r.get("peak_memory_bytes"))) for r in _ganged(_grouped(rows))]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _grouped(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with each array's jobs as one row: its id with its indices, its jobs counted by state."""
    arrays: dict[str, list[dict[str, Any]]] = {}
    shown: list[dict[str, Any]] = []
    for row in rows:
        if not row.get("array"):
            shown.append(row)
        elif row["array"] not in arrays:
            arrays[row["array"]] = [row]
            shown.append({**row, "members": arrays[row["array"]]})
        else:
            arrays[row["array"]].append(row)
    for row in shown:
        members = row.pop("members", None)
        if members:
            indices = sorted(m.get("index") or 0 for m in members)
            states = [str(m.get("state")) for m in members]
            ended = [m.get("ended") for m in members]
            row.update(id=f"{row['array']}[{indices[0]}-{indices[-1]}]",
                       state=", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states)),
                       started=min((m["started"] for m in members if m.get("started")), default=None),
                       ended=None if None in ended else max(ended), exit_code=None, peak_memory_bytes=None)
    return shown


def _ganged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with each gang as its own row (its ranks' peers in PEER) followed by one row per rank (its
    state and peer); a rank's own row is shown there only."""
    ranks = {r["id"]: r for r in rows if (r.get("gang") or {}).get("rank") is not None}
    owned = {m["job"] for r in rows for m in (r.get("gang") or {}).get("ranks", [])}
    shown: list[dict[str, Any]] = []
    for row in rows:
        members = (row.get("gang") or {}).get("ranks")
        if row["id"] in owned:
            continue
        if not members:
            shown.append(row)
            continue
        shown.append({**row, "peer": ",".join(m["peer"] for m in members)})
        for index, member in enumerate(members):
            shown.append({**ranks.get(member["job"], {"state": "unknown"}), "id": f"  rank {index}: {member['job']}",
                          "name": "", "peer": member["peer"], "submitter": ""})
    return shown


def _logs(args: argparse.Namespace) -> int:
    job = _jobs().job(args.job)
    if args.follow:
        try:
            job.logs(follow=True, tail=args.tail, out=sys.stdout.buffer)
        except KeyboardInterrupt:
            return 130
        return 0
    job.logs(tail=args.tail, out=sys.stdout.buffer)
    return 0


def _wait(args: argparse.Namespace) -> int:
    from .client.jobs import exit_status

    job = _jobs().job(args.job)
    job.wait()
    print(f"job {job.id} {job.state}{': ' + job.reason if job.reason else ''}", file=sys.stderr)
    return exit_status(job)


def _stop(args: argparse.Namespace) -> int:
    job = _jobs().job(args.job)
    print(f"job {job.id} {job.stop(args.grace)}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    job = _jobs().job(args.job)
    for path in job.fetch(args.paths or None, args.to, force=args.force, rank=args.rank):
        print(path)
    return 0


def _rm(args: argparse.Namespace) -> int:
    _jobs().job(args.job).remove()
    print(f"removed job {args.job}")
    return 0


def add_commands(sub: Any) -> None:
    """The job commands, on the `gpulayer` parser's subparsers."""
    from .protocol.jobs import DEFAULT_GRACE_S

    submit = sub.add_parser("submit", help="run a command with this folder on a peer, as a job that outlives "
                                           "this shell; prints its id")
    submit.add_argument("--accelerator", choices=["cpu", "cuda", "mps", "gpu"], default=None)
    submit.add_argument("--gpu-memory-gb", type=float, default=None, dest="gpu_memory_gb")
    submit.add_argument("--frameworks", nargs="+", default=[], metavar="SPEC",
                        help="what the job interpreter must have, e.g. 'torch>=2.4'")
    submit.add_argument("--peer", default=None, help="run on the peer of this name")
    submit.add_argument("--working-dir", default=".", metavar="DIR", help="the folder shipped (default: .)")
    submit.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                        help="a .gitignore pattern of files not to ship (repeatable)")
    submit.add_argument("--name", default="", help="a name shown by gpulayer jobs")
    submit.add_argument("--env", action="append", default=[], type=_env, metavar="K=V",
                        help="a variable of the job's environment (repeatable)")
    submit.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="stop it after this long")
    submit.add_argument("--retries", type=int, default=0, help="run it again this often after a failure")
    submit.add_argument("--priority", type=int, default=0, metavar="N",
                        help="a peer starts its queued jobs highest priority first (default 0)")
    submit.add_argument("--array", type=_array, default=None, metavar="FIRST-LAST[%LIMIT]",
                        help="one job per index (GPULAYER_ARRAY_INDEX), at most LIMIT running at once; "
                             "the id printed names the array")
    submit.add_argument("--preemptible", action="store_true",
                        help="it may be stopped for a job of higher priority, and is then queued again")
    submit.add_argument("--grace", type=float, default=None, metavar="S",
                        help="seconds from SIGTERM to SIGKILL when it is preempted (default 30)")
    submit.add_argument("--nodes", type=int, default=None, metavar="N",
                        help="a gang: N ranks on N distinct matching peers, started together, stopped together "
                             "(RANK, WORLD_SIZE, MASTER_ADDR ... set for torch.distributed and MLX)")
    submit.add_argument("--follow", "-f", action="store_true",
                        help="stream its output until it ends, exit with its exit code (Ctrl-C detaches)")
    submit.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    submit.set_defaults(func=_submit)

    jobs = sub.add_parser("jobs", help="the jobs of every peer of the cluster")
    jobs.add_argument("--json", action="store_true")
    jobs.add_argument("--all", action="store_true", help="also the jobs that ended over a day ago")
    jobs.set_defaults(func=_list)

    logs = sub.add_parser("logs", help="a job's output (stdout and stderr, in order)")
    logs.add_argument("job")
    logs.add_argument("--follow", "-f", action="store_true", help="go on until the job ends (Ctrl-C detaches)")
    logs.add_argument("--tail", type=int, default=None, metavar="N", help="from the last N lines")
    logs.set_defaults(func=_logs)

    wait = sub.add_parser("wait", help="block until a job ends; exit with its exit code")
    wait.add_argument("job")
    wait.set_defaults(func=_wait)

    stop = sub.add_parser("stop", help="stop a job: SIGTERM to its processes, SIGKILL after --grace")
    stop.add_argument("job")
    stop.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, metavar="S",
                      help=f"seconds between SIGTERM and SIGKILL (default {DEFAULT_GRACE_S:g})")
    stop.set_defaults(func=_stop)

    fetch = sub.add_parser("fetch", help="bring files of a job's folder here (default: what it created or changed)")
    fetch.add_argument("job")
    fetch.add_argument("paths", nargs="*", metavar="PATH")
    fetch.add_argument("--to", default=".", metavar="DIR", help="where to write them (default: .)")
    fetch.add_argument("--force", action="store_true", help="overwrite files that exist")
    fetch.add_argument("--rank", type=int, default=None, metavar="K", help="a gang's rank K (default 0)")
    fetch.set_defaults(func=_fetch)

    rm = sub.add_parser("rm", help="forget an ended job and delete its folder on its peer")
    rm.add_argument("job")
    rm.set_defaults(func=_rm)
