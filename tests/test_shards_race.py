"""A peer much faster than the one a block waits on is asked for it too (node/shards/picker.py,
``race_factor``; issue 46 item 3). Pure: no network, time passed in.

Why: in the simulated swarm of issue 46 (10 % of peers at 1 Gbit/s, the rest 10-100 Mbit/s) a
downloader asked the slow peers for ~3 s of their rate each, and by the time a fast peer held the
same pieces they were all in those queues: the fast peers had nothing left to be asked for and
uploaded at 15-35 % of their link. Measured rates are all the picker trusts: a peer's claims (its
bitfield, its record) never make it race, and the request it races stays with the slower peer, so a
racer that does not deliver delays nothing.
"""

from __future__ import annotations

import copy
import random

from node.shards.picker import Cancel, Picker, PickerParams, Request

B = 16 * 1024
NOBODY = 9  # a piece no peer holds: the download is never in its endgame here


def picker(**kw) -> Picker:
    return Picker([B] * 10, PickerParams(block_size=B, initial_depth=1, random_first=0, **kw),
                  rng=random.Random(0))


def measured(p: Picker, peer: str, pieces: set[int], seconds: float) -> float:
    """``peer`` holds ``pieces``; one block asked of it arrives after ``seconds``: its rate is measured.
    Returns the time it arrived."""
    p.on_bitfield(peer, pieces)
    [r] = [r for r in p.poll(0.0).requests if r.peer == peer]
    p.on_block(peer, r.piece, r.offset, r.length, seconds)
    p.on_piece_verified(r.piece, seconds)
    return seconds


def waiting_on(p: Picker, peer: str) -> set[int]:
    return {piece for st in [p.peers[peer]] for piece, _ in st.in_flight}


def slow_and_fast(fast_seconds: float) -> tuple[Picker, set[int]]:
    """S (one block in 1 s) has pieces 0-4 queued; F (one block in ``fast_seconds``) holds piece 5
    only, then tells us it holds the pieces queued at S."""
    p = picker()
    p.on_bitfield("S", {0, 1, 2, 3, 4})
    p.on_bitfield("F", {5})
    reqs = {r.peer: r for r in p.poll(0.0).requests}
    s, f = reqs["S"], reqs["F"]
    p.on_block("F", f.piece, f.offset, f.length, fast_seconds)
    p.on_piece_verified(f.piece, fast_seconds)
    p.on_block("S", s.piece, s.offset, s.length, 1.0)
    p.on_piece_verified(s.piece, 1.0)
    p.poll(1.0)  # S, measured, is asked for ~3 s of its rate
    queued = waiting_on(p, "S")
    assert queued and not p.in_endgame
    for piece in queued:
        p.on_have("F", piece)
    return p, queued


def test_a_peer_four_times_faster_is_asked_for_blocks_queued_at_a_slow_one() -> None:
    p, queued = slow_and_fast(fast_seconds=0.01)
    raced = p.poll(1.1).requests
    assert raced and {r.peer for r in raced} == {"F"} and {r.piece for r in raced} <= queued
    assert waiting_on(p, "S") == queued  # S keeps them: F is one more copy, not a replacement
    first = raced[0]
    kept, acts = p.on_block("F", first.piece, first.offset, first.length, 1.15)
    assert kept == [(first.offset, first.length)]
    assert acts.cancels == [Cancel("S", first.piece, first.offset, first.length)]  # S need not send it


def test_a_peer_less_than_four_times_faster_races_nothing() -> None:
    p, _ = slow_and_fast(fast_seconds=0.4)  # 2.5x S's rate
    assert p.poll(1.1).requests == []


def test_a_racer_that_does_not_deliver_delays_nothing() -> None:
    """F races, then goes silent: S's copy completes the piece, and F's request is cancelled."""
    p, queued = slow_and_fast(fast_seconds=0.01)
    raced = {r.piece: r for r in p.poll(1.1).requests}
    piece = next(iter(raced))
    [offset] = [o for q, o in p.peers["S"].in_flight if q == piece]
    kept, acts = p.on_block("S", piece, offset, B, 2.0)
    assert kept == [(offset, B)] and p.piece_ready(piece)
    assert acts.cancels == [Cancel("F", piece, raced[piece].offset, raced[piece].length)]


def test_a_peer_that_claims_every_piece_but_delivers_slowly_gains_no_race() -> None:
    """What a peer claims is not what it delivers. L tells us it holds every piece (the most a
    bitfield can claim) and sends as slowly as honest H: it is asked for what H would be, never for
    blocks queued at a third peer, S; H's place in the same swarm gets the same requests."""
    def swarm(claims_all: bool) -> list[Request]:
        p = picker()
        measured(p, "S", {0, 1, 2, 3}, 1.0)
        p.on_bitfield("X", {4, 5, 6, 7, 8})
        p.on_bitfield("L", set(range(10)) if claims_all else {0, 1, 2, 3, 4, 5, 6, 7, 8})
        got = [r for r in p.poll(1.0).requests if r.peer == "L"]
        for r in got:
            p.on_block("L", r.piece, r.offset, r.length, 2.0)  # as slow as S
            p.on_piece_verified(r.piece, 2.0)
        return [r for r in p.poll(2.0).requests if r.peer == "L" and r.piece in waiting_on(p, "S")]

    assert swarm(claims_all=True) == swarm(claims_all=False) == []


def test_a_fast_peer_that_turned_silent_races_nothing() -> None:
    """F was measured fast, then let a request time out: snubbed, it races no one until a block of
    it arrives again (a peer cannot bank a fast start)."""
    p = picker()
    p.on_bitfield("S", {0, 1, 2, 3, 4})
    p.on_bitfield("F", {5, 6})
    reqs = {r.peer: r for r in p.poll(0.0).requests}
    for peer, at in (("F", 0.01), ("S", 1.0)):
        r = reqs[peer]
        p.on_block(peer, r.piece, r.offset, r.length, at)
        p.on_piece_verified(r.piece, at)
    late = [r for r in p.poll(1.0).requests if r.peer == "F"]  # F's piece 6: it never answers
    t = 1.0
    for piece, o in list(p.peers["S"].in_flight):  # S answers, one block a second
        t += 1.0
        p.on_block("S", piece, o, B, t)
        p.on_piece_verified(piece, t)
    p.poll(t)  # S is asked again: its new requests run past F's deadline
    queued = waiting_on(p, "S")
    assert late and queued and not p.in_endgame
    for piece in queued:
        p.on_have("F", piece)
    before = copy.deepcopy(p)
    assert {r.peer for r in before.poll(10.9).requests} == {"F"}  # still trusted: it races
    again = p.poll(1.0 + p.params.request_timeout).requests  # F's own piece, timed out, is asked again
    assert [r for r in again if r.peer == "F" and r.piece in queued] == []
    assert p.peers["F"].snubbed and waiting_on(p, "S") == queued
