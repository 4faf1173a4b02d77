"""Shared helpers for the resources tests: recorded facts under facts/."""

import json

import pytest
from recorded import FACTS_DIR


@pytest.fixture
def load_facts():
    """load_facts("mac_m2_max") -> the recorded facts dict (a fresh copy each call)."""
    return lambda name: json.loads((FACTS_DIR / f"{name}.json").read_text())
