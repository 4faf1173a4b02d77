"""Shared helpers for the resources tests: recorded facts under facts/."""

import json
from pathlib import Path

import pytest

FACTS_DIR = Path(__file__).with_name("facts")


@pytest.fixture
def load_facts():
    """load_facts("mac_m2_max") -> the recorded facts dict (a fresh copy each call)."""
    return lambda name: json.loads((FACTS_DIR / f"{name}.json").read_text())
