"""Rendezvous assignment of batches to validators: deterministic, balanced, minimal movement."""

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from node.hashes import digest
from node.rollouts.assign import assign_validator, validator_ranking

VALIDATORS = [f"12D3KooValidator{i}" for i in range(4)]


def _ids(n: int) -> list[bytes]:
    return [digest(i.to_bytes(4, "big")) for i in range(n)]


def test_same_answer_whatever_the_order_of_the_view():
    for bid in _ids(50):
        assert assign_validator(bid, VALIDATORS) == assign_validator(bid, list(reversed(VALIDATORS)))


def test_no_validator_means_no_assignment():
    assert assign_validator(b"\0" * 32, []) is None
    assert assign_validator(b"\0" * 32, ["a"], exclude=["a"]) is None


def test_load_is_spread_evenly():
    counts = Counter(assign_validator(bid, VALIDATORS) for bid in _ids(4000))
    assert set(counts) == set(VALIDATORS)
    assert all(800 <= c <= 1200 for c in counts.values()), counts


def test_only_the_departed_validators_batches_move():
    ids = _ids(1000)
    before = {bid: assign_validator(bid, VALIDATORS) for bid in ids}
    gone = VALIDATORS[1]
    after = {bid: assign_validator(bid, [v for v in VALIDATORS if v != gone]) for bid in ids}
    for bid in ids:
        if before[bid] != gone:
            assert after[bid] == before[bid]
        else:
            assert after[bid] != gone


def test_exclude_walks_to_the_next_choice():
    bid = _ids(1)[0]
    ranking = validator_ranking(bid, VALIDATORS)
    assert assign_validator(bid, VALIDATORS, exclude=ranking[:1]) == ranking[1]
    assert assign_validator(bid, VALIDATORS, exclude=ranking[:3]) == ranking[3]


@given(st.binary(min_size=32, max_size=32), st.sets(st.text(min_size=1, max_size=8), min_size=1, max_size=6))
def test_assigned_is_a_live_validator_and_first_of_ranking(bid, live):
    chosen = assign_validator(bid, live)
    assert chosen in live
    assert validator_ranking(bid, live)[0] == chosen
