"""The pure member table: every transition, with time passed in (no clock, no sockets)."""

from __future__ import annotations

import random

import pytest

from node.gossip.connections import ConnectionManager
from node.gossip.membership import SEQ_CLOCK_SLACK_S, MembershipConfig, MemberState, MemberTable, Verdict, next_seq
from node.gossip.records import Accusation, Goodbye, PeerRecord, open_membership, DOMAIN_RECORD, DOMAIN_GOODBYE
from node.identity import Identity
from node.wire import RemoteProtocolError, decode_as, encode, seal

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


def test_a_member_that_never_heard_its_death_is_revived_by_its_own_refresh(table):
    """A lost DEAD notice leaves the member nothing to refute: its own same-seq refresh (gossipsub
    author = the member) brings it back; the same record relayed by anyone else does not."""
    table.on_record(record("a", 10), now=0)
    table.on_probe_failed("a", now=5)
    table.tick(now=5 + table.config.suspicion_timeout(table.size()))
    assert table.state_of("a") is MemberState.DEAD
    assert table.on_record(record("a", 10), now=20, source="b") is Verdict.SAME  # hearsay: still dead
    assert table.on_record(record("a", 10), now=21, source="a", exchange=True) is Verdict.SAME  # a table copy
    assert table.state_of("a") is MemberState.DEAD
    assert table.on_record(record("a", 10), now=22, source="a") is Verdict.UPDATED
    assert table.state_of("a") is MemberState.ALIVE and table.revived == 1
    # A suspicion of ours is cleared the same way, without waiting for a refutation.
    table.on_probe_failed("a", now=30)
    assert table.state_of("a") is MemberState.SUSPECT
    assert table.on_record(record("a", 10), now=31, source="a") is Verdict.UPDATED
    assert table.state_of("a") is MemberState.ALIVE
    # A member that said goodbye stays gone.
    table.on_goodbye(Goodbye(run=RUN, peer_id="a", seq=10), now=40)
    assert table.on_record(record("a", 10), now=41, source="a") is Verdict.SAME
    assert table.state_of("a") is MemberState.LEFT


def test_our_failed_probe_publishes_nothing_when_an_accusation_of_that_record_is_pending(table):
    """Issue 46: every neighbour of a crashed member flooded its own accusation; after the first,
    each changed nothing anywhere and cost every node a flood (the largest share of a node's bytes
    that grew with N under churn). Our suspicion is still ours: the member is SUSPECT here."""
    table.on_record(record("a", 10), now=0)
    table.on_accusation(Accusation(run=RUN, target="a", seq=10, accuser="b"), dead=False, now=1)
    assert table.on_probe_failed("a", now=2) is None
    assert table.state_of("a") is MemberState.SUSPECT
    assert table.tick(now=1 + table.config.suspicion_timeout(table.size())) == []  # b's timed out: no declaration
    assert table.state_of("a") is MemberState.DEAD
    # Refuted since (its newer record cleared b's): a failed probe of ours is news, and goes out.
    table.on_record(record("a", 11), now=20)
    assert table.on_probe_failed("a", now=21) == Accusation(run=RUN, target="a", seq=11, accuser="me")


def test_indirect_helpers_are_members_we_can_reach_before_throwaway_ones(table):
    for peer in ("conn", "was-reached", *(f"fake{i}" for i in range(20))):
        table.on_record(record(peer, 10), now=0)
    table.on_record(record("target", 10), now=0)
    table.on_probe_ok("was-reached", now=1)
    for _ in range(10):
        helpers = table.indirect_helpers("target", connected={"conn"}, k=3)
        assert helpers[:2] == ["conn", "was-reached"] and helpers[2].startswith("fake")


def test_remote_suspicion_times_out_without_our_declaration(table):
    table.on_record(record("a", 10), now=0)
    assert table.on_accusation(Accusation(run=RUN, target="a", seq=10, accuser="b"), dead=False, now=1) is Verdict.SUSPECTED
    assert table.tick(now=100) == []  # someone else's suspicion: we do not publish a death
    assert table.state_of("a") is MemberState.DEAD


def test_refutation_with_higher_seq_revives(table):
    table.on_record(record("a", 10), now=0)
    table.on_probe_failed("a", now=1)
    table.tick(now=1 + table.config.suspicion_timeout(table.size()))
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
    table.config.far_probe_every = 0  # the round among connections alone (far probes: below)
    for p in "abcdef":
        table.on_record(record(p, 1), now=0)
    connected = {"b", "d", "f"}
    picks = [table.next_probe_target(connected) for _ in range(6)]
    assert sorted(picks) == ["b", "b", "d", "d", "f", "f"]  # every connected member once per round
    assert table.next_probe_target(set()) is None
    assert table.next_probe_target({"zz"}) is None  # not a member
    table.on_goodbye(Goodbye(run=RUN, peer_id="b", seq=1), now=1)
    assert {table.next_probe_target({"b", "d"}) for _ in range(3)} == {"d"}  # the departed are not probed


def test_every_far_probe_every_th_pick_is_a_live_member_we_hold_no_connection_to(table):
    """A member nobody holds a connection to is probed too (issue 46: one that crashed after its
    last connections closed on purpose was probed by nobody and never expired): each
    ``far_probe_every``-th pick is drawn round-robin from the live members outside the connections."""
    table.config.far_probe_every = 3
    for p in "abcdefgh":
        table.on_record(record(p, 1), now=0)
    table.on_goodbye(Goodbye(run=RUN, peer_id="h", seq=1), now=1)  # the departed are not probed
    connected = {"a", "b"}
    picks = [table.next_probe_target(connected) for _ in range(3 * 10)]
    far = picks[2::3]
    near = [p for i, p in enumerate(picks) if i % 3 != 2]
    assert set(near) == connected and near.count("a") == near.count("b")
    assert sorted(far) == sorted("cdefg" * 2)  # each far member once per far round


def test_junk_records_cannot_make_a_node_dial_more_far_members(table):
    """Attack: a peer floods the table with records of members that do not exist (their
    addresses anyone's), so that far probes dial them. They choose which member a far probe
    dials, never how many: one per ``far_probe_every`` picks, the rest stay on our connections."""
    table.config.max_members = 10_000
    for i in range(2000):
        table.on_record(record(f"junk{i}", 1), now=0, source=None, exchange=True)
    connected = {"a", "b", "c"}
    for p in connected:
        table.on_record(record(p, 1), now=0)
    picks = [table.next_probe_target(connected) for _ in range(1000)]
    assert sum(p not in connected for p in picks) == 1000 // table.config.far_probe_every


def test_table_bound(table):
    table.config.max_members = 2
    assert table.on_record(record("a", 1), 0) is Verdict.NEW
    assert table.on_record(record("b", 1), 0) is Verdict.NEW
    for p in "ab":
        table.on_reached(p, 0)  # members we reach are never evicted for a newcomer
    assert table.on_record(record("c", 1), 0) is Verdict.FULL


def test_timers_scale_with_size():
    cfg = MembershipConfig()
    assert cfg.suspicion_timeout(10) == 4.0 and cfg.suspicion_timeout(1000) == 12.0
    assert cfg.refresh_interval(5) == 30.0 and cfg.refresh_interval(500) == 2000.0
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
    h.on_probe_missed()  # our own direct ping got no ack
    assert h.score == 3  # capped


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


def test_a_join_exchange_that_brought_nothing_is_tried_again_with_the_same_peer() -> None:
    """Issue 46: a joiner's one connection is its bootstrap peer; an exchange lost with it was never
    tried again, and the joiner held an empty table until its lone random exchange 30 s later."""
    from node.gossip.membership import JOIN_SYNC_RETRY, SyncPlanner

    rng, sp = random.Random(1), SyncPlanner()
    assert sp.plan({"boot"}, 0.0, 30.0, rng) == ["boot"]
    assert sp.plan({"boot"}, JOIN_SYNC_RETRY - 0.25, 30.0, rng) == []  # the first may still be running
    assert sp.plan({"boot"}, JOIN_SYNC_RETRY, 30.0, rng) == ["boot"]
    sp.on_synced()
    assert sp.plan({"boot"}, 2 * JOIN_SYNC_RETRY, 30.0, rng) == []  # joined: only the random one


def test_the_random_exchange_waits_the_interval_of_the_table_it_holds_now_not_of_the_one_it_started_with() -> None:
    """Issue 46: a node starts alone (sync_interval(1) = 30 s) and its join exchange brings 1,000
    members; the deadline fixed at start made it push-pull a full table again at 30 s, one more
    exchange per join for the whole swarm, where its interval is now 1,000 s."""
    from node.gossip.membership import SyncPlanner

    cfg, rng, sp = MembershipConfig(), random.Random(1), SyncPlanner()
    assert sp.plan({"boot"}, 0.0, cfg.sync_interval(1), rng) == ["boot"]  # joining, alone
    sp.on_synced()
    peers, big = {"boot", "p1", "p2"}, cfg.sync_interval(1000)
    for t in (0.25, 30.0, 31.0, 600.0, 999.75):
        assert sp.plan(peers, t, big, rng) == [], t
    assert len(sp.plan(peers, 1000.0, big, rng)) == 1
    # The swarm shrinks: the interval of the smaller table counts from that exchange.
    assert sp.plan(peers, 1029.0, cfg.sync_interval(10), rng) == []
    assert len(sp.plan(peers, 1030.0, cfg.sync_interval(10), rng)) == 1


def test_our_record_is_refreshed_at_the_interval_of_the_table_it_holds_now() -> None:
    """Issue 46: the record published at start, alone, was due again at min_refresh (30 s) however
    many members the node learned meanwhile: every join flooded the swarm twice."""
    from node.gossip.membership import RecordRefresh

    cfg, r = MembershipConfig(), RecordRefresh()
    assert r.due(0.0, 1, cfg, mesh=6)  # never published
    r.on_published(0.0, mesh=6)
    assert not r.due(29.9, 1, cfg, mesh=6) and r.due(30.0, 1, cfg, mesh=6)  # alone: min_refresh
    assert not r.due(30.0, 1000, cfg, mesh=6) and not r.due(3599.0, 1000, cfg, mesh=6)  # it learned 999 members
    assert r.due(3600.0, 1000, cfg, mesh=6)
    assert not r.due(399.0, 100, cfg, mesh=6) and r.due(400.0, 100, cfg, mesh=6)  # shrunk to 100: 400 s from the last one
    r.on_published(400.0, mesh=6)
    assert not r.due(429.0, 1, cfg, mesh=6) and r.due(430.0, 1, cfg, mesh=6)


def test_a_record_published_with_no_mesh_peer_is_published_again_once_there_is_one() -> None:
    """Issue 45: a node's start record goes out before its first connection, to nobody; a restarted
    member held dead stayed dead at every peer its join exchange did not reach until its refresh."""
    from node.gossip.membership import RecordRefresh

    cfg, r = MembershipConfig(), RecordRefresh()
    r.on_published(0.0, mesh=0)
    assert not r.due(0.1, 1, cfg, mesh=0)  # still nobody to send it to
    assert not r.due(3599.0, 1000, cfg, mesh=0)  # nor at its refresh: it would reach nobody again
    assert r.due(0.2, 1, cfg, mesh=1)  # the first mesh peer: at once, not at the refresh interval
    r.on_published(0.2, mesh=2)
    assert not r.due(0.3, 1, cfg, mesh=4) and not r.due(30.1, 1, cfg, mesh=0)
    assert r.due(30.2, 1, cfg, mesh=4)  # heard: the interval again


def test_a_record_published_to_one_peer_is_published_again_once_a_second_can_hear_it() -> None:
    """Issue 46: a joiner's start record goes to its bootstrap peer alone; that one copy lost (1 %
    loss lost 1 of 300 in bench/sim_membership.py's ramp), no node but the bootstrap learned it
    for minutes. Published to one peer, it goes again once there are two, and then not again."""
    from node.gossip.membership import RecordRefresh

    cfg, r = MembershipConfig(), RecordRefresh()
    r.on_published(0.0, mesh=1)
    assert not r.due(0.5, 1, cfg, mesh=1)  # the same single peer: nothing gained
    assert r.due(0.6, 1, cfg, mesh=2)
    r.on_published(0.6, mesh=2)
    assert not r.due(1.0, 1, cfg, mesh=6) and r.due(30.6, 1, cfg, mesh=6)  # heard: the interval again
    # Two members only: one mesh peer is all there can be; the refresh keeps its interval.
    r = RecordRefresh()
    r.on_published(0.0, mesh=1)
    assert not r.due(29.9, 1, cfg, mesh=1) and r.due(30.0, 1, cfg, mesh=1)


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


# --------------------------------------------------------------------- forged verdicts (issue 14)


def snapshot_alive(table, peer: str) -> bool:
    """What other services see: the live set (inference picks trainers from it) and the state."""
    return peer in table.alive() and table.state_of(peer) is MemberState.ALIVE


def test_a_flood_of_accusations_by_a_non_prober_never_takes_the_victim_out(table):
    """Issue 14, attack 4: 50 DEAD and 49 SUSPECT accusations by a peer that never probed the
    victim got it declared dead 50 times. Whatever the seq (implausible or the victim's current
    one), the victim stays alive in every snapshot, the accuser is budgeted, then, refuted, ignored
    and reported to the peer score owner."""
    table.on_record(record("victim", 1000), now=0)
    seq, now, verdicts = 1000, 0.0, []
    for i in range(99):
        now += 0.1
        dead = i < 50
        for accused in (2**63 - 1, seq):  # the forged incarnation, then the victim's real one
            verdicts.append(table.on_accusation(Accusation(run=RUN, target="victim", seq=accused, accuser="mallory"),
                                                dead=dead, now=now))
            assert snapshot_alive(table, "victim"), (i, accused)
            table.tick(now)
            assert snapshot_alive(table, "victim"), (i, accused)
        if table.members["victim"].hearsay is not None:  # the victim hears of it and refutes
            seq += 1
            now += 0.05
            assert table.on_record(record("victim", seq), now=now, source="victim") is Verdict.UPDATED
            assert snapshot_alive(table, "victim")
    assert Verdict.DIED not in verdicts and table.entered[MemberState.DEAD] == 0
    assert table.entered[MemberState.SUSPECT] == 0  # only our own probes make a suspect
    cfg = table.config
    assert verdicts.count(Verdict.SUSPECTED) == cfg.refuted_limit  # refuted that often, then ignored
    assert table.distrusted("mallory", now)
    assert verdicts.count(Verdict.DISTRUSTED) == 99 - cfg.refuted_limit
    assert verdicts.count(Verdict.IGNORED) == 99  # every forged seq
    faults = table.take_faults()
    assert faults == ([("mallory", "refuted-accusation")] * cfg.refuted_limit
                      + [("mallory", "distrusted-accusation")] * (99 - cfg.refuted_limit))
    assert table.take_faults() == []


def test_accusations_are_rate_limited_per_accuser(table):
    cfg = table.config
    for p in range(40):
        table.on_record(record(f"m{p}", 1), now=0)
    got = [table.on_accusation(Accusation(run=RUN, target=f"m{p}", seq=1, accuser="mallory"), dead=False, now=1)
           for p in range(40)]
    assert got.count(Verdict.SUSPECTED) == cfg.accusation_burst
    assert got.count(Verdict.LIMITED) == 40 - cfg.accusation_burst
    assert table.take_faults() == [("mallory", "accusation-flood")] * (40 - cfg.accusation_burst)
    # Another accuser has its own budget; the first gets one more per 1/rate seconds.
    assert table.on_accusation(Accusation(run=RUN, target="m39", seq=1, accuser="honest"), False, now=1) \
        is Verdict.SUSPECTED
    later = 1 + 1 / cfg.accusation_rate
    assert table.on_accusation(Accusation(run=RUN, target="m38", seq=1, accuser="mallory"), False, now=later) \
        is Verdict.SUSPECTED


def test_a_death_declaration_by_someone_else_is_only_a_suspicion(table):
    """SWIM's confirm is the accuser's word: the accused still gets its suspicion timeout."""
    table.on_record(record("a", 10), now=0)
    timeout = table.config.suspicion_timeout(table.size())
    assert table.on_accusation(Accusation(run=RUN, target="a", seq=10, accuser="b"), dead=True, now=1) \
        is Verdict.SUSPECTED
    assert snapshot_alive(table, "a") and table.rows(1)[0]["suspected_by"] == "b"
    table.tick(now=1 + timeout - 0.01)
    assert snapshot_alive(table, "a")
    table.tick(now=1 + timeout)  # not refuted in time: now it is dead
    assert table.state_of("a") is MemberState.DEAD and "a" not in table.alive()
    assert table.take_faults() == []  # an accusation nobody refuted costs the accuser nothing


def test_our_own_probe_clears_someone_elses_suspicion_without_blaming_them(table):
    table.on_record(record("a", 10), now=0)
    table.on_accusation(Accusation(run=RUN, target="a", seq=10, accuser="b"), dead=False, now=1)
    table.on_probe_ok("a", now=2)
    table.tick(now=20)  # past the suspicion timeout
    assert table.state_of("a") is MemberState.ALIVE
    assert table.take_faults() == [] and not table.distrusted("b", 20)


def test_refutations_by_the_accused_itself_count_against_the_accuser(table):
    """The victim's own table: it refutes (service) and notes the accuser each time."""
    for i in range(table.config.refuted_limit):
        assert not table.distrusted("mallory", now=i)
        table.note_refuted("mallory", now=i)
    assert table.distrusted("mallory", now=10)
    assert not table.distrusted("mallory", now=table.config.refuted_window + 1)  # forgiven in time
    table.note_refuted("me", now=1)  # our own wrong suspicion is no fault
    assert all(p == "mallory" for p, _ in table.take_faults())


def test_refuting_an_accusation_does_not_stretch_our_probe_timeouts():
    """Issue 14: each refutation raised the victim's local health score, so a peer that never
    probed it could lengthen its probe timeouts at will."""
    from node.gossip.service import Membership

    table = MemberTable("me")
    svc = Membership(None, table.config, table, record("me", 5))
    for above in range(5, 105):
        svc.refute(above=above)
    assert svc.record.seq > 104 and svc.health.score == 0 and svc.health.scale() == 1


def test_throwaway_records_are_budgeted_per_source_and_expire(table):
    """Issue 14, attack 5: 10 peers at 9 msg/s each added 900 records of throwaway identities,
    kept alive for ever. Now each source introduces at most its budget, and what nobody reachable
    vouches for is gone after the TTL, while a member we reach and one that refreshes its own
    record stay."""
    cfg = table.config
    table.on_record(record("reached", 1), now=0, source="reached")
    table.on_record(record("talker", 1), now=0, source="talker")
    verdicts = []
    for k in range(90):  # 10 s at 9 msg/s per source
        for src in range(10):
            fake = record(f"fake-{src}-{k}", 1)
            verdicts.append(table.on_record(fake, now=k / 9, source=f"attacker{src}"))
    budget = cfg.new_member_burst + cfg.new_member_rate * 10
    assert verdicts.count(Verdict.NEW) <= 10 * budget < 900 / 4
    assert verdicts.count(Verdict.LIMITED) == 900 - verdicts.count(Verdict.NEW)
    faults = table.take_faults()
    assert {p for p, _ in faults} == {f"attacker{i}" for i in range(10)} and len(faults) == 900 - verdicts.count(Verdict.NEW)
    # Attackers re-sending the fakes' records (and a push-pull copy) do not keep them.
    ttl = cfg.member_ttl(table.size())
    now = 0.0
    while now <= ttl + 1:
        now += 10
        table.on_reached("reached", now)
        if now % 30 == 0:
            table.on_record(record("talker", 1), now=now, source="talker")  # its own refresh
        for m in [m for m in table.members.values() if m.peer_id.startswith("fake")][:50]:
            table.on_record(m.record, now=now, source="attacker0")
            table.on_record(m.record, now=now, source=None)
        table.tick(now)
    assert sorted(table.members) == ["reached", "talker"]
    assert table.dropped["expired"] == verdicts.count(Verdict.NEW)


def test_at_the_bound_unreached_entries_make_room_for_newcomers(table):
    table.config.max_members = 3
    table.on_record(record("a", 1), now=0)
    table.on_reached("a", now=0)
    table.on_record(record("b", 1), now=1)
    table.on_record(record("c", 1), now=2)
    assert table.on_record(record("x", 1), now=3) is Verdict.FULL  # an exempt join exchange only fills
    assert table.on_record(record("d", 1), now=3, source="d") is Verdict.NEW  # b: oldest of the never reached
    assert sorted(table.members) == ["a", "c", "d"] and table.dropped["evicted"] == 1
    for p in "cd":
        table.on_reached(p, now=4)
    assert table.on_record(record("e", 1), now=5, source="e") is Verdict.FULL  # everyone is reached: refuse


def test_dials_to_one_advertised_address_back_off():
    """Issue 14, attack 5: 900 members advertising one address were dialled 202 times in 15 s.
    The connection loop (every 2 s, as the service runs it) with every dial failing."""
    from node.gossip.connections import AddressBackoff

    cfg = MembershipConfig()
    addr = "/ip4/203.0.113.7/tcp/4001"
    alive = {f"fake{i}": "inference" for i in range(900)}
    cm = ConnectionManager(cfg.conn_low, cfg.conn_high, cfg.dial_backoff, rng=random.Random(0))
    backoff = AddressBackoff(cfg.dial_backoff, cfg.dial_backoff_max)
    dials: list[float] = []
    t = 0.0
    while t <= 15.0:
        plan = cm.plan(set(), alive, set(), t, dialable=lambda p: backoff.ready(addr, t))
        for p in plan.dial:
            if backoff.try_dial(addr, t):
                dials.append(t)
                backoff.on_failed(addr, t + 3.0)  # the dial timed out
            cm.on_dial_failed(p, t + 3.0)
        t += 2.0
    assert len(dials) <= 3, dials  # 0 s, then 3 + 10 s
    # The wait doubles per failure up to the cap, and a success forgets it.
    b = AddressBackoff(base=10, cap=40)
    for k, wait in enumerate([10, 20, 40, 40]):
        b.on_failed("x", now=0)
        assert not b.ready("x", wait - 0.01) and b.ready("x", wait), k
    b.on_connected("x")
    assert b.try_dial("x", 0) and not b.try_dial("x", 1)  # one dial at a time
    assert b.ready("y", 0)


def test_a_push_pull_table_over_the_budget_is_trimmed_without_blaming_its_sender(table):
    """An honest peer's table may hold many members we lack (it joined through someone else):
    the surplus waits for the members' own refreshes, and the sender is not scored down."""
    got = [table.on_record(record(f"m{i}", 1), now=0, source="peer", exchange=True) for i in range(30)]
    assert got.count(Verdict.NEW) == table.config.new_member_burst
    assert table.take_faults() == []
    assert table.on_record(record("m29", 1), now=1, source="m29") is Verdict.NEW  # its own record, later


def test_our_record_advertises_the_newest_checkpoint_versions_that_fit():
    """A node may hold more versions than a record carries: membership keeps the newest
    ``MAX_VERSIONS`` (the trainer trimmed them itself before issue 44; a caller that forgot would
    have published a record no peer accepts), so the record still encodes."""
    from node.gossip.records import MAX_VERSIONS
    from node.gossip.service import Membership

    table = MemberTable("me")
    svc = Membership(None, table.config, table, record("me", 5))
    held = list(range(3, 3 + 2 * MAX_VERSIONS + 5))
    svc.update(checkpoints=held)
    assert svc.record.checkpoints == held[-MAX_VERSIONS:] and svc.record.seq > 5
    assert decode_as(PeerRecord, encode(svc.record)).checkpoints == held[-MAX_VERSIONS:]
