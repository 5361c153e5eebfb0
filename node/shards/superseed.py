"""Super-seeding: the origin hands out pieces one at a time so it uploads each piece about once.

Why: when the seed's upload is the bottleneck, Kumar & Ross's bound T_min = F/u_s (IEEE HotWeb
2006) is reachable only if the seed sends every byte once, never idles, and the downloaders pass
everything on at once. Plain rarest-first lets two downloaders fetch the same piece from the seed
before either has advertised it. BitTorrent's super-seeding (BEP 16; measured 1.40x T_min flat in N
with libtorrent, against 1.7-2.1x without) instead advertises to each downloader only pieces the
swarm lacks, a few at a time, and more when it reports (have) that it finished one.

How this works
--------------
One (downloader, piece) reveal goes SHOWN (advertised; we have not written all its bytes yet) ->
SENT (every byte written to the downloader's stream: it is draining through buffers and the link)
-> HELD (the downloader reported it with ``have``). The server reports the middle step
(``on_sent``).

Rules, each measured with 8 downloaders behind 10 Mbit/s upload caps (bench/shards.py swarm):

* A piece is shown to a second downloader only when its first recipient left, sat on it for
  ``stall_seconds`` without reporting it, or reported it but in ``stall_seconds`` no downloader has
  reported it save those we gave it to. Showing "least-sent first" instead made the seed upload
  1.47x the checkpoint. The last case is a holder that can pass it to nobody: a NAT'd downloader
  whose only direct peer is the origin accepts no transfer session (relay circuits carry no
  checkpoint bytes), and in simulation (bench/sim_shards.py, 40 downloaders, half NAT'd) the other
  39 waited forever for the one piece it held.
* At most ``in_transit`` pieces are SHOWN at once, over all downloaders. Showing two pieces to each
  of 8 downloaders made the seed split its upload 16 ways, so the first piece finished — and could
  be passed on — only after ~16 piece-times; with 2 in transit, a piece is complete and tradable
  every half a piece-time from the start.
* The next piece goes to a downloader with nothing in transit from us, then to the one with the
  least forwarding left (:meth:`SuperSeeder.backlog`: copies of what we gave it that others still
  lack), ties at random. Choosing "holding the fewest pieces" instead gave the 8 downloaders 3 to
  19 % of the pieces (32 of 1 MiB): each 19 % one owed 6 x 7 piece uploads, 34 s at its cap, more
  than T_min (26.8 s), and everyone waited for its pieces: 1.50x T_min; 1.38x with this rule (and
  the budget below), same pieces.
* The budget frees when a piece is SENT, not when it is HELD, and both budgets are sized in bytes
  by the server (``SUPER_SEED_*_BYTES`` below, with the measurements): from a reveal to our
  last byte of the piece took 0.3-0.7 s (the reveal and the request each wait behind queues on busy
  links), from our last byte to the ``have`` 0.2-0.6 s. Had the budget freed only on ``have``, it
  would need that many more pieces in transit to keep the link busy; what we have written and the
  link has not yet carried covers the round trip instead. ``max_unreported`` bounds SHOWN + SENT,
  so deep send buffers cannot turn this into many pieces sharing the link.
* Both budgets grow while more pieces in flight do not lengthen the round trip from a reveal to its
  ``have``, as TCP Vegas grows its window (Brakmo & Peterson, IEEE JSAC 1995): with the base round
  trip the shortest seen to that downloader (they are 10-240 ms apart on the internet),
  ``max_unreported * (1 - base / round_trip)`` pieces wait in queues; under
  ``VEGAS_ALPHA`` the budget grows by a piece, over ``VEGAS_BETA`` it shrinks by one, never below
  the sizes above (a full 10 Mbit/s link keeps them) nor above ``SUPER_SEED_MAX_BYTES``. Sized for
  10 Mbit/s, a 1 Gbit/s origin 5-60 ms from its downloaders ran at 60-90 Mbit/s until one copy was
  out (bench/sim_shards.py, N = 100, issue 46): the budget covered a round trip at 10 Mbit/s only.
  A downloader's first round trip may already have waited behind others', so on a full link the
  budget swings a few pieces above its floor and back (bench/shards.py swarm's scenario, simulated:
  1.03-1.13x T_min before, 1.04-1.12x after).

The seeder is in one of two modes (:class:`SeedMode`): SUPER as above until every piece is held
by at least one downloader, then ORDINARY for good: each downloader is shown every piece it lacks
(a peer that comes later, everything at once), the budgets no longer apply, and the origin serves
like any other holder. Kept SUPER to the end, the origin idled once one copy was out: in simulation
(bench/sim_shards.py, N = 100, 256 MiB, a 1 Gbit/s origin) it sent nothing for 7 s while the swarm
traded, then served only pieces shown again after ``stall_seconds``. An earlier pair of runs at
N = 8 on one 10 Mbit/s bridge saw no gain (35.2 s without, 37.6 s with, 1 MiB pieces on a loaded
machine): there the origin's uplink is no larger than anyone's.

Pure: the server feeds it what each downloader holds, with the time, and is told which pieces to
reveal to whom, as ``(peer, piece)`` pairs.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

# Super-seeding in bytes so that it holds for any piece size: what may be revealed
# and not yet written (at least 2 pieces), and what may be written and not yet reported (have)
# besides (at least 2 pieces). Measured in bench/shards.py swarm (N=8, 10 Mbit/s, 128 KiB pieces):
# from a reveal to our last byte of that piece took 0.3-0.7 s (the reveal and the request each wait
# behind ~0.1 s of queue on a busy link), from our last byte to the have 0.21 s (median) and up to
# 0.63 s (~0.8 MB at 10 Mbit/s). With room for only 2 pieces in each, the seed's link was busy 85 %
# of the time with 64 KiB pieces and 95 % with 128 KiB pieces; with these budgets 97 %.
SUPER_SEED_WRITING_BYTES = 512 << 10
SUPER_SEED_REPORT_BYTES = 1 << 20
SUPER_SEED_MAX_BYTES = 64 << 20  # what the budgets may grow to (see the module docstring)
VEGAS_ALPHA = 1.0  # pieces queued below which the budget grows
VEGAS_BETA = 2.0  # pieces queued above which it shrinks


def super_seeding_pays(seed_up: float, ups: Sequence[float], downs: Sequence[float]) -> bool:
    """Whether to super-seed a version: only where the origin's upload ``seed_up`` is the binding
    term of Kumar & Ross's bound, T_min = max(F/u_s, F/min d_i, N F/(u_s + sum u_i)) (bytes/s;
    ``ups``, ``downs``: the downloaders'). Super-seeding makes the origin send each piece about once,
    which is what reaching F/u_s takes; where the swarm's total upload or the slowest download binds,
    it holds back an origin that could send more: simulated (bench/sim_shards.py, N = 100, 256 MiB,
    a 1 Gbit/s origin, 10 % of downloaders at 1 Gbit/s and the rest 10-100 Mbit/s up) 2.41x the bound
    without against 2.72x with. A tie counts as binding; with no downloader there is nothing to hold."""
    if not ups or not downs or seed_up <= 0:
        return True  # no downloader, or an origin that cannot send: nothing to weigh
    # 1/seed_up >= max(1/min(downs), n/(seed_up + sum(ups))), multiplied out: no division by a zero rate
    return seed_up <= min(downs) and seed_up * len(ups) <= seed_up + sum(ups)


class SeedMode(enum.Enum):
    SUPER = "super"  # pieces shown a few at a time, each to the downloader that lacks it most usefully
    ORDINARY = "ordinary"  # every piece held by some downloader: everything shown to everyone


@dataclass
class _Downloader:
    holds: set[int] = field(default_factory=set)
    shown: set[int] = field(default_factory=set)  # revealed, not all bytes written yet
    sent: set[int] = field(default_factory=set)  # revealed, every byte written, not reported yet
    from_us: set[int] = field(default_factory=set)  # reported after we revealed it: it got it from us
    revealed: set[int] = field(default_factory=set)  # every piece ever shown to it
    base_round_trip: float = math.inf  # shortest from a reveal to its have

    @property
    def unreported(self) -> set[int]:
        return self.shown | self.sent


class SuperSeeder:
    """Decides which pieces the origin advertises to which downloader."""

    def __init__(
        self,
        num_pieces: int,
        in_transit: int = 2,
        stall_seconds: float = 15.0,
        rng: random.Random | None = None,
        max_unreported: int = 4,
        hand_over: bool = True,
        grow_to: int = 0,
    ) -> None:
        if in_transit < 1 or max_unreported < in_transit:
            raise ValueError("need 1 <= in_transit <= max_unreported")
        self.num_pieces = num_pieces
        self.in_transit = in_transit  # pieces SHOWN (bytes still to write), over all downloaders
        self.max_unreported = max_unreported  # pieces SHOWN or SENT, over all downloaders
        self.floor = (in_transit, max_unreported)  # the budgets never shrink below these
        self.grow_to = max(grow_to, max_unreported)  # nor grow past this (max_unreported; 0: no growth)
        self.stall_seconds = stall_seconds
        self.rng = rng or random.Random()
        self.sent = [0] * num_pieces  # times revealed (≈ times uploaded by us)
        self.last_sent = [0.0] * num_pieces  # when it was last revealed
        self.held = [0] * num_pieces  # downloaders known to hold it
        self.peers: dict[str, _Downloader] = {}
        self.hand_over = hand_over  # turn ORDINARY once every piece is held (False: SUPER to the end)
        self.mode = SeedMode.SUPER
        self._to_show: set[str] = set()  # ORDINARY: downloaders not yet shown every piece

    @classmethod
    def for_pieces(cls, num_pieces: int, piece_size: int, rng: random.Random | None = None,
                   hand_over: bool = True) -> "SuperSeeder":
        """The super-seeder of a version of ``num_pieces`` pieces of ``piece_size`` bytes, its
        budgets sized in bytes (SUPER_SEED_WRITING_BYTES, SUPER_SEED_REPORT_BYTES)."""
        writing = max(2, -(-SUPER_SEED_WRITING_BYTES // piece_size))
        return cls(num_pieces, in_transit=writing, rng=rng, hand_over=hand_over,
                   max_unreported=writing + max(2, -(-SUPER_SEED_REPORT_BYTES // piece_size)),
                   grow_to=SUPER_SEED_MAX_BYTES // piece_size)

    def _live(self, pieces: set[int], now: float | None) -> int:
        return sum(1 for i in pieces if now is None or now - self.last_sent[i] < self.stall_seconds)

    def outstanding(self, now: float | None = None) -> int:
        """Pieces revealed and not reported, over all downloaders; with ``now``, stalled ones (see
        ``stall_seconds``) not counted."""
        return sum(self._live(d.unreported, now) for d in self.peers.values())

    def writing(self, now: float | None = None) -> int:
        """Pieces SHOWN whose bytes we have not all written yet (stalled ones not counted)."""
        return sum(self._live(d.shown, now) for d in self.peers.values())

    def on_bitfield(self, peer: str, pieces: set[int], now: float) -> list[tuple[str, int]]:
        """A downloader connected and told us what it holds."""
        d = self.peers.setdefault(peer, _Downloader())
        if self.mode is SeedMode.ORDINARY:
            self._to_show.add(peer)
        for i in pieces:
            if 0 <= i < self.num_pieces and i not in d.holds:
                d.holds.add(i)
                self.held[i] += 1
        return self.reveal(now)

    def on_sent(self, peer: str, piece: int, now: float) -> list[tuple[str, int]]:
        """We wrote the last byte of a revealed piece to ``peer``'s stream."""
        d = self.peers.get(peer)
        if d is None or piece not in d.shown:
            return []
        d.shown.discard(piece)
        d.sent.add(piece)
        return self.reveal(now)

    def on_have(self, peer: str, piece: int, now: float) -> list[tuple[str, int]]:
        """A downloader finished a piece (from us or from anyone)."""
        d = self.peers.get(peer)
        if d is None or not 0 <= piece < self.num_pieces:
            return []
        if piece not in d.holds:
            d.holds.add(piece)
            self.held[piece] += 1
        if piece in d.unreported:
            d.from_us.add(piece)
            self._on_round_trip(d, now - self.last_sent[piece])
        d.shown.discard(piece)
        d.sent.discard(piece)
        return self.reveal(now)

    def _on_round_trip(self, d: _Downloader, seconds: float) -> None:
        """A piece we revealed to ``d`` was reported ``seconds`` later: resize the budgets (TCP
        Vegas, see the module docstring), against the downloader's own shortest round trip."""
        if seconds <= 0 or self.mode is not SeedMode.SUPER:
            return
        d.base_round_trip = min(d.base_round_trip, seconds)
        queued = self.max_unreported * (1 - d.base_round_trip / seconds)
        if queued < VEGAS_ALPHA:
            self.max_unreported = min(self.grow_to, self.max_unreported + 1)
        elif queued > VEGAS_BETA:
            self.max_unreported = max(self.floor[1], self.max_unreported - 1)
        # The writing budget in proportion, as the two were sized together.
        self.in_transit = max(self.floor[0], self.max_unreported * self.floor[0] // self.floor[1])

    def on_peer_gone(self, peer: str, now: float) -> list[tuple[str, int]]:
        d = self.peers.pop(peer, None)
        if d is None:
            return []
        for i in d.holds:
            self.held[i] -= 1
        for i in d.unreported:
            self.sent[i] -= 1  # never delivered (as far as we know): someone else gets it
        return self.reveal(now)

    def backlog(self, peer: str) -> int:
        """Copies of the pieces we gave ``peer`` that other downloaders still lack: roughly the
        upload work queued at it (a piece in transit from us counts as owed to everyone)."""
        d = self.peers[peer]
        others = len(self.peers) - 1
        return sum(others - (self.held[i] - 1) for i in d.from_us if i in d.holds) + others * len(d.unreported)

    def revealed_to(self, peer: str) -> set[int]:
        d = self.peers.get(peer)
        return set() if d is None else d.unreported

    def reveal(self, now: float) -> list[tuple[str, int]]:
        """Fill the in-transit budget: (peer, piece) pairs to advertise now; once every piece is
        held by some downloader, every piece each downloader lacks and was not shown (ORDINARY)."""
        if self.hand_over and self.mode is SeedMode.SUPER and min(self.held, default=1) >= 1:
            self.mode = SeedMode.ORDINARY
            self._to_show.update(self.peers)
        if self.mode is SeedMode.ORDINARY:
            return self._show_the_rest()
        out: list[tuple[str, int]] = []
        while self.writing(now) < self.in_transit and self.outstanding(now) < self.max_unreported:
            pick = self._next(now)
            if pick is None:
                break
            peer, piece = pick
            self.peers[peer].shown.add(piece)
            self.peers[peer].revealed.add(piece)
            self.sent[piece] += 1
            self.last_sent[piece] = now
            out.append(pick)
        return out

    def _show_the_rest(self) -> list[tuple[str, int]]:
        """ORDINARY: every piece to the downloaders not yet shown everything (each once: this
        runs on every have, and the origin hears one per piece per downloader)."""
        out = []
        for peer in sorted(self._to_show & self.peers.keys()):
            d = self.peers[peer]
            rest = sorted(set(range(self.num_pieces)) - d.holds - d.revealed)
            d.revealed.update(rest)
            out += [(peer, i) for i in rest]
        self._to_show.clear()
        return out

    def _next(self, now: float) -> tuple[str, int] | None:
        fresh = [i for i in range(self.num_pieces) if self.sent[i] == 0 and self.held[i] == 0]
        stuck = [  # no one has it but those we gave it to (if anyone), for stall_seconds
            i for i in range(self.num_pieces)
            if 0 < self.sent[i] >= self.held[i] and now - self.last_sent[i] >= self.stall_seconds
        ]
        # Stalled: the least sent, longest ago, that the downloader lacks (not only the first:
        # the one downloader left may hold it).
        pieces = fresh or sorted(stuck, key=lambda i: (self.sent[i], self.last_sent[i]))
        if not pieces:
            return None
        # Downloaders with nothing in transit from us first, then those with the least
        # forwarding left to do (see backlog), ties at random.
        for peer in sorted(self.peers, key=lambda p: (
                bool(self.peers[p].unreported), self.backlog(p), self.rng.random())):
            d = self.peers[peer]
            options = [i for i in pieces if i not in d.holds and i not in d.unreported]
            if options:
                return peer, self.rng.choice(options) if fresh else options[0]
        return None
