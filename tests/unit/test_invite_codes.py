"""Invite codes (gpulayer/invite.py): what a person may type, the time to live, and a peer's table of
open invites on a clock of the test's own (the exchange itself runs in tests/lan/test_lan_invite.py)."""

from __future__ import annotations

import pytest

from gpulayer import invite
from gpulayer.protocol import messages
from gpulayer.errors import ConfigError


def test_a_code_is_read_as_typed_and_anything_else_is_refused_with_an_example():
    code = invite.new_code(417)
    channel, first, second = code.split("-")
    assert channel == "417" and first in invite.WORDS and second in invite.WORDS
    assert invite.parse_code(f"  417 {first.upper()}-{second} ") == (417, code.encode())
    for bad in ("0-harp-moss", "1000-harp-moss", "417-harp", "417-harp-zzzz", "harp-moss-417", ""):
        with pytest.raises(ConfigError, match="like 417-harp-moss"):
            invite.parse_code(bad)


def test_the_word_list_holds_256_distinct_words():
    assert len(invite.WORDS) == len(set(invite.WORDS)) == 256
    assert all(word.isalpha() and word.islower() for word in invite.WORDS)


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("10m", 600), ("2h", 7200), ("45", 45), ("1.5m", 90)])
def test_a_time_to_live_takes_seconds_minutes_or_hours(text, seconds):
    assert invite.parse_ttl(text) == seconds


@pytest.mark.parametrize("text", ["0", "25h", "abc", "-5m", "10d", ""])
def test_a_bad_time_to_live_is_refused(text):
    with pytest.raises(ValueError, match="time to live"):
        invite.parse_ttl(text)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_invite_ends_at_its_time_to_live_and_a_peer_holds_a_bounded_number():
    clock, warnings = Clock(), []
    invites = invite.Invites(b"k" * 32, warnings.append, clock)
    made = invites.make(60, 1)
    assert invites.open == {made.channel: made}
    clock.now += 59
    hello = {"t": messages.HELLO, "peer": "p", "nonce": b"n"}
    reply, more = invites.step(object(), hello, {"t": messages.PAKE, "ch": made.channel, "m": b"\x00" * 33})
    assert reply["code"] == "protocol" and not more  # open still: a bad element is refused as such, not counted
    assert made.failed == 0
    clock.now += 1
    reply, more = invites.step(object(), hello, {"t": messages.PAKE, "ch": made.channel, "m": b"\x00" * 33})
    assert reply["code"] == invite.NO_INVITE and not more and not invites.open
    for _ in range(invite.MAX_INVITES):
        invites.make(600, 1)
    with pytest.raises(invite.InviteError, match="open invites already"):
        invites.make(600, 1)
    assert len({i.channel for i in invites.open.values()}) == invite.MAX_INVITES


@pytest.mark.parametrize("request_, problem", [({"ttl": 0, "uses": 1}, "ttl"), ({"ttl": 1e9, "uses": 1}, "ttl"),
                                               ({"ttl": True, "uses": 1}, "ttl"), ({"ttl": 60, "uses": 0}, "uses"),
                                               ({"ttl": 60, "uses": 1000}, "uses"), ({"ttl": 60}, "uses")])
def test_a_bad_invite_request_is_answered_with_the_reason(request_, problem):
    invites = invite.Invites(b"k" * 32, print)
    reply = invites.answer({"t": messages.INVITE, "id": 3, **request_})
    assert reply["t"] == messages.ERROR and reply["id"] == 3 and f"'{problem}'" in reply["message"]
    assert not invites.open


def test_a_confirmation_without_an_exchange_is_a_protocol_error():
    invites = invite.Invites(b"k" * 32, print)
    invites.make(60, 1)
    reply, more = invites.step(object(), {}, {"t": messages.PAKE_CONFIRM, "mac": b"x" * 32})
    assert reply["code"] == "protocol" and not more


def test_a_peer_starts_at_most_max_starts_exchanges_a_second():
    from spake2 import SPAKE2_A

    clock = Clock()
    invites = invite.Invites(b"k" * 32, print, clock)
    made = invites.make(60, 1)
    hello = {"t": messages.HELLO, "peer": "p", "nonce": b"n"}

    def start():
        return invites.step(object(), hello, {"t": messages.PAKE, "ch": made.channel, "m": SPAKE2_A(b"guess").start()})

    assert all(start()[1] for _ in range(invite.MAX_STARTS))
    reply, more = start()
    assert reply["code"] == "busy" and not more
    clock.now += 1.0
    assert start()[1]
