"""The suite's own rules, checked on its source (ast over tests/): no test that cannot fail.

- no assert that always holds: a constant, a comparison of constants or of a thing with itself,
  `x >= 0` (a count always is);
- no test whose only check is `try: call() except ...: pass` (any outcome passes);
- no `time.sleep` in a test or a fixture: wait on a condition, with support.wait_until or support.holds_for;
  a load a test plays at a pace goes through support.paced
  (the tasks a test ships, and the helpers that play a slow link, may sleep);
- no wall-clock comparison in an assert (performance lives in bench/): a bound is the timeout of the
  call that waits (result(timeout), stop(timeout), wait_until(..., timeout));
- no import from `conftest` (pytest loads several; which one a name comes from depends on the order).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import ci_forbids

TESTS = Path(__file__).parent
CLOCKS = {"monotonic", "monotonic_ns", "time", "time_ns", "perf_counter", "perf_counter_ns"}
DURATION_NAMES = {"elapsed", "slowest"}  # what tests call a time they measured

SLEEP, CLOCK = "time.sleep in a test", "wall-clock comparison in an assert"


def own_nodes(fn: ast.AST):
    """The nodes of a function's body, not of the functions, lambdas and classes defined in it."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def compared(node: ast.AST):
    """The nodes of an expression, not those inside a call's arguments (a deadline given to a call)."""
    yield node
    children = [node.func] if isinstance(node, ast.Call) else ast.iter_child_nodes(node)
    for child in children:
        yield from compared(child)


def reads_clock(node: ast.AST) -> bool:
    """`node` computes with time.monotonic() or its kind (rather than only passing it to a call)."""
    return any(isinstance(n, ast.Attribute) and n.attr in CLOCKS and isinstance(n.value, ast.Name)
               and n.value.id == "time" for n in compared(node))


def is_sleep(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (
        isinstance(node.func, ast.Attribute) and node.func.attr == "sleep"
        and isinstance(node.func.value, ast.Name) and node.func.value.id in ("time", "asyncio")
        or isinstance(node.func, ast.Name) and node.func.id == "sleep")


def is_fixture(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("fixture" in ast.unparse(d) for d in fn.decorator_list)


def always_holds(test: ast.expr) -> bool:
    if isinstance(test, ast.Constant):
        return bool(test.value)
    if not isinstance(test, ast.Compare):
        return False
    operands = [test.left, *test.comparators]
    if all(isinstance(o, ast.Constant) for o in operands):
        return True
    if len(test.ops) == 1 and ast.dump(test.left) == ast.dump(test.comparators[0]) \
            and isinstance(test.ops[0], (ast.Eq, ast.LtE, ast.GtE, ast.Is)) \
            and not any(isinstance(n, ast.Call) for n in ast.walk(test.left)):  # f(x) == f(x) checks determinism
        return True
    zero = ast.Constant(0)
    return len(test.ops) == 1 and (
        isinstance(test.ops[0], ast.GtE) and ast.dump(test.comparators[0]) == ast.dump(zero)
        or isinstance(test.ops[0], ast.LtE) and ast.dump(test.left) == ast.dump(zero))


def measures_time(test: ast.expr, clock_names: set[str]) -> bool:
    """An assert compares a time the test measured: a clock read, a name set from one, an "elapsed"."""
    for cmp in (n for n in ast.walk(test) if isinstance(n, ast.Compare)):
        for n in (n for operand in (cmp.left, *cmp.comparators) for n in compared(operand)):
            if reads_clock(n) or isinstance(n, ast.Name) and n.id in clock_names | DURATION_NAMES \
                    or isinstance(n, ast.Constant) and n.value in DURATION_NAMES:  # out["elapsed"]
                return True
    return False


def swallows_the_outcome(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A test whose checks are only a try whose handler passes: any outcome passes."""
    tries = [n for n in own_nodes(fn) if isinstance(n, ast.Try) and not n.orelse
             and any(all(isinstance(s, ast.Pass) or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                         for s in h.body) for h in n.handlers)]
    if not tries:
        return False
    inside = {id(n) for t in tries for n in ast.walk(t)}
    return not any(isinstance(n, ast.Assert) or isinstance(n, ast.Call) and "raises" in ast.unparse(n.func)
                   for n in own_nodes(fn) if id(n) not in inside)


def offences(path: Path, root: Path = TESTS) -> set[tuple[str, str, str]]:
    """(file, function, rule) for each rule that a function of `path` breaks."""
    tree = ast.parse(path.read_text(), str(path))
    where = str(path.relative_to(root))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "conftest":
            found.add((where, "<module>", "import from conftest"))
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        is_test = node.name.startswith("test_")
        clock_names = {t.id for n in own_nodes(node) if isinstance(n, ast.Assign) and reads_clock(n.value)
                       for t in n.targets if isinstance(t, ast.Name)}
        for n in own_nodes(node):
            if isinstance(n, ast.Assert):
                if always_holds(n.test):
                    found.add((where, node.name, "assert that always holds"))
                if measures_time(n.test, clock_names):
                    found.add((where, node.name, CLOCK))
            if is_sleep(n) and (is_test or is_fixture(node)):
                found.add((where, node.name, SLEEP))
        if is_test and swallows_the_outcome(node):
            found.add((where, node.name, "except: pass around the call under test"))
    return found


def test_no_test_in_the_suite_breaks_the_rules():
    found = set().union(*(offences(p) for p in sorted(TESTS.rglob("*.py"))))
    assert not found, "\n".join(f"{f}::{fn}: {rule}" for f, fn, rule in sorted(found))


BAD = '''
import time
import pytest
from conftest import HELPER

@pytest.fixture
def slow():
    time.sleep(1)

def test_constant():
    assert True

def test_count(packets):
    assert packets["idle"] >= 0

def test_swallowed(data):
    try:
        parse(data)
    except ValueError:
        pass

def test_clock(client):
    started = time.monotonic()
    client.run()
    assert time.monotonic() - started < 2.0

def test_measured(agent):
    out = agent.call()
    assert out["elapsed"] < 2.0

def test_slept(peer):
    time.sleep(0.5)
    assert peer.alive()

def test_fine(peer, tmp_path):
    def task():
        time.sleep(1)  # a task it ships may sleep
    try:
        peer.run(task)
    except OSError:
        pass
    assert 0 <= peer.load() <= 1 and peer.alive()
'''


@pytest.mark.parametrize("rule, names", [
    ("assert that always holds", {"test_constant", "test_count"}),
    ("except: pass around the call under test", {"test_swallowed"}),
    (CLOCK, {"test_clock", "test_measured"}),
    (SLEEP, {"slow", "test_slept"}),
    ("import from conftest", {"<module>"}),
])
def test_each_rule_finds_its_kind_and_only_it(tmp_path, rule, names):
    bad = tmp_path / "test_bad.py"
    bad.write_text(BAD)
    assert {fn for _, fn, r in offences(bad, tmp_path) if r == rule} == names


@pytest.mark.parametrize("reason, forbidden", [
    ("needs a CUDA GPU; none is present", False), ("needs Apple MPS; not present", False),
    ("needs systemd, not present here", False), ("no Python 3.11 interpreter here (pyenv or PATH)", True),
    ("network namespaces need root (run the suite as root, as CI does)", True),
    ("tensorboard is not installed: the clear error is tested", True), ("could not import 'lightning.pytorch'", True),
])
def test_in_ci_a_skip_is_an_error_unless_ci_cannot_run_it(monkeypatch, reason, forbidden):
    skipped = SimpleNamespace(skipped=True, longrepr=("test_x.py", 1, f"Skipped: {reason}"))
    monkeypatch.setenv("CI", "true")
    assert (ci_forbids(skipped) is not None) == forbidden
    monkeypatch.delenv("CI")
    assert ci_forbids(skipped) is None
