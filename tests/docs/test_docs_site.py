"""The documentation site builds with `mkdocs build --strict` (no broken link, no page left out
of the navigation), and the benchmark page shows the figures of bench/results/*.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocs")
pytest.importorskip("material")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_navigation_and_built(site):
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # hooks need no loading here
    listed = set(nav_pages(config["nav"]))
    present = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert listed == present
    for page in listed:
        stem = page.removesuffix(".md")
        html = stem.removesuffix("index") + "index.html" if stem.endswith("index") else stem + "/index.html"
        assert (site / html).exists(), html


def test_the_benchmark_page_shows_the_result_files(site):
    html = (site / "benchmarks" / "index.html").read_text()
    results = ROOT / "bench" / "results"
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        machine = data.get("machine")
        date = data.get("date") or data.get("when") or (machine.get("date") if isinstance(machine, dict) else None)
        assert path.name in html, f"{path.name} is not on the benchmarks page"
        if date:
            assert date[:10] in html, f"the date of {path.name} is not on the benchmarks page"
    for png in sorted(results.glob("*.png")):
        assert (site / "bench" / "results" / png.name).exists()
        assert f"bench/results/{png.name}" in html
    assert "<!-- bench:" not in html
