"""QuietLog: a warning anyone can cause is logged a line a kind per interval, and none is lost from the count."""

from __future__ import annotations

import logging

from gpulayer.peer.quiet import QuietLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_in_full_then_a_count_per_interval_then_in_full_again(caplog):
    clock = Clock()
    quiet = QuietLog(logging.getLogger("test-quiet"), interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, "test-quiet"):
        for i in range(500):
            quiet.warning("knocks", "knock %d", i)
            quiet.flush()
        quiet.warning("other", "another kind: %s", "logged at once")
        assert caplog.messages == ["knock 0", "another kind: logged at once"]
        clock.now += 10.0
        quiet.warning("knocks", "knock %d", 500)  # still counted: the count's line opens the next interval
        quiet.flush()
        assert caplog.messages[2:] == ["knocks: 500 more in the last 10 s (logged once per 10 s)"]
        quiet.warning("knocks", "knock %d", 501)  # held back: in the interval the count's line opened
        clock.now += 10.0
        quiet.flush()
        quiet.flush()
        assert caplog.messages[3:] == ["knocks: 1 more in the last 10 s (logged once per 10 s)"]
        clock.now += 10.0
        quiet.flush()  # a quiet interval: nothing to say, and the kind is forgotten
        quiet.warning("knocks", "knock %d", 502)
        quiet.warning("knocks", "knock %d", 503)
        quiet.flush(final=True)  # the peer stops: what was held back is told at once
        assert caplog.messages[4:] == ["knock 502", "knocks: 1 more in the last 0 s (logged once per 10 s)"]
