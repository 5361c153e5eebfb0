"""Sybils racing honest newcomers for the fresh-identity pool (issue 42, hole 3).

The attack as it was run against the trainer: a few free keys, no model work, submit junk the moment
the trainer's own ``retry_after_ms`` says the pool refills, while an honest new worker samples one
batch every 5 s (12 a minute). On the pool of fixed intervals, first come, first served, the
newcomer got 1 of 24 in two minutes. Pure: the real :class:`QuotaBook` driven with the time as a number.
"""

from __future__ import annotations

import pytest

from node.rollouts.quota import MAX_ORIGINS, QuotaBook, QuotaConfig, simulate_flood

CFG = QuotaConfig()
WANTS_PER_MIN = CFG.interval_s / 5.0  # the newcomer samples a batch every 5 s


def _fair(sybils: int) -> float:
    """The newcomer's fair share per minute: the pool split equally among the keys asking, or what it wants."""
    return min(WANTS_PER_MIN, CFG.new_total / (sybils + 1))


def test_four_sybil_keys_racing_the_pool_leave_an_honest_newcomer_its_batches():
    """The issue's run: 4 keys, two intervals; the newcomer wanting 12 a minute got 0 of 12 in each."""
    assert simulate_flood(CFG, 4, 2 * CFG.interval_s) >= 0.9 * 2 * WANTS_PER_MIN


@pytest.mark.parametrize("sybils", [4, 16, 64])
def test_an_honest_newcomer_gets_its_fair_share_however_many_keys_flood(sybils):
    minutes = 10
    got = simulate_flood(CFG, sybils, minutes * CFG.interval_s) / minutes
    assert 0.9 * _fair(sybils) <= got <= 1.2 * _fair(sybils) + 1


def test_junk_that_fails_its_verdict_costs_the_sybil_keys_the_pool():
    """With a validator failing each junk batch 10 s after intake, 64 keys leave the pool to the newcomer."""
    minutes = 10
    got = simulate_flood(CFG, 64, minutes * CFG.interval_s, fail_after_s=10.0) / minutes
    assert got >= 0.8 * WANTS_PER_MIN > 5 * _fair(64)


def test_a_refused_key_is_told_when_its_share_holds_a_batch_not_an_interval_boundary():
    book = QuotaBook(CFG)
    for i in range(4):  # four keys use up the welcome bucket at once
        while book.check(f"s{i}", 0, 0.0) is None:
            book.take(f"s{i}", 0, 0.0)
    refusal = book.check("fifth", 0, 0.0)
    assert refusal.reason == "quota-new" and refusal.retry_after_s < CFG.interval_s / 4
    assert book.check("fifth", 0, refusal.retry_after_s) is None


def test_a_barred_key_stays_out_of_the_pool_and_a_key_with_history_is_unaffected():
    book = QuotaBook(CFG)
    book.fail("junk", 0.0)
    assert book.check("junk", 0, 30.0).reason == "quota-new"
    assert book.check("junk", 3, 30.0) is None  # history: the pool is not consulted


def test_the_pool_holds_a_bounded_number_of_origins():
    book = QuotaBook(CFG)
    for i in range(MAX_ORIGINS + 10):
        book.check(f"k{i}", 0, 0.0)
    assert book.status()["fresh_origins"] == MAX_ORIGINS
    assert book.check("late", 0, 0.0).retry_after_s == CFG.interval_s
    assert book.check("late", 0, 2 * CFG.interval_s) is None  # the quiet keys were dropped


def test_a_key_whose_bar_just_ended_joins_with_a_welcome_not_an_open_tap():
    """Between prunes an expired bar said "wait <= 0", i.e. take freely, with no bucket to charge."""
    from node.rollouts.quota import BAR_INTERVALS, PRUNE_EVERY_S, FreshPool

    pool = FreshPool(CFG.new_total, CFG.new_batches, CFG.interval_s)
    pool.fail("junk", 0.0)
    end = BAR_INTERVALS * CFG.interval_s
    pool.wait("other", end - PRUNE_EVERY_S / 2)  # a prune just before the bar ends
    taken = 0
    while pool.wait("junk", end) == 0 and taken < 10 * CFG.new_batches:
        pool.take("junk", end)
        taken += 1
    assert taken == CFG.new_batches  # its welcome, as any new key


@pytest.mark.parametrize("sybils", [4, 16, 64])
def test_a_node_making_a_key_for_every_attempt_from_one_address_leaves_a_newcomer_its_batches(sybils):
    """The lockout left open by per-key sharing: keys that were only ever refused took the pool's key
    table and the welcome bucket. Shared per address, one address is one share however many keys."""
    minutes = 10
    got = simulate_flood(CFG, sybils, minutes * CFG.interval_s, origins=1, key_making=True) / minutes
    assert got >= 0.9 * WANTS_PER_MIN


@pytest.mark.parametrize("addresses", [4, 16])
def test_key_making_from_many_addresses_holds_one_share_per_address(addresses):
    minutes = 10
    got = simulate_flood(CFG, addresses, minutes * CFG.interval_s, origins=addresses, key_making=True) / minutes
    assert 0.9 * _fair(addresses) <= got <= 1.2 * _fair(addresses) + 1


def test_keys_from_one_address_take_one_slot_and_one_welcome():
    book = QuotaBook(CFG)
    taken = 0
    for i in range(10 * MAX_ORIGINS):  # a new key per attempt, all from one address
        if book.check(f"sybil-{i}", 0, 0.0, "203.0.113.7") is None:
            book.take(f"sybil-{i}", 0, 0.0, "203.0.113.7")
            taken += 1
    assert taken == CFG.new_batches and book.status()["fresh_origins"] == 1  # one welcome, one slot
    assert book.check("newcomer", 0, 0.0, "198.51.100.9") is None  # the welcome bucket still holds its batches


def test_a_failed_verdict_bars_the_key_not_its_address():
    """An honest worker may share an address (a NAT, a relay) with a cheat: the bar is the key's."""
    book = QuotaBook(CFG)
    book.fail("cheat", 0.0)
    assert book.check("cheat", 0, 1.0, "203.0.113.7").reason == "quota-new"
    assert book.check("honest", 0, 1.0, "203.0.113.7") is None
