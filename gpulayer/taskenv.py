"""What a task's environment may change in a warm worker, and what needs a fresh one.

A leaf module: the submitter, the peer and every worker (in a job interpreter that has only
msgpack, cloudpickle and cryptography) import it.
"""

from __future__ import annotations

# Variables that the interpreter reads when it starts, or a library (torch, mlx, Metal, CUDA, the
# math and thread libraries) when it loads or initialises: setting one in a warm worker, where torch
# may already be loaded, would come too late. A task whose env sets one runs in a fresh worker.
READ_AT_LOAD_PREFIXES = ("PYTORCH_", "TORCH_", "CUDA_", "MLX_", "METAL_", "MTL_", "OMP_", "MKL_", "OPENBLAS_",
                         "KMP_", "VECLIB_", "XLA_", "JAX_", "TF_", "HF_", "PYTHON", "LD_", "DYLD_", "MALLOC_")


def read_at_load(name: str) -> bool:
    """Whether variable `name` takes effect only in a process started with it (READ_AT_LOAD_PREFIXES)."""
    return name.startswith(READ_AT_LOAD_PREFIXES)
