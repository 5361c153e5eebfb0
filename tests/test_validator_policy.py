"""Penalties and bans: pure, with time passed in."""


from node.validator.config import ValidatorConfig
from node.validator.policy import PenaltyBook

CFG = ValidatorConfig(penalty_points=1, ban_threshold=3, penalty_window=100.0, ban_seconds=50)


def test_benign_reasons_cost_nothing():
    book = PenaltyBook(CFG)
    for reasons in (["ok", "ok"], ["stale_policy"] * 4, ["banned"], ["no_checkpoint"], ["forged_signature"]):
        assert book.on_verdict("w", reasons, 0.0) is None
    assert book.points("w", 0.0) == 0


def test_threshold_bans_once_and_for_the_configured_time():
    book = PenaltyBook(CFG)
    d1 = book.on_verdict("w", ["ok", "reward_mismatch", "reward_mismatch", "proof_exponent"], 1.0)
    assert (d1.reason, d1.points, d1.ban_seconds) == ("reward_mismatch", 1, 0)
    assert book.on_verdict("w", ["wrong_task"], 2.0).ban_seconds == 0
    d3 = book.on_verdict("w", ["wrong_task"], 3.0)
    assert d3.ban_seconds == 50 and book.is_banned("w", 52.9) and not book.is_banned("w", 53.0)
    assert book.bans(10.0) == {"w": {"seconds_left": 43, "reason": "wrong_task"}}
    assert book.points("w", 3.0) == 0  # a new ban needs a fresh run of offences
    assert book.on_verdict("w", ["wrong_task"], 4.0).ban_seconds == 0
    assert not book.is_banned("other", 10.0)


def test_points_expire_after_the_window():
    book = PenaltyBook(CFG)
    book.on_verdict("w", ["wrong_task"], 0.0)
    book.on_verdict("w", ["wrong_task"], 10.0)
    assert book.on_verdict("w", ["wrong_task"], 105.0).ban_seconds == 0  # the first point expired at 100
    assert book.points("w", 105.0) == 2
