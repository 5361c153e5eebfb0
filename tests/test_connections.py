"""The connection decisions the membership service used to make inline (issue 44, item 4), now
pure in node/gossip/connections.py: when to dial the bootstrap peers again, and which addresses of
a member a dial may use under the per-address backoff."""

from node.gossip.connections import AddressBackoff, ConnectionManager

BOOT = {"b1", "b2"}


def test_bootstrap_is_dialled_while_we_hold_none_of_it_and_are_short():
    cm = ConnectionManager(low=3, high=6, backoff=10)
    assert cm.needs_bootstrap(set(), BOOT)
    assert cm.needs_bootstrap({"m1", "m2"}, BOOT)  # short, and no bootstrap peer among them
    assert not cm.needs_bootstrap({"m1", "b2"}, BOOT)  # one bootstrap peer is enough
    assert not cm.needs_bootstrap({"m1", "m2", "m3"}, BOOT)  # not short: the members will do
    assert not cm.needs_bootstrap(set(), set())  # a first node has none to dial


def test_a_dial_reserves_the_addresses_out_of_backoff_and_only_those():
    b = AddressBackoff(base=10, cap=40)
    b.on_failed("a", now=0)  # waits until 10
    assert b.reserve(["a", "b", "c"], now=5) == ["b", "c"]
    assert b.reserve(["a", "b", "c"], now=6) == []  # b and c are being dialled; a still waits
    b.on_connected("b")
    assert b.reserve(["a", "b", "c"], now=10) == ["a", "b"]  # c's dial has no outcome yet, for base seconds
    assert b.reserve(["c"], now=15) == ["c"]


def test_a_seeded_manager_prunes_the_same_peers_whatever_the_interpreters_hash_seed():
    """The simulator (sim/, issue 46) and the tests seed the manager's rng; its prune choice must not
    also depend on the order Python happens to iterate a set of peer ids in (PYTHONHASHSEED)."""
    import os
    import subprocess
    import sys

    code = ("import random; from node.gossip.connections import ConnectionManager as M; "
            "m = M(2, 4, 1.0, rng=random.Random(7)); peers = {f'peer{i}' for i in range(40)}; "
            "print(m.plan(peers, dict.fromkeys(peers, 'worker'), set(), 0.0).prune)")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert len(outs) == 1, outs
