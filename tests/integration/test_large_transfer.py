"""A 256 MiB numpy argument goes to a peer and comes back, compared for equality."""

from __future__ import annotations

import numpy as np

from gpulayer.matching import Requirements


def checksum_and_echo(array):
    return int(array[::4096].sum()), array


def test_a_256_mib_array_round_trips_intact(cluster):
    client, _ = cluster("bulk")
    rng = np.random.default_rng(7)
    array = rng.integers(0, 2**31, size=(256 << 20) // 8, dtype=np.int64)
    total, back = client.submit(checksum_and_echo, (array,), req=Requirements.build()).result(120)
    assert total == int(array[::4096].sum())
    assert back.dtype == array.dtype and back.shape == array.shape
    assert np.array_equal(back, array)
    assert back.flags.writeable  # rebuilt on the received buffer, not a read-only copy
