import os
import sys

import pytest
import torch

# glt_models must be importable by name, also from DDP worker processes and under --import-mode=importlib
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _isolate(monkeypatch, tmp_path):
    """Each test starts without GPULAYER_DEVICE, in its own temporary working directory (where a Trainer's
    default lightning_logs/ and checkpoints go), and leaves the global determinism settings as it found them."""
    monkeypatch.delenv("GPULAYER_DEVICE", raising=False)
    monkeypatch.chdir(tmp_path)
    # registered with monkeypatch so that Trainer(deterministic=True)'s setdefault is undone afterwards
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
