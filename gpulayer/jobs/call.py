"""A function as a job (`gl.submit(fn, *args, detach=True)`): the call and its outcome as files of the
job's folder, and `python -m gpulayer.jobs.call`, the command that runs it in the job interpreter.

The submitter writes CALL_FILE (msgpack: the pickled function, the pickled (args, kwargs) and their
out-of-band buffers); the runner loads it, calls it, and writes OUTCOME_FILE: the pickled result and
its buffers, or the exception packed as a task's is (remote_exceptions.pack). The peer only moves
these files: it never unpickles them. `Job.result()` fetches OUTCOME_FILE and reads it here.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import msgpack

from .. import remote_exceptions, serialization

CALL_FILE = ".gpulayer/call.msgpack"
OUTCOME_FILE = ".gpulayer/outcome.msgpack"
COMMAND = ["python", "-m", "gpulayer.jobs.call"]


def pack_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """The bytes of CALL_FILE for fn(*args, **kwargs)."""
    data, buffers = serialization.dumps_call(fn, args, kwargs)
    return msgpack.packb({"fn": serialization.dumps_function(fn), "args": data,
                          "buffers": [bytes(b) for b in buffers]})


def outcome(packed: bytes) -> Any:
    """The value that OUTCOME_FILE holds, or raise the exception it holds (with its remote traceback)."""
    msg = msgpack.unpackb(packed, raw=False)
    if msg.get("t") == "result":
        return serialization.loads(msg["data"], msg["buffers"])
    raise remote_exceptions.rebuild(msg)


def run(folder: str) -> int:
    """Run the call of `folder` and write its outcome; the exit code says whether it raised (1) or not."""
    with open(os.path.join(folder, CALL_FILE), "rb") as f:
        call = msgpack.unpackb(f.read(), raw=False)
    failed = True
    try:
        fn = serialization.loads(call["fn"])
        args, kwargs = serialization.loads(call["args"], call["buffers"])
        data, buffers = serialization.dumps(fn(*args, **kwargs))
        packed = msgpack.packb({"t": "result", "data": data, "buffers": [bytes(b) for b in buffers]})
        failed = False
    except BaseException as exc:  # the call's failure, SystemExit included, goes to Job.result()
        packed = msgpack.packb({"t": "error", **remote_exceptions.pack(exc, skip_frames=1)})
    path = os.path.join(folder, OUTCOME_FILE)
    with open(f"{path}.partial", "wb") as f:
        f.write(packed)
    os.replace(f"{path}.partial", path)
    return int(failed)


if __name__ == "__main__":
    sys.exit(run(os.getcwd()))
