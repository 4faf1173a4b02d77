"""A peer's gossip state (gpulayer/peer/gossip.py, ADR 0017) on a clock of the test's own: members only
from its own handshakes, hints from lists, fresher ages win, ageing out, and the bounds on what a list
may carry. The exchanges themselves run in tests/lan/test_lan_gossip.py."""

from __future__ import annotations

from gpulayer.protocol import messages
from gpulayer.protocol.messages import AGE_OUT, MAX_LIST, check_peers, peers_entry
from gpulayer.peer.gossip import DUE, MAX_EXCHANGES, MAX_HINTS, Gossip

A, B, C = ("10.77.1.1", 7000), ("10.77.2.1", 7000), ("10.77.2.2", 7000)


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def listed(*entries):
    """The entries of a PEERS message as a peer reads them."""
    return check_peers(messages.peers(None, list(entries)))[0]


def gossip(seeds=()):
    clock = Clock()
    return Gossip(b"k" * 32, "self0000", [("10.77.1.9", 7000)], list(seeds), clock), clock


def test_a_listed_peer_is_a_hint_until_this_peer_verifies_it_and_then_a_member_with_the_freshest_age():
    g, clock = gossip()
    g.merge(listed(peers_entry("bbbb", [B], 1.0)))
    assert not g.members and list(g.hints) == [(B,)]
    assert g.next_target() == [B]
    g.verified("bbbb", [B])
    assert set(g.members) == {"bbbb"} and not g.hints
    clock.now += 8
    g.merge(listed(peers_entry("bbbb", [B], 2.0)))  # another key holder verified it 2 s ago
    assert [e["age"] for e in g.listing() if e["id"] == "bbbb"] == [2.0]
    g.merge(listed(peers_entry("bbbb", [B], 9.0)))  # an older word changes nothing
    assert [e["age"] for e in g.listing() if e["id"] == "bbbb"] == [2.0]


def test_a_member_verified_nowhere_for_age_out_drops_out_of_the_list():
    g, clock = gossip()
    g.verified("bbbb", [B])
    g.verified("cccc", [C])
    clock.now += AGE_OUT - 1
    g.merge(listed(peers_entry("cccc", [C], 0.0)))
    clock.now += 2
    assert [e["id"] for e in g.listing()] == ["self0000", "cccc"]


def test_the_rounds_go_to_hints_then_seeds_then_the_members_half_way_to_ageing_out():
    g, clock = gossip(seeds=[A])
    assert g.next_target() == [A]
    g.verified("aaaa", [A])  # the seed answered: a member there, no need to try it as a seed
    g.verified("bbbb", [B])
    clock.now += AGE_OUT / 2
    g.merge(listed(peers_entry("bbbb", [B], 0.0)))
    assert {tuple(g.next_target()) for _ in range(20)} == {(A,)}  # the stale one
    g.hint([C])
    assert g.next_target() == [C]
    g.failed([C])
    assert not g.hints


def test_a_round_verifies_several_hints_side_by_side_the_oldest_first_and_a_bounded_number():
    g, _ = gossip(seeds=[A])
    hints = [[(f"10.77.3.{i}", 7000)] for i in range(1, 2 * MAX_EXCHANGES + 1)]
    g.merge(listed(*(peers_entry(f"p{i:03d}", h, 0.0) for i, h in enumerate(hints))))
    assert g.next_targets() == hints[:MAX_EXCHANGES]
    for i, h in enumerate(hints[:MAX_EXCHANGES]):
        g.verified(f"p{i:03d}", h)
    assert g.next_targets() == hints[MAX_EXCHANGES:]
    for h in hints[MAX_EXCHANGES:]:
        g.failed(h)
    assert g.next_targets() == [[A]]  # no hint left: one exchange, with the seed


def test_the_members_about_to_age_out_are_verified_side_by_side_before_they_do():
    g, clock = gossip()
    members = [[(f"10.77.3.{i}", 7000)] for i in range(1, MAX_EXCHANGES + 3)]
    for i, m in enumerate(members):
        g.verified(f"p{i:03d}", m)
        clock.now += 0.1
    assert len(g.next_targets()) == 1  # all fresh: one exchange a round
    clock.now += DUE
    assert g.next_targets() == members[:MAX_EXCHANGES]  # the oldest first
    g.hint([C])
    assert g.next_targets() == [[C]] + members[:MAX_EXCHANGES - 1]  # hints go first


def test_a_seed_that_is_this_peer_itself_is_not_tried_again_and_a_failed_one_waits():
    g, clock = gossip(seeds=[A, B])
    g.verified("self0000", [A])
    assert not g.members and list(g.seeds) == [B]
    g.failed([B])
    assert g.next_target() is None
    clock.now += AGE_OUT
    assert g.next_target() == [B]


def test_what_a_list_may_carry_is_bounded_and_checked():
    g, _ = gossip()
    g.heard_from("10.77.2.7", messages.peers(None, [peers_entry(f"p{i}", [("10.77.3.1", 1000 + i)], 0.0)
                                                    for i in range(MAX_HINTS + 10)], 7001))
    assert len(g.hints) == MAX_HINTS
    bad = [{"id": "x y", "a": [["h", 1]], "age": 0}, {"id": "ok", "a": [["h", 0]], "age": 0},
           {"id": "ok", "a": [["h", 1]], "age": AGE_OUT + 1}, {"id": "ok", "a": "h:1", "age": 0},
           {"id": "ok", "a": [["h", 1]], "age": True}, "nonsense", {"id": "ok", "a": [["h", 1]], "age": 1}]
    assert listed(*bad) == [("ok", [("h", 1)], 1.0)]
    assert len(listed(*[peers_entry(f"p{i}", [A], 0.0) for i in range(MAX_LIST + 5)])) == MAX_LIST
    assert check_peers({"t": messages.PEERS, "peers": {"not": "a list"}, "port": True}) == ([], None)
