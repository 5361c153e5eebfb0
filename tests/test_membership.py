"""The pure member table: every transition, with time passed in (no clock, no sockets)."""

from __future__ import annotations

import random

import pytest

from node.gossip.connections import ConnectionManager
from node.gossip.membership import SEQ_CLOCK_SLACK_S, MembershipConfig, MemberState, MemberTable, Verdict, next_seq
from node.gossip.records import Accusation, Goodbye, PeerRecord, open_membership, DOMAIN_RECORD, DOMAIN_GOODBYE
from node.identity import Identity
from node.wire import RemoteProtocolError, encode, seal

RUN = "test"


def record(peer: str, seq: int, role: str = "inference") -> PeerRecord:
    return PeerRecord(run=RUN, peer_id=peer, role=role, addrs=["/ip4/127.0.0.1/tcp/1"], software="t", seq=seq)


@pytest.fixture
def table():
    return MemberTable("me", MembershipConfig(probe_period=1.0, suspicion_mult=4.0), rng=random.Random(1))


def test_new_update_same_stale(table):
    assert table.on_record(record("a", 10), now=0) is Verdict.NEW
    assert table.on_record(record("a", 10), now=1) is Verdict.SAME
    assert table.members["a"].last_heard == 1
    assert table.on_record(record("a", 9), now=2) is Verdict.STALE
    assert table.on_record(record("a", 11), now=3) is Verdict.UPDATED
    assert table.members["a"].record.seq == 11
    assert table.on_record(record("me", 99), now=3) is Verdict.SELF
    assert "me" not in table.members


def test_suspect_then_dead_after_timeout(table):
    table.on_record(record("a", 10), now=0)
    acc = table.on_probe_failed("a", now=5)
    assert acc == Accusation(run=RUN, target="a", seq=10, accuser="me")
    assert table.state_of("a") is MemberState.SUSPECT
    timeout = table.config.suspicion_timeout(table.size())
    assert timeout == 4.0  # 4 * max(1, log10(2)) periods of 1 s
    assert table.tick(now=5 + timeout - 0.01) == []
    assert table.state_of("a") is MemberState.SUSPECT
    declared = table.tick(now=5 + timeout)
    assert [d.target for d in declared] == ["a"]  # we suspected it, so we declare it dead
    assert table.state_of("a") is MemberState.DEAD


def test_remote_suspicion_times_out_without_our_declaration(table):
    table.on_record(record("a", 10), now=0)
    assert table.on_accusation(Accusation(run=RUN, target="a", seq=10, accuser="b"), dead=False, now=1) is Verdict.SUSPECTED
    assert table.tick(now=100) == []  # someone else's suspicion: we do not publish a death
    assert table.state_of("a") is MemberState.DEAD


def test_refutation_with_higher_seq_revives(table):
    table.on_record(record("a", 10), now=0)
    table.on_accusation(Accusation(run=RUN, target="a", seq=10, accuser="b"), dead=True, now=1)
    assert table.state_of("a") is MemberState.DEAD
    assert table.on_record(record("a", 10), now=2) is Verdict.SAME  # same seq cannot revive
    assert table.state_of("a") is MemberState.DEAD
    assert table.on_record(record("a", 11), now=3) is Verdict.UPDATED
    assert table.state_of("a") is MemberState.ALIVE


def test_outdated_accusation_ignored(table):
    table.on_record(record("a", 12), now=0)
    assert table.on_accusation(Accusation(run=RUN, target="a", seq=11, accuser="b"), dead=False, now=1) is Verdict.IGNORED
    assert table.on_accusation(Accusation(run=RUN, target="zz", seq=1, accuser="b"), dead=False, now=1) is Verdict.IGNORED
    assert table.on_accusation(Accusation(run=RUN, target="me", seq=1, accuser="b"), dead=False, now=1) is Verdict.SELF
    assert table.state_of("a") is MemberState.ALIVE


def test_probe_ok_clears_local_suspicion(table):
    table.on_record(record("a", 1), now=0)
    table.on_probe_failed("a", now=1)
    table.on_probe_ok("a", now=2)
    assert table.state_of("a") is MemberState.ALIVE
    assert table.on_probe_failed("zz", now=3) is None


def test_goodbye_and_restart_with_same_key(table):
    table.on_record(record("a", 10), now=0)
    assert table.on_goodbye(Goodbye(run=RUN, peer_id="a", seq=10), now=1) is Verdict.LEFT
    assert table.state_of("a") is MemberState.LEFT
    assert table.next_probe_target() is None  # nobody left to probe
    restarted = next_seq(10, now_ms=5)  # a clock behind the old seq still moves forward
    assert restarted == 11
    assert table.on_record(record("a", restarted), now=2) is Verdict.UPDATED
    assert table.state_of("a") is MemberState.ALIVE


def test_tombstones_expire(table):
    table.on_record(record("a", 1), now=0)
    table.on_goodbye(Goodbye(run=RUN, peer_id="a", seq=1), now=1)
    table.tick(now=1 + table.config.tombstone_ttl)
    assert "a" not in table.members


def test_probe_order_is_round_robin(table):
    for p in "abcd":
        table.on_record(record(p, 1), now=0)
    first_round = [table.next_probe_target() for _ in range(4)]
    assert sorted(first_round) == list("abcd")
    second_round = [table.next_probe_target() for _ in range(4)]
    assert sorted(second_round) == list("abcd")


def test_probe_order_only_among_eligible_members(table):
    for p in "abcdef":
        table.on_record(record(p, 1), now=0)
    connected = {"b", "d", "f"}
    picks = [table.next_probe_target(connected) for _ in range(6)]
    assert sorted(picks) == ["b", "b", "d", "d", "f", "f"]  # every connected member once per round
    assert table.next_probe_target(set()) is None
    assert table.next_probe_target({"zz"}) is None  # not a member
    table.on_accusation(Accusation(run=RUN, target="b", seq=1, accuser="x"), dead=True, now=1)
    assert {table.next_probe_target({"b", "d"}) for _ in range(3)} == {"d"}  # the dead are not probed


def test_table_bound(table):
    table.config.max_members = 2
    assert table.on_record(record("a", 1), 0) is Verdict.NEW
    assert table.on_record(record("b", 1), 0) is Verdict.NEW
    assert table.on_record(record("c", 1), 0) is Verdict.FULL


def test_timers_scale_with_size():
    cfg = MembershipConfig()
    assert cfg.suspicion_timeout(10) == 4.0 and cfg.suspicion_timeout(1000) == 12.0
    assert cfg.refresh_interval(10) == 30.0 and cfg.refresh_interval(1000) == 2000.0
    assert cfg.refresh_interval(100_000) == 3600.0
    assert cfg.sync_interval(10) == 30.0 and cfg.sync_interval(10_000) == 10_000.0


# --------------------------------------------------------------------- checks before the table


def signed(identity, domain, msg) -> bytes:
    return encode(seal(identity, domain, msg))


def test_records_signed_by_another_key_are_forged():
    alice, mallory = Identity.generate(), Identity.generate()
    good = signed(alice, DOMAIN_RECORD, record(alice.peer_id, 1))
    assert open_membership(good, RUN).message.peer_id == alice.peer_id
    with pytest.raises(RemoteProtocolError, match="forged"):
        open_membership(signed(mallory, DOMAIN_RECORD, record(alice.peer_id, 2)), RUN)
    with pytest.raises(RemoteProtocolError, match="forged"):
        open_membership(signed(mallory, DOMAIN_GOODBYE, Goodbye(run=RUN, peer_id=alice.peer_id, seq=3)), RUN)
    with pytest.raises(RemoteProtocolError, match="wrong-run"):
        open_membership(good, "other-run")
    with pytest.raises(RemoteProtocolError, match="oversized"):
        open_membership(good + b"\x00" * 5000, RUN)
    with pytest.raises(RemoteProtocolError, match="wrong-domain"):
        open_membership(signed(alice, "ledger-entry", record(alice.peer_id, 1)), RUN)


# --------------------------------------------------------------------- connection manager


def test_connection_manager_dials_diverse_and_prunes_unprotected():
    cm = ConnectionManager(low=3, high=4, backoff=10, rng=random.Random(0))
    alive = {"r1": "relay", "r2": "relay", "r3": "relay", "t": "trainer", "v": "validator", "i": "inference"}
    plan = cm.plan(connected={"r1"}, alive=alive, protected=set(), now=0)
    assert len(plan.dial) == 2 and not any(p.startswith("r") for p in plan.dial)  # other roles first
    cm.on_dial_failed("t", now=0)
    plan = cm.plan(connected={"r1"}, alive={"r1": "relay", "t": "trainer"}, protected=set(), now=5)
    assert plan.dial == []  # in backoff
    plan = cm.plan(connected={"r1"}, alive={"r1": "relay", "t": "trainer"}, protected=set(), now=10)
    assert plan.dial == ["t"]
    plan = cm.plan(connected=set(alive), alive=alive, protected={"r1", "r2"}, now=0)
    assert len(plan.prune) == 2 and "r1" not in plan.prune and "r2" not in plan.prune
    assert "r3" in plan.prune  # the most represented role goes first


def test_local_health_stretches_timeouts_when_we_are_the_slow_one():
    from node.gossip.membership import LocalHealth

    h = LocalHealth(max_score=3)
    assert h.scale() == 1
    for _ in range(5):
        h.on_round(lag=0.9, tolerance=0.25)  # our own timer fired late: we are overloaded
    assert h.scale() == 4  # capped
    h.on_round(lag=0.0, tolerance=0.25)
    assert h.scale() == 3  # recovers one step per timely round
    h.on_refute()
    assert h.score == 3


def test_sync_planner_syncs_new_connections_only_while_joining() -> None:
    from node.gossip.membership import JOIN_SYNC_FANOUT, SyncPlanner

    rng = random.Random(1)
    sp = SyncPlanner()
    assert sp.plan(set(), 0.0, 30.0, rng) == []
    first = sp.plan({"a", "b"}, 0.0, 30.0, rng)
    assert sorted(first) == ["a", "b"]  # joining: every new connection
    assert sp.plan({"a", "b"}, 1.0, 30.0, rng) == []  # not twice while the exchanges run
    many = {f"p{i}" for i in range(10)}
    assert len(sp.plan(many | {"a", "b"}, 2.0, 30.0, rng)) == JOIN_SYNC_FANOUT  # bounded per tick
    sp.on_synced()
    # Joined: connections that come and go (probes dial, the manager prunes) cost no exchange...
    assert sp.plan({"x", "y", "z"}, 3.0, 30.0, rng) == []
    assert sp.plan({"q"}, 29.0, 30.0, rng) == []
    # ...only one random peer per interval.
    assert sp.plan({"q", "r"}, 30.0, 30.0, rng) in (["q"], ["r"])
    assert sp.plan({"q", "r"}, 31.0, 30.0, rng) == []
    # Losing every connection means joining again.
    assert sp.plan(set(), 40.0, 30.0, rng) == []
    assert sp.plan({"s"}, 41.0, 30.0, rng) == ["s"]


def test_an_accusation_of_an_incarnation_nobody_has_seen_is_ignored(table):
    """The attack of issue 14: signed SUSPECT/DEAD messages at seq 2**63 - 1 were applied, and the
    victim could never publish a higher seq to refute them. Seqs are wall-clock ms: an accused seq
    may be ahead of ours by the time since we heard of the member plus the clock slack, no more."""
    table.on_record(record("a", 12), now=0)
    slack_ms = int(SEQ_CLOCK_SLACK_S * 1000)
    for seq in (2**63 - 1, 12 + slack_ms + 1001):
        for dead in (False, True):
            assert table.on_accusation(Accusation(run=RUN, target="a", seq=seq, accuser="b"), dead=dead,
                                       now=1) is Verdict.IGNORED
    assert table.state_of("a") is MemberState.ALIVE and table.entered[MemberState.SUSPECT] == 0
    assert table.on_accusation(Accusation(run=RUN, target="a", seq=12 + slack_ms + 999, accuser="b"), dead=False,
                               now=1) is Verdict.SUSPECTED
