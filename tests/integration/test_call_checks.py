"""A call is checked against the function's signature before anything is sent (issue 26, items 3 and 9):
task options cannot eat the function's own arguments, a typo of an option never runs anywhere, and
`gl.options(...)` separates the two; `gl.map` takes several iterables and draws tqdm's bar.
Against a real peer subprocess on loopback."""

from __future__ import annotations

import pytest

import gpulayer as gl
from gpulayer.task_options import NAMES


@pytest.fixture(scope="module")
def peer(peer_factory, cluster_key, gl_client):
    return peer_factory("checked", "--concurrency", "2", key=cluster_key)


def train(epochs, marker, timeout=60):
    """Stands for a user's function with a parameter named like a task option; notes that it ran."""
    import time

    with open(marker, "a") as out:
        out.write(f"{epochs} {timeout}\n")
    time.sleep(min(timeout, 30) if epochs < 0 else 0)  # a negative epoch count stands for a long run
    return epochs * timeout


def takes_anything(x, **kwargs):
    return x, sorted(kwargs)


def add(a, b):
    return a + b


def test_a_keyword_that_is_also_an_option_is_refused_before_anything_runs(peer, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(TypeError, match=r"train\(\) takes timeout= itself.*gl\.options\(timeout=\.\.\.\)\.run"):
        gl.run(train, 3, str(marker), timeout=5)
    with pytest.raises(TypeError, match="ambiguous|takes timeout= itself"):
        gl.submit(train, 3, str(marker), timeout=5)
    assert gl.options().run(train, 2, str(marker), timeout=7) == 14  # the function's own timeout=
    assert marker.read_text() == "2 7\n"  # the refused calls never ran


def test_options_apart_from_the_call_give_the_task_option_and_the_argument_each_its_own(peer, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(gl.TaskTimeout):
        gl.options(timeout=1).run(train, -1, str(marker), timeout=25)  # the task's 1 s, train's own 25
    assert marker.read_text() == "-1 25\n"
    assert gl.options(accelerator="cpu").submit(add, 2, b=3).result(timeout=30) == 5
    with pytest.raises(ValueError, match="timeout"):
        gl.options(timeout=-1)  # checked when given, like @gl.remote's


def test_a_misspelt_option_fails_here_with_a_suggestion(peer):
    with pytest.raises(TypeError, match=r"add\(\).*unexpected keyword argument 'acelerator'.*"
                                        r"did you mean the task option accelerator="):
        gl.run(add, 1, 2, acelerator="cuda")
    with pytest.raises(TypeError, match=r"acelerator= is not a task option and would go to takes_anything's "
                                        r"\*\*kwargs: did you mean the task option accelerator="):
        gl.run(takes_anything, 1, acelerator="cuda")
    # said on purpose, apart from the options, it reaches the function
    assert gl.options().run(takes_anything, 1, acelerator="cuda") == (1, ["acelerator"])
    assert gl.run(takes_anything, 1, learning_rate=0.1) == (1, ["learning_rate"])  # nothing near an option


def test_a_wrong_call_fails_with_pythons_own_error_before_it_is_sent(peer):
    square = gl.remote(add)
    with pytest.raises(TypeError, match=r"add\(\): missing a required argument: 'b'"):
        gl.run(add, 1)
    with pytest.raises(TypeError, match=r"add\(\): too many positional arguments"):
        square.submit(1, 2, 3)
    with pytest.raises(TypeError, match=r"add\(\): missing a required argument: 'b'"):
        gl.map(add, [1, 2])
    assert square(1, b=2) == 3


def test_map_takes_several_iterables_like_the_builtin(peer):
    assert gl.map(add, [1, 2, 3], [10, 20]) == [11, 22]  # stops at the shortest
    assert gl.remote(add).map(range(3), range(3)) == [0, 2, 4]
    assert gl.options(timeout=30).map(add, "ab", "cd") == ["ac", "bd"]
    with pytest.raises(TypeError, match="at least one iterable"):
        gl.map(add)


def test_the_map_progress_bar_shows_rate_and_time_left_only_when_asked_or_on_a_terminal(peer, capsys):
    gl.map(add, range(3), range(3), progress=True)
    drawn = capsys.readouterr().err
    assert "add" in drawn and "3/3" in drawn and "task/s" in drawn and "<00:00" in drawn
    gl.map(add, range(3), range(3))  # pytest's stderr is no terminal: no bar
    assert capsys.readouterr().err == ""


def test_the_api_is_discoverable():
    assert {"run", "submit", "map", "remote", "options"} <= set(dir(gl))
    for name in NAMES:
        assert name in gl.submit.__doc__, name
        assert name in gl.run.__doc__ or name == "keep", name  # run refuses keep=True
