"""Moving messages over sockets, on top of `gpulayer.protocol`.

- `blocking`: `BlockingConnection`, the submitter's and the worker's connection;
- `channel`: `AsyncChannel`, a connection on the peer's event loop, driven by callbacks;
- `shm`: shared memory on one host, and the local links that pass its descriptors (ADR 0009);
- `sockets`: the options of every TCP connection (`tune`).
"""
