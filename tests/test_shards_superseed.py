"""The super-seeder's hand-over to ordinary seeding (node/shards/superseed.py; issue 46 item 3)."""

from __future__ import annotations

import random

from node.shards.superseed import SeedMode, SuperSeeder


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
