"""The submitter's API: run, submit, map, options, remote, peers, device, actors.

Every function uses one process-wide backend, made on first use from the environment: the LAN's
Client (GPULAYER_KEY or the key file, GPULAYER_INTERFACES, GPULAYER_PEERS), or a Ray cluster when
GPULAYER_BACKEND=ray (GPULAYER_RAY_ADDRESS; see gpulayer.backends). `configure()` replaces it.
Task options (accelerator, gpu_memory_gb, frameworks, capabilities, peer, devices, timeout,
retries, python, env) are defined and checked in one table, `gpulayer.task_options`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .actor_class import ActorClass
from .runtime import configure as configure, default_client as default_client, shutdown as shutdown
from .errors import ConfigError
from .task_options import TaskOptions, check_arguments, no_keep, split_call

if TYPE_CHECKING:
    from .client.jobs import Job, Jobs as JobsApi


def _submit(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: TaskOptions) -> Future[Any]:
    if options.nodes is not None:  # a gang: its future's result is the ranks' results (docs/gangs.md)
        return _gang(fn, args, kwargs, options)
    return default_client().submit(fn, args, kwargs, req=options.requirements, timeout=options.timeout,
                                   retries=options.retries, env=options.env, keep=options.keep,
                                   priority=options.priority)


def _gang(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: TaskOptions) -> Future[Any]:
    backend = default_client()
    submit_gang = getattr(backend, "submit_gang", None)
    if submit_gang is None:
        raise ConfigError("a gang (nodes=) runs on the LAN's peers; this backend has no gangs")
    future: Future[Any] = submit_gang(fn, args, kwargs, req=options.requirements, nodes=options.nodes,
                                      timeout=options.timeout, retries=options.retries, env=options.env)
    return future


def _map(fn: Callable[..., Any], iterables: tuple[Iterable[Any], ...], progress: bool | None,
         options: TaskOptions) -> list[Any]:
    if not iterables:
        raise TypeError("map() needs at least one iterable")
    no_keep(options, "gl.map()")
    if options.nodes is not None:
        raise ValueError("nodes= makes a gang of one call: use gl.run or gl.submit, not gl.map")
    calls = list(zip(*iterables))
    if calls:
        check_arguments(fn, calls[0], {})  # a wrong count fails here, not on every peer
    return default_client().map(fn, calls, req=options.requirements, timeout=options.timeout,
                                retries=options.retries, env=options.env, progress=progress,
                                priority=options.priority)


def submit(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any] | Job:
    """Run fn(*args, **kwargs) on a matching peer; returns a concurrent.futures.Future.

    Keyword arguments named like a task option are task options; the others go to fn. The call is
    checked against fn's signature here, before anything is sent (docs/concepts.md, "Task options").
    A future among the arguments (also inside lists and dicts) is replaced by its value; with
    keep=True, the result stays on its peer, and a future of it passed to another task travels
    from peer to peer, not through here (docs/data.md).

    Task options: accelerator, gpu_memory_gb, frameworks, capabilities, peer, devices, python
    (what the peer must offer); timeout, retries, env, keep, nodes, priority (how the task runs; nodes=N: a
    gang of N ranks on N peers, whose future's result is their results in rank order; priority=N: a peer
    starts its waiting work highest priority first, docs/jobs.md "The queue"). A function that
    takes one of these names itself is called with `gl.options(...).submit(fn, ...)`, where
    every keyword goes to fn.

    With detach=True the call runs as a job (docs/jobs.md): it goes on when this process ends, and
    the `Job` returned gives its result later, from any process (`gl.job(job.id).result()`).
    """
    detach = kwargs.pop("detach", False)
    options, kwargs = split_call(fn, args, kwargs)
    if detach:
        no_keep(options, "gl.submit(..., detach=True)")
        return _jobs().submit_function(fn, args, kwargs, options.requirements, timeout=options.timeout,
                                       retries=options.retries, env=options.env, priority=options.priority)
    return _submit(fn, args, kwargs, options)


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run fn(*args, **kwargs) on a matching peer and return its result (or raise its exception).

    Task options: accelerator, gpu_memory_gb, frameworks, capabilities, peer, devices, python
    (what the peer must offer); timeout, retries, env, priority, nodes (how the task runs; nodes=N runs fn as a
    gang of N ranks on N distinct peers and returns their results in rank order, docs/gangs.md). The other keywords go
    to fn; the call is checked against fn's signature before anything is sent, and a keyword
    that fn also takes is refused as ambiguous: `gl.options(timeout=5).run(fn, ..., timeout=...)`
    gives the task option and fn's own argument apart.
    """
    options, kwargs = split_call(fn, args, kwargs)
    no_keep(options, "gl.run()")
    return _submit(fn, args, kwargs, options).result()


def map(fn: Callable[..., Any], *iterables: Iterable[Any], progress: bool | None = None, **options: Any) -> list[Any]:
    """fn(*items) for the items of the iterables taken together (as the built-in `map`, stopping at
    the shortest), spread over all matching peers; results in input order.

    At most two tasks per slot of the matching peers are in flight at once, so that faster
    peers take more. The first failure cancels the rest and is raised. A progress bar with the
    rate and the time left is drawn on a terminal (or when progress=True). Every keyword is a task
    option (as for `gl.run`).
    """
    return _map(fn, iterables, progress, TaskOptions.parse(options))


class Options:
    """What `gl.options(...)` returns: task options fixed once, and `run`, `submit` and `map` whose
    every keyword goes to the function (no name is taken as a task option)."""

    def __init__(self, options: dict[str, Any]):
        self._parsed = TaskOptions.parse(options)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on a matching peer, with these options; its result."""
        no_keep(self._parsed, "gl.options(...).run()")
        return self.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """fn(*args, **kwargs) on a matching peer, with these options; a future."""
        check_arguments(fn, args, kwargs)
        return _submit(fn, args, kwargs, self._parsed)

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], progress: bool | None = None) -> list[Any]:
        """As `gl.map`, with these options."""
        return _map(fn, iterables, progress, self._parsed)


def options(**task_options: Any) -> Options:
    """Task options given apart from the call: `gl.options(timeout=5).run(train, 3, timeout=30)` runs
    train(3, timeout=30) with a 5 s task timeout. Checked here, as `@gl.remote` checks them."""
    return Options(task_options)


class RemoteFunction:
    """What @gl.remote returns: call it to run remotely, or use .submit(), .map(), .options()."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]):
        self._parsed = TaskOptions.parse(options)  # validate now, not at the first call
        self.__gpulayer_function__ = fn
        self._options = options
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        no_keep(self._parsed, "calling a remote function (use its .submit())")
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> Future[Any]:
        check_arguments(self.__gpulayer_function__, args, kwargs)
        return _submit(self.__gpulayer_function__, args, kwargs, self._parsed)

    def map(self, *iterables: Iterable[Any], progress: bool | None = None) -> list[Any]:
        return _map(self.__gpulayer_function__, iterables, progress, self._parsed)

    def options(self, **overrides: Any) -> RemoteFunction:
        """A copy with some options replaced, e.g. f.options(accelerator="cuda")."""
        return RemoteFunction(self.__gpulayer_function__, {**self._options, **overrides})

    def local(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function here, in this process."""
        return self.__gpulayer_function__(*args, **kwargs)


def remote(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator: `@gl.remote` or `@gl.remote(accelerator="mps", frameworks={"mlx": ">=0.10"})`.

    On a class it makes an actor class (`gpulayer.actor_class`: also `max_concurrency=` and `restarts=`).
    """
    if fn is None:
        return lambda f: _remote(f, options)
    return _remote(fn, options)


def _remote(obj: Any, options: dict[str, Any]) -> RemoteFunction | ActorClass:
    return ActorClass(obj, options) if isinstance(obj, type) else RemoteFunction(obj, options)


def actors() -> list[dict[str, Any]]:
    """This submitter's live actors (actor id, class, peer, address, slot, calls served, calls pending)."""
    return default_client().live_actors()


def _jobs() -> JobsApi:
    """The jobs of the process-wide backend's cluster (client/jobs.py)."""
    from .client.jobs import Jobs

    return Jobs(default_client())


def submit_job(command: list[str] | str, working_dir: str | None = ".", *, excludes: Iterable[str] = (),
               name: str = "", limit_mb: int | None = None, priority: int = 0,
               array: tuple[int, int, int] | None = None, preemptible: bool = False, grace: float | None = None,
               keep_link: bool = False, progress: bool | None = None, **options: Any) -> Job:
    """Run `command` (a list of arguments, or one string split as a shell would) as a job on a matching
    peer, in a copy of `working_dir` (honouring .gitignore and `excludes`); returns its `Job` once a peer
    has recorded it. The job goes on when this process ends (docs/jobs.md).

    Options as for tasks: accelerator, gpu_memory_gb, frameworks, capabilities, peer, devices, python
    (what the peer must offer), timeout, retries, env. A peer starts its queued jobs highest `priority`
    first (docs/jobs.md, "The queue"). With `array=(first, last, limit)` the peer records one job per index
    (each sees GPULAYER_ARRAY_INDEX), at most `limit` of them running at once (0: no limit); the first
    job is returned, and its id names the array (stop and wait act on all of its jobs). A `preemptible`
    job may be stopped for one of higher priority (SIGTERM, SIGKILL after `grace` s, default 30) and is
    then queued again (GPULAYER_RESTARTS counts it). With `nodes=N` (N > 1), a gang: N ranks on N distinct
    matching peers, started together with the rendezvous variables of docs/gangs.md; the `Job` returned is
    the gang's (its `ranks`, one merged log; docs/jobs.md, "Gangs"). With `keep_link`, the `Job`'s first
    request (`logs(follow=True)`, say) goes over the submit's connection; `job.close()` closes it unused.
    The upload's progress bar (bytes sent, rate, time left) is drawn on a terminal once the upload has taken
    half a second; `progress=True` draws it always, False never (`Job.fetch` takes the same).
    """
    import shlex

    from .jobs.store import PREEMPT_GRACE_S

    parsed = TaskOptions.parse(options)
    no_keep(parsed, "gl.submit_job()")
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    if not argv:
        raise ValueError("a job needs a command")
    return _jobs().submit(argv, working_dir, parsed.requirements, excludes=tuple(excludes), name=name,
                          env=parsed.env, timeout=parsed.timeout, retries=parsed.retries, priority=priority,
                          array=array, preemptible=preemptible, grace=PREEMPT_GRACE_S if grace is None else grace,
                          limit_bytes=(limit_mb << 20) if limit_mb is not None else None, nodes=parsed.nodes or 1,
                          keep_link=keep_link, progress=progress)


def job(job_id: str) -> Job:
    """The job of that id, from any process of any machine of the cluster: its state, logs, result."""
    return _jobs().job(job_id)


def jobs(all: bool = False) -> list[dict[str, Any]]:
    """Every job that the cluster's peers know (each peer is asked): the last day's, or `all`."""
    return _jobs().rows(include_old=all)


def peers(wait: float | None = None, probe: bool = True) -> list[dict[str, Any]]:
    """The discovered peers of this cluster, with their state and load."""
    return default_client().peers(wait=wait, probe=probe)


def device() -> Any:
    """Inside a task, the torch device the peer gave it; elsewhere, the best local one (cuda, mps, cpu).

    Raises `gpulayer.torch.AcceleratorUnavailable`, saying what to install, when the job's torch
    cannot use the device the peer gave the task.
    """
    from .torch.accelerators import resolve

    return resolve().device()
