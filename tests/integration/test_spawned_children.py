"""Child processes that a task starts with multiprocessing's spawn (the macOS default) or forkserver.

The submitter is a script run as `python script.py`, so that its Dataset class and its functions
really live in its `__main__` and arrive at the worker by value. The peer is a Mac emulated through
the advertise override (its workers preload torch, as on a Mac).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import new_key, write_override

TORCH_MPS = [{"name": "torch", "version": "2.13.0", "capabilities": ["torch.cpu", "torch.mps"]}]

DATALOADER_SCRIPT = """
    import gpulayer as gl
    import torch
    from torch.utils.data import DataLoader, Dataset


    class Squares(Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return torch.tensor(i * i)


    def total(n):
        loader = DataLoader(Squares(n), batch_size=4, num_workers=2, multiprocessing_context="spawn")
        return int(sum(batch.sum() for batch in loader))


    if __name__ == "__main__":
        print("sum", gl.run(total, 10, accelerator="mps"))
"""

MULTIPROCESSING_SCRIPT = """
    import multiprocessing
    import sys

    import gpulayer as gl


    class Square:
        def __init__(self, x):
            self.value = x * x


    def square(x):
        return Square(x)


    def put_square(queue, x):
        queue.put(square(x))


    def children(method):
        context = multiprocessing.get_context(method)
        with context.Pool(2) as pool:
            pooled = pool.map(square, range(4))
        queue = context.Queue()
        process = context.Process(target=put_square, args=(queue, 5))
        process.start()
        sent = queue.get()
        process.join()
        assert all(isinstance(s, Square) for s in [*pooled, sent]), "a child's Square is not the task's class"
        return [s.value for s in pooled], sent.value, process.exitcode


    if __name__ == "__main__":
        print("children", gl.run(children, sys.argv[1], accelerator="mps"))
"""


@pytest.fixture(scope="module")
def mac(peer_factory, tmp_path_factory):
    key = new_key()
    override = write_override(tmp_path_factory.mktemp("override") / "mac.json", "mps", frameworks=TORCH_MPS)
    return peer_factory("spawning-mac", "--advertise-override", str(override), key=key)


def run_script(source: str, *args: str, peer, tmp_path: Path) -> str:
    """Run `source` as a submitter script of `peer`'s cluster (found by mDNS on loopback); return its stdout."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "GPULAYER_KEY": peer.key}
    out = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_a_dataloader_with_spawned_workers_loads_the_scripts_dataset(mac, tmp_path):
    assert "sum 285\n" in run_script(DATALOADER_SCRIPT, peer=mac, tmp_path=tmp_path)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_pool_and_process_children_run_the_scripts_functions_and_send_back_its_objects(mac, tmp_path, method):
    out = run_script(MULTIPROCESSING_SCRIPT, method, peer=mac, tmp_path=tmp_path)
    assert "children ([0, 1, 4, 9], 25, 0)\n" in out
