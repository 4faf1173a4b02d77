"""A Ray driver that tries to run one function on a Ray cluster, and says how it went.

    python lan_ray_client.py '{"address": "ray://10.77.0.1:10001", "marker": PATH, "via": "ray"}'

`via` "ray" is a plain `ray.init(address)`, as anyone on the LAN can call it; "gpulayer" is the
GPUlayer Ray backend (`gl.configure(backend="ray", address=...)`), which brings the cluster's
token when this machine holds the cluster key. The function creates `marker` (so that the test
sees whether any code ran) and returns the address of the Ray node it ran on. One JSON line goes
to stdout: {"ran": NODE_IP} or {"error": "Type: message", "rpc": [what Ray's client logged]}.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path


class Collect(logging.Handler):
    """Keeps what Ray's client logs while it retries: the server's answer to each attempt."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def touch_and_say_where(marker: str) -> str:
    import ray

    Path(marker).touch()
    return ray.util.get_node_ip_address()


def main() -> None:
    args = json.loads(sys.argv[1])
    collected = Collect()
    client_log = logging.getLogger("ray.util.client.worker")
    client_log.setLevel(logging.DEBUG)
    client_log.addHandler(collected)
    try:
        if args["via"] == "gpulayer":
            import gpulayer as gl

            gl.configure(backend="ray", address=args["address"], echo_output=False)
            ran = gl.run(touch_and_say_where, args["marker"], timeout=args.get("timeout"))
        else:
            import ray

            ray.init(args["address"], log_to_driver=False)
            ran = ray.get(ray.remote(touch_and_say_where).remote(args["marker"]), timeout=60)
    except Exception as exc:  # the outcome under test: reported, not raised
        causes = []
        while exc is not None:
            causes.append(f"{type(exc).__name__}: {exc}")
            exc = exc.__cause__
        print(json.dumps({"error": causes, "rpc": collected.messages}), flush=True)
        return
    print(json.dumps({"ran": ran}), flush=True)


if __name__ == "__main__":
    main()
