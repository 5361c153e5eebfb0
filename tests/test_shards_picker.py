"""Pure tests of the piece picker and the super-seeder: no network, time passed in."""

from __future__ import annotations

import random
from collections import Counter

from node.shards.picker import Cancel, Picker, PickerParams, Request
from node.shards.superseed import SeedMode, SuperSeeder

B = 16 * 1024  # block size used in these tests


def picker(pieces: int, blocks_per_piece: int = 1, seed: int = 0, have=(), **kw) -> Picker:
    params = PickerParams(block_size=B, **kw)
    return Picker([B * blocks_per_piece] * pieces, params, have=set(have), rng=random.Random(seed))


def by_peer(reqs: list[Request]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in reqs:
        out.setdefault(r.peer, []).append(r.piece)
    return out


def test_rarest_piece_first_once_a_few_pieces_are_verified() -> None:
    p = picker(10, have={0, 1, 2, 3}, initial_depth=1)
    p.on_bitfield("A", set(range(10)))
    p.on_bitfield("B", set(range(9)))
    p.on_bitfield("C", set(range(8)))
    got = by_peer(p.poll(0.0).requests)
    assert got["A"] == [9]  # only A has 9: rarest
    assert got["B"] == [8]  # 8 is on two peers, 4..7 on three
    assert got["C"][0] in {4, 5, 6, 7}


def test_ties_and_first_pieces_are_random() -> None:
    firsts = Counter()
    for seed in range(40):
        p = picker(8, seed=seed, initial_depth=1)
        p.on_bitfield("A", set(range(8)))
        p.on_bitfield("B", {0})  # piece 0 is the most common; not rarest, still a random first pick
        firsts[p.poll(0.0).requests[0].piece] += 1
    assert len(firsts) >= 5  # spread over the pieces, not always the lowest index


def test_blocks_of_started_pieces_come_first() -> None:
    p = picker(5, blocks_per_piece=4, initial_depth=3)
    p.on_bitfield("A", set(range(5)))
    reqs = p.poll(0.0).requests
    assert len({r.piece for r in reqs}) == 1 and [r.offset for r in reqs] == [0, B, 2 * B]


def test_queue_depth_follows_measured_rate() -> None:
    p = picker(200, initial_depth=4, max_depth=64)
    p.on_bitfield("A", set(range(200)))
    t = 0.0
    assert len(p.poll(t).requests) == 4
    rate = 1024 * 1024  # 1 MiB/s: one 16 KiB block every 1/64 s
    for _ in range(40):
        r = next(iter(p.peers["A"].in_flight))
        t += B / rate
        keep, _ = p.on_block("A", r[0], r[1], B, t)
        assert keep
        p.on_piece_verified(r[0])
        p.poll(t)
    assert abs(p.rate_of("A") - rate) / rate < 0.05
    assert p.depth_of("A") == 64  # ceil(1 MiB/s * 3 s / 16 KiB) = 192, clamped to max_depth
    p = picker(10, max_depth=64)
    p.on_bitfield("S", set(range(10)))
    p.peers["S"].rate = 16 * 1024  # one block per second -> 3 s of rate = 3 blocks
    assert p.depth_of("S") == 3


def test_peer_choice_is_weighted_by_throughput() -> None:
    wins = Counter()
    for seed in range(300):
        p = picker(1, seed=seed, have=set())
        p.on_bitfield("fast", {0})
        p.on_bitfield("slow", {0})
        p.peers["fast"].rate, p.peers["slow"].rate = 9e6, 1e6
        wins[p.poll(0.0).requests[0].peer] += 1  # one block: one winner
    assert 240 <= wins["fast"] <= 295  # expected 270 of 300 (90%)


def test_endgame_duplicates_then_cancels() -> None:
    p = picker(2, blocks_per_piece=2, initial_depth=4)
    p.on_bitfield("A", {0, 1})
    first = p.poll(0.0).requests
    assert len(first) == 4 and p.in_endgame  # every block is in flight to A
    p.on_bitfield("B", {0, 1})
    dup = p.poll(0.1).requests
    assert {(r.piece, r.offset) for r in dup} == {(r.piece, r.offset) for r in first}
    assert all(r.peer == "B" for r in dup)
    keep, acts = p.on_block("A", 0, 0, B, 0.2)
    assert keep and acts.cancels == [Cancel("B", 0, 0, B)]
    keep, _ = p.on_block("B", 0, 0, B, 0.3)  # the cancel raced the data: dropped quietly
    assert not keep and not p.is_banned("B", 0.3)


def test_bad_pieces_ban_after_threshold_and_parole_isolates() -> None:
    p = picker(6, blocks_per_piece=2, have=set(), initial_depth=2, random_first=0)
    p.on_bitfield("liar", set(range(6)))
    reqs = p.poll(0.0).requests
    assert len({r.piece for r in reqs}) == 1
    for r in reqs:
        p.on_block("liar", r.piece, r.offset, r.length, 0.1)
    assert p.piece_ready(reqs[0].piece)
    acts = p.on_piece_failed(reqs[0].piece, 0.2)
    assert acts.banned == [] and p.strikes["liar"] == 1.0
    p.on_bitfield("honest", set(range(6)))
    # On parole the failed piece goes to one peer only.
    reqs = [r for r in p.poll(0.3).requests if r.piece == reqs[0].piece]
    assert len({r.peer for r in reqs}) == 1
    # A second bad piece from the liar alone: banned, nothing more asked of it.
    p = picker(4, blocks_per_piece=1, initial_depth=1, min_depth=1, max_depth=1, random_first=0)
    p.on_bitfield("liar", set(range(4)))
    for k in range(2):
        (r,) = p.poll(float(k)).requests
        p.on_block("liar", r.piece, r.offset, r.length, k + 0.1)
        acts = p.on_piece_failed(r.piece, k + 0.2)
    assert acts.banned == [("liar", "bad-piece")]
    assert p.is_banned("liar", 100.0) and not p.is_banned("liar", 2.2 + 600.0)
    assert p.poll(3.0).requests == []


def test_smart_ban_convicts_only_the_peer_whose_bytes_differ() -> None:
    # A and B each deliver one block of the same piece; B's is bad.
    p = picker(1, blocks_per_piece=2, initial_depth=1, max_depth=1, min_depth=1, ban_threshold=1.0)
    p.on_bitfield("A", {0})
    p.on_bitfield("B", {0})
    got = p.poll(0.0).requests
    assert {r.peer for r in got} == {"A", "B"}
    for r in got:
        p.on_block(r.peer, r.piece, r.offset, r.length, 0.1)
    sent_by = {r.offset: r.peer for r in got}
    bad = {0: b"good0" if sent_by[0] == "A" else b"evil0", B: b"good1" if sent_by[B] == "A" else b"evil1"}
    acts = p.on_piece_failed(0, 0.2, bad)
    assert acts.banned == [] and p.strikes == {}  # nobody blamed yet
    for r in p.poll(0.3).requests:  # re-fetched on parole from a single peer
        p.on_block(r.peer, r.piece, r.offset, r.length, 0.4)
    acts = p.on_piece_verified(0, 0.5, {0: b"good0", B: b"good1"})
    assert acts.banned == [("B", "bad-piece")] and "A" not in p.strikes


def test_wrong_length_bans_at_once() -> None:
    p = picker(2, initial_depth=1)
    p.on_bitfield("A", {0, 1})
    (r,) = p.poll(0.0).requests
    keep, acts = p.on_block("A", r.piece, r.offset, B - 1, 0.1)
    assert not keep and acts.banned == [("A", "wrong-length")]


def test_timeouts_reissue_elsewhere_then_drop_unresponsive() -> None:
    p = picker(20, initial_depth=2, min_depth=1, request_timeout=5.0)
    p.on_bitfield("mute", set(range(20)))
    first = p.poll(0.0).requests
    assert len(first) == 2
    p.on_bitfield("ok", set(range(20)))
    acts = p.poll(5.0)
    assert {(c.peer, c.piece) for c in acts.cancels} == {("mute", r.piece) for r in first}
    assert {r.piece for r in acts.requests} >= {r.piece for r in first}  # stuck pieces asked again
    assert any(r.peer == "ok" for r in acts.requests)
    assert p.depth_of("mute") == 1  # snubbed: minimum queue until it answers
    p.on_peer_gone("ok")
    assert p.poll(10.0).dropped == []
    acts = p.poll(15.0)
    acts.extend(p.poll(20.0))
    # Dropped, not banned: a starved honest peer looks the same as a silent one from here.
    assert acts.dropped == ["mute"] and acts.banned == []
    assert not p.is_banned("mute", 20.0)
    assert p.poll(21.0).requests == []  # it is forgotten: nothing is asked of it until it is back
    p.on_bitfield("mute", set(range(20)))
    assert p.poll(22.0).requests  # a new session starts it afresh


def test_a_later_request_times_out_on_its_own_clock_once_the_older_ones_are_answered() -> None:
    p = picker(20, initial_depth=1, request_timeout=5.0)
    p.on_bitfield("A", set(range(20)))
    first = p.poll(0.0).requests[0]
    p.on_block("A", first.piece, first.offset, first.length, 3.0)
    second = p.poll(3.0).requests  # sent at 3.0, after the first was answered
    assert second and p.next_deadline() == 8.0
    assert p.poll(7.9).cancels == []  # (what it sends at 7.9 is not late at 8.0)
    assert {(c.piece, c.offset) for c in p.poll(8.0).cancels} == {(r.piece, r.offset) for r in second}


def test_peer_gone_returns_its_blocks() -> None:
    p = picker(1, blocks_per_piece=1, initial_depth=1)
    p.on_bitfield("A", {0})
    (r,) = p.poll(0.0).requests
    p.on_peer_gone("A")
    p.on_bitfield("B", {0})
    assert p.poll(0.1).requests == [Request("B", 0, 0, B)]


def test_resume_never_requests_verified_pieces() -> None:
    p = picker(10, have={0, 2, 4, 6, 8}, initial_depth=10)
    p.on_bitfield("A", set(range(10)))
    assert sorted(r.piece for r in p.poll(0.0).requests) == [1, 3, 5, 7, 9]
    for piece in (1, 3, 5, 7, 9):
        p.on_block("A", piece, 0, B, 0.1)
        p.on_piece_verified(piece)
    assert p.complete and p.poll(0.2).requests == []


def fast(p: Picker, peer: str, rate: float = 64 * B) -> None:
    """Give ``peer`` a measured rate: 64 blocks/s keeps 192 blocks (max_depth) in flight."""
    p.peers[peer].rate = rate


def test_a_fast_peer_gets_a_new_piece_in_one_request_once_it_has_room_for_all_of_it() -> None:
    p = picker(8, blocks_per_piece=4, initial_depth=3, max_depth=8, random_first=0)
    p.on_bitfield("A", set(range(8)))
    first = p.poll(0.0).requests  # not measured yet: one block per request
    assert [r.length for r in first] == [B, B, B]
    fast(p, "A")
    kept, _ = p.on_block("A", first[0].piece, first[0].offset, B, 0.1)
    assert kept == [(first[0].offset, B)]
    reqs = p.poll(0.1).requests
    # The started piece's last block first (one block), then new pieces whole: 4 + 1 + 2 in flight
    # leaves one slot, too few for a piece, so nothing more is asked until 4 are free.
    assert [r.length for r in reqs] == [B, 4 * B]
    assert reqs[1].offset == 0 and p.in_flight("A") == 7
    whole = reqs[1].piece
    assert p.poll(0.2).requests == []
    kept, _ = p.on_block("A", whole, 0, 4 * B, 0.3)
    assert kept == [(0, B), (B, B), (2 * B, B), (3 * B, B)] and p.piece_ready(whole)
    assert p.contributors(whole) == {"A": 4 * B}
    # One rate sample for the piece: 4 blocks over the 0.2 s A was busy with them, not 1 ms per block.
    assert p.rate_of("A") < 64 * B


def test_whole_piece_data_of_the_wrong_length_bans() -> None:
    for length in (B, 4 * B - 1, 4 * B + 1):
        p = picker(2, blocks_per_piece=4, initial_depth=8, max_depth=8)
        p.on_bitfield("liar", {0, 1})
        fast(p, "liar")
        (r, *_) = p.poll(0.0).requests
        assert r.length == 4 * B
        kept, acts = p.on_block("liar", r.piece, 0, length, 0.1)
        assert kept == [] and acts.banned == [("liar", "wrong-length")]
        assert p.peers["liar"].in_flight == {}  # its blocks are free for others
    # A whole piece's bytes in answer to a one-block request are malformed too.
    p = picker(2, blocks_per_piece=4, initial_depth=1)
    p.on_bitfield("liar", {0, 1})
    (r,) = p.poll(0.0).requests
    kept, acts = p.on_block("liar", r.piece, 0, 4 * B, 0.1)
    assert kept == [] and acts.banned == [("liar", "wrong-length")]


def test_a_rejected_whole_piece_request_frees_every_block() -> None:
    p = picker(1, blocks_per_piece=4, initial_depth=8, max_depth=8)
    p.on_bitfield("A", {0})
    fast(p, "A")
    (r,) = p.poll(0.0).requests
    p.on_reject("A", 0, 0)
    assert p.in_flight("A") == 0 and not p.peer_has("A", 0)
    p.on_bitfield("B", {0})
    assert sorted(q.offset for q in p.poll(0.1).requests) == [0, B, 2 * B, 3 * B]


def test_a_timed_out_whole_piece_request_is_cancelled_once() -> None:
    p = picker(2, blocks_per_piece=4, initial_depth=8, max_depth=8, request_timeout=5.0)
    p.on_bitfield("A", {0, 1})
    fast(p, "A")
    reqs = p.poll(0.0).requests
    assert [r.length for r in reqs] == [4 * B, 4 * B]
    acts = p.poll(5.0)
    assert sorted((c.piece, c.offset, c.length) for c in acts.cancels) == [(0, 0, 4 * B), (1, 0, 4 * B)]
    # The data a cancel raced arrives after all: dropped, nobody banned, even though block 0
    # of that piece is now asked of A again (snubbed: one block at a time).
    again = acts.requests[0]
    assert (again.peer, again.offset, again.length) == ("A", 0, B)
    kept, acts = p.on_block("A", again.piece, 0, 4 * B, 5.2)
    assert kept == [] and acts.banned == [] and not p.is_banned("A", 5.2)
    kept, _ = p.on_block("A", again.piece, 0, B, 5.3)  # the block asked for since is taken as usual
    assert kept == [(0, B)]


def test_endgame_takes_each_block_of_a_whole_piece_once() -> None:
    p = picker(1, blocks_per_piece=4, initial_depth=8, max_depth=8)
    p.on_bitfield("A", {0})
    fast(p, "A")
    (r,) = p.poll(0.0).requests
    assert r.length == 4 * B and p.in_endgame
    p.on_bitfield("B", {0})
    dup = p.poll(0.1).requests
    assert sorted(q.offset for q in dup) == [0, B, 2 * B, 3 * B] and {q.peer for q in dup} == {"B"}
    kept, acts = p.on_block("B", 0, 2 * B, B, 0.2)
    # A still owes the other three blocks: its one request cannot be cut, so no cancel goes to it.
    assert kept == [(2 * B, B)] and acts.cancels == []
    kept, acts = p.on_block("A", 0, 0, 4 * B, 0.3)
    assert kept == [(0, B), (B, B), (3 * B, B)]
    assert sorted(c.offset for c in acts.cancels) == [0, B, 3 * B] and {c.peer for c in acts.cancels} == {"B"}
    assert p.contributors(0) == {"A": 3 * B, "B": B} and p.piece_ready(0)


def test_super_seeder_sends_each_piece_once_two_at_a_time() -> None:
    s = SuperSeeder(12, in_transit=2, stall_seconds=10.0, rng=random.Random(1))
    shown: list[tuple[str, int]] = []
    for p in "abc":
        shown += s.on_bitfield(p, set(), 0.0)
    assert len(shown) == 2 and len({piece for _, piece in shown}) == 2  # two pieces out, not six
    t = 0.0
    while shown and s.mode is SeedMode.SUPER:  # recipients report their piece; each report frees a slot
        peer, piece = shown.pop(0)
        t += 0.1
        new = s.on_have(peer, piece, t)
        assert s.outstanding() <= 2
        # The next piece goes to a downloader with nothing in transit from us.
        for p, _ in new:
            assert not s.revealed_to(p) - {x for q, x in new if q == p}
        shown += new
    assert s.sent == [1] * 12  # every piece went out exactly once; the rest is peer to peer
    # Everything is held by someone: the seeder turns ordinary seed (tests/test_shards_superseed.py).
    counts = Counter(len(d.holds) for d in s.peers.values())
    assert sum(k * v for k, v in counts.items()) == 12 and max(counts) - min(counts) <= 1  # spread evenly


def test_super_seeder_resends_stalled_or_orphaned_pieces() -> None:
    s = SuperSeeder(1, in_transit=1, stall_seconds=10.0, rng=random.Random(2))
    ((first, pa),) = s.on_bitfield("a", set(), 0.0)
    assert s.on_bitfield("b", set(), 0.0) == []  # budget used: b waits
    assert s.reveal(5.0) == []  # a's piece is in transit, not stalled yet
    again = s.reveal(10.0)  # a sat on it for 10 s: it goes out again, to b
    assert again == [("b", pa)]
    assert s.sent[pa] == 2
    gone = s.on_peer_gone("a", 11.0)
    assert s.sent[pa] == 1 and gone == []  # a never delivered; the second copy is the one that counts


def test_super_seeder_gives_a_gone_peers_piece_to_another() -> None:
    s = SuperSeeder(4, in_transit=1, rng=random.Random(2))
    ((_, piece),) = s.on_bitfield("x", set(), 0.0)
    s.on_bitfield("y", set(), 0.0)
    assert s.on_peer_gone("x", 1.0) == [("y", piece)] or s.sent[piece] == 0


def test_a_banned_peers_delivered_blocks_are_fetched_again() -> None:
    p = picker(3, blocks_per_piece=2, initial_depth=1, max_depth=1, min_depth=1, random_first=0)
    p.on_bitfield("liar", {0, 1, 2})
    (r,) = p.poll(0.0).requests
    p.on_block("liar", r.piece, r.offset, r.length, 0.1)  # half of a piece from the liar
    p.on_misbehaved("liar", 0.2, "test")
    p.on_bitfield("honest", {0, 1, 2})
    assert p.poll(0.3).requests == [Request("honest", r.piece, 0, B)]  # the liar's block is asked again



def test_a_ban_leaves_a_complete_piece_to_its_hash_check() -> None:
    """A piece whose blocks have all arrived waits for the writer thread's hash check: a ban of one
    of its senders meanwhile does not reset it (the check settles who lied, on_piece_failed)."""
    p = picker(1, blocks_per_piece=2, initial_depth=2, max_depth=2, min_depth=2, random_first=0)
    p.on_bitfield("a", {0})
    reqs = p.poll(0.0).requests
    assert len(reqs) == 2
    for r in reqs:
        p.on_block("a", r.piece, r.offset, r.length, 0.1)
    assert p.piece_ready(0)
    p.on_misbehaved("a", 0.2, "test")
    assert p.piece_ready(0) and p.contributors(0) == {"a": 2 * B}
    p.on_piece_verified(0, 0.3)
    assert p.complete

def test_super_seeder_frees_a_slot_when_a_piece_is_written_not_when_it_is_reported() -> None:
    s = SuperSeeder(10, in_transit=2, max_unreported=4, rng=random.Random(3))
    shown = [x for p in "abcdef" for x in s.on_bitfield(p, set(), 0.0)]
    assert len(shown) == 2 and s.writing() == 2
    # Our last byte of the first piece is in its recipient's stream: the next piece goes out now,
    # to a downloader with nothing in transit from us, while the first is still draining.
    (peer, piece) = shown[0]
    new = s.on_sent(peer, piece, 0.1)
    assert len(new) == 1 and new[0][0] not in {p for p, _ in shown}
    assert s.writing() == 2 and s.outstanding() == 3
    shown += new
    k = 1
    while k < len(shown):  # every other piece written too
        shown += s.on_sent(*shown[k], 0.2)
        k += 1
    # Written but unreported pieces are bounded too: deep send buffers cannot fan the seed out.
    assert s.outstanding() == 4 and s.writing() == 0 and len(shown) == 4
    assert s.on_sent(peer, piece, 0.3) == []  # a second report of the same piece changes nothing
    more = s.on_have(peer, piece, 0.4)
    assert len(more) == 1 and s.outstanding() == 4


def test_super_seeder_gives_the_next_piece_to_the_downloader_with_least_forwarding_left() -> None:
    s = SuperSeeder(8, in_transit=1, max_unreported=1, rng=random.Random(6))
    ((_, x),) = s.on_bitfield("a", set(), 0.0)
    assert s.on_bitfield("b", set(), 0.0) == [] and s.on_bitfield("c", set(), 0.0) == []
    # a got x from us and nobody else has it: a owes 2 uploads, b and c owe nothing.
    ((q, y),) = s.on_have("a", x, 1.0)
    assert q != "a" and s.backlog("a") == 2
    ((r, z),) = s.on_have(q, y, 2.0)
    assert r not in ("a", q)
    # Everyone owes 2 now. Once b and c have a's piece, a owes nothing: the next piece is a's,
    # although it holds no fewer pieces than the others.
    s.on_have("b", x, 3.0)
    s.on_have("c", x, 3.0)
    assert s.backlog("a") == 0
    ((nxt, _),) = s.on_have(r, z, 4.0)
    assert nxt == "a"


def _counting_picks(p: Picker) -> list[str]:
    """The peers ``p._pick_block`` is tried for, in order (wraps the instance's method)."""
    tried: list[str] = []
    real = p._pick_block

    def counted(peer: str, slots: int):
        tried.append(peer)
        return real(peer, slots)

    p._pick_block = counted
    return tried


def test_a_poll_does_not_try_peers_that_hold_only_pieces_already_being_fetched() -> None:
    """A swarm's usual state: most peers hold a few pieces, all already asked of someone else.
    Each poll (one per wake-up) tried every one of them for a block first."""
    p = picker(20, initial_depth=4)
    p.on_bitfield("A", set(range(20)))
    asked = {r.piece for r in p.poll(0.0).requests}
    assert len(asked) == 4
    for k in range(15):
        p.on_bitfield(f"P{k}", set(asked))  # only what A is already fetching; not endgame yet
    tried = _counting_picks(p)
    assert p.poll(0.1).requests == [] and tried == []


def test_peers_ruled_out_of_a_poll_still_duplicate_once_it_starts_the_endgame() -> None:
    p = picker(2, initial_depth=1)
    p.on_bitfield("A", {0})
    assert [(r.peer, r.piece) for r in p.poll(0.0).requests] == [("A", 0)]
    p.on_bitfield("B", {1})
    p.on_bitfield("C", {0})  # only a piece in flight from A: nothing for C until B takes piece 1
    got = sorted((r.peer, r.piece) for r in p.poll(0.1).requests)
    assert got == [("B", 1), ("C", 0)]  # B's pick began the endgame; C duplicates in the same poll


def test_a_peer_is_ruled_out_of_a_poll_only_when_no_block_could_be_picked_for_it() -> None:
    """The cheap test that skips a peer must never skip one the full pick would have served:
    random swarms (partial holdings, started, failed and verified pieces, parole, endgame)."""
    import copy

    checked = skipped = 0
    for seed in range(60):
        rng = random.Random(seed)
        p = picker(12, blocks_per_piece=rng.choice([1, 3]), seed=seed, initial_depth=rng.choice([1, 2, 4]))
        peers = [f"P{k}" for k in range(5)]
        for peer in peers:
            p.on_bitfield(peer, {i for i in range(12) if rng.random() < 0.5})
        t = 0.0
        for _ in range(25):
            t += 0.1
            endgame = p.in_endgame
            open_pieces = {i for i, ap in p.active.items() if any(s.value == "missing" for s in ap.states)}
            for peer, st in p.peers.items():
                slots = p.depth_of(peer) - len(st.in_flight)
                if slots <= 0 or p.is_banned(peer, t):
                    continue
                checked += 1
                if not p._could_offer(st, open_pieces, endgame):
                    skipped += 1
                    assert copy.deepcopy(p)._pick_block(peer, slots) is None, (seed, peer)
            reqs = p.poll(t).requests
            for r in rng.sample(reqs, k=len(reqs) // 2):  # some answered, the rest stay in flight
                kept, _ = p.on_block(r.peer, r.piece, r.offset, r.length, t)
                if kept and p.piece_ready(r.piece):
                    if rng.random() < 0.15:
                        p.on_piece_failed(r.piece, t)  # on parole from now on
                    else:
                        p.on_piece_verified(r.piece, t)
            if rng.random() < 0.3:
                p.on_have(rng.choice(peers), rng.randrange(12))
    assert skipped > 100 and checked > skipped  # the claim was exercised, both ways


def _bags_match(p: Picker) -> None:
    """The picker's bags hold exactly the unstarted pieces, each under its availability."""
    by_level: dict[int, set[int]] = {}
    for i in p._unstarted:
        by_level.setdefault(p.availability[i], set()).add(i)
    assert {lvl: set(bag.items) for lvl, bag in p._rarest.items()} == by_level
    for bag in p._rarest.values():
        assert all(bag.items[k] == x for x, k in bag.index.items()) and len(bag.index) == len(bag.items)


def test_the_new_piece_is_one_of_the_rarest_a_peer_holds_drawn_evenly_among_them() -> None:
    """Rarest first with random ties, kept in bags by availability instead of a scan per pick:
    random swarms (seeds, sparse peers, peers leaving, rejects, pieces started and verified)."""
    for seed in range(40):
        rng = random.Random(seed)
        p = picker(64, seed=seed, initial_depth=rng.choice([1, 3]), random_first=0)
        peers = [f"P{k}" for k in range(6)]
        for k, peer in enumerate(peers):
            share = 1.0 if k == 0 else rng.random()
            p.on_bitfield(peer, {i for i in range(64) if rng.random() < share})
        t = 0.0
        for _ in range(12):
            t += 0.1
            _bags_match(p)
            for peer, st in p.peers.items():
                held = p._unstarted & st.pieces
                if held:
                    x = p._rarest_held(st.pieces)
                    assert x in held and p.availability[x] == min(p.availability[i] for i in held), seed
            reqs = p.poll(t).requests
            for r in rng.sample(reqs, k=len(reqs) // 2):
                kept, _ = p.on_block(r.peer, r.piece, r.offset, r.length, t)
                if kept and p.piece_ready(r.piece):
                    p.on_piece_verified(r.piece, t)
            event = rng.random()
            if event < 0.3:
                p.on_have(rng.choice(peers), rng.randrange(64))
            elif event < 0.4 and reqs:
                r = reqs[-1]
                p.on_reject(r.peer, r.piece, r.offset)
            elif event < 0.5 and len(p.peers) > 1:
                p.on_peer_gone(rng.choice(list(p.peers)))
        _bags_match(p)
    # Ties are drawn evenly: four pieces on one peer each, every one of them comes up.
    counts = Counter()
    for seed in range(200):
        p = picker(8, seed=seed, random_first=0)
        p.on_bitfield("A", set(range(8)))
        p.on_bitfield("B", {4, 5, 6, 7})
        counts[p._rarest_held(p.peers["A"].pieces)] += 1
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 25


def test_the_super_seeders_budgets_are_bytes_whatever_the_piece_size():
    small = SuperSeeder.for_pieces(256, 128 << 10)  # 512 KiB written, 1 MiB more unreported
    assert (small.in_transit, small.max_unreported) == (4, 12)
    large = SuperSeeder.for_pieces(256, 4 << 20)  # never fewer than 2 pieces in each
    assert (large.in_transit, large.max_unreported) == (2, 4)


def test_super_seeder_shows_again_a_piece_that_never_spread_from_the_one_that_holds_it() -> None:
    """A NAT'd downloader whose only direct peer is the origin holds its piece for good: nobody can
    open a transfer session to it. Found by simulation (bench/sim_shards.py, issue 46): 39 of 40
    downloaders waited forever for the one piece it was shown."""
    s = SuperSeeder(1, in_transit=1, stall_seconds=10.0, rng=random.Random(2), hand_over=False)
    ((first, piece),) = s.on_bitfield("a", set(), 0.0)
    assert s.on_bitfield("b", set(), 0.0) == []
    s.on_sent(first, piece, 0.5)
    assert s.on_have(first, piece, 1.0) == []  # held, by the one we gave it to
    assert s.reveal(5.0) == []  # not stalled yet: it may be spreading
    other = "b" if first == "a" else "a"
    assert s.reveal(10.0) == [(other, piece)]  # no one got it from its holder: shown to another


def test_super_seeder_leaves_alone_a_piece_that_spread() -> None:
    s = SuperSeeder(1, in_transit=1, stall_seconds=10.0, rng=random.Random(2))
    ((first, piece),) = s.on_bitfield("a", set(), 0.0)
    s.on_bitfield("b", set(), 0.0)
    s.on_sent(first, piece, 0.5)
    s.on_have(first, piece, 1.0)
    s.on_have("b" if first == "a" else "a", piece, 3.0)  # the other got it from the first
    assert s.reveal(100.0) == [] and s.sent[piece] == 1


def test_a_request_times_out_at_the_deadline_the_picker_gave_whatever_the_float_rounding() -> None:
    """The download polls again at ``next_deadline()``; a request sent at 510.588... with a 10 s
    timeout was not late there ((t + 10) - t < 10 in floats), so the deadline stayed now and the
    loop spun without time passing (found by the simulator, issue 46: a virtual clock never moves)."""
    sent = 510.5880801746119
    assert (sent + 10.0) - sent < 10.0  # the rounding this test is about
    p = picker(4, initial_depth=1, request_timeout=10.0)
    p.on_bitfield("A", set(range(4)))
    (req,) = p.poll(sent).requests
    due = p.next_deadline()
    assert due == sent + 10.0
    acts = p.poll(due)
    assert [(c.piece, c.offset) for c in acts.cancels] == [(req.piece, req.offset)]
    assert p.next_deadline() > due


def test_super_seeder_shows_a_stalled_piece_the_downloader_lacks_not_only_the_most_stalled_one() -> None:
    """Only the most stalled piece was considered: when the downloader that lacked a piece held
    that one, nothing was shown, and a NAT'd downloader reachable only by the origin waited
    forever (bench/sim_shards.py, N = 100, issue 46)."""
    s = SuperSeeder(2, in_transit=1, stall_seconds=10.0, rng=random.Random(3), hand_over=False)
    ((_, x),) = s.on_bitfield("b", set(), 0.0)  # x to b
    assert s.on_bitfield("a", set(), 0.5) == []  # budget used
    ((_, y),) = [r for r in s.on_sent("b", x, 1.0) if r[0] == "a"]  # y to a, with nothing from us
    s.on_sent("a", y, 1.5)
    s.on_have("a", y, 2.0)
    s.on_have("b", x, 2.0)
    s.on_peer_gone("a", 3.0)  # y is held by no one now; x by b, who got it from us
    assert s.reveal(30.0) == [("b", y)]  # x is the most stalled, but b holds it
