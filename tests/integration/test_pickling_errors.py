"""What cannot travel says which part of the call it is (issue 26, item 7): the argument, or the global
or closure variable of the function, that could not be pickled; an open file is refused, not sent as
a StringIO of its content. Against a real peer on loopback: nothing reaches it."""

from __future__ import annotations

import threading

import pytest

import gpulayer as gl

LOCK = threading.Lock()


@pytest.fixture(scope="module")
def peer(peer_factory, cluster_key, gl_client):
    return peer_factory("pickles", "--concurrency", "1", key=cluster_key)


def identity(value, scale=1):
    return value


def uses_the_lock():
    with LOCK:
        return 1


def notes(info) -> str:
    return "\n".join(getattr(info.value, "__notes__", []))


def test_an_argument_that_cannot_be_pickled_is_named(peer):
    with pytest.raises(TypeError, match="cannot pickle '_thread.lock' object") as info:
        gl.run(identity, [1, 2], scale=threading.Lock())
    assert "argument scale= of identity (a lock) could not be pickled" in notes(info)
    with pytest.raises(TypeError) as info:
        gl.map(identity, [threading.Lock()])
    assert "argument 0 of identity" in notes(info)
    assert gl.run(identity, [1, 2]) == [1, 2]  # the peer never saw the others


def test_a_global_or_closure_variable_that_cannot_be_pickled_is_named(peer):
    with pytest.raises(TypeError) as info:
        gl.run(uses_the_lock)
    assert "its global 'LOCK' of uses_the_lock (a lock)" in notes(info)
    event = threading.Event()

    def waits():
        return event.wait(0)

    with pytest.raises(TypeError) as info:
        gl.run(waits)
    assert "the variable 'event' of its closure" in notes(info)


def test_an_open_file_is_refused_not_sent_as_its_content(peer, tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b\n1,2\n")
    with open(path) as f, pytest.raises(TypeError, match="an open file .*data.csv.* cannot travel to a peer: pass its "
                                                          r"path, for a file that exists on the peer, or its content"):
        gl.run(identity, f)
