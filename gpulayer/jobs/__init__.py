"""Jobs (issue 27): commands that outlive their submitter, with their working folder, on the peer that runs them.

`folder` packs a working folder into a content-addressed manifest and rebuilds it on the peer;
`transfer` moves the blobs over a connection's secure channel.
"""
