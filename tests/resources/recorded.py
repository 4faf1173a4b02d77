"""Where the recorded facts of the resources tests live (facts/): a module of its own, since a test
that imports from `conftest` gets whichever conftest was loaded last."""

from pathlib import Path

FACTS_DIR = Path(__file__).with_name("facts")
