import os
import sys

# the tiny models of the trainer tests (tests/torch/glt_models.py), importable by DDP worker processes too
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "torch"))
