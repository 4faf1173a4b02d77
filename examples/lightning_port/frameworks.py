"""Run an example of this folder under gpulayer.torch (as written) or under Lightning (the imports
swapped back): the same file, the same seed, two trainers.

    from frameworks import load
    autoencoder = load("autoencoder.py", "lightning")   # or "glt"
    metrics = autoencoder.main("/tmp/run")
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

HERE = pathlib.Path(__file__).parent
EXAMPLES = ("autoencoder.py", "classifier.py")
# the only lines an example changes to move from Lightning to gpulayer.torch
SWAPS = {"lightning": [("import gpulayer.torch as L", "import lightning.pytorch as L"),
                       ("from gpulayer.torch import ", "from lightning.pytorch import "),
                       ("from gpulayer.torch.callbacks import ", "from lightning.pytorch.callbacks import "),
                       ("from gpulayer.torch.loggers import ", "from lightning.pytorch.loggers import ")],
         "glt": []}


def source(name: str, framework: str) -> str:
    """The example's code for `framework` ("glt" or "lightning")."""
    text = (HERE / name).read_text()
    for ours, theirs in SWAPS[framework]:
        text = text.replace(ours, theirs)
    return text


def load(name: str, framework: str) -> types.ModuleType:
    """The example as a module of its own, run under `framework`."""
    module_name = f"lightning_port_{pathlib.Path(name).stem}_{framework}"
    spec = importlib.util.spec_from_loader(module_name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(HERE / name)
    sys.modules[module_name] = module  # picklable classes (checkpoints, DDP) need their module importable
    exec(compile(source(name, framework), str(HERE / name), "exec"), module.__dict__)
    return module
