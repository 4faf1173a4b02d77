"""Where the docs state one fact on several pages, the pages agree (issue 26, item 10).

The ADRs (docs/adr/) keep what was decided when, so an earlier state stays true there; every
other page describes the code as it is.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "adr" not in p.parts)]


def lines_matching(pattern: str) -> list[str]:
    found = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if re.search(pattern, line, re.IGNORECASE):
                found.append(f"{page.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_no_page_says_that_gpulayers_traffic_is_not_encrypted():
    assert lines_matching(r"\b(not encrypted|unencrypted)\b") == []  # docs/security.md: AES-256-GCM


def test_every_page_names_the_same_cipher():
    named = {m for line in lines_matching(r"AES-\d+-GCM") for m in re.findall(r"AES-\d+-GCM", line)}
    assert named == {"AES-256-GCM"}
