"""The layers of gpulayer/, read from the source (ast): no import cycle, counting the imports inside
functions; each module imports only its own layer or those below it, and the worker, the peer daemon,
the client and the trainer import none of each other; no module reaches for another's private name.
The map is in docs/architecture.md ("Layers"), the target in docs/adr/0015-structure-ii-layers.md.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpulayer"

# Lowest first. A module imports only modules of its own layer or of a layer below; layer 4's sides
# import only themselves (and the layers below). A module is placed by its longest listed prefix.
LAYERS: list[dict[str, set[str]]] = [
    {"leaves": {"errors", "accelerators", "serialization", "remote_exceptions", "held", "taskenv", "checks",
                "distributed", "records", "security", "progress", "peer_table", "jobs", "jobs.folder"}},
    {"protocol": {"protocol"}},
    {"transport": {"transport", "lending", "invite", "jobs.transfer", "jobs.local_fetch"}},
    {"offers and needs": {"resources", "matching", "task_options", "discovery", "mdns"}},
    {"worker": {"worker"}, "peer": {"peer"}, "client": {"client"}, "trainer": {"torch"}},
    {"backends": {"backends"}},
    {"surface": {"", "__main__", "runtime", "api", "actor_class", "cli", "dashboard", "demo", "benchmark",
                 "jobs_cli"}},
]
# Edges the layers would allow that stay out all the same (prefixes of module names): the Ray backend
# runs tasks without the peer's or the worker's code; the option table needs no transport.
BREAKS = {("backends", "peer"), ("backends", "worker"), ("task_options", "transport")}
# Inside the client: a connection, and the pool that opens and watches them, know nothing of tasks, their
# placement, leases, actors or the engine (they report through connection.Listener).
BREAKS |= {(low, high) for low in ("client.connection", "client.pool")
           for high in ("client.engine", "client.placement", "client.tasks", "client.leases", "client.actors")}
BREAKS.add(("client.connection", "client.pool"))
# What a job interpreter has besides the standard library: the worker side needs nothing else (torch
# only where a task's data holds tensors, which serialization rebuilds; no psutil, no zeroconf).
JOB_INTERPRETER = {"msgpack", "cloudpickle", "cryptography", "torch"}
# The peer's decisions, pure (ADR 0015): they import no event loop, socket, process or thread, and of the
# peer's modules only each other; the asyncio side (peer/scheduler) performs what they return.
PURE = {"peer.scheduler_state", "peer.slots", "peer.actors", "peer.admission"}
IO = {"asyncio", "socket", "selectors", "subprocess", "signal", "threading", "multiprocessing", "psutil", "zeroconf"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node, inside functions too, except under `if TYPE_CHECKING:` (annotations only)."""
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for stmt in node.body for n in ast.walk(stmt)}
    return [node for node in ast.walk(tree) if id(node) not in skipped]


def imported_from(name: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def known(dotted: str) -> str:
    """The gpulayer module that an import of `dotted` loads (a package for a name inside it)."""
    while dotted not in MODULES and "." in dotted:
        dotted = dotted.rsplit(".", 1)[0]
    return dotted


def imports(name: str) -> tuple[set[str], set[str]]:
    """The gpulayer modules and the top-level outside packages that module `name` imports."""
    ours, outside = set(), set()
    for node in runtime_nodes(TREES[name]):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = imported_from(name, node)
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "gpulayer" or target.startswith("gpulayer."):
                ours.add(known(target))
            else:
                outside.add(target.partition(".")[0])
    ours.discard(name)
    return ours, outside


GRAPH = {name: imports(name)[0] for name in MODULES}


def under(name: str, prefix: str) -> bool:
    """Whether module `name` is `prefix` (gpulayer.<prefix>) or inside it."""
    inner = name.removeprefix("gpulayer").removeprefix(".")
    return inner == prefix or inner.startswith(prefix + ".")


def place(name: str) -> tuple[int, str]:
    """(layer index, side) of a module: the longest prefix listed in LAYERS."""
    best: tuple[int, int, str] | None = None
    for index, sides in enumerate(LAYERS):
        for side, prefixes in sides.items():
            for prefix in prefixes:
                if under(name, prefix):
                    if best is None or len(prefix) > best[0]:
                        best = (len(prefix), index, side)
    assert best is not None, f"{name} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return best[1], best[2]


def test_no_import_cycle():
    seen: dict[str, int] = {}

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        seen[name] = 1  # on the current path
        for other in sorted(GRAPH[name]):
            if seen.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in seen and (found := cycle_from(other, [*path, other])):
                return found
        seen[name] = 2  # done
        return None

    for name in sorted(MODULES):
        if name not in seen:
            found = cycle_from(name, [name])
            assert found is None, "import cycle: " + " -> ".join(found)


def test_each_module_imports_only_its_layer_and_those_below():
    wrong = []
    for name, targets in GRAPH.items():
        layer, side = place(name)
        for target in targets:
            other_layer, other_side = place(target)
            if other_layer > layer or (other_layer == layer and other_side != side) or \
                    any(under(name, low) and under(target, high) for low, high in BREAKS):
                wrong.append(f"{name} ({side}) imports {target} ({other_side})")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_worker_side_needs_only_what_a_job_interpreter_has():
    worker = {name for name in MODULES if place(name)[1] == "worker"}
    closure, todo = set(), list(worker)
    while todo:
        name = todo.pop()
        if name not in closure:
            closure.add(name)
            todo.extend(GRAPH[name])
    outside = {pkg: name for name in closure for pkg in imports(name)[1]
               if pkg not in sys.stdlib_module_names and pkg not in JOB_INTERPRETER and pkg != "__future__"}
    assert not outside, f"the worker side imports {outside} (package: importing module)"
    assert not {name for name in closure if place(name)[1] in ("peer", "client")}


def defined_names(tree: ast.AST) -> set[str]:
    """Every name a module defines: functions, classes, assigned names and attributes (self._x = ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
    return names


def private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def test_no_module_uses_another_modules_private_names():
    defined = {name: defined_names(tree) for name, tree in TREES.items()}
    wrong = []
    for name, tree in TREES.items():
        elsewhere = {attr for other, names in defined.items() if other != name for attr in names
                     if private(attr)} - defined[name]
        module_aliases = {}
        for node in ast.walk(tree):
            where = f"{MODULES[name].relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom):
                source = imported_from(name, node)
                for alias in node.names:
                    if f"{source}.{alias.name}" in MODULES:
                        module_aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                    elif source.startswith("gpulayer") and private(alias.name):
                        wrong.append(f"{where}: imports {alias.name} from {source}")
            elif isinstance(node, ast.Import):
                module_aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and private(node.attr)):
                continue
            owner = node.value
            where = f"{MODULES[name].relative_to(ROOT)}:{node.lineno}"
            if isinstance(owner, ast.Name) and owner.id in module_aliases:
                if module_aliases[owner.id] != name:
                    wrong.append(f"{where}: {ast.unparse(node)}")
            elif not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) and node.attr in elsewhere:
                wrong.append(f"{where}: {ast.unparse(node)} (defined in another module)")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_peers_decisions_do_no_io():
    pure = {f"gpulayer.{name}" for name in PURE}
    assert pure <= MODULES.keys()
    wrong = {name: sorted(IO & imports(name)[1] | {t for t in GRAPH[name] if place(t)[1] == "peer"} - pure)
             for name in pure}
    assert not any(wrong.values()), f"the pure modules import (module: what): {wrong}"


def test_a_messages_validator_lives_in_the_protocol_layer_only():
    """One validator per message (issue 25): a `check_<kind>` (or `_check_<kind>`, `check_leased_<kind>`) of a
    message kind is defined in protocol/ alone, where the peer's handlers and the worker find it."""
    from gpulayer.protocol import messages

    wrong = []
    for name, tree in TREES.items():
        if under(name, "protocol"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                words = node.name.lstrip("_").split("_")
                kind = words[2] if words[:2] == ["check", "leased"] and len(words) > 2 else words[1:2]
                if words[0] == "check" and "".join(kind) in messages.MESSAGE_TYPES:
                    wrong.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno}: {node.name}")
    assert not wrong, "validators of a message outside protocol/: " + ", ".join(wrong)
    assert {fn.__module__ for fn in messages.CHECKS.values()} == {"gpulayer.protocol.messages"}


WORKER_TIMERS = {"Timer", "alarm", "setitimer", "call_later"}  # what a second timeout mechanism would use


def test_the_worker_reads_its_streams_in_one_loop_and_times_its_tasks_in_one_watchdog():
    """One worker receive loop and one timeout mechanism (issue 25): on the worker side, a message is read
    (`.recv()`) only by the receiver's loop, through a stream (worker/streams), and no module arms a timer
    of its own beside the receiver's one Watchdog."""
    readers, timers, watchdogs = set(), [], []
    for name in (n for n in MODULES if place(n)[1] == "worker"):
        for node in runtime_nodes(TREES[name]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "recv" \
                    and not node.args:
                readers.add(name)
            elif isinstance(node, (ast.Attribute, ast.Name, ast.alias)):
                word = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) \
                    else node.name.rpartition(".")[2]
                if word in WORKER_TIMERS:
                    timers.append(f"{name}: {word}")
            elif isinstance(node, ast.ClassDef) and node.name == "Watchdog":
                watchdogs.append(name)
    assert readers == {"gpulayer.worker.receiver", "gpulayer.worker.streams"}, readers
    assert not timers, timers
    assert watchdogs == ["gpulayer.worker.receiver"]


def test_the_worker_chooses_a_tasks_output_path_in_one_place():
    """One output path per stream kind, chosen in one place (issue 25): on the worker side only
    worker/output replaces sys.stdout or sys.stderr, or moves file descriptors (dup2, redirect_*)."""
    wrong = set()
    for name in (n for n in MODULES if place(n)[1] == "worker"):
        for node in runtime_nodes(TREES[name]):
            targets = node.targets if isinstance(node, ast.Assign) else []
            stores = [t for target in targets for t in ast.walk(target)
                      if isinstance(t, ast.Attribute) and ast.unparse(t) in ("sys.stdout", "sys.stderr")]
            moves = isinstance(node, ast.Attribute) and node.attr in ("dup2", "redirect_stdout", "redirect_stderr")
            if stores or moves:
                wrong.add(name)
    assert wrong == {"gpulayer.worker.output"}, wrong
