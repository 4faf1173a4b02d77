"""Remote exceptions: packed into an ERROR by the worker, rebuilt by the submitter.

The worker sends the exception pickled (when it pickles without out-of-band buffers), its
qualified type name, its message and the formatted traceback. The submitter re-raises the
exception itself when it unpickles there, with the remote traceback as its `__cause__`;
otherwise a RemoteError that carries the type name and traceback.
"""

from __future__ import annotations

import linecache
import re
import traceback
from typing import Any

from . import serialization
from .errors import RemoteError, RemoteTraceback

_FRAME_LINE = re.compile(r'^(\s*)File "([^"]+)", line (\d+), in .*$')


def pack(exc: BaseException, *, skip_frames: int = 0, note: str = "") -> dict[str, Any]:
    """The fields of an "exception" ERROR for `exc`; `skip_frames` drops the runner's own frames."""
    tb = exc.__traceback__
    for _ in range(skip_frames):
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    pickled: bytes | None
    try:
        pickled, oob = serialization.dumps(exc)
        if oob:
            pickled = None
    except Exception:
        pickled = None
    message = f"{note}: {exc}" if note else str(exc)
    return {"code": "exception", "message": message, "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "exc": pickled, "tb": text}


def with_local_source(tb: str) -> str:
    """Add source lines the peer could not show (the code was shipped from here) from local files."""
    lines = tb.splitlines()
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        frame = _FRAME_LINE.match(line)
        if frame is None or (i + 1 < len(lines) and lines[i + 1].startswith(frame.group(1) + "  ")):
            continue
        source = linecache.getline(frame.group(2), int(frame.group(3))).strip()
        if source:
            out.append(f"{frame.group(1)}  {source}")
    return "\n".join(out) + "\n"


def rebuild(msg: dict[str, Any]) -> BaseException:
    """The remote exception itself when it unpickles here, with its remote traceback as cause."""
    tb = with_local_source(msg.get("tb") or "")
    if msg.get("exc"):
        try:
            exc = serialization.loads(msg["exc"])
        except Exception:
            exc = None
        if isinstance(exc, BaseException):
            exc.__cause__ = RemoteTraceback(tb)
            return exc
    return RemoteError(msg.get("type", "Exception"), msg.get("message", ""), tb)
