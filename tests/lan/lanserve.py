"""The JSON-lines loop of the processes that the LAN tests drive (lan_agent.py, lan_rogue.py)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


def serve(make_target: Callable[[], Any]) -> None:
    """Answer each JSON request on stdin, {"op": NAME, ...}, by calling target.op_NAME(...) with the rest.

    One reply a line on stdout, carrying "t" (this process's time.monotonic()); an exception comes
    back as {"exception", "message", "traceback"}. Stray prints go to stderr, so that they cannot
    corrupt the replies. The target is made after that redirection; the process exits after "exit".
    """
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    target = make_target()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            request = json.loads(line)
            op = request.pop("op")
            reply = getattr(target, f"op_{op}")(**request)
        except Exception as exc:
            reply = {"exception": type(exc).__name__, "message": str(exc)[:4000], "traceback": traceback.format_exc()}
            op = None
        reply["t"] = time.monotonic()
        out.write(json.dumps(reply) + "\n")
        if op == "exit":
            break
    os._exit(0)
