"""The pure peer score table, driven with explicit times (no clock, no sleeps)."""

from __future__ import annotations

import pytest

from node.peers import ActionKind, FaultRule, PeerTable
from node.peers.table import BAN_SCORE


def kinds(actions):
    return [a.kind for a in actions]


def test_penalties_from_different_sources_add_up_instead_of_overwriting():
    table = PeerTable({"sync": FaultRule(weight=20), "shards": FaultRule(strikes=1, ban_seconds=600)})
    assert kinds(table.on_fault("p", "shards", "bad-piece", 0.0)) == [ActionKind.BAN, ActionKind.DISCONNECT]
    table.on_fault("p", "sync", "bad-link", 1.0)
    assert table.app_score("p", 1.0) <= BAN_SCORE - 19.9
    table.on_fault("q", "sync", "bad-link", 1.0)
    table.on_fault("q", "sync", "bad-link", 1.0)
    assert table.app_score("q", 1.0) == pytest.approx(-40.0)


def test_scores_decay_toward_zero_and_bans_expire():
    table = PeerTable({"sync": FaultRule(weight=20), "shards": FaultRule(strikes=1, ban_seconds=600)}, half_life=100.0)
    table.on_fault("p", "sync", "x", 0.0)
    assert table.score("p", 100.0) == pytest.approx(-10.0)
    assert table.score("p", 200.0) == pytest.approx(-5.0)
    table.on_fault("p", "shards", "bad-piece", 200.0)
    assert table.is_banned("p", 799.9) and table.app_score("p", 799.9) < BAN_SCORE
    assert not table.is_banned("p", 800.0)
    assert BAN_SCORE < table.app_score("p", 800.0) < 0


def test_strikes_within_the_window_earn_a_ban_of_the_rules_length():
    table = PeerTable({"rollouts": FaultRule(strikes=3, window=60.0, ban_seconds=100.0)})
    assert table.on_fault("p", "rollouts", "forged", 0.0) == []
    assert table.on_fault("p", "rollouts", "forged", 50.0) == []
    actions = table.on_fault("p", "rollouts", "forged", 59.0)
    assert kinds(actions) == [ActionKind.BAN, ActionKind.DISCONNECT] and actions[0].until == 159.0
    assert table.on_fault("p", "rollouts", "forged", 60.0) == []  # already banned: nothing new
    assert table.is_banned("p", 158.0, "rollouts") and not table.is_banned("p", 158.0, "shards")


def test_a_ban_from_elsewhere_is_listed_without_a_disconnect_when_the_rule_says_so():
    table = PeerTable({"ledger": FaultRule(disconnect=False)})
    assert kinds(table.ban("w", "ledger", "fake-rewards", 600.0, 0.0)) == [ActionKind.BAN]
    assert table.is_banned("w", 599.0) and table.app_score("w", 599.0) == 0.0
    assert table.ban("w", "ledger", "again", 300.0, 1.0) == []  # never shortened
    assert table.bans(0.0) == {"w": {"ledger": {"seconds_left": 600, "reason": "fake-rewards"}}}


def test_unknown_sources_are_counted_but_cost_nothing():
    table = PeerTable()
    assert table.on_fault("p", "verify", "malformed", 0.0) == []
    assert table.app_score("p", 0.0) == 0.0 and table.peers["p"].faults == 1
    assert table.snapshot(0.0)["worst"] == []


def test_the_table_is_bounded_and_evicts_the_least_relevant_peer():
    table = PeerTable({"sync": FaultRule(weight=1), "shards": FaultRule(strikes=1, ban_seconds=1000)}, max_peers=3)
    table.on_fault("banned", "shards", "bad-piece", 0.0)
    table.on_fault("big", "sync", "x", 0.0)
    table.on_fault("big", "sync", "x", 0.0)
    table.on_fault("small", "sync", "x", 1.0)
    table.on_fault("new", "sync", "x", 2.0)
    assert set(table.peers) == {"banned", "big", "new"} and table.evicted == 1
    for i in range(10):
        table.on_fault(f"n{i}", "sync", "x", 3.0 + i)
    assert len(table.peers) == 3 and "banned" in table.peers


def test_a_rule_whose_weight_would_raise_a_score_is_refused():
    """A fault must never be worth points: the delta store's rule was written ``weight=-10``, so
    every forged delta a signer sent *raised* its gossipsub score by 10 (its ban does not
    disconnect, so the app score was the raised one)."""
    with pytest.raises(ValueError, match="weight"):
        FaultRule(weight=-10.0)


def test_the_delta_stores_rule_lowers_the_signers_score():
    from node.shards.deltasync import delta_rule

    table = PeerTable({"deltas": delta_rule(600.0)})
    table.on_fault("p", "deltas", "bad-delta", 0.0)
    assert table.score("p", 0.0) < 0 and table.app_score("p", 0.0) < 0
