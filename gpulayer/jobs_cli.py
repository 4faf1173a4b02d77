"""`gpulayer submit | jobs | logs | wait | stop | fetch | rm`: jobs from the shell (docs/jobs.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .errors import ConfigError
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


def _framework(text: str) -> tuple[str, str]:
    """'torch>=2.4' as ("torch", ">=2.4"); a bare name asks for any version."""
    cut = next((i for i, ch in enumerate(text) if ch in "<>=!~"), len(text))
    return text[:cut].strip(), text[cut:].strip()


def _follow(job: Any) -> int:
    """Stream the job's output until it ends; its exit status. Ctrl-C detaches (the job goes on)."""
    from .client.jobs import exit_status

    try:
        job.logs(follow=True, out=sys.stdout.buffer)
    except KeyboardInterrupt:
        print(f"\ngpulayer: detached; job {job.id} goes on (gpulayer logs -f {job.id})", file=sys.stderr)
        return 130
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
    for name in ("accelerator", "gpu_memory_gb", "peer"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.frameworks:
        options["frameworks"] = dict(_framework(spec) for spec in args.frameworks)
    job = submit_job(command, args.working_dir, excludes=args.exclude, name=args.name, **options)
    print(job.id, flush=True)
    print(f"gpulayer: job {job.id} recorded on peer {job.peer}", file=sys.stderr)
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
    header = ("ID", "NAME", "STATE", "PEER", "SUBMITTER", "SUBMITTED", "STARTED", "ENDED", "EXIT")
    table = [header] + [(str(r.get("id")), str(r.get("name") or "")[:24], str(r.get("state")),
                         str(r.get("peer")), str(r.get("submitter") or "")[:24], _when(r.get("submitted")),
                         _when(r.get("started")), _when(r.get("ended")),
                         "" if r.get("exit_code") is None else str(r.get("exit_code"))) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


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
    for path in job.fetch(args.paths or None, args.to, force=args.force):
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
    fetch.set_defaults(func=_fetch)

    rm = sub.add_parser("rm", help="forget an ended job and delete its folder on its peer")
    rm.add_argument("job")
    rm.set_defaults(func=_rm)
