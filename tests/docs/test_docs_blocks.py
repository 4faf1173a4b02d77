"""Every fenced code block of docs/**/*.md and README.md runs, or is marked as not runnable here.

The convention is in docblocks.py (and docs/testing.md). Blocks run in page order, each page in
a working folder of its own with a private HOME, against a loopback peer of a fresh cluster:
GPULAYER_KEY is new, GPULAYER_INTERFACES=127.0.0.1, GPULAYER_CACHE=0. Nothing leaves loopback:
a runnable block that names another address fails before it runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import docblocks
from docblocks import Block, Page
from support import PeerProcess, new_key

if os.environ.get(docblocks.NESTED_ENV):  # a docs block that runs pytest must not run the docs again
    pytest.skip("inside a docs block", allow_module_level=True)

BLOCKS = docblocks.all_blocks()
LAST_OF_PAGE = {b.path: b for b in BLOCKS}  # dicts keep the last value: the page's last block


def test_every_block_is_runnable_or_marked():
    bad = [f"{b.where}: {why}" for b in BLOCKS for why in docblocks.problems(b)]
    assert not bad, "blocks that break the docs' code-block convention (see tests/docs/docblocks.py):\n" + \
        "\n".join(bad)


def test_the_readme_rules_still_match_the_readme():
    """The README is not the docs' to edit; if its lines change, README_RULES must follow."""
    lines = {line.strip() for b in docblocks.blocks_of(docblocks.ROOT / "README.md") for line in b.text.splitlines()}
    stale = [line for line in docblocks.README_RULES if line not in lines]
    assert not stale, f"README_RULES name lines that README.md no longer has: {stale}"


def test_the_marker_parser():
    assert docblocks.parse_marker("<!-- needs: mps; background: ready on port -->") == {
        "needs": "mps", "background": "ready on port"}
    assert docblocks.parse_marker("<!-- continue -->") == {"continue": ""}
    assert docblocks.parse_marker("<!-- an ordinary comment -->") is None
    assert docblocks.parse_marker("text <!-- needs: mps -->") is None
    assert docblocks.parse_marker("<!-- not-run: a; b; needs: cuda -->") == {"not-run": "a; b", "needs": "cuda"}
    assert docblocks.parse_marker("<!-- needs mps -->") is None
    block = Block(Path("x.md"), 1, "bash", "pip install .\n")
    assert any("would install" in why for why in docblocks.problems(block))
    block = Block(Path("x.md"), 1, "bash", "python -m pytest -q\n")
    assert any("runs more than" in why for why in docblocks.problems(block))
    block = Block(Path(docblocks.ROOT / "docs/x.md"), 1, "bash", "GPULAYER_PEERS=10.0.0.2:7340 gpulayer peers\n")
    assert any("10.0.0.2" in why for why in docblocks.problems(block))
    block = Block(Path(docblocks.ROOT / "docs/x.md"), 1, "bash", "GPULAYER_PEERS=gpubox.local:7340 gpulayer peers\n")
    assert any("gpubox.local:7340" in why for why in docblocks.problems(block))
    block = Block(Path(docblocks.ROOT / "docs/x.md"), 1, "bash", "a \\\n  b\n# comment\n\nc  # trailing\n")
    assert [c.split() for c in docblocks.commands(block)] == [["a", "b"], ["c", "#", "trailing"]]
    block = Block(Path(docblocks.ROOT / "docs/x.md"), 1, "console", "$ gpulayer peers\nNAME ADDRESS\n")
    assert docblocks.commands(block) == ["gpulayer peers"]
    assert docblocks.problems(Block(Path("x.md"), 1, "json", "{}\n")) != []
    assert docblocks.problems(Block(Path("x.md"), 1, "json", "{}\n", {"not-run": ""})) != []
    assert docblocks.problems(Block(Path("x.md"), 1, "json", "{}\n", {"file": "a.json"})) == []


@pytest.fixture(scope="session")
def have():
    return docblocks.present_needs()


@pytest.fixture(scope="module")
def base_env(tmp_path_factory):
    """The environment of every block, with one loopback peer of its fresh cluster running."""
    key = new_key()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    env.update(GPULAYER_KEY=key, GPULAYER_INTERFACES="127.0.0.1", GPULAYER_CACHE="0",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    home = tmp_path_factory.mktemp("docs-peer-home")
    env.update(XDG_CONFIG_HOME=str(home / "config"), XDG_CACHE_HOME=str(home / "cache"))
    peer = PeerProcess(tmp_path_factory.mktemp("docs-peer"), key, "docs-peer", env=env)
    peer.start()
    yield env
    peer.stop(timeout=20)
    peer.kill()


@pytest.fixture(scope="module")
def pages(base_env, tmp_path_factory):
    """Page contexts, made when a page's first block runs; a page's last block closes its own."""
    open_pages: dict[Path, Page] = {}

    def get(path: Path) -> Page:
        if path not in open_pages:
            for other in list(open_pages):  # a page left open by a failure before its last block
                open_pages.pop(other).close()
            workdir = tmp_path_factory.mktemp("page-" + path.stem)
            for name in ("bench", "docs", "examples", "gpulayer", "scripts", "tests", "pyproject.toml",
                         "README.md", "mkdocs.yml"):  # repository paths that blocks name, read-only by intent
                if (docblocks.ROOT / name).exists():
                    (workdir / name).symlink_to(docblocks.ROOT / name)
            open_pages[path] = Page(path, workdir, base_env)
        return open_pages[path]

    def close(path: Path) -> list[str]:
        page = open_pages.pop(path, None)
        return page.close() if page else []

    get.close = close
    yield get
    for page in open_pages.values():
        page.close()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block(block: Block, pages, have):
    page = pages(block.path)
    failed = True
    try:
        why = docblocks.problems(block)
        assert not why, f"{block.where}: " + "; ".join(why)
        reason = docblocks.skip_reason(block, have)
        if reason:
            failed = False
            pytest.skip(reason)
        page.run(block)
        failed = False
    finally:
        if LAST_OF_PAGE[block.path] is block:
            complaints = pages.close(block.path)
            if complaints and not failed:
                pytest.fail(f"{block.path.name}: " + "\n".join(complaints))
