"""docs/configuration.md names every command-line option and every GPULAYER_ variable of the code."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "configuration.md").read_text()


def options(parser: argparse.ArgumentParser, where: str = "gpulayer"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from options(sub, f"{where} {name}")
        else:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    yield where, flag


def test_every_cli_option_is_documented():
    from gpulayer.cli import build_parser

    found = sorted(set(options(build_parser())))
    assert found, "no options found: has the CLI changed shape?"
    missing = [f"{where} {flag}" for where, flag in found if f"`{flag}" not in PAGE]
    assert not missing, f"docs/configuration.md does not mention: {missing}"


def test_every_environment_variable_is_documented():
    names = set()
    for path in (ROOT / "gpulayer").rglob("*.py"):
        names |= set(re.findall(r"\bGPULAYER_[A-Z_]+[A-Z]\b", path.read_text()))
    assert {"GPULAYER_KEY", "GPULAYER_PEERS"} <= names
    missing = sorted(n for n in names if f"`{n}`" not in PAGE)
    assert not missing, f"docs/configuration.md does not mention: {missing}"


def test_the_architecture_page_names_every_module_and_only_real_ones():
    page = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(gpulayer/[\w/]+(?:\.py|/))`", page))
    assert {"gpulayer/client/engine.py", "gpulayer/peer/scheduler.py"} <= named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "gpulayer").glob("*.py") if p.name != "__init__.py"}
    modules |= {str(p.relative_to(ROOT)) for p in (ROOT / "gpulayer").glob("*/*.py")
                if p.name not in ("__init__.py", "__main__.py") and p.parent.name not in ("torch", "resources")}
    covered = {m for m in modules if m in named or any(m.startswith(d) for d in named if d.endswith("/"))}
    assert modules == covered, f"docs/architecture.md does not mention: {sorted(modules - covered)}"
