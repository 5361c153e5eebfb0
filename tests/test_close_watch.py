"""CloseWatch: which dropped connections look like failures (moved out of the membership service's
tick so that the simulator in sim/ drives the same rules; pure, time passed in)."""

from node.gossip.connections import CLOSING_S, PRUNE_MEMORY, CloseWatch


def live(_peer: str) -> bool:
    return True


def test_an_unannounced_drop_is_lost_once_and_not_again_within_the_memory():
    w = CloseWatch()
    assert w.lost({"a", "b"}, 0.0, live) == []
    assert w.lost({"b"}, 1.0, live) == ["a"]
    # It reconnects and drops again at once: not probed a second time until the memory passes.
    w.lost({"a", "b"}, 2.0, live)
    assert w.lost({"b"}, 3.0, live) == []
    w.lost({"a", "b"}, 1.0 + PRUNE_MEMORY + 0.5, live)
    assert w.lost({"b"}, 1.0 + PRUNE_MEMORY + 1.0, live) == ["a"]
    assert w.closes == {"pruned": 0, "pruned_by_peer": 0, "lost": 2}


def test_an_announced_close_either_way_is_no_loss_and_is_closing_for_a_while():
    w = CloseWatch()
    w.lost({"a", "b", "c"}, 0.0, live)
    w.on_prune_sent("a", 1.0)
    w.on_prune_received("b", 1.0)
    assert w.closing(1.0 + CLOSING_S - 0.1) == {"a", "b"}
    assert w.closing(1.0 + CLOSING_S) == set()
    assert w.lost({"c"}, 2.0, live) == []
    assert w.closed_on_purpose_since("a", 0.5) and not w.closed_on_purpose_since("a", 1.5)
    assert not w.closed_on_purpose_since("c", 0.0)
    assert w.closes == {"pruned": 1, "pruned_by_peer": 1, "lost": 0}


def test_a_drop_of_a_member_no_longer_live_is_not_lost():
    w = CloseWatch()
    w.lost({"a", "b"}, 0.0, live)
    assert w.lost(set(), 1.0, lambda p: p == "b") == ["b"]
