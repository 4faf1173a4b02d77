"""Unit tests of the submitter's handling of remote tracebacks (gpulayer.client).

`_with_local_source` fills in source lines that the peer could not show (the code came from here),
and `_rebuild_exception` turns an ERROR(code="exception") message back into an exception.
"""

from __future__ import annotations

import pickle
import sys
import traceback
import uuid

import pytest

from gpulayer import serialization
from gpulayer.remote_exceptions import rebuild as _rebuild_exception, with_local_source as _with_local_source
from gpulayer.errors import GPULayerError, RemoteError, RemoteTraceback

SOURCE = (
    "def outer(x):\n"
    "    return inner(x) * 2\n"
    "\n"
    "def inner(x):\n"
    "    if x > 0:\n"
    "        raise ValueError('positive: %d' % x)\n"
    "    return x\n"
)


@pytest.fixture
def source_file(tmp_path):
    path = tmp_path / f"user_code_{uuid.uuid4().hex[:8]}.py"
    path.write_text(SOURCE)
    return path


def remote_tb(path, frames=((2, "outer"), (6, "inner")), with_source=False, exc="ValueError: positive: 1"):
    """A traceback as a peer prints it; without source lines when it does not have the file."""
    lines = ["Traceback (most recent call last):",
             '  File "/opt/gpulayer/peer/worker.py", line 50, in run_task',
             "    result = fn(*args, **kwargs)"]
    src = SOURCE.splitlines()
    for lineno, func in frames:
        lines.append(f'  File "{path}", line {lineno}, in {func}')
        if with_source:
            lines.append("    " + src[lineno - 1].strip())
    lines.append(exc)
    return "\n".join(lines) + "\n"


# ---- _with_local_source -------------------------------------------------------------------------------

def test_missing_source_lines_are_filled_from_local_files(source_file):
    out = _with_local_source(remote_tb(source_file)).splitlines()
    i = out.index(f'  File "{source_file}", line 2, in outer')
    assert out[i + 1].strip() == "return inner(x) * 2"
    j = out.index(f'  File "{source_file}", line 6, in inner')
    assert out[j + 1].strip() == "raise ValueError('positive: %d' % x)"
    # filled lines are indented under their frame line
    assert out[i + 1].startswith("    ") and not out[i + 1].startswith("  File")
    assert out[-1] == "ValueError: positive: 1"


def test_filled_traceback_keeps_every_original_line_in_order(source_file):
    tb = remote_tb(source_file)
    out = _with_local_source(tb)
    original = tb.splitlines()
    filled = out.splitlines()
    assert len(filled) == len(original) + 2
    it = iter(filled)
    assert all(line in it for line in original)  # a subsequence
    assert out.endswith("\n")


def test_last_line_frame_is_filled(source_file):
    tb = f'  File "{source_file}", line 6, in inner'
    assert _with_local_source(tb).splitlines()[-1].strip() == "raise ValueError('positive: %d' % x)"


def test_unknown_files_are_left_as_they_are(tmp_path):
    missing = tmp_path / "not_here.py"
    tb = remote_tb(missing)
    assert _with_local_source(tb) == tb
    for name in ("<stdin>", "<string>", "<frozen importlib._bootstrap>"):
        tb = remote_tb(name)
        assert _with_local_source(tb) == tb


def test_line_numbers_past_the_end_of_the_file_add_nothing(source_file):
    tb = remote_tb(source_file, frames=((999, "outer"),))
    assert _with_local_source(tb) == tb


def test_blank_source_line_adds_nothing(source_file):
    tb = remote_tb(source_file, frames=((3, "outer"),))  # line 3 is empty
    assert _with_local_source(tb) == tb


def test_lines_that_are_not_frames_are_untouched():
    tb = "ValueError: boom\n  During handling: File nowhere\nsome text\n"
    assert _with_local_source(tb) == tb
    assert _with_local_source("") == "\n"


def test_frames_with_source_in_a_deeper_indent_are_untouched(source_file):
    """Frame lines whose next line is indented 4 more than the frame are seen as having source."""
    tb = (f'  File "{source_file}", line 2, in outer\n'
          "      return something_else()\n"
          "ValueError: x\n")
    assert _with_local_source(tb) == tb


def test_lines_that_already_have_source_are_untouched(source_file):
    tb = remote_tb(source_file, with_source=True)
    assert _with_local_source(tb) == tb


def test_a_real_local_traceback_is_untouched(source_file, monkeypatch):
    monkeypatch.syspath_prepend(str(source_file.parent))
    module = __import__(source_file.stem)
    try:
        module.outer(1)
    except ValueError as exc:
        tb = "".join(traceback.format_exception(exc))
    finally:
        sys.modules.pop(source_file.stem, None)
    assert "return inner(x) * 2" in tb  # Python printed the source itself
    assert _with_local_source(tb) == tb


# ---- _rebuild_exception ------------------------------------------------------------------------------

def error_msg(exc=None, exc_bytes=None, tb="Traceback (most recent call last):\nValueError: bad\n", **extra):
    msg = {"t": "error", "id": 1, "code": "exception", "type": type(exc).__name__ if exc else "ValueError",
           "message": str(exc) if exc else "bad", "tb": tb}
    if exc is not None:
        msg["exc"] = serialization.dumps(exc)[0]
    if exc_bytes is not None:
        msg["exc"] = exc_bytes
    msg.update(extra)
    return msg


def test_the_original_exception_type_comes_back_with_the_remote_traceback_as_cause():
    msg = error_msg(KeyError("missing"), tb="Traceback (most recent call last):\nKeyError: 'missing'\n")
    exc = _rebuild_exception(msg)
    assert type(exc) is KeyError and exc.args == ("missing",)
    assert isinstance(exc.__cause__, RemoteTraceback)
    assert "KeyError: 'missing'" in exc.__cause__.traceback
    assert "Remote traceback:" in str(exc.__cause__)


def test_custom_exception_class_defined_here_comes_back():
    class Custom(RuntimeError):
        pass

    exc = _rebuild_exception(error_msg(Custom("c")))
    assert type(exc).__name__ == "Custom" and isinstance(exc, RuntimeError) and str(exc) == "c"
    assert isinstance(exc.__cause__, RemoteTraceback)


def test_the_cause_carries_the_filled_source(source_file):
    exc = _rebuild_exception(error_msg(ValueError("positive: 1"), tb=remote_tb(source_file)))
    assert "raise ValueError('positive: %d' % x)" in exc.__cause__.traceback


def test_raising_the_rebuilt_exception_prints_the_remote_traceback(source_file):
    exc = _rebuild_exception(error_msg(ValueError("positive: 1"), tb=remote_tb(source_file)))
    try:
        raise exc
    except ValueError as caught:
        printed = "".join(traceback.format_exception(caught))
    assert "Remote traceback:" in printed and str(source_file) in printed


@pytest.mark.parametrize("exc_bytes", [b"not a pickle", b"", b"\x80\x05N.",  # the last unpickles to None
                                       pickle.dumps("a string, not an exception", protocol=5)])
def test_unusable_exc_gives_remote_error(exc_bytes, source_file):
    msg = error_msg(exc_bytes=exc_bytes, tb=remote_tb(source_file), type="ValueError", message="positive: 1")
    exc = _rebuild_exception(msg)
    assert type(exc) is RemoteError and isinstance(exc, GPULayerError)
    assert exc.type_name == "ValueError"
    assert "positive: 1" in str(exc) and "Remote traceback:" in str(exc)
    assert "raise ValueError('positive: %d' % x)" in exc.remote_traceback  # filled here too


def test_exception_of_a_class_missing_here_gives_remote_error(tmp_path, monkeypatch):
    name = f"gl_remote_only_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("class PeerOnlyError(Exception):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    data = pickle.dumps(module.PeerOnlyError("only there"), protocol=5)  # by reference, as a peer's own class
    del sys.modules[name]
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    exc = _rebuild_exception(error_msg(exc_bytes=data, type="PeerOnlyError", message="only there"))
    assert type(exc) is RemoteError and exc.type_name == "PeerOnlyError"
    assert "only there" in str(exc)


def test_message_without_exc_or_fields_gives_a_default_remote_error():
    exc = _rebuild_exception({"t": "error", "code": "exception"})
    assert type(exc) is RemoteError and exc.type_name == "Exception"
    assert exc.remote_traceback == "\n"


def test_base_exceptions_are_rebuilt_too():
    exc = _rebuild_exception(error_msg(KeyboardInterrupt()))
    assert type(exc) is KeyboardInterrupt and isinstance(exc.__cause__, RemoteTraceback)
