"""Jobs (issue 27): commands that outlive their submitter, with their working folder, on the peer that runs them.

`folder` packs a working folder into a content-addressed manifest and rebuilds it on the peer;
`transfer` moves the blobs over a connection's secure channel. `store` is the peer's record of its
jobs, `shim` the supervisor of one job's processes, `call` a function run as a job; the peer's side is
peer/jobs.py, the submitter's client/jobs.py, the messages protocol/jobs.py (ADR 0016).
"""
