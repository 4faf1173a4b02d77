"""The Ray backend: `gl.run`, `gl.submit`, `gl.map` and `@gl.remote` on a Ray cluster (issue 15).

A task's requirements become Ray's own mechanisms: `accelerator="cuda"` asks `num_gpus`
(`devices` of them), `"mps"` the custom resource `mps`, `gpu_memory_gb` the custom resource
`gpu_memory_gb`; frameworks, capabilities and the job Python are read from the `gpulayer.io/`
node labels that `gpulayer ray-node` sets (`node_settings`). Before a task is submitted every
alive node is turned into an Advert and checked with `gpulayer.matching.match` and against its
Ray resources, so a cluster that lacks what a task needs raises NoMatchingPeer with each node's
reasons instead of leaving the task pending; when only some nodes fit, a label selector on their
node ids pins the task to them.

The function and its arguments are pickled by `gpulayer.serialization`, as on the LAN. In the
Ray worker, `_execute` sets GPULAYER_DEVICE and GPULAYER_PEER_NAME, captures stdout and stderr
(replayed here when the task ends) and packs exceptions as a LAN worker does. A task with a
timeout runs as a streaming generator whose first item says it started: its deadline counts
from then, and past it the task is cancelled with `ray.cancel(force=True)` (TaskTimeout).
An actor class becomes a Ray actor (`ActorHost`) holding the same resources for its life;
`RayActorHandle` answers as the LAN's ActorHandle does.

Ray's token authentication guards the cluster: `gpulayer ray-node` starts every node with the
token derived from the cluster key (`token_environment`), and the backend brings the same token
to its ray.init (`use_cluster_token`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .. import remote_exceptions, security, serialization
from ..accelerators import CPU, CUDA, DISTRIBUTED, ENV_DEVICE, GPU, HOST_MEMORY, MEMORY_KIND, MPS, UNSUPPORTED
from ..client import inference
from ..client.actors import ActorMethod, ActorSpec
from ..errors import ActorDied, ConfigError, NoMatchingPeer, PeerLost, RemoteError, TaskTimeout, WorkerDied
from ..matching import Requirements, match
from ..task_options import check_retries
from ..checks import check_timeout
from ..taskenv import check_env, task_environment
from ..progress import ProgressBar
from ..resources.model import Advert, Resources

LABEL = "gpulayer.io/"  # the prefix of every label `gpulayer ray-node` sets
FRAMEWORK_LABEL, CAPABILITY_LABEL = LABEL + "fw.", LABEL + "cap."
MPS_RESOURCE, MEMORY_RESOURCE = "mps", "gpu_memory_gb"
NODE_ID_LABEL = "ray.io/node-id"
ADDRESS_ENV = "GPULAYER_RAY_ADDRESS"
AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"  # Ray's own
TOKEN_SUFFIX = ".ray-token"  # the token file is the key file's path with this appended
PLAN_TTL = 2.0  # seconds a check of the cluster is reused for tasks with the same requirements
STARTED = "gpulayer-started"  # the first item of a timed task's stream
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]+")


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError('the ray backend needs Ray: pip install "gpulayer[ray]"') from None
    return ray


# ---- nodes: what `gpulayer ray-node` declares, and the Advert read back from it ---------------------


def _label_value(text: str) -> str:
    """`text` as a Ray label value: at most 63 of [A-Za-z0-9_.-], alphanumeric at both ends."""
    return _LABEL_VALUE.sub("-", text)[:63].strip("-_.")


def _version_label(version: str) -> str:
    """A version as a label value: its public part ('2.13.0+cpu' -> '2.13.0'), since '+' is not allowed."""
    try:
        return Version(version).public
    except InvalidVersion:
        return _label_value(version)


@dataclass(frozen=True)
class NodeSettings:
    """What a node declares to Ray: its GPUs, custom resources and labels."""

    num_gpus: int
    resources: dict[str, float]
    labels: dict[str, str]

    def ray_start_args(self) -> list[str]:
        """The `ray start` options that declare them."""
        return ["--num-gpus", str(self.num_gpus), "--resources", json.dumps(self.resources, sort_keys=True),
                "--labels", ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))]


def node_settings(res: Resources, name: str | None = None) -> NodeSettings:
    """A node's Ray settings from what `gpulayer resources detect` found on it."""
    gpus = [d for d in res.devices if d.kind == res.accelerator]
    resources = {MPS_RESOURCE: 1.0} if res.accelerator == MPS else {}
    labels = {LABEL + "name": _label_value(name or res.host), LABEL + "accelerator": res.accelerator,
              LABEL + "python": res.python, LABEL + "memory-kind": res.memory_kind}
    if gpus:
        resources[MEMORY_RESOURCE] = round(sum(d.memory_gb for d in gpus), 1)
        labels[LABEL + "device"] = _label_value(gpus[0].name)
        labels[LABEL + "gpu-memory-gb"] = f"{min(round(d.memory_gb, 1) for d in gpus):g}"
    for framework in res.frameworks:
        labels[FRAMEWORK_LABEL + framework.name] = _version_label(framework.version)
        labels.update({CAPABILITY_LABEL + cap: "1" for cap in framework.capabilities})
    return NodeSettings(len(gpus) if res.accelerator == CUDA else 0, resources,
                        {k: v for k, v in labels.items() if v})


def ray_start_command(res: Resources, *, name: str | None = None, head: bool = False, address: str | None = None,
                      extra: Iterable[str] = ()) -> list[str]:
    """`ray start` (of this interpreter's Ray) for a head or a node joining `address`, declaring `res`."""
    where = ["--head"] if head else ["--address", address or ""]
    return [sys.executable, "-m", "ray.scripts.scripts", "start", *where,
            *node_settings(res, name).ray_start_args(), *extra]


# ---- authentication: Ray's token, derived from the cluster key -------------------------------------


def token_environment(key_file: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Ray's token authentication with the cluster's token (`security.ray_token`): RAY_AUTH_MODE=token
    and RAY_AUTH_TOKEN_PATH naming the token, written here 0600 beside the key file (its path plus
    TOKEN_SUFFIX; beside the default key path when the key comes from GPULAYER_KEY)."""
    key = security.load_key(key_file)
    path = Path(key_file or security.default_key_path())
    token_file = security.write_private_file(path.with_name(path.name + TOKEN_SUFFIX), security.ray_token(key))
    return {AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: str(token_file)}


def node_environment(key_file: str | os.PathLike[str] | None = None, *, insecure: bool = False) -> dict[str, str]:
    """What `gpulayer ray-node` sets for `ray start`: the cluster's token (`token_environment`), or
    with `insecure` Ray's authentication explicitly off. ConfigError when there is no usable key."""
    if insecure:
        return {AUTH_MODE_ENV: "disabled"}
    try:
        return token_environment(key_file)
    except ConfigError as exc:
        raise ConfigError(f"{exc}\ngpulayer ray-node turns on Ray's token authentication with a token derived from "
                          "the cluster key: without it, anyone who reaches the node's ports runs code on it. "
                          "Pass --insecure to start it so anyway.") from None


def use_cluster_token() -> bool:
    """Turn on Ray's token authentication in this process, and the Ray processes it starts, with the
    cluster's token; before ray.init. Nothing changes when the environment already configures
    Ray's authentication (RAY_AUTH_MODE, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH), or when this
    machine names no cluster key: Ray's own rules apply then. Returns whether it turned it on."""
    if any(name in os.environ for name in (AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV)) or not security.key_configured():
        return False
    os.environ.update(token_environment())
    _ray()._raylet.Config.initialize("")  # Ray caches the mode it read from the environment; its ray.init does this
    return True


def _labelled(node: dict[str, Any]) -> bool:
    """Whether `gpulayer ray-node` (or the same labels) declared the node's frameworks."""
    return LABEL + "python" in (node.get("Labels") or {})


def node_name(node: dict[str, Any]) -> str:
    labels = node.get("Labels") or {}
    return labels.get(LABEL + "name") or f"{node.get('NodeManagerHostname', 'node')}-{node['NodeID'][:8]}"


def advert_of(node: dict[str, Any]) -> Advert:
    """A Ray node (an entry of ray.nodes()) as the Advert that matching reads."""
    labels, res = node.get("Labels") or {}, node.get("Resources") or {}
    gpus, has_mps = int(res.get("GPU", 0)), res.get(MPS_RESOURCE, 0) > 0
    accelerator = labels.get(LABEL + "accelerator") or (CUDA if gpus else MPS if has_mps else CPU)
    count = gpus if accelerator == CUDA else int(accelerator == MPS)
    per_device = float(labels.get(LABEL + "gpu-memory-gb") or (res.get(MEMORY_RESOURCE, 0.0) / count if count else 0))
    return Advert(
        peer_id=node["NodeID"], name=node_name(node), cluster="ray", accelerator=accelerator,
        memory_kind=labels.get(LABEL + "memory-kind") or MEMORY_KIND.get(accelerator, HOST_MEMORY),
        device_memory_gb=(per_device,) * count, device_name=labels.get(LABEL + "device", ""),
        distributed=DISTRIBUTED.get(accelerator, UNSUPPORTED), ram_gb=round(res.get("memory", 0) / 2**30, 1),
        cpu_count=int(res.get("CPU", 0)),
        frameworks=tuple(sorted((k[len(FRAMEWORK_LABEL):], v) for k, v in labels.items()
                                if k.startswith(FRAMEWORK_LABEL))),
        capabilities=frozenset(k[len(CAPABILITY_LABEL):] for k in labels if k.startswith(CAPABILITY_LABEL)),
        slots=max(count, 1), python=labels.get(LABEL + "python") or platform.python_version())


# ---- placement: requirements to Ray options, checked against the nodes ------------------------------


def _task_accelerator(req: Requirements, advert: Advert) -> str:
    """The accelerator the task uses on this node: the node's for "gpu", cpu when none is asked for."""
    if req.accelerator == GPU:
        return advert.accelerator
    return req.accelerator or CPU


def _asks(req: Requirements, accelerator: str) -> dict[str, float]:
    """The Ray resources one task holds while it runs."""
    asks = {"CPU": 1.0}
    if accelerator == CUDA:
        asks["GPU"] = float(req.devices)
    elif accelerator == MPS:
        asks[MPS_RESOURCE] = 1.0
    if req.gpu_memory_gb:
        asks[MEMORY_RESOURCE] = req.gpu_memory_gb * req.devices
    return asks


def _node_reasons(req: Requirements, node: dict[str, Any], advert: Advert, accelerator: str) -> list[str]:
    why = list(match(req, advert))
    if not why and not _labelled(node) and (req.frameworks or req.capabilities or req.uses):
        why.append("has no gpulayer.io/ labels (start it with `gpulayer ray-node`), so its frameworks and "
                   "capabilities are unknown")
    if not why:
        total = node.get("Resources") or {}
        why = [f"has {total.get(name, 0):g} of Ray resource {name!r}; the task asks for {amount:g}"
               for name, amount in _asks(req, accelerator).items() if total.get(name, 0) < amount]
    return why


@dataclass(frozen=True)
class Plan:
    """Where a task with given requirements may run: Ray options, the accelerator it gets, when checked."""

    options: dict[str, Any]
    accelerator: str
    made: float = field(default_factory=time.monotonic)


def plan(req: Requirements, nodes: list[dict[str, Any]]) -> Plan:
    """The Ray options of a task with `req` on a cluster of `nodes`; NoMatchingPeer when none fits."""
    alive = [n for n in nodes if n.get("Alive")]
    reasons: dict[str, list[str]] = {}
    fitting: dict[str, str] = {}  # node id -> the task's accelerator there
    for node in alive:
        advert = advert_of(node)
        accelerator = _task_accelerator(req, advert)
        why = _node_reasons(req, node, advert, accelerator)
        if why:
            reasons[f"{advert.name} (ray node {advert.peer_id[:8]})"] = why
        else:
            fitting[advert.peer_id] = accelerator
    if not fitting:
        raise NoMatchingPeer(req, reasons or {"ray cluster": ["has no alive nodes"]})
    kinds = set(fitting.values())
    accelerator = CUDA if CUDA in kinds else kinds.pop()  # "gpu": CUDA nodes first, as a LAN peer reports
    ids = sorted(i for i, kind in fitting.items() if kind == accelerator)
    asks = _asks(req, accelerator)
    options: dict[str, Any] = {"num_cpus": asks.pop("CPU"), "num_gpus": asks.pop("GPU", 0), "resources": asks}
    if len(ids) < len(alive):
        options["label_selector"] = {NODE_ID_LABEL: f"in({','.join(ids)})"}
    return Plan(options, accelerator)


# ---- in the Ray worker -----------------------------------------------------------------------------


def _missing_frameworks(frameworks: list[tuple[str, str]]) -> str:
    """Why this interpreter lacks a required framework, or ""; for names the node's labels do not list."""
    for name, spec in frameworks:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            return f"refused the task: {name} is not installed in the job interpreter"
        if spec and not SpecifierSet(spec).contains(version, prereleases=True):
            return f"refused the task: {name} {version} does not satisfy {spec}"
    return ""


def _device(accelerator: str) -> str:
    """GPULAYER_DEVICE for the task: Ray's CUDA_VISIBLE_DEVICES lists its GPUs, so the first is cuda:0."""
    return "cuda:0" if accelerator == CUDA else accelerator


Outcome = tuple[str, Any, str, str, str]  # (kind, payload, node name, stdout, stderr)


def _node_name() -> str:
    import ray

    context = ray.get_runtime_context()
    return str(context.get_node_labels().get(LABEL + "name") or context.get_node_id()[:8])


def _captured(name: str, run: Callable[[], Any]) -> Outcome:
    """run() with its output captured and its result (or exception) packed as a LAN worker packs them."""
    out, err = io.StringIO(), io.StringIO()
    outcome: tuple[str, Any]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            result, oob = serialization.dumps(run())
            outcome = "ok", (result, [bytes(b) for b in oob])
        except (Exception, SystemExit) as exc:
            outcome = "error", remote_exceptions.pack(exc, skip_frames=2)  # not _captured's and run's frames
    return (*outcome, name, out.getvalue(), err.getvalue())


def _refusal(name: str, frameworks: list[tuple[str, str]]) -> Outcome | None:
    refused = _missing_frameworks(frameworks)
    return ("no-match", refused, name, "", "") if refused else None


def _execute(fn_bytes: bytes, data: bytes, buffers: list[bytes], accelerator: str,
             frameworks: list[tuple[str, str]]) -> Outcome:
    """Runs in a Ray worker: the task, with the device env and captured output; never raises."""
    name = _node_name()

    def run() -> Any:
        args, kwargs = serialization.loads(data, buffers)
        return serialization.loads(fn_bytes)(*args, **kwargs)

    with task_environment({ENV_DEVICE: _device(accelerator), "GPULAYER_PEER_NAME": name}):
        return _refusal(name, frameworks) or _captured(name, run)


def _execute_timed(*call: Any) -> Iterator[Any]:
    """A timed task: says it started (so that the submitter starts its clock), then its outcome."""
    yield STARTED
    yield _execute(*call)


class ActorHost:
    """Runs as a Ray actor: the user's instance, built with the device env (the actor's process is its
    own); its calls run as tasks do, output captured and exceptions packed."""

    def __init__(self, cls_bytes: bytes, data: bytes, buffers: list[bytes], accelerator: str,
                 frameworks: list[tuple[str, str]]):
        self.name = _node_name()
        os.environ.update({ENV_DEVICE: _device(accelerator), "GPULAYER_PEER_NAME": self.name})
        self.instance: Any = None

        def build() -> None:
            args, kwargs = serialization.loads(data, buffers)
            self.instance = serialization.loads(cls_bytes)(*args, **kwargs)

        self.created = _refusal(self.name, frameworks) or _captured(self.name, build)

    def ready(self) -> Outcome:
        """How the constructor went."""
        return self.created

    def call(self, method: str, data: bytes, buffers: list[bytes]) -> Outcome:
        def run() -> Any:
            args, kwargs = serialization.loads(data, buffers)
            return getattr(self.instance, method)(*args, **kwargs)

        return _captured(self.name, run)

    def call_timed(self, method: str, data: bytes, buffers: list[bytes]) -> Iterator[Any]:
        yield STARTED
        yield self.call(method, data, buffers)


# ---- the submitter's side ----------------------------------------------------------------------------


class RayFuture(Future[Any]):
    """A task's future, as the LAN's TaskFuture: `cancel()` also stops the Ray task; `stdout`/`stderr`/`peer`."""

    def __init__(self, task: RayTask):
        super().__init__()
        self._task = task
        self.stdout = ""
        self.stderr = ""
        self.peer: str | None = None

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            self._task.stop()
        return cancelled


@dataclass(eq=False)
class RayTask:
    """One submitted call: its Ray reference (a generator when timed), deadline, and future.

    One thread settles it: the reference's done-callback, or the watcher of timed tasks.
    """

    name: str
    req: Requirements
    timeout: float | None
    echo_output: bool
    ref: Any = None
    deadline: float | None = None
    kill: Callable[[], None] | None = None  # how to stop it (default: ray.cancel(force=True))
    then: Callable[[Any], Any] | None = None  # the future's result from the task's (default: the same)
    future: RayFuture = field(init=False)

    def __post_init__(self) -> None:
        self.future = RayFuture(self)

    @property
    def done(self) -> bool:
        return self.future.done()

    def stop(self) -> None:
        if self.kill is not None:
            self.kill()
        elif self.ref is not None:
            _ray().cancel(self.ref, force=True)

    def complete(self, result: Any = None, exc: BaseException | None = None) -> None:
        """Resolve the future; a cancelled or settled one keeps its state."""
        if self.future.done() or not self.future.set_running_or_notify_cancel():
            return
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)

    def resolve(self, outcome: Outcome) -> None:
        """Complete from what `_execute` returned, replaying the task's output."""
        kind, payload, node, out, err = outcome
        self.future.peer, self.future.stdout, self.future.stderr = node, out, err
        if self.echo_output:
            for text, stream in ((out, sys.stdout), (err, sys.stderr)):
                if text:
                    stream.write(text)
                    stream.flush()
        if kind == "ok":
            try:
                result = serialization.loads(payload[0], payload[1])
            except Exception as exc:
                self.complete(exc=RemoteError(type(exc).__name__, f"the result could not be unpickled here: {exc}", ""))
            else:
                self.complete(self.then(result) if self.then else result)
        elif kind == "error":
            self.complete(exc=remote_exceptions.rebuild(payload))
        else:
            self.complete(exc=NoMatchingPeer(self.req, {node: [payload]}))

    def fail(self, exc: BaseException) -> None:
        """Complete from an exception of Ray's own, in GPUlayer's shapes."""
        self.complete(exc=_gpulayer_error(exc))


def _gpulayer_error(exc: BaseException) -> BaseException:
    """Ray's failure of a task as the LAN backend reports it."""
    from ray import exceptions as rx

    if isinstance(exc, rx.RayActorError):
        return ActorDied(f"the Ray actor is gone: {exc}")
    if isinstance(exc, rx.TaskCancelledError):
        return CancelledError(str(exc))
    if isinstance(exc, rx.WorkerCrashedError):
        return WorkerDied(f"the Ray worker running the task died: {exc}")
    if isinstance(exc, (rx.NodeDiedError, rx.ObjectLostError, rx.RaySystemError)):
        return PeerLost(f"Ray lost the task: {exc}")
    if isinstance(exc, rx.RayTaskError):
        return RemoteError(type(exc.cause).__name__ if exc.cause else "RayTaskError", str(exc), exc.traceback_str)
    return RemoteError(type(exc).__name__, str(exc), "")


class RayActorHandle:
    """A live Ray actor, as the LAN's ActorHandle: `handle.method(...)` runs the method there,
    `handle.method.submit(...)` returns a future, `.options(timeout=)` bounds a call (past it the
    actor is killed); `close()` (or leaving a `with` block) ends it."""

    def __init__(self, backend: RayBackend, actor: Any, class_name: str, req: Requirements):
        self._backend = backend
        self._actor = actor
        self.class_name = class_name
        self.req = req
        self.actor_id: str = actor._actor_id.hex()
        self.peer: str | None = None
        self.calls = 0  # calls sent
        self._dead: str | None = None

    def __getattr__(self, name: str) -> ActorMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return ActorMethod(self, name)  # type: ignore[arg-type]  # it needs only call()

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None) -> RayFuture:
        """Send one method call; its future resolves with the method's result (or raises its exception)."""
        if self._dead is not None:
            raise ActorDied(f"actor {self.class_name} {self.actor_id[:8]}: {self._dead}")
        data, buffers = serialization.dumps((args, kwargs))
        self.calls += 1
        return self._backend.call_actor(self, method, (method, data, [bytes(b) for b in buffers]), timeout)

    def died(self, reason: str) -> None:
        """The actor is gone (closed, or killed past a call's timeout): later calls raise ActorDied."""
        if self._dead is None:
            self._dead = reason
            _ray().kill(self._actor, no_restart=True)
        self._backend.actors.pop(self.actor_id, None)

    @property
    def alive(self) -> bool:
        return self._dead is None

    def close(self) -> None:
        """End the actor and free what it holds on its node."""
        self.died("the actor was closed")

    def __enter__(self) -> RayActorHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "" if self._dead is None else f", ended: {self._dead}"
        return f"<ray actor {self.class_name} {self.actor_id[:8]} on {self.peer}{state}>"


def _end_unless_created(handle: RayActorHandle, creation: Future[Any]) -> None:
    """A failed or cancelled constructor leaves no actor behind holding its node's resources."""
    if creation.cancelled() or creation.exception() is not None:
        handle.died("its constructor did not complete")


class RayBackend:
    """Runs GPUlayer tasks on a Ray cluster (see the module docstring); `address` as ray.init takes it."""

    def __init__(self, address: str | None = None, echo_output: bool = True,
                 init_options: dict[str, Any] | None = None):
        ray = _ray()
        self.echo_output = echo_output
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:  # output is captured in the task and replayed, so Ray's own copy is off
            use_cluster_token()
            ray.init(address=address or os.environ.get(ADDRESS_ENV) or None, log_to_driver=False,
                     **(init_options or {}))
        self._run = ray.remote(_execute)
        self._run_timed = ray.remote(_execute_timed)
        self._host = ray.remote(ActorHost)
        self.actors: dict[str, RayActorHandle] = {}  # the live actors this submitter created
        self._plans: dict[Requirements, Plan] = {}
        self._timed: dict[int, RayTask] = {}  # id(generator) -> task
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._settling = ThreadPoolExecutor(1, thread_name_prefix="gpulayer-ray-results")

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _plan(self, req: Requirements) -> Plan:
        cached = self._plans.get(req)
        if cached is not None and time.monotonic() - cached.made < PLAN_TTL:
            return cached
        self._plans[req] = fresh = plan(req, _ray().nodes())
        return fresh

    def submit(self, fn: Callable[..., Any], args: Iterable[Any] = (), kwargs: dict[str, Any] | None = None, *,
               req: Requirements, timeout: float | None = None, retries: int = 0,
               env: dict[str, str] | None = None, fn_bytes: bytes | None = None, keep: bool = False,
               priority: int = 0) -> RayFuture:
        """Submit one call to a fitting node; NoMatchingPeer at once when none fits.

        keep=True (results held on the LAN's peers, docs/data.md) is refused: Ray keeps every result
        in its own object store, and passing a future as an argument is not supported here. So is a
        priority: Ray's scheduler has none."""
        if self.closed:
            raise ConfigError("this Ray backend is closed; call gl.configure() again")
        if priority:
            raise ValueError("priority= is not supported on the Ray backend: Ray's scheduler has no task priorities")
        if keep:
            raise ValueError("keep=True is not supported on the Ray backend: Ray holds results in its object "
                             "store; pass values, or use the LAN backend to chain held results peer to peer")
        timeout, retries, env = check_timeout(timeout), check_retries(retries), check_env(env)
        data, buffers = serialization.dumps_call(fn, tuple(args), kwargs or {})
        fn_bytes = fn_bytes or serialization.dumps_function(fn)
        req = inference.with_inferred(req, fn, fn_bytes, data)
        chosen = self._plan(req)
        options = {**chosen.options, "max_retries": retries}  # retries of lost workers and nodes, as on the LAN
        if env:
            options["runtime_env"] = {"env_vars": env}  # a worker started with them, as the LAN's one-off workers
        call = (fn_bytes, data, [bytes(b) for b in buffers], chosen.accelerator, list(req.frameworks))
        task = RayTask(getattr(fn, "__qualname__", type(fn).__name__), req, timeout, self.echo_output)
        task.ref = (self._run if timeout is None else self._run_timed).options(**options).remote(*call)
        return self._start(task)

    def _start(self, task: RayTask) -> RayFuture:
        """Resolve the task when its reference does: at once, or through the watcher of deadlines."""
        if task.timeout is None:
            # settled on a thread of ours: Ray's callback thread must not block, and a future's
            # callbacks (the user's too) may call Ray (ray.kill there never returns)
            task.ref.future().add_done_callback(lambda done: self._settling.submit(self._finished, task, done))
        else:
            self._watch(task)
        return task.future

    # ---- actors -------------------------------------------------------------------------------

    def create_actor(self, spec: ActorSpec) -> RayFuture:
        """A Ray actor holding the task's resources for its life (`restarts` as Ray's max_restarts);
        the future's result is its handle once the constructor ran. A constructor timeout counts
        from here."""
        cls_bytes = serialization.dumps(spec.cls)[0]
        data, buffers = serialization.dumps_call(spec.cls, tuple(spec.args), spec.kwargs)
        req = inference.with_inferred(spec.req, spec.cls, cls_bytes, data)
        chosen = self._plan(req)
        options = {**chosen.options, "max_concurrency": spec.concurrency, "max_restarts": spec.restarts}
        if spec.env:
            options["runtime_env"] = {"env_vars": spec.env}
        actor = self._host.options(**options).remote(cls_bytes, data, [bytes(b) for b in buffers],
                                                     chosen.accelerator, list(req.frameworks))
        handle = RayActorHandle(self, actor, spec.name, req)

        def created(_: Any) -> RayActorHandle:
            handle.peer = task.future.peer
            self.actors[handle.actor_id] = handle
            return handle

        task = RayTask(spec.name, req, spec.timeout, self.echo_output, ref=actor.ready.remote(),
                       kill=lambda: handle.died("its constructor ran past its timeout"), then=created)
        if spec.timeout is not None:
            task.deadline = time.monotonic() + spec.timeout
        future = self._start(task)
        future.add_done_callback(lambda done: _end_unless_created(handle, done))
        return future

    def call_actor(self, handle: RayActorHandle, method: str, call: tuple[str, bytes, list[bytes]],
                   timeout: float | None) -> RayFuture:
        """One method call on `handle`'s actor; past `timeout` (from its start) the actor is killed."""
        actor = handle._actor
        task = RayTask(method, handle.req, timeout, self.echo_output,
                       kill=lambda: handle.died(f"its call {method} ran past its timeout"))
        task.ref = (actor.call if timeout is None else actor.call_timed).remote(*call)
        return self._start(task)

    def live_actors(self) -> list[dict[str, Any]]:
        """This submitter's live actors, as `gl.actors()` lists them (slot and counts Ray does not report)."""
        return [{"actor": h.actor_id, "class": h.class_name, "peer": h.peer, "address": "ray", "slot": None,
                 "calls": h.calls, "pending": None} for h in list(self.actors.values())]

    @staticmethod
    def _finished(task: RayTask, done: Future[Any]) -> None:
        try:
            outcome = done.result()
        except BaseException as exc:
            task.fail(exc)
        else:
            task.resolve(outcome)

    def map(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]], *, req: Requirements, timeout: float | None = None,
            retries: int = 0, env: dict[str, str] | None = None, progress: bool | None = None,
            priority: int = 0) -> list[Any]:
        """fn(*args) for the args of every call, queued on Ray at once; results in input order; the first failure
        cancels the rest and is raised. A priority is refused, as by `submit`."""
        fn_bytes = serialization.dumps_function(fn)
        bar = ProgressBar(len(calls), label=getattr(fn, '__name__', 'map'), enabled=progress)
        futures: list[RayFuture] = []
        try:
            for args in calls:
                futures.append(self.submit(fn, args, req=req, timeout=timeout, retries=retries, env=env,
                                           fn_bytes=fn_bytes, priority=priority))
                futures[-1].add_done_callback(lambda _: bar.advance())
            wait(futures, return_when=FIRST_EXCEPTION)
            failure = next((exc for f in futures if f.done() and not f.cancelled()
                            and (exc := f.exception()) is not None), None)
            if failure is not None:
                raise failure
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()  # a no-op for those done: the rest after a failure, or on KeyboardInterrupt
            bar.close()

    # ---- timed tasks: one thread watches their streams and deadlines ----------------------------

    def _watch(self, task: RayTask) -> None:
        with self._lock:
            self._timed[id(task.ref)] = task
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_loop, name="gpulayer-ray-deadlines", daemon=True)
                self._watcher.start()
        self._wake.set()

    def _watch_loop(self) -> None:
        ray = _ray()
        while not self._closed.is_set():
            with self._lock:
                tasks = [t for t in self._timed.values() if not t.done]
                self._timed = {id(t.ref): t for t in tasks}
            if not tasks:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            now = time.monotonic()
            for task in tasks:
                if task.deadline is not None and now >= task.deadline:
                    self._expire(task)
            waiting = [t.ref for t in tasks if not t.done]
            if not waiting:
                continue
            deadlines = [t.deadline for t in tasks if t.deadline is not None and not t.done]
            wait = max(0.0, min([0.1, *(d - now for d in deadlines)]))  # new tasks are seen within 0.1 s
            ready, _ = ray.wait(waiting, num_returns=1, timeout=wait)
            for ref in ready:
                self._advance(self._timed[id(ref)])

    def _advance(self, task: RayTask) -> None:
        """The next item of a timed task's stream: its start, or its outcome."""
        ray = _ray()
        try:
            item = ray.get(next(task.ref) if isinstance(task.ref, ray.ObjectRefGenerator) else task.ref)
        except StopIteration:
            task.fail(PeerLost("the Ray task ended without an outcome"))
        except Exception as exc:
            task.fail(exc)
        else:
            if item == STARTED:
                assert task.timeout is not None
                task.deadline = time.monotonic() + task.timeout
            else:
                task.resolve(item)

    @staticmethod
    def _expire(task: RayTask) -> None:
        task.stop()
        task.complete(exc=TaskTimeout(f"task {task.name} ran past its timeout of {task.timeout:g} s on Ray; "
                                      "its worker was killed"))

    # ---- inspection and shutdown --------------------------------------------------------------

    def peers(self, wait: float | None = None, probe: bool = True) -> list[dict[str, Any]]:
        """The cluster's nodes as rows of `gl.peers()` (busy and queued are unknown: None)."""
        rows = []
        for node in _ray().nodes():
            a = advert_of(node)
            rows.append({"name": a.name, "peer_id": a.peer_id, "address": node.get("NodeManagerAddress", ""),
                         "accelerator": a.accelerator, "device": a.device_name, "memory_kind": a.memory_kind,
                         "device_memory_gb": list(a.device_memory_gb), "ram_gb": a.ram_gb,
                         "frameworks": dict(a.frameworks), "capabilities": sorted(a.capabilities), "slots": a.slots,
                         "busy": None, "queued": None, "source": "ray",
                         "state": "up" if node.get("Alive") else "down",
                         "error": "" if node.get("Alive") else node.get("DeathReasonMessage", "")})
        return sorted(rows, key=lambda r: r["name"])

    def close(self) -> None:
        """Stop watching; shut Ray down when this backend started it (ray.init here)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        for handle in list(self.actors.values()):
            handle.close()
        self._settling.shutdown(wait=False, cancel_futures=True)
        if self._owns_ray:
            _ray().shutdown()
