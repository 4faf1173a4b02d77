"""gl.run, submit, remote and map against two real peer subprocesses on loopback."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future

import numpy as np
import pytest

import gpulayer as gl
from gpulayer.errors import RemoteTraceback
from support import wait_until


@pytest.fixture(scope="module")
def peers(peer_factory, cluster_key, gl_client):
    return [peer_factory(name, "--concurrency", "1", key=cluster_key) for name in ("alpha", "beta")]


def where():
    return os.environ["GPULAYER_PEER_NAME"], os.getpid()


def add(a, b, *, scale=1):
    return (a + b) * scale


def test_run_returns_the_result_and_passes_kwargs(peers):
    assert gl.run(add, 2, 3, scale=10) == 50
    assert gl.run(lambda: "lambda ok") == "lambda ok"


def test_submit_returns_a_future(peers):
    future = gl.submit(add, 1, 1)
    assert isinstance(future, Future)
    assert future.result(timeout=30) == 2
    assert future.peer in ("alpha", "beta")


def test_remote_decorator_call_submit_options_map_and_local(peers):
    @gl.remote(accelerator="cpu")
    def square(x):
        return x * x

    assert square(7) == 49
    assert square.submit(8).result(timeout=30) == 64
    assert square.map(range(5)) == [0, 1, 4, 9, 16]
    assert square.local(3) == 9
    assert square.__name__ == "square"
    with pytest.raises(gl.NoMatchingPeer, match="task needs cuda; peer offers cpu"):
        square.options(accelerator="cuda")(2)
    with pytest.raises(TypeError, match="unknown remote option"):
        gl.remote(acelerator="mps")(square.local)


def test_map_spreads_over_all_matching_peers_in_order(peers):
    def slow_where(i):
        time.sleep(0.05)
        return i, os.environ["GPULAYER_PEER_NAME"]

    results = gl.map(slow_where, range(20))
    assert [i for i, _ in results] == list(range(20))
    assert {name for _, name in results} == {"alpha", "beta"}


def test_remote_exception_keeps_its_type_and_remote_traceback(peers):
    def fails(x):
        raise ValueError(f"bad value {x}")

    with pytest.raises(ValueError, match="bad value 42") as info:
        gl.run(fails, 42)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "fails" in cause.traceback and 'raise ValueError(f"bad value {x}")' in cause.traceback


def test_an_exception_that_cannot_come_back_becomes_remote_error(peers):
    def fails_oddly():
        class Local(Exception):
            def __reduce__(self):
                raise TypeError("no pickling")
        raise Local("odd")

    with pytest.raises(gl.RemoteError, match="Local") as info:
        gl.run(fails_oddly)
    assert "fails_oddly" in info.value.remote_traceback


def test_stdout_and_stderr_stream_back_while_the_task_runs(peers, tmp_path, capsys):
    go = tmp_path / "go"

    def chatty(path):
        import sys
        print("started", flush=True)
        print("to stderr", file=sys.stderr)
        deadline = time.time() + 30
        while not os.path.exists(path) and time.time() < deadline:
            time.sleep(0.01)
        print("finished")
        return os.path.exists(path)

    future = gl.submit(chatty, str(go))
    wait_until(lambda: "started" in future.stdout, 30)
    assert not future.done()  # streamed before the task ended
    go.touch()
    assert future.result(timeout=30) is True
    assert future.stdout == "started\nfinished\n"
    assert future.stderr == "to stderr\n"
    echoed = capsys.readouterr()
    assert "started" in echoed.out and "to stderr" in echoed.err


def test_a_warm_worker_runs_the_next_task_in_the_same_process(peers):
    def mark():
        import builtins
        builtins.gpulayer_test_marker = os.getpid()
        return os.getpid()

    def read_mark():
        import builtins
        return getattr(builtins, "gpulayer_test_marker", None), os.getpid()

    pid = gl.run(mark, peer="alpha")
    assert gl.run(read_mark, peer="alpha") == (pid, pid)


def test_arrays_and_tensors_round_trip(peers):
    torch = pytest.importorskip("torch")
    array = np.arange(2_000_000, dtype=np.float64).reshape(1000, 2000)
    tensor = torch.randn(512, 256)
    back_array, back_tensor = gl.run(lambda a, t: (a * 2, t + 1), array, tensor)
    np.testing.assert_array_equal(back_array, array * 2)
    assert torch.equal(back_tensor, tensor + 1)
    half = gl.run(lambda: torch.ones(300, 300, dtype=torch.bfloat16))
    assert half.dtype == torch.bfloat16 and bool((half == 1).all())


def test_device_inside_a_task_is_the_peer_given_one(peers):
    def which():
        import gpulayer as gl
        return str(gl.device())

    assert gl.run(which) == "cpu"


def test_bad_arguments_fail_clearly_before_sending(peers):
    with pytest.raises(ValueError, match="accelerator must be one of"):
        gl.run(add, 1, 2, accelerator="tpu")
    with pytest.raises(ValueError, match="not a PEP 440"):
        gl.run(add, 1, 2, frameworks={"torch": "latest"})
    with pytest.raises(ValueError, match="timeout must be a positive"):
        gl.run(add, 1, 2, timeout=-1)
