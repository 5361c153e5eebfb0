"""The validator gate as a pure state machine: assignment, timeouts, reassignment, verdicts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from node.hashes import digest
from node.trainer.gate import Phase, ValidatorGate
from node.rollouts.assign import validator_ranking

VALS = ["val-a", "val-b", "val-c"]


def bid(i: int) -> bytes:
    return digest(i.to_bytes(4, "big"))


def test_a_batch_goes_to_its_rendezvous_choice_and_waits():
    g = ValidatorGate(timeout=10.0, max_in_flight=8)
    g.add(bid(1))
    [(b, v)] = g.due(VALS, now=0.0)
    assert b == bid(1) and v == validator_ranking(bid(1), VALS)[0]
    g.sent(b, now=0.0)
    assert g.due(VALS, now=5.0) == []  # waiting within its deadline
    assert g.batches[b].phase is Phase.AWAITING and g.next_deadline() == 10.0


def test_silent_validator_is_skipped_after_the_timeout():
    g = ValidatorGate(timeout=10.0, max_in_flight=8)
    g.add(bid(1))
    [(_, first)] = g.due(VALS, 0.0)
    g.sent(bid(1), 0.0)
    [(_, second)] = g.due(VALS, 10.0)
    assert second == validator_ranking(bid(1), VALS)[1] != first
    assert g.timeouts == 1 and g.reassignments == 1


def test_unreachable_validator_moves_the_batch_at_once():
    g = ValidatorGate(timeout=10.0, max_in_flight=8)
    g.add(bid(2))
    [(_, first)] = g.due(VALS, 0.0)
    g.send_failed(bid(2))
    [(_, second)] = g.due(VALS, 0.0)
    assert second != first


def test_after_every_validator_failed_the_batch_starts_over_never_dropped():
    g = ValidatorGate(timeout=1.0, max_in_flight=8)
    g.add(bid(3))
    seen = []
    for _ in range(len(VALS) + 1):
        [(_, v)] = g.due(VALS, 0.0)
        seen.append(v)
        g.send_failed(bid(3))
    assert seen[:3] == validator_ranking(bid(3), VALS) and seen[3] == seen[0]
    assert bid(3) in g.batches


def test_no_live_validator_means_the_batch_waits():
    g = ValidatorGate(timeout=1.0, max_in_flight=8)
    g.add(bid(4))
    assert g.due([], 0.0) == []
    assert g.batches[bid(4)].phase is Phase.UNASSIGNED


def test_in_flight_is_bounded():
    g = ValidatorGate(timeout=1.0, max_in_flight=3)
    for i in range(10):
        g.add(bid(i))
    assert len(g.due(VALS, 0.0)) == 3
    assert g.due(VALS, 0.0) == []


def test_verdicts_decide_once():
    g = ValidatorGate(timeout=1.0, max_in_flight=8)
    g.add(bid(5))
    g.add(bid(6))
    assert g.on_verdict(bid(5), True, ["ok"]).passed
    again = g.on_verdict(bid(5), True, ["ok"])
    assert not again.decided and again.reason == "already-decided"
    failed = g.on_verdict(bid(6), False, ["ok", "toploc-exponent"])
    assert failed.decided and not failed.passed and failed.reason == "verdict:toploc-exponent"
    assert g.on_verdict(bid(7), True, []).reason == "unknown-batch"
    g.add(bid(5))  # a replayed batch id that was decided is not gated again
    assert bid(5) not in g.batches


def test_late_verdict_from_a_skipped_validator_still_counts():
    g = ValidatorGate(timeout=1.0, max_in_flight=8)
    g.add(bid(8))
    g.due(VALS, 0.0)
    g.sent(bid(8), 0.0)
    g.due(VALS, 5.0)  # timed out, reassigned
    assert g.on_verdict(bid(8), True, ["ok"]).passed


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(["sent", "fail", "tick", "verdict"]), max_size=40), st.integers(1, 20))
def test_every_batch_is_either_decided_or_still_gated(ops, n):
    """Whatever validators do, no batch is lost and none is decided twice."""
    g = ValidatorGate(timeout=2.0, max_in_flight=4)
    ids = [bid(i) for i in range(n)]
    for b in ids:
        g.add(b)
    now = 0.0
    decided = []
    for op in ops:
        pairs = g.due(VALS, now)
        for b, _ in pairs:
            if op == "sent":
                g.sent(b, now)
            elif op == "fail":
                g.send_failed(b)
            elif op == "verdict":
                g.sent(b, now)
                if g.on_verdict(b, True, ["ok"]).decided:
                    decided.append(b)
        now += 1.0
        assert g.in_flight() <= 4
    assert len(decided) == len(set(decided))
    assert set(decided) | set(g.batches) == set(ids)
    assert not set(decided) & set(g.batches)


def test_batches_that_can_no_longer_be_trained_are_dropped_before_any_prefill():
    """Issue 15: a waiting batch past its last trainable step never reaches a validator."""
    g = ValidatorGate(timeout=10.0, max_in_flight=8)
    g.add(bid(1), policy_version=3, expires=7)
    g.add(bid(2), policy_version=5, expires=9)
    assert g.drop_expired(step=7) == []  # step 7 may still train it
    assert g.drop_expired(step=8) == [bid(1)]
    assert [b for b, _ in g.due(VALS, 0.0)] == [bid(2)] and g.status()["skipped_expired"] == 1


def test_a_batch_already_with_a_validator_is_left_to_finish():
    g = ValidatorGate(timeout=10.0, max_in_flight=8)
    g.add(bid(1), policy_version=3, expires=7)
    g.due(VALS, 0.0)
    g.sent(bid(1), 0.0)
    assert g.drop_expired(step=9) == [] and bid(1) in g.batches


def test_nearest_deadline_first_then_freshest_then_oldest_arrival():
    g = ValidatorGate(timeout=10.0, max_in_flight=1)
    g.add(bid(1), policy_version=4, expires=9)
    g.add(bid(2), policy_version=2, expires=7)  # nearest deadline
    g.add(bid(3), policy_version=5, expires=9)  # same deadline as 1, fresher
    g.add(bid(4), policy_version=5, expires=9)  # same as 3, arrived later
    order = []
    for _ in range(4):
        [(b, _)] = g.due(VALS, 0.0)
        order.append(b)
        g.on_verdict(b, True, ["ok"])
    assert order == [bid(2), bid(3), bid(4), bid(1)]


def test_each_validator_holds_only_its_share_so_the_order_stays_here():
    g = ValidatorGate(timeout=10.0, max_in_flight=64, per_validator=2)
    for i in range(10):
        g.add(bid(i), policy_version=i, expires=100 - i)
    sent = g.due(["val-a"], 0.0)
    assert len(sent) == 2  # the checked batch and the next; the other 8 wait here, ordered
    assert [b for b, _ in sent] == [bid(9), bid(8)]  # nearest deadlines
    g.on_verdict(bid(9), True, ["ok"])
    assert [b for b, _ in g.due(["val-a"], 0.0)] == [bid(7)]
    assert len(g.due(VALS, 0.0)) == 4  # val-a is full; val-b and val-c take two each


# ---------------------------------------------------------------- "cannot judge yet" (issue 15)


def test_not_now_frees_the_slot_at_once_and_moves_the_batch_to_the_next_validator():
    # Without not_now the batch would hold first's slot until now = 100 (the timeout).
    g = ValidatorGate(timeout=100.0, max_in_flight=8, per_validator=1, retry=2.0)
    g.add(bid(1))
    [(_, first)] = g.due(VALS, 0.0)
    g.sent(bid(1), 0.0)
    assert g.not_now(bid(1), first, now=1.0)
    [(b, second)] = g.due(VALS, 1.0)
    assert b == bid(1) and second == validator_ranking(bid(1), VALS)[1] != first
    assert g.timeouts == 0 and g.not_now_count == 1 and bid(1) not in g.decided


def test_not_now_from_the_only_validator_waits_retry_seconds_then_asks_again():
    g = ValidatorGate(timeout=100.0, max_in_flight=8, per_validator=1, retry=2.0)
    g.add(bid(1))
    g.add(bid(2))
    [(b1, v)] = g.due(["val-a"], 0.0)  # one slot: bid(1) first (arrival order)
    assert b1 == bid(1)
    g.sent(b1, 0.0)
    g.not_now(b1, v, now=1.0)
    # The freed slot serves the batch the validator can judge; bid(1) waits out its retry.
    assert g.due(["val-a"], 1.0) == [(bid(2), "val-a")]
    g.sent(bid(2), 1.0)
    assert g.on_verdict(bid(2), True, ["ok"]).passed
    assert g.due(["val-a"], 2.5) == []
    assert g.next_deadline(now=2.5) == 3.0  # the gate loop wakes when the wait ends
    assert g.due(["val-a"], 3.0) == [(bid(1), "val-a")]


def test_not_now_from_a_validator_the_batch_already_left_does_not_move_it():
    g = ValidatorGate(timeout=10.0, max_in_flight=8)
    g.add(bid(1))
    [(_, first)] = g.due(VALS, 0.0)
    g.sent(bid(1), 0.0)
    [(_, second)] = g.due(VALS, 10.0)  # first timed out; second has it now
    g.sent(bid(1), 10.0)
    assert not g.not_now(bid(1), first, now=11.0)  # a late answer from first
    assert g.batches[bid(1)].phase is Phase.AWAITING and g.batches[bid(1)].validator == second
    assert not g.not_now(bid(9), first, now=11.0)  # unknown batch: nothing to do


def test_not_now_is_no_verdict_a_later_verdict_still_decides():
    g = ValidatorGate(timeout=10.0, max_in_flight=8, retry=1.0)
    g.add(bid(1))
    [(_, v)] = g.due(["val-a"], 0.0)
    g.sent(bid(1), 0.0)
    g.not_now(bid(1), v, 0.5)
    assert bid(1) in g.batches and bid(1) not in g.decided
    [(_, v2)] = g.due(["val-a"], 1.5)
    g.sent(bid(1), 1.5)
    assert g.on_verdict(bid(1), False, ["bad-proof"]).reason == "verdict:bad-proof"


def test_batches_the_next_step_would_leave_expired_are_counted():
    g = ValidatorGate(timeout=10.0, max_in_flight=4)
    g.add(bid(1), policy_version=3, expires=5)
    g.add(bid(2), policy_version=4, expires=6)
    g.add(bid(3), policy_version=4)  # never expires
    assert [g.expiring(s) for s in (4, 5, 6)] == [0, 1, 2]
    g.on_verdict(bid(1), True, ["ok"])
    assert g.expiring(5) == 0


def test_a_restarted_validator_gets_its_lost_batches_back_and_new_ones_at_once():
    """Issue 45's 20-minute soak: a validator killed with -9 had its share of batches awaiting its
    verdicts; the new process never knew them, and the gate held its share full until their verify
    timeout (30 s in the demo): no batch for it for ~33 s after it was ready. Released when its
    connection is gone, they are handed out again (to it, once back: it queues them afresh, or
    answers a batch it still holds with "accepted", so nothing is checked twice)."""
    g = ValidatorGate(timeout=30.0, max_in_flight=16, per_validator=2)
    ids = [bytes([i]) * 32 for i in range(6)]
    for b in ids:
        g.add(b)
    sent = g.due(["A"], 0.0)
    assert len(sent) == 2
    for b, _ in sent:
        g.sent(b, 0.0)
    assert g.holding() == {"A"} and g.due(["A"], 1.0) == []  # its share is full
    assert sorted(g.release("A")) == sorted(b for b, _ in sent)
    assert g.holding() == set() and g.status()["released"] == 2
    again = g.due(["A"], 2.0)  # back: the same two first (not marked failed), its share free
    assert sorted(b for b, _ in again) == sorted(b for b, _ in sent) and {v for _, v in again} == {"A"}
    assert g.release("A") == []  # only batches awaiting a verdict are released, not those being sent
