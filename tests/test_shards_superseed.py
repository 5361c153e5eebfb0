"""The super-seeder's hand-over to ordinary seeding (node/shards/superseed.py; issue 46 item 3)."""

from __future__ import annotations

import heapq
import random

from node.shards.superseed import SeedMode, SuperSeeder, super_seeding_pays


def test_once_every_piece_is_held_by_a_downloader_the_origin_shows_everyone_everything():
    """Found by simulation (bench/sim_shards.py, N = 100, issue 46): once one copy was out the
    origin's 1 Gbit/s idled while the swarm traded, then served only the pieces shown again."""
    s = SuperSeeder(4, in_transit=1, max_unreported=1, stall_seconds=10.0, rng=random.Random(1))
    pending = s.on_bitfield("a", set(), 0.0) + s.on_bitfield("b", {3}, 0.0)
    t, last = 0.0, []
    while pending:  # each piece to its one recipient, who reports it
        assert s.mode is SeedMode.SUPER
        (peer, piece), *rest = pending
        t += 0.1
        last = s.on_sent(peer, piece, t) + s.on_have(peer, piece, t)
        pending = rest + last
        if s.mode is SeedMode.ORDINARY:
            break
    assert s.mode is SeedMode.ORDINARY and sum(s.sent) == 3  # each piece went out once, then the switch
    # The report that completed the first copy shows each downloader every piece it still lacks.
    lacking = {(p, i) for p, d in s.peers.items() for i in range(4) if i not in d.holds}
    assert set(last) == lacking and len(last) == len(lacking)
    assert s.reveal(t + 20.0) == []  # nothing twice, stalled or not
    # A downloader that comes later is shown every piece at once, not a few at a time.
    assert sorted(i for _, i in s.on_bitfield("c", {0}, t + 21.0)) == [1, 2, 3]


def test_until_every_piece_is_held_by_a_downloader_pieces_go_out_one_at_a_time():
    s = SuperSeeder(3, in_transit=1, max_unreported=1, stall_seconds=10.0, rng=random.Random(2))
    ((peer, piece),) = s.on_bitfield("a", set(), 0.0)
    assert s.on_bitfield("b", set(), 0.0) == []
    s.on_sent(peer, piece, 0.1)
    assert len(s.on_have(peer, piece, 0.2)) == 1  # the next piece, to one downloader
    assert s.mode is SeedMode.SUPER and sum(s.sent) == 2



def run_reports(s: SuperSeeder, piece_seconds: float, latency: float, until: float) -> list[int]:
    """The origin's uplink writes revealed pieces one after another, ``piece_seconds`` each, and
    their downloaders report them ``latency`` later; the budget (max_unreported) after each report."""
    events: list[tuple[float, int, str, int]] = []  # (when, 0 written / 1 reported, peer, piece)
    link_free, now, budgets = 0.0, 0.0, []

    def write(reveals: list[tuple[str, int]]) -> None:
        nonlocal link_free
        for peer, piece in reveals:
            link_free = max(now + latency, link_free) + piece_seconds  # the request comes back first
            heapq.heappush(events, (link_free, 0, peer, piece))

    write([r for p in "abcdefgh" for r in s.on_bitfield(p, set(), 0.0)])
    while events and now < until:
        now, kind, peer, piece = heapq.heappop(events)
        if kind == 0:
            heapq.heappush(events, (now + latency, 1, peer, piece))
            write(s.on_sent(peer, piece, now))
        else:
            write(s.on_have(peer, piece, now))
            budgets.append(s.max_unreported)
    return budgets


def test_the_budget_grows_while_more_pieces_in_flight_do_not_lengthen_the_round_trip():
    """Found by simulation (bench/sim_shards.py, N = 100, issue 46): a 1 Gbit/s origin with 5-60 ms
    to its downloaders ran at 60-90 Mbit/s until one copy was out, its budget sized for 10 Mbit/s
    links. A round trip that stays at its shortest means the uplink has room (TCP Vegas)."""
    s = SuperSeeder(4096, in_transit=2, max_unreported=4, rng=random.Random(1), grow_to=64, hand_over=False)
    budgets = run_reports(s, piece_seconds=0.008, latency=0.05, until=10.0)  # 1 MiB at 1 Gbit/s
    # Around what the link carries in a round trip (0.108 s / 0.008 s = 13.5 pieces), not to the cap.
    late = budgets[len(budgets) // 2:]
    assert budgets[0] <= 5 and 10 <= sum(late) / len(late) <= 20 and max(budgets) < 32


def test_the_budget_stays_put_when_each_piece_more_in_flight_lengthens_the_round_trip():
    """A full uplink: each more piece in flight waits behind the others (128 KiB pieces at 10 Mbit/s:
    0.1 s each), the case bench/shards.py swarm measured the budgets in."""
    s = SuperSeeder(4096, in_transit=4, max_unreported=12, rng=random.Random(1), grow_to=64, hand_over=False)
    budgets = run_reports(s, piece_seconds=0.1, latency=0.05, until=60.0)
    # A downloader's first round trip already waited behind others, so it reads a little room:
    # the budget swings a few pieces above its floor and back, never far.
    assert sum(budgets) / len(budgets) <= 1.4 * 12 and max(budgets) <= 2 * 12


def test_super_seeding_pays_only_where_the_origin_s_upload_is_the_binding_term_of_the_bound():
    """Kumar & Ross: T_min = max(F/u_s, F/min d_i, N F/(u_s + sum u_i)). Super-seeding makes the seed
    send each piece about once, which reaches F/u_s; where another term binds, it holds back an
    origin that could send more (simulated N = 100, a 1 Gbit/s origin: 2.41x the bound without,
    2.72x with)."""
    mbit = 1e6 / 8
    # bench/shards.py swarm's scenario: every uplink 10 Mbit/s, so the origin's is the binding term.
    for n in (8, 16, 24):
        assert super_seeding_pays(10 * mbit, [10 * mbit] * n, [10 * mbit] * n)
    # Issue 46's scale scenario: a 1 Gbit/s origin, 10 % of 100 downloaders at 1 Gbit/s, the rest 10-100.
    ups = [1000 * mbit] * 10 + [(10 + i) * mbit for i in range(90)]
    assert not super_seeding_pays(1000 * mbit, ups, [300 * mbit] * 100)
    # A fast origin and two slow downlinks: the downloads bind, the origin just sends to both.
    assert not super_seeding_pays(1000 * mbit, [100 * mbit] * 2, [100 * mbit] * 2)
    # Where the origin's term ties with the swarm's, it still binds: every byte it sends counts.
    assert super_seeding_pays(10 * mbit, [5 * mbit, 5 * mbit], [1000 * mbit] * 2) is True
    assert super_seeding_pays(10 * mbit, [], []) is True  # nobody to hold back from


def test_super_seeding_pays_is_defined_for_zero_rates_and_no_downloads():
    """Rates measured as 0 (a stalled link) or no download rates at all must decide, not raise."""
    assert super_seeding_pays(0.0, [1e6], [1e6])  # an origin that cannot send: nothing to weigh
    assert not super_seeding_pays(1e6, [1e6], [0.0])  # a download that takes nothing binds
    assert super_seeding_pays(1e6, [1e6], [])
