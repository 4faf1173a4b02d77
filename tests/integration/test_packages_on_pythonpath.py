"""Issue 24, item 11: a submitter whose packages come from PYTHONPATH (`pip install --target`, as on
clusters, in containers, with Nix) pickles them by reference, as installed packages, against a real
peer; the user's own modules beside them are still shipped by value."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import new_key

LOCAL_INDEX = Path("/opt/pypi/simple")  # this machine's package index (offline)
ROOT = Path(__file__).resolve().parents[2]

SUBMITTER = textwrap.dedent("""
    import os, sys
    import cloudpickle, msgpack, numpy as np
    import gpulayer as gl
    import mytasks  # the user's own module: in a folder of theirs, not installed

    target = os.environ["TARGET"]
    assert all(m.__file__.startswith(target) for m in (cloudpickle, msgpack, np)), "not from PYTHONPATH"
    gl.configure(key=os.environ["KEY"].encode(), peers=os.environ["PEER"], mdns=False, echo_output=False)
    try:
        back = gl.run(mytasks.doubled, np.arange(4), timeout=60)
        assert type(back) is np.ndarray and back.tolist() == [0, 2, 4, 6], back
        assert gl.run(np.add, 2, 3, timeout=60) == 5  # an installed function, by reference
    finally:
        gl.api.shutdown()
    print("ok")
""")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """cloudpickle, msgpack and numpy installed with `pip install --target` into a folder of their own."""
    if not LOCAL_INDEX.is_dir():
        pytest.skip(f"no local package index at {LOCAL_INDEX} to install from")
    folder = tmp_path_factory.mktemp("target")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--index-url", LOCAL_INDEX.as_uri(),
                    "--target", str(folder), "cloudpickle", "msgpack", "numpy"],
                   check=True, timeout=300, capture_output=True)
    return folder


def test_packages_installed_on_pythonpath_are_pickled_by_reference(target, peer_factory, tmp_path):
    peer = peer_factory("target-peer", "--no-mdns", "--concurrency", "1", key=new_key())
    project = tmp_path / "project"
    project.mkdir()
    (project / "mytasks.py").write_text("import numpy as np\n\n\ndef doubled(x):\n    return np.asarray(x) * 2\n")
    (project / "submit.py").write_text(SUBMITTER)
    env = {**os.environ, "KEY": peer.key, "PEER": peer.address, "TARGET": str(target),
           "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}
    done = subprocess.run([sys.executable, "-s", str(project / "submit.py")], env=env, cwd=project,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
