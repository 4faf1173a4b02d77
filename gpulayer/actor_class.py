"""Actor classes: what `@gl.remote` returns for a class (docs/actors.md).

    @gl.remote(accelerator="mps", gpu_memory_gb=8)
    class Generator:
        def __init__(self, path): self.model = load(path)
        def generate(self, prompt): ...

    g = Generator("weights/")   # the actor, on a matching peer, once __init__ ran there
    g.generate("hello")         # runs there

The task options (`gpulayer.task_options`) apply to creating the actor; two more are the actor's own:
`max_concurrency` (calls run at once, default 1: one at a time, in the order they were sent) and
`restarts` (how many times a dead actor is re-created with its constructor arguments).
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .checks import check_concurrency
from .runtime import default_client
from .task_options import TaskOptions

if TYPE_CHECKING:
    from .client.actors import ActorHandle

ACTOR_OPTIONS = ("max_concurrency", "restarts")


def check_restarts(restarts: Any) -> int:
    """A non-negative integer."""
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"restarts must be a non-negative integer, not {restarts!r}")
    return restarts


class ActorClass:
    """A class made remote: calling it creates an actor on a matching peer and returns its handle.

    `.submit(...)` returns a future of the handle, `.options(...)` a copy with some options
    replaced, `.local(...)` a plain instance in this process.
    """

    def __init__(self, cls: type, options: dict[str, Any]):
        self.__gpulayer_class__ = cls
        self._options = options
        self._parsed = TaskOptions.parse({k: v for k, v in options.items() if k not in ACTOR_OPTIONS})
        if self._parsed.nodes is not None:
            raise ValueError("nodes= makes a gang of a function's ranks (gl.run(fn, nodes=N)), not of an actor")
        self._concurrency = check_concurrency(options.get("max_concurrency", 1))
        self._restarts = check_restarts(options.get("restarts", 0))
        functools.update_wrapper(self, cls, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> ActorHandle:
        handle: ActorHandle = self.submit(*args, **kwargs).result()
        return handle

    def submit(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Create the actor; the future's result is its handle once the constructor ran on the peer."""
        from .client.actors import ActorSpec  # here: `gpulayer submit` imports the API but makes no actor

        p = self._parsed
        spec = ActorSpec(self.__gpulayer_class__, args, kwargs, p.requirements, p.timeout, p.retries, p.env,
                         self._concurrency, self._restarts)
        return default_client().create_actor(spec)  # on a LAN peer, or a Ray actor

    def options(self, **overrides: Any) -> ActorClass:
        """A copy with some options replaced, e.g. Generator.options(accelerator="cuda")."""
        return ActorClass(self.__gpulayer_class__, {**self._options, **overrides})

    def local(self, *args: Any, **kwargs: Any) -> Any:
        """A plain instance of the class, here in this process."""
        return self.__gpulayer_class__(*args, **kwargs)
