"""MemberTable.tick and size without a scan of every entry (issue 46): at N = 10,000 the scans of
every tick cost each node ~120,000 entry visits a second. The incremental version must give what
a scan of every entry at every tick gives (checked over seeded random histories)."""

from __future__ import annotations

import random

from node.gossip.connections import ConnectionManager, ConnectionPlan
from node.gossip.membership import MembershipConfig, MemberState, MemberTable
from node.gossip.records import Accusation, Goodbye, PeerRecord

RUN = "t"


def record(peer: str, seq: int) -> PeerRecord:
    return PeerRecord(run=RUN, peer_id=peer, role="relay", addrs=["/ip4/127.0.0.1/tcp/1"], software="t", seq=seq)


class CountingDict(dict):
    """The members dict, counting whole-table walks."""

    walks = 0

    def values(self):
        CountingDict.walks += 1
        return super().values()

    def items(self):
        CountingDict.walks += 1
        return super().items()

    def __iter__(self):
        CountingDict.walks += 1
        return super().__iter__()


def test_a_quiet_table_is_not_walked_at_every_tick():
    table = MemberTable("me", MembershipConfig())
    table.members = CountingDict()
    for i in range(1000):
        table.on_record(record(f"p{i}", 1), 0.0, None, exchange=True)
    table.tick(0.0)
    CountingDict.walks = 0
    for k in range(1, 101):
        table.tick(k * 0.25)
        assert table.size() == 1001
    assert CountingDict.walks <= 2  # was 200: one walk in tick and one in size at each call


def big_table(n: int, connected: int) -> tuple[MemberTable, set[str]]:
    table = MemberTable("me", MembershipConfig(), rng=random.Random(7))
    table.members = CountingDict()
    for i in range(n):
        table.on_record(record(f"p{i}", 1), 0.0, None, exchange=True)
    return table, {f"p{i}" for i in range(0, n, n // connected)}


def test_probing_among_our_connections_does_not_walk_the_table():
    """The probe loop picks among the members we hold a connection to; refilling its round from a
    walk of every entry cost each node N / connections entry visits per probe (issue 46: ~800 a
    second at N = 10,000 with 12 connections)."""
    table, connected = big_table(1000, 12)
    every = table.config.far_probe_every
    CountingDict.walks = 0
    picks = [table.next_probe_target(connected) for _ in range(every * 10 * len(connected))]
    # One walk builds the far round (a member we hold no connection to, every far_probe_every-th
    # pick), which lasts its ~1,000 far picks: the walk per round of 12 near picks was 120 here.
    assert CountingDict.walks == 1
    near = [p for i, p in enumerate(picks) if (i + 1) % every]
    assert sorted(near) == sorted(list(connected) * (every - 1) * 10)  # still each connection once per round


def test_indirect_helpers_come_from_our_connections_without_walking_the_table():
    """A missed direct probe (1 % loss makes a few a minute per node) asks k helpers; while our
    connections can supply them, the table is not walked for the others."""
    table, connected = big_table(1000, 12)
    target = sorted(connected)[0]
    CountingDict.walks = 0
    seen: set[str] = set()
    for _ in range(50):
        helpers = table.indirect_helpers(target, connected, k=3)
        assert len(set(helpers)) == 3 and set(helpers) <= connected - {target}
        seen.update(helpers)
    assert CountingDict.walks == 0  # was 50: one walk per missed probe
    assert seen == connected - {target}  # every connection gets asked in turn (random choice)
    few = set(sorted(connected)[:2])  # one helper short among the connections: then the rest of the table
    helpers = table.indirect_helpers(target, few, k=3)
    assert helpers[:1] == sorted(few - {target}) and helpers[1] not in connected and len(set(helpers)) == 3


def test_the_connection_plan_reads_the_table_only_to_dial():
    """Every connection period plans; with enough connections it must not cost a walk of the table
    (the services built a dict of every alive member for it: N entry visits a period per node)."""
    table, connected = big_table(1000, 12)
    manager = ConnectionManager(low=8, high=24, backoff=10.0, rng=random.Random(1))
    CountingDict.walks = 0
    assert manager.plan(connected, table.alive_roles(), set(), now=1.0) == ConnectionPlan([], [])
    crowded = {f"p{i}" for i in range(30)}
    assert len(manager.plan(crowded, table.alive_roles(), set(), now=1.0).prune) == 30 - 24
    assert CountingDict.walks == 0
    few = set(sorted(connected)[:3])  # below low: the dial candidates are every alive member we lack
    table.on_goodbye(Goodbye(run=RUN, peer_id="p1", seq=1), now=1.0)
    roles = table.alive_roles()
    assert dict(roles) == {p: "relay" for p, m in table.members.items() if m.state is MemberState.ALIVE}
    assert "p1" not in roles and roles.get("p1") is None and roles["p2"] == "relay"
    dial = manager.plan(few, roles, set(), now=1.0).dial
    assert len(dial) == 8 - 3 and not set(dial) & (few | {"p1"})


def recount(table: MemberTable) -> int:
    return 1 + sum(1 for m in table.members.values() if m.state in (MemberState.ALIVE, MemberState.SUSPECT))


def snapshot(table: MemberTable) -> dict:
    return {p: (m.state, m.since, m.record.seq, m.hearsay) for p, m in table.members.items()}


def test_the_incremental_tick_matches_a_full_scan_at_every_tick():
    config = MembershipConfig(min_refresh=5.0, tombstone_ttl=20.0, max_members=12)
    for seed in range(60):
        rng = random.Random(seed)
        fast, full = MemberTable("me", config), MemberTable("me", config)
        peers = [f"p{i}" for i in range(15)]
        seqs = dict.fromkeys(peers, 1)
        now = 0.0
        for _ in range(300):
            now += rng.choice((0.25, 0.25, 1.0, 7.0))
            p = rng.choice(peers)
            op = rng.random()
            if op < 0.35 and rng.random() < 0.3:
                seqs[p] += 1
            source = rng.choice((p, "q", None))
            for t in (fast, full):
                if op < 0.35:
                    t.on_record(record(p, seqs[p]), now, source)
                elif op < 0.5:
                    t.on_accusation(Accusation(run=RUN, target=p, seq=seqs[p], accuser="x"), False, now)
                elif op < 0.6:
                    t.on_probe_failed(p, now)
                elif op < 0.7:
                    t.on_probe_ok(p, now)
                elif op < 0.75:
                    t.on_goodbye(Goodbye(run=RUN, peer_id=p, seq=seqs[p]), now)
                elif op < 0.85:
                    t.on_reached(p, now)
            full._sweep_at = float("-inf")  # the reference: every entry, every tick
            declared = [sorted(t.tick(now), key=lambda a: a.target) for t in (fast, full)]
            assert declared[0] == declared[1], seed  # the same death declarations (in any order)
            assert snapshot(fast) == snapshot(full), seed
            assert fast.size() == recount(fast), seed
