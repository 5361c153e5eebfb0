"""The piece picker: which block to ask which peer for, and what to do when peers misbehave.

How this works
--------------
Pure logic, no I/O, time passed in (``now``, seconds, never decreasing). The download service
feeds it what peers say (``on_bitfield``, ``on_have``, ``on_block``, ``on_reject``,
``on_peer_gone``) and the outcome of hash checks (``on_piece_verified``, ``on_piece_failed``);
``poll(now)`` returns :class:`Actions`: requests to send, cancels to send and peers newly banned
(to disconnect).

Each piece is cut into blocks (the request unit). A block is MISSING, REQUESTED (from one peer, or
from several in endgame) or RECEIVED (from one peer); a piece whose blocks are all received is handed
to the caller to hash-check.

Policies, with their sources:

* **Rarest first** with random ties, and **random first pieces** until a few are verified so a new
  peer quickly has something to trade (BEP 3; Legout et al., "Rarest First and Choke Algorithms Are
  Enough", IMC 2006). Blocks of already started pieces come first ("strict priority"), so pieces
  complete — and become servable — as early as possible. Unstarted pieces sit in bags by
  availability, so finding the rarest a peer holds does not scan every piece per request.
* **Pipelining** with a per-peer queue depth sized to ``queue_seconds`` of the peer's measured rate
  (libtorrent's ``request_queue_time`` = 3 s), clamped to [min_depth, max_depth].
* **Throughput-weighted peer choice**: when the free request slots of several peers compete for the
  same scarce blocks, a peer is drawn with probability proportional to its measured rate (as
  SHARDCAST's clients weight servers, but across every peer that has the piece).
* **Endgame**: once every missing block has been requested, idle slots re-request in-flight blocks
  from other peers (at most ``endgame_copies`` copies); the first arrival cancels the rest.
* **Racing slow peers** (issue 46): a peer whose measured rate is ``race_factor`` times that of
  every peer a block waits on is asked for the block too, before the endgame, as the endgame does
  (at most ``endgame_copies``; the first arrival cancels the rest). Each peer's queue holds
  ``queue_seconds`` of its rate, so a slow peer's queue holds the pieces a fast peer receives a
  moment later: in a simulated swarm with 10 % of peers at 1 Gbit/s and the rest at 10-100 Mbit/s,
  the fast peers had nothing left to be asked for and used 15-35 % of their uplink
  (bench/sim_shards.py). Only measured rates count, never what a peer claims: a peer not measured
  yet races no one and is raced by no one (its first requests are its trial), a snubbed one races
  no one, and the slower peer keeps its request, so a racer that does not deliver delays nothing.
* **Bad pieces**: a piece that fails its hash is re-fetched "on parole" from one peer only
  (libtorrent's parole mode). If one peer sent all of it, that peer gets a strike; if several did,
  the digest of each one's block is kept and compared with the good piece once it verifies, and
  only those whose bytes differ get a strike (libtorrent's smart ban), so honest peers that shared
  a piece with a liar are never blamed. Reaching ``ban_threshold`` strikes, a peer is banned for
  ``ban_seconds``. Malformed data (wrong length,
  unrequested pieces) bans at once: that is never an accident.
* **Whole pieces for fast peers** (libtorrent's ``prefer_whole_pieces``): a new piece goes to a
  peer in one request for all its blocks (up to ``max_request`` bytes) when the peer's measured
  rate already keeps that many blocks in flight, so a fast link costs one request and one data
  message per piece instead of one per block. The bytes in flight are the same; the blocks are
  still tracked one by one (endgame, smart ban), and the cancel of a whole-piece request goes out
  once none of its blocks is still wanted from that peer.
* **Timeouts**: a request unanswered after ``request_timeout`` goes back to MISSING (re-requested
  elsewhere) and the peer's queue is cut to the minimum; ``max_timeouts`` in a row and the peer is
  *dropped* as unresponsive, not banned: a silent liar and an honest peer on a starved machine look
  the same from here, and banning the honest one could leave its pieces unreachable (the caller
  retries a dropped peer after a growing back-off instead).
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    peer: str
    piece: int
    offset: int
    length: int


@dataclass(frozen=True)
class Cancel:
    peer: str
    piece: int
    offset: int
    length: int


@dataclass
class Actions:
    """What the caller should do now."""

    requests: list[Request] = field(default_factory=list)
    cancels: list[Cancel] = field(default_factory=list)
    banned: list[tuple[str, str]] = field(default_factory=list)  # (peer, reason)
    dropped: list[str] = field(default_factory=list)  # unresponsive peers: end the session, retry later

    def extend(self, other: "Actions") -> None:
        self.requests += other.requests
        self.cancels += other.cancels
        self.banned += other.banned
        self.dropped += other.dropped


@dataclass(frozen=True)
class PickerParams:
    block_size: int = 256 * 1024
    request_timeout: float = 10.0  # seconds before a request is given up and re-issued
    queue_seconds: float = 3.0  # libtorrent's request_queue_time
    initial_depth: int = 4  # requests in flight to a peer whose rate is not measured yet
    min_depth: int = 2
    max_depth: int = 32  # 8 MiB of 256 KiB blocks in flight per peer: bounds unverified memory
    random_first: int = 4  # pieces picked at random before rarest-first starts (libtorrent: 4)
    endgame_copies: int = 2  # a block is requested from at most this many peers at once
    race_factor: float = 4.0  # a peer this many times faster than the one a block waits on is asked too
    ban_threshold: float = 2.0  # strikes (pieces proven bad) before a ban
    ban_seconds: float = 600.0
    max_timeouts: int = 3  # timeouts in a row before an unresponsive peer is dropped
    rate_alpha: float = 0.25  # EWMA weight of a new rate sample
    max_request: int = 1 << 20  # largest whole-piece request (protocol.MAX_BLOCK)


class BlockState(enum.Enum):
    MISSING = "missing"
    REQUESTED = "requested"
    RECEIVED = "received"


@dataclass
class _Piece:
    """An active (started, not yet verified) piece."""

    states: list[BlockState]
    requested_from: list[set[str]]
    received_from: list[str | None]
    parole_peer: str | None = None  # when set, only this peer may supply blocks
    on_parole: bool = False  # failed before: the next peer to take a block gets it exclusively

    def is_open(self) -> bool:
        """Has a block nobody was asked for (a list's ``in`` runs in C: polls ask it of every active piece)."""
        return BlockState.MISSING in self.states

    def received_all(self) -> bool:
        return all(s is BlockState.RECEIVED for s in self.states)


@dataclass
class _Peer:
    pieces: set[int] = field(default_factory=set)
    # (piece, offset) -> when sent; in the order sent, as ``now`` never decreases (see _oldest)
    in_flight: dict[tuple[int, int], float] = field(default_factory=dict)
    rate: float = 0.0  # bytes/s, EWMA; 0 = not measured yet
    last_arrival: float = -math.inf
    timeouts_in_row: int = 0
    snubbed: bool = False  # a request timed out: keep min_depth in flight until a block arrives
    received_bytes: int = 0  # bytes in blocks accepted from this peer (verified or not)
    whole: set[int] = field(default_factory=set)  # pieces asked of this peer in one request
    # Whole-piece requests we cancelled: their data may still come (the cancel raced it), and
    # must be dropped, not taken for a wrong-length block. At most one per piece; never also in
    # ``whole`` (asking for the piece whole again takes it out).
    whole_cancelled: set[int] = field(default_factory=set)


class _Bag:
    """A set of ints with O(1) add, remove and uniform random draw (a list, and each one's place)."""

    __slots__ = ("items", "index")

    def __init__(self) -> None:
        self.items: list[int] = []
        self.index: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, x: int) -> bool:
        return x in self.index

    def add(self, x: int) -> None:
        if x not in self.index:
            self.index[x] = len(self.items)
            self.items.append(x)

    def remove(self, x: int) -> None:
        i = self.index.pop(x)
        last = self.items.pop()
        if last != x:
            self.items[i] = last
            self.index[last] = i


# Random draws from a bag of equally rare pieces before the picker lists the ones a peer holds.
RAREST_DRAWS = 4


def _oldest(st: _Peer) -> float:
    """When the oldest request in flight to ``st`` was sent: the first one in its dict, which
    keeps insertion order and gets requests only in time order."""
    return next(iter(st.in_flight.values()))


class Picker:
    """Download state of one checkpoint version (see the module docstring)."""

    def __init__(
        self,
        piece_lengths: list[int],
        params: PickerParams | None = None,
        *,
        have: set[int] | frozenset[int] = frozenset(),
        rng: random.Random | None = None,
    ) -> None:
        self.params = params or PickerParams()
        self.rng = rng or random.Random()
        self.piece_lengths = list(piece_lengths)
        self.verified: set[int] = set(have)
        self.availability = [0] * len(self.piece_lengths)
        self.active: dict[int, _Piece] = {}
        self.peers: dict[str, _Peer] = {}
        self.strikes: dict[str, float] = {}
        self.banned_until: dict[str, float] = {}
        # piece -> {offset: (peer, digest of the block it sent)} for pieces that failed with
        # several contributors: resolved when the piece verifies (smart ban).
        self._suspects: dict[int, dict[int, tuple[str, bytes]]] = {}
        self._unstarted = set(range(len(self.piece_lengths))) - self.verified
        # Unstarted pieces by availability (rarest first without scanning every piece per pick).
        self._rarest: dict[int, _Bag] = {}
        for i in sorted(self._unstarted):
            self._bag(0).add(i)

    # ----------------------------------------------------------------------------------------
    # Queries

    @property
    def num_pieces(self) -> int:
        return len(self.piece_lengths)

    @property
    def complete(self) -> bool:
        return len(self.verified) == self.num_pieces

    @property
    def in_endgame(self) -> bool:
        return not self._unstarted and not any(p.is_open() for p in self.active.values())

    def is_banned(self, peer: str, now: float) -> bool:
        return self.banned_until.get(peer, -math.inf) > now

    def rate_of(self, peer: str) -> float:
        return self.peers[peer].rate if peer in self.peers else 0.0

    def depth_of(self, peer: str) -> int:
        """Requests to keep in flight to ``peer``: ~queue_seconds of its rate (libtorrent)."""
        p, st = self.params, self.peers[peer]
        if st.snubbed:
            return p.min_depth
        if st.rate <= 0:
            return p.initial_depth
        depth = math.ceil(st.rate * p.queue_seconds / p.block_size)
        return max(p.min_depth, min(p.max_depth, depth))

    def in_flight(self, peer: str) -> int:
        return len(self.peers[peer].in_flight) if peer in self.peers else 0

    def next_deadline(self) -> float:
        """The earliest time a request times out (inf when none is in flight)."""
        times = [_oldest(st) for st in self.peers.values() if st.in_flight]
        return min(times) + self.params.request_timeout if times else math.inf

    def blocks_of(self, piece: int) -> list[tuple[int, int]]:
        """(offset, length) of each block of ``piece``."""
        n, b = self.piece_lengths[piece], self.params.block_size
        return [(off, min(b, n - off)) for off in range(0, n, b)]

    def has_suspects(self, piece: int) -> bool:
        """Did ``piece`` fail before with several contributors (block digests wanted)?"""
        return piece in self._suspects

    def holds_all(self, peer: str) -> bool:
        """Has ``peer`` told us it holds every piece?"""
        st = self.peers.get(peer)
        return st is not None and len(st.pieces) == self.num_pieces

    def peer_has(self, peer: str, piece: int) -> bool:
        """Has ``peer`` told us it holds ``piece`` (bitfield or Have)?"""
        st = self.peers.get(peer)
        return st is not None and piece in st.pieces

    # ----------------------------------------------------------------------------------------
    # What peers say

    def add_peer(self, peer: str) -> None:
        self.peers.setdefault(peer, _Peer())

    def on_bitfield(self, peer: str, pieces: set[int]) -> None:
        """``peer``'s full holdings (replaces what we knew)."""
        self.add_peer(peer)
        st = self.peers[peer]
        for i in st.pieces:
            self._shift(i, -1)
        st.pieces = {i for i in pieces if 0 <= i < self.num_pieces}
        for i in st.pieces:
            self._shift(i, +1)

    def on_have(self, peer: str, piece: int) -> None:
        self.add_peer(peer)
        st = self.peers[peer]
        if 0 <= piece < self.num_pieces and piece not in st.pieces:
            st.pieces.add(piece)
            self._shift(piece, +1)

    def on_peer_gone(self, peer: str) -> None:
        """The peer disconnected: its in-flight blocks go back to MISSING. Bans are kept."""
        st = self.peers.pop(peer, None)
        if st is None:
            return
        for i in st.pieces:
            self._shift(i, -1)
        for piece, offset in st.in_flight:
            self._release(peer, piece, offset)
        for ap in self.active.values():
            if ap.parole_peer == peer:
                ap.parole_peer = None

    def on_reject(self, peer: str, piece: int, offset: int, still_holds: bool = False) -> None:
        """``peer`` refused a request: ask someone else. Unless it was only busy
        (``still_holds``), it does not serve that piece now: forget that it has it."""
        st = self.peers.get(peer)
        if st is None:
            return
        blocks = self._requested(st, piece, offset)
        held = [o for o, _ in blocks if (piece, o) in st.in_flight]
        if not held:
            return
        if len(blocks) > 1:
            st.whole.discard(piece)
        for o in held:
            del st.in_flight[(piece, o)]
            self._release(peer, piece, o)
        if piece in st.pieces and not still_holds:
            st.pieces.discard(piece)
            self._shift(piece, -1)

    def on_block(self, peer: str, piece: int, offset: int, length: int,
                 now: float) -> tuple[list[tuple[int, int]], Actions]:
        """Data arrived: one block, or a whole piece asked for in one request. Returns (the
        ``(offset, length)`` of each block in it to keep, actions): none for duplicates and strays.

        Data that does not match a request we made to this peer at this exact offset and
        length is malformed: the peer is banned (a cancel race only ever drops the data).
        """
        acts = Actions()
        st = self.peers.get(peer)
        if st is None:
            return [], acts
        if offset == 0 and piece in st.whole_cancelled and length == self.piece_lengths[piece]:
            st.whole_cancelled.discard(piece)
            return [], acts  # the cancel of a whole-piece request raced its data
        blocks = self._requested(st, piece, offset)
        if len(blocks) > 1:
            st.whole.discard(piece)
        sent = {o: st.in_flight.pop((piece, o)) for o, _ in blocks if (piece, o) in st.in_flight}
        if not sent:
            return [], acts  # cancelled, timed out or never asked: drop silently
        if length != sum(n for _, n in blocks):
            for o in sent:
                self._release(peer, piece, o)
            acts.banned += self._ban(peer, now, "wrong-length")
            return [], acts
        # Rate sample: bytes over the time this peer was busy with them (pipelining keeps the
        # link full, so inter-arrival time of back-to-back requests is the link rate).
        busy_from = max(st.last_arrival, min(sent.values()))
        sample = length / max(now - busy_from, 1e-3)
        a = self.params.rate_alpha
        st.rate = sample if st.rate <= 0 else (1 - a) * st.rate + a * sample
        st.last_arrival = now
        st.timeouts_in_row = 0
        st.snubbed = False
        ap = self.active.get(piece)
        kept: list[tuple[int, int]] = []
        for o, n in blocks:
            idx = o // self.params.block_size
            if o not in sent or ap is None or ap.states[idx] is BlockState.RECEIVED:
                continue  # endgame duplicate, or piece already done
            for other in ap.requested_from[idx] - {peer}:
                ost = self.peers.get(other)
                if ost is not None:
                    self._cancel(other, ost, piece, o, acts)
            ap.requested_from[idx] = set()
            ap.states[idx] = BlockState.RECEIVED
            ap.received_from[idx] = peer
            st.received_bytes += n
            kept.append((o, n))
        return kept, acts

    def _requested(self, st: _Peer, piece: int, offset: int) -> list[tuple[int, int]]:
        """The blocks a request to ``st`` for ``piece`` at ``offset`` covers: all of the piece's for
        a whole-piece request, else the one block there."""
        if offset == 0 and piece in st.whole:
            return self.blocks_of(piece)
        return [(offset, self._block_length(piece, offset))]

    def _cancel(self, peer: str, st: _Peer, piece: int, offset: int, acts: Actions) -> None:
        """Stop wanting one block from ``peer`` (if it is in flight): forget its request and tell
        the peer, with one cancel for a whole-piece request once none of its blocks is wanted."""
        if st.in_flight.pop((piece, offset), None) is None:
            return
        if piece not in st.whole:
            acts.cancels.append(Cancel(peer, piece, offset, self._block_length(piece, offset)))
        elif not any((piece, o) in st.in_flight for o, _ in self.blocks_of(piece)):
            st.whole.discard(piece)
            st.whole_cancelled.add(piece)
            acts.cancels.append(Cancel(peer, piece, 0, self.piece_lengths[piece]))

    def piece_ready(self, piece: int) -> bool:
        """Every block of an active piece has been received: hash-check it now."""
        ap = self.active.get(piece)
        return ap is not None and ap.received_all()

    def contributors(self, piece: int) -> dict[str, int]:
        """Bytes each peer supplied to an active piece (for receipts and blame)."""
        ap = self.active.get(piece)
        out: dict[str, int] = {}
        if ap is None:
            return out
        for (off, n), who in zip(self.blocks_of(piece), ap.received_from):
            if who is not None:
                out[who] = out.get(who, 0) + n
        return out

    def on_piece_verified(self, piece: int, now: float = 0.0, block_digests: dict[int, bytes] | None = None) -> Actions:
        """The piece matched its hash. ``block_digests`` (offset -> digest of each block) lets us
        convict whoever sent different bytes for this piece before (smart ban, as libtorrent)."""
        self.active.pop(piece, None)
        self._start(piece)
        self.verified.add(piece)
        acts = Actions()
        suspects = self._suspects.pop(piece, {})
        if block_digests is not None:
            for offset, (peer, bad) in suspects.items():
                if block_digests.get(offset) != bad:
                    acts.banned += self._strike(peer, now)
        return acts

    def on_piece_failed(self, piece: int, now: float, block_digests: dict[int, bytes] | None = None) -> Actions:
        """The assembled piece did not match its hash: re-fetch it on parole.

        With one contributor the fault is certain: one strike. With several we cannot tell yet,
        so nobody is struck now; the digests of what each sent are kept and compared with the good
        piece once it verifies (libtorrent's smart ban), so a liar is convicted and honest peers
        that shared the piece with it never are.
        """
        acts = Actions()
        ap = self.active.get(piece)
        if ap is None:
            return acts
        culprits = {p for p in ap.received_from if p is not None}
        if len(culprits) == 1:
            acts.banned += self._strike(culprits.pop(), now)
        elif block_digests is not None:
            kept = self._suspects.setdefault(piece, {})
            for (offset, _), who in zip(self.blocks_of(piece), ap.received_from):
                if who is not None and offset in block_digests:
                    kept[offset] = (who, block_digests[offset])
        n = len(ap.states)
        self.active[piece] = _Piece(
            [BlockState.MISSING] * n, [set() for _ in range(n)], [None] * n, on_parole=True
        )
        # Requests still in flight for this piece are void (their blocks were reset).
        for peer, st in self.peers.items():
            for key in [k for k in st.in_flight if k[0] == piece]:
                self._cancel(peer, st, piece, key[1], acts)
        return acts

    def _strike(self, peer: str, now: float) -> list[tuple[str, str]]:
        self.strikes[peer] = self.strikes.get(peer, 0.0) + 1.0
        if self.strikes[peer] >= self.params.ban_threshold:
            return self._ban(peer, now, "bad-piece")
        return []

    def on_misbehaved(self, peer: str, now: float, reason: str) -> Actions:
        """The peer broke the protocol (malformed data): ban at once."""
        acts = Actions()
        acts.banned += self._ban(peer, now, reason)
        return acts

    # ----------------------------------------------------------------------------------------
    # Deciding

    def poll(self, now: float) -> Actions:
        """Expire timed-out requests, then fill every peer's free request slots."""
        acts = self._expire(now)
        endgame = self.in_endgame
        acts.extend(self._fill(now, endgame))
        if not endgame and self.in_endgame:  # the last blocks went out just now: duplicates may go too
            acts.extend(self._fill(now, True))
        return acts

    def _could_offer(self, st: _Peer, open_pieces: set[int], endgame: bool) -> bool:
        """Might ``_pick_block`` find a block for this peer? False only when it surely would not: it
        holds no unstarted piece, no started one with a block nobody was asked for, and (outside the
        endgame) duplicates are not wanted. Picks only shrink what is unstarted or open, so a peer
        ruled out stays out until the endgame begins. In a swarm most peers hold only pieces already
        being fetched from others: trying each of them on every wake-up was most of poll's cost."""
        if not st.pieces.isdisjoint(self._unstarted) or not st.pieces.isdisjoint(open_pieces):
            return True
        return (endgame or self._races(st)) and not st.pieces.isdisjoint(self.active)

    def _races(self, st: _Peer) -> bool:
        """Is ``st`` fast enough to race a block waiting on a slower peer (see _pick_block)?"""
        return st.rate > 0 and not st.snubbed and st.rate >= self.params.race_factor * self._slowest_waited_on()

    def _slowest_waited_on(self) -> float:
        """The lowest measured rate of the peers blocks wait on (a peer not measured yet is given
        its first requests' time: racing it would take its trial away)."""
        rates = [o.rate for o in self.peers.values() if o.in_flight and o.rate > 0]
        return min(rates) if rates else math.inf

    def _fill(self, now: float, endgame: bool) -> Actions:
        """Fill the free request slots of every peer that could be asked for something (``endgame``:
        whether the endgame was on as the fill began)."""
        acts = Actions()
        open_pieces = {i for i, ap in self.active.items() if ap.is_open()}
        free: dict[str, int] = {}
        for peer, st in self.peers.items():
            if self.is_banned(peer, now):
                continue
            slots = self.depth_of(peer) - len(st.in_flight)
            if slots > 0 and self._could_offer(st, open_pieces, endgame):
                free[peer] = slots
        if not free:
            return acts
        rates = [st.rate for st in self.peers.values() if st.rate > 0]
        default_rate = sorted(rates)[len(rates) // 2] if rates else 1.0  # unmeasured: median
        while free:
            names = list(free)
            weights = [self.peers[p].rate or default_rate for p in names]
            peer = self.rng.choices(names, weights)[0]
            block = self._pick_block(peer, free[peer])
            if block is None:
                del free[peer]
                continue
            piece, offset, length = block
            offsets = range(offset, offset + length, self.params.block_size)
            in_flight = self.peers[peer].in_flight
            for o in offsets:
                in_flight.pop((piece, o), None)  # never there; were it, its place would break the time order
                in_flight[(piece, o)] = now
            acts.requests.append(Request(peer, piece, offset, length))
            free[peer] -= len(offsets)
            if free[peer] <= 0:
                del free[peer]
        return acts

    def _pick_block(self, peer: str, slots: int) -> tuple[int, int, int] | None:
        """(piece, offset, length) of the next request to ``peer``, which has ``slots`` free."""
        st = self.peers[peer]
        # 1. Unrequested blocks of pieces already started (finish pieces first).
        for piece, ap in self.active.items():
            if not ap.is_open() or piece not in st.pieces or ap.parole_peer not in (None, peer):
                continue
            if ap.on_parole and ap.parole_peer is None:
                ap.parole_peer = peer
            return self._assign(peer, piece, ap.states.index(BlockState.MISSING))
        # 2. A new piece: random while we have few, then rarest first with random ties.
        if not st.pieces.isdisjoint(self._unstarted):
            if len(self.verified) < self.params.random_first:
                piece = self.rng.choice(sorted(self._unstarted & st.pieces))  # sorted: a seeded rng picks the same
            else:
                piece = self._rarest_held(st.pieces)
            n = len(self.blocks_of(piece))
            whole = 1 < n and self.piece_lengths[piece] <= self.params.max_request and st.rate > 0 \
                and not st.snubbed and self.depth_of(peer) >= 2 * n
            if whole and slots < n:
                return None  # depth - n blocks are still in flight: ask for all n once they are free
            self.active[piece] = _Piece([BlockState.MISSING] * n, [set() for _ in range(n)], [None] * n)
            self._start(piece)
            if whole:
                for idx in range(n):
                    self._assign(peer, piece, idx)
                st.whole.add(piece)
                st.whole_cancelled.discard(piece)
                return piece, 0, self.piece_lengths[piece]
            return self._assign(peer, piece, 0)
        # 3. Endgame: duplicate an in-flight block this peer has not been asked for. Before the
        # endgame, a peer race_factor times faster than every peer a block waits on races them.
        endgame = self.in_endgame
        if not endgame and not self._races(st):
            return None
        limit = 0.0 if endgame else st.rate / self.params.race_factor
        options = [
            (len(ap.requested_from[idx]), piece, idx)
            for piece, ap in self.active.items()
            if piece in st.pieces and ap.parole_peer in (None, peer)
            for idx, state in enumerate(ap.states)
            if state is BlockState.REQUESTED
            and peer not in ap.requested_from[idx]
            and len(ap.requested_from[idx]) < self.params.endgame_copies
            and (endgame or all(0 < self.peers[o].rate <= limit for o in ap.requested_from[idx]))
        ]
        if not options:
            return None
        fewest = min(o[0] for o in options)
        _, piece, idx = self.rng.choice([o for o in options if o[0] == fewest])
        return self._assign(peer, piece, idx)

    def _rarest_held(self, pieces: set[int]) -> int:
        """A random one of the rarest unstarted pieces among ``pieces`` (some of which are unstarted).

        Levels are few (availability runs to the number of peers), so they are walked in order; a
        level's bag is drawn from at random first, which for a peer holding most of it (a seed)
        ends at once, and only then listed. The scan of every unstarted piece this replaced took
        ~0.6 ms a choice at 16,384 pieces (a 16 GiB checkpoint), this ~13 µs (``bench/picker.py``).
        """
        for level in sorted(self._rarest):
            if level == 0:
                continue  # nobody holds these
            bag = self._rarest[level]
            for _ in range(RAREST_DRAWS):
                x = bag.items[self.rng.randrange(len(bag))]
                if x in pieces:
                    return x
            held = [x for x in pieces if x in bag] if len(pieces) < len(bag) else \
                [x for x in bag.items if x in pieces]
            if held:
                return self.rng.choice(sorted(held))  # sorted: a seeded rng picks the same
        raise AssertionError("a held unstarted piece is in no bag")

    def _bag(self, level: int) -> _Bag:
        bag = self._rarest.get(level)
        if bag is None:
            bag = self._rarest[level] = _Bag()
        return bag

    def _shift(self, piece: int, delta: int) -> None:
        """One more (or one fewer) peer holds ``piece``; an unstarted piece changes bags."""
        old = self.availability[piece]
        self.availability[piece] = old + delta
        if piece in self._unstarted:
            self._drop_from_bag(piece, old)
            self._bag(old + delta).add(piece)

    def _start(self, piece: int) -> None:
        """``piece`` is no longer unstarted (asked for, or verified)."""
        if piece in self._unstarted:
            self._unstarted.discard(piece)
            self._drop_from_bag(piece, self.availability[piece])

    def _drop_from_bag(self, piece: int, level: int) -> None:
        bag = self._rarest[level]
        bag.remove(piece)
        if not bag:
            del self._rarest[level]  # keeps the walk over levels short

    def _assign(self, peer: str, piece: int, idx: int) -> tuple[int, int, int]:
        ap = self.active[piece]
        ap.states[idx] = BlockState.REQUESTED
        ap.requested_from[idx].add(peer)
        offset, length = self.blocks_of(piece)[idx]
        return piece, offset, length

    def _block_length(self, piece: int, offset: int) -> int:
        return min(self.params.block_size, self.piece_lengths[piece] - offset)

    def _release(self, peer: str, piece: int, offset: int) -> None:
        """``peer`` will not deliver this block: back to MISSING unless someone else is on it."""
        ap = self.active.get(piece)
        if ap is None:
            return
        idx = offset // self.params.block_size
        ap.requested_from[idx].discard(peer)
        if ap.states[idx] is BlockState.REQUESTED and not ap.requested_from[idx]:
            ap.states[idx] = BlockState.MISSING

    def _expire(self, now: float) -> Actions:
        acts = Actions()
        limit = self.params.request_timeout
        for peer, st in list(self.peers.items()):
            # sent + limit, as next_deadline computes it: now - sent may round below limit there
            if not st.in_flight or now < _oldest(st) + limit:
                continue  # polled on every wake-up: most peers have nothing late, and this says so in O(1)
            late = [k for k, sent in st.in_flight.items() if now >= sent + limit]
            for piece, offset in late:
                self._cancel(peer, st, piece, offset, acts)
                self._release(peer, piece, offset)
            st.timeouts_in_row += 1
            st.snubbed = True
            if st.timeouts_in_row >= self.params.max_timeouts:
                self.on_peer_gone(peer)
                acts.dropped.append(peer)
        return acts

    def _ban(self, peer: str, now: float, reason: str) -> list[tuple[str, str]]:
        already = self.is_banned(peer, now)
        self.banned_until[peer] = now + self.params.ban_seconds
        st = self.peers.get(peer)
        if st is not None:
            for piece, offset in list(st.in_flight):
                self._release(peer, piece, offset)
            st.in_flight.clear()
            st.whole.clear()
        # Blocks it already delivered to unfinished pieces are suspect too: fetch them again, or
        # they would fail those pieces later and the blame would fall on the honest co-authors.
        # Not those of a complete piece: it is being hash-checked, and its hash settles the blame.
        for ap in self.active.values():
            if ap.received_all():
                continue
            for idx, who in enumerate(ap.received_from):
                if who == peer:
                    ap.received_from[idx] = None
                    ap.states[idx] = BlockState.MISSING
        return [] if already else [(peer, reason)]
