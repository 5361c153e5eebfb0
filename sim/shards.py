"""The checkpoint swarm on the simulated network: node/shards' own Picker, SuperSeeder and peering
choices, driven (issue 46 item 3).

Each :class:`Holder` is what a node's shards service holds for one version: the download's
:class:`Picker` (client.py's Download), its client sessions chosen by
:func:`sessions_to_open`/:func:`session_to_end` (peering.py, every ``RESCAN_INTERVAL``), the
serving sessions of the peers downloading from it, and at the origin the version's
:class:`SuperSeeder` (sized by ``SuperSeeder.for_pieces`` as the service does). All imported,
called with the arguments the sessions use; what stands in for I/O:

* a serving node writes the requests of its sessions in turn, up to ``SEND_BATCH`` bytes of one
  session's queue at a time, the next batch when its uplink is free (server.py's _serve_queue
  under Uploads; TCP sharing the uplink between the ``max_serving`` writers is modelled as this
  round robin); a request cancelled before its turn is never sent.
* a verified piece is told (Have) to every peer downloading from us that has not told us it holds
  it (service.on_piece_verified's have suppression), within ``HAVE_DELAY``; to the origin, whose
  super-seeder wants haves, at once. Hash checks and disk writes take no time.
* transfer sessions run only on direct connections (host.direct_peers): a NAT'd node reaches
  public nodes through connections it opened; two NAT'd nodes, or a public node and a NAT'd one that
  never dialled it, have only a relay circuit, which carries no checkpoint bytes.
* connections: every node dials the origin (its bootstrap peer) and then the peers the real
  :class:`ConnectionManager` plans (``conn_low``), before the version is published; the origin
  prunes itself down to ``conn_high`` by the same manager. A download short of ``max_peers`` direct
  peers then dials the public members its node's :class:`DialBook` chooses at each rescan, as
  client.py's Download._dial_public does (ShardsService.dials, one book per node shared by its
  downloads; membership's view is every node): peers it holds a relay circuit to first, then members
  it reached before, then members drawn from the records, ``SPECULATIVE_SLOTS`` of those in flight.
  A member's record says ``private`` for a NAT'd node (:func:`direct_addrs` gives no address to
  dial), ``public`` for the others, whose dials succeed after the handshake's round trips; a dial
  still in flight when its download ends is abandoned in the book (the real one is cancelled), and
  its connection, made all the same, stands. Nothing else changes during a transfer.
* no loss: the transfer runs on TCP, which turns loss into delay; links are the profile's.

The bound, Kumar & Ross (IEEE HotWeb 2006), for a file of F bytes from a seed of upload u_s to N
downloaders of upload u_i and download d_i, no matter how the file is cut:

    T_min = max(F / u_s, F / min_i d_i, N * F / (u_s + sum_i u_i))

(:func:`kumar_ross`). bench/sim_shards.py prints distribution time / T_min.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from node.gossip.connections import ConnectionManager
from node.gossip.membership import MembershipConfig
from node.shards.client import RESCAN_INTERVAL, RETRY_PEER_AFTER
from node.shards.config import ShardsConfig
from node.shards.manifest import choose_piece_size, pieces_for
from node.shards.peering import DialBook, direct_addrs, session_to_end, sessions_to_open
from node.shards.picker import Actions, Picker, PickerParams, Request
from node.shards.server import HAVE_DELAY, SEND_BATCH
from node.shards.superseed import SuperSeeder

from .events import Simulation
from .network import Endpoint, Network

ORIGIN = "origin"
SMALL_BYTES = 40  # a request, cancel, reject, hello or one Have, with framing
DATA_OVERHEAD = 40  # framing of a Data message
MBIT = 1e6 / 8


def kumar_ross(size: float, seed_up: float, ups: list[float], downs: list[float]) -> float:
    """Kumar & Ross's lower bound on the time to give ``size`` bytes to every downloader (see the
    module docstring): the seed's upload, the slowest download, the swarm's total upload."""
    return max(size / seed_up, size / min(downs), len(ups) * size / (seed_up + sum(ups)))


@dataclass
class Links:
    """How peers' links are drawn (issue 46: 10 % at 1 Gbit/s, the rest 10-100 Mbit/s up)."""

    fast_share: float = 0.1
    fast_mbit: float = 1000.0
    up_mbit: tuple[float, float] = (10.0, 100.0)
    down_mbit: tuple[float, float] = (300.0, 1000.0)
    latency: tuple[float, float] = (0.005, 0.06)  # one-way to the core, seconds
    nat: float = 0.3  # share of downloaders behind NAT
    seed_mbit: float = 1000.0  # the origin (a trainer in a data centre)

    @classmethod
    def namespaces(cls, mbit: float) -> "Links":
        """bench/shards.py swarm: one bridge, every host's upload capped at ``mbit`` (tbf), no NAT."""
        return cls(fast_share=0.0, up_mbit=(mbit, mbit), down_mbit=(10_000.0, 10_000.0),
                   latency=(0.0001, 0.0001), nat=0.0, seed_mbit=mbit)


@dataclass
class Serving:
    """One node's serving side of one version: the queued requests of each session, served in turn."""

    sessions: dict[str, deque[Request]] = field(default_factory=dict)  # downloader -> its queue
    turn: deque[str] = field(default_factory=deque)  # sessions with requests, in serving order
    busy: bool = False  # a batch is on the uplink
    written: dict[tuple[str, int], int] = field(default_factory=dict)  # super-seeding: bytes of a shown piece
    haves: dict[str, list[int]] = field(default_factory=dict)  # downloader -> pieces to tell it


class Holder:
    """One node's state for one version: its download (if it has not all of it) and its serving side."""

    def __init__(self, dist: "Distribution", pid: str, complete: bool):
        self.dist, self.pid = dist, pid
        n = dist.num_pieces
        self.verified: set[int] = set(range(n)) if complete else set()
        self.picker: Picker | None = None
        self.sessions: dict[str, bool] = {}  # client sessions: peer -> open (False while the hello is out)
        self.refused: dict[str, float] = {}
        self.serving = Serving()
        self.shown: dict[str, set[int]] = {}  # super-seeding: what each downloader was shown
        self.dialled: set[str] = set()  # public members this download dials now (client.py's Download.dialled)
        self.started: float | None = None
        self.done_at: float | None = 0.0 if complete else None
        self.poll_timer = None
        self.poll_at = math.inf

    # ------------------------------------------------------------------ the download (client.py)

    def start(self) -> None:
        """The announcement arrived: download (Download.run's loop: a rescan every RESCAN_INTERVAL)."""
        d = self.dist
        self.started = d.sim.now
        self.picker = Picker(d.piece_lengths, d.params, rng=random.Random(d.rng.random()))
        self.rescan()

    def rescan(self) -> None:
        """Download._connect_new: dial public members, then open sessions to direct peers."""
        d = self.dist
        if self.done_at is not None:
            return
        now = d.sim.now
        if d.dial_direct:
            self.dial_public(now)
        served = set(self.serving.sessions)
        opened, waiting = sessions_to_open(d.direct[self.pid], self.sessions, ORIGIN, served, d.cfg.max_peers,
                                           lambda p: now - self.refused.get(p, -math.inf) >= RETRY_PEER_AFTER,
                                           d.rng)
        for p in opened:
            self.sessions[p] = False
            d.send(self.pid, p, SMALL_BYTES, d.holders[p].on_hello, self.pid)
        if waiting:
            held = [p for p, up in self.sessions.items() if up]
            end = session_to_end(held, ORIGIN, served, self.picker.holds_all, self.picker.in_flight)
            if end is not None:
                self.end_session(end)
        d.sim.after(RESCAN_INTERVAL, self.rescan)

    def dial_public(self, now: float) -> None:
        """Download._dial_public: short of ``max_peers`` direct peers, dial the public members the
        node's DialBook chooses; their sessions open at a later rescan, once they are direct."""
        topo, book = self.dist.topo, self.dist.topo.dials[self.pid]
        direct = topo.direct[self.pid]
        book.note_direct(direct, now)
        chosen = book.to_dial(now, direct, list(topo.net.links[self.pid]), lambda: topo.members,
                              lambda p: direct_addrs(p, topo.addrs_of, topo.reachability_of),
                              lambda p: not self.picker.is_banned(p, now), self.dist.cfg.max_peers, self.dist.rng)
        for peer, _addrs in chosen:
            self.dialled.add(peer)
            topo.dial_direct(self.pid, peer, lambda ok, peer=peer: self._dialled(peer, ok))

    def _dialled(self, peer: str, ok: bool) -> None:
        if peer in self.dialled:  # not abandoned
            self.dialled.discard(peer)
            self.dist.topo.dials[self.pid].on_result(peer, ok, self.dist.sim.now)

    def _abandon_dials(self) -> None:
        """The download ended: its dials in flight are cancelled, which proves nothing of the members."""
        book, now = self.dist.topo.dials[self.pid], self.dist.sim.now
        for peer in sorted(self.dialled):
            book.on_result(peer, None, now)
        self.dialled.clear()

    def end_session(self, peer: str) -> None:
        self.sessions.pop(peer, None)
        self.picker.on_peer_gone(peer)
        self.dist.send(self.pid, peer, SMALL_BYTES, self.dist.holders[peer].on_goodbye, self.pid)

    def on_refused(self, peer: str) -> None:
        self.sessions.pop(peer, None)
        self.refused[peer] = self.dist.sim.now

    def on_bitfield(self, peer: str, pieces: set[int]) -> None:
        if peer not in self.sessions or self.done_at is not None:
            return
        self.sessions[peer] = True
        self.refused.pop(peer, None)
        self.picker.on_bitfield(peer, pieces)
        self.poll()

    def on_have(self, peer: str, pieces: list[int]) -> None:
        if not self.sessions.get(peer) or self.done_at is not None:
            return
        for i in pieces:
            self.picker.on_have(peer, i)
        self.poll()

    def on_reject(self, peer: str, piece: int, offset: int) -> None:
        if self.sessions.get(peer) and self.done_at is None:
            self.picker.on_reject(peer, piece, offset)
            self.poll()

    def on_data(self, peer: str, piece: int, offset: int, length: int) -> None:
        if self.done_at is not None:
            return
        d, now = self.dist, self.dist.sim.now
        kept, acts = self.picker.on_block(peer, piece, offset, length, now)
        self.apply(acts)
        if kept and self.picker.piece_ready(piece):
            self.apply(self.picker.on_piece_verified(piece, now))
            self.verified.add(piece)
            d.on_piece_verified(self, piece)
            if self.picker.complete:
                self.done_at = now
                self._abandon_dials()
                for p in list(self.sessions):
                    self.end_session(p)
                return
        self.poll()

    def poll(self) -> None:
        """Download.run's loop body: the picker's actions now, and again at its next deadline."""
        now = self.dist.sim.now
        self.apply(self.picker.poll(now))
        due = self.picker.next_deadline()
        if due < self.poll_at:  # a later deadline is met by the earlier timer's poll
            if self.poll_timer is not None:
                self.poll_timer.cancel()
            self.poll_at, self.poll_timer = due, self.dist.sim.at(due, self._deadline)

    def _deadline(self) -> None:
        self.poll_timer, self.poll_at = None, math.inf
        if self.done_at is None:
            self.poll()

    def apply(self, acts: Actions) -> None:
        d = self.dist
        for r in acts.requests:
            d.send(self.pid, r.peer, SMALL_BYTES, d.holders[r.peer].on_request, self.pid, r)
        for c in acts.cancels:
            d.send(self.pid, c.peer, SMALL_BYTES, d.holders[c.peer].on_cancel, self.pid, c.piece, c.offset)
        for p in [*acts.dropped, *(p for p, _ in acts.banned)]:
            if p in self.sessions:
                self.end_session(p)

    # ------------------------------------------------------------------ serving (server.py)

    def on_hello(self, peer: str) -> None:
        d = self.dist
        if self.picker is None and self.done_at is None:  # not holding the version (yet): refused
            d.send(self.pid, peer, SMALL_BYTES, d.holders[peer].on_refused, self.pid)
            return
        self.serving.sessions[peer] = deque()
        pieces = set(self.verified)
        if d.seeder is not None and self.pid == ORIGIN:
            self.shown[peer] = set()
            d.route_reveals(d.seeder.on_bitfield(peer, d.holders[peer].verified, d.sim.now))
            pieces = self.shown[peer]
        d.send(self.pid, peer, SMALL_BYTES + d.num_pieces // 8, d.holders[peer].on_bitfield, self.pid, set(pieces))

    def on_goodbye(self, peer: str) -> None:
        self.serving.sessions.pop(peer, None)
        if self.pid == ORIGIN and self.dist.seeder is not None:
            self.shown.pop(peer, None)
            self.dist.route_reveals(self.dist.seeder.on_peer_gone(peer, self.dist.sim.now))

    def may_serve(self, peer: str, piece: int) -> bool:
        shown = self.shown.get(peer)
        return piece in self.verified and (self.dist.seeder is None or self.pid != ORIGIN or piece in shown)

    def on_request(self, peer: str, req: Request) -> None:
        d = self.dist
        queue = self.serving.sessions.get(peer)
        if queue is None:
            return
        if not self.may_serve(peer, req.piece):
            d.send(self.pid, peer, SMALL_BYTES, d.holders[peer].on_reject, self.pid, req.piece, req.offset)
            return
        if not queue:
            self.serving.turn.append(peer)
        queue.append(req)
        self.serve()

    def on_cancel(self, peer: str, piece: int, offset: int) -> None:
        queue = self.serving.sessions.get(peer)
        if queue:
            for r in list(queue):
                if r.piece == piece and r.offset == offset:
                    queue.remove(r)

    def serve(self) -> None:
        """Write the next session's batch once the uplink is free (see the module docstring)."""
        sv, d = self.serving, self.dist
        if sv.busy:
            return
        while sv.turn:
            peer = sv.turn.popleft()
            queue = sv.sessions.get(peer)
            if not queue:
                continue
            size = 0
            while queue and size < SEND_BATCH:
                r = queue.popleft()
                d.send(self.pid, peer, r.length + DATA_OVERHEAD, d.holders[peer].on_data, self.pid,
                       r.piece, r.offset, r.length)
                size += r.length
                if self.pid == ORIGIN and d.seeder is not None:
                    self.note_written(peer, r)
            if queue:
                sv.turn.append(peer)
            sv.busy = True
            d.sim.at(d.net.endpoints[self.pid].up_free, self._written)
            return

    def _written(self) -> None:
        self.serving.busy = False
        self.serve()

    def note_written(self, peer: str, r: Request) -> None:
        """Super-seeding: the last byte of a shown piece is on its way (server._note_written)."""
        d, key = self.dist, (peer, r.piece)
        if r.piece not in self.shown.get(peer, ()):
            return
        done = self.serving.written.get(key, 0) + r.length
        if done < d.piece_lengths[r.piece]:
            self.serving.written[key] = done
            return
        self.serving.written.pop(key, None)
        d.sim.at(d.net.endpoints[self.pid].up_free, lambda: d.route_reveals(d.seeder.on_sent(peer, r.piece, d.sim.now)))

    def push_have(self, peer: str, piece: int) -> None:
        """Tell a downloader we serve ``piece``, with the other Haves of the next HAVE_DELAY."""
        haves = self.serving.haves
        if peer not in haves:
            haves[peer] = []
            self.dist.sim.after(HAVE_DELAY, self._flush_haves, peer)
        haves[peer].append(piece)

    def _flush_haves(self, peer: str) -> None:
        pieces = self.serving.haves.pop(peer, [])
        if peer in self.serving.sessions and pieces:
            self.dist.send(self.pid, peer, SMALL_BYTES * len(pieces), self.dist.holders[peer].on_have, self.pid, pieces)


class Distribution:
    """One version (a full checkpoint or a delta) spreading from the origin to the other nodes of a
    :class:`Topology`; ``run()`` returns when every one holds it, or at ``limit``."""

    def __init__(self, topo: "Topology", size: int, *, piece_size: int = 0, block_size: int | None = None,
                 super_seed: bool = True, hand_over: bool = True, dial_direct: bool = True, race: bool = True):
        self.topo, self.sim, self.net, self.rng = topo, topo.sim, topo.net, topo.rng
        self.cfg, self.direct = topo.cfg, topo.direct
        self.size = size
        ps = choose_piece_size(size, piece_size)
        n = pieces_for(size, ps)
        self.num_pieces = n
        self.piece_lengths = [min(ps, size - i * ps) for i in range(n)]
        self.params = PickerParams(block_size=min(block_size or self.cfg.block_size, ps),
                                   request_timeout=self.cfg.request_timeout, ban_seconds=self.cfg.ban_seconds,
                                   max_request=max(PickerParams.max_request, min(block_size or 0, ps)),
                                   race_factor=PickerParams.race_factor if race else math.inf)
        self.seeder = (SuperSeeder.for_pieces(n, ps, random.Random(self.rng.random()), hand_over=hand_over)
                       if super_seed else None)
        self.holders = {p: Holder(self, p, p == ORIGIN) for p in topo.peers}
        # Downloads short of direct peers dial public ones (Holder.dial_public); without
        # that, NAT'd nodes holding only relay circuits get nothing and are left out of the run.
        self.dial_direct = dial_direct
        self.left_out = set() if dial_direct else topo.stranded
        self.t0 = self.sim.now

    def send(self, a: str, b: str, nbytes: int, deliver, *args) -> None:
        if not self.net.send(a, b, nbytes, deliver, *args, lossy=False):
            raise RuntimeError(f"no connection {a} -> {b}")  # we are wrong: sessions run on connections

    def route_reveals(self, reveals: list[tuple[str, int]]) -> None:
        """The origin shows these pieces to these downloaders (service.route_reveals)."""
        origin = self.holders[ORIGIN]
        for peer, piece in reveals:
            if peer in origin.serving.sessions and piece not in origin.shown[peer]:
                origin.shown[peer].add(piece)
                self.send(ORIGIN, peer, SMALL_BYTES, self.holders[peer].on_have, ORIGIN, [piece])

    def on_piece_verified(self, h: Holder, piece: int) -> None:
        """service.on_piece_verified: Have to every peer downloading from ``h`` but those known to
        hold the piece; the origin (which wants haves) is told at once."""
        for peer in h.serving.sessions:
            if not h.picker.peer_has(peer, piece):
                h.push_have(peer, piece)
        if self.seeder is not None and h.sessions.get(ORIGIN):
            self.send(h.pid, ORIGIN, SMALL_BYTES, self._origin_have, h.pid, piece)

    def _origin_have(self, peer: str, piece: int) -> None:
        if peer in self.holders[ORIGIN].serving.sessions:
            self.route_reveals(self.seeder.on_have(peer, piece, self.sim.now))

    def _stalled(self) -> None:
        """server._reveal_stalled: pieces stuck at a slow first recipient are shown again."""
        if not self.done():
            self.route_reveals(self.seeder.reveal(self.sim.now))
            self.sim.after(self.seeder.stall_seconds / 4, self._stalled)

    def done(self) -> bool:
        """Every node holds the version, but those left out (no transfer session can reach them)."""
        return all(h.done_at is not None for p, h in self.holders.items() if p not in self.left_out)

    def run(self, limit: float, announce_hops: int = 2) -> float | None:
        """Announce (gossip: ``announce_hops`` one-way trips from the origin), then run until every
        node holds the version; the time from the announcement, or None past ``limit``."""
        for p, h in self.holders.items():
            if p != ORIGIN and p not in self.left_out:
                self.sim.after(announce_hops * self.net.one_way(ORIGIN, p), h.start)
        if self.seeder is not None:
            self.sim.after(self.seeder.stall_seconds / 4, self._stalled)
        step = 1.0
        while self.sim.now - self.t0 < limit:
            self.sim.run(self.sim.now + step)
            if self.done():
                return max(h.done_at for h in self.holders.values() if h.done_at is not None) - self.t0
        return None

    def bound(self) -> float:
        e = self.net.endpoints
        others = [p for p in self.holders if p != ORIGIN and p not in self.left_out]
        return kumar_ross(self.size, e[ORIGIN].up, [e[p].up for p in others], [e[p].down for p in others])


class Topology:
    """The origin and ``n`` downloaders on one simulated network, connected before the version is out."""

    def __init__(self, n: int, links: Links, *, seed: int = 0, cfg: ShardsConfig | None = None,
                 members: MembershipConfig | None = None):
        self.cfg = cfg or ShardsConfig()
        self.rng = random.Random(seed)
        self.sim = Simulation()
        self.net = Network(self.sim, rng=random.Random(self.rng.random()))
        self.peers = [ORIGIN] + [f"n{i:05d}" for i in range(n)]
        r = self.rng
        self.net.add(ORIGIN, Endpoint(latency=r.uniform(*links.latency), up=links.seed_mbit * MBIT,
                                      down=max(links.seed_mbit, links.down_mbit[1]) * MBIT))
        for p in self.peers[1:]:
            fast = r.random() < links.fast_share
            up = links.fast_mbit if fast else r.uniform(*links.up_mbit)
            down = max(up, links.fast_mbit if fast else r.uniform(*links.down_mbit))
            nat = not fast and r.random() < links.nat
            self.net.add(p, Endpoint(latency=r.uniform(*links.latency), up=up * MBIT, down=down * MBIT,
                                     nat=nat, relay=ORIGIN if nat else None))
        self._connect(members or MembershipConfig())
        self.direct = {p: [q for q, relay in self.net.links[p].items() if relay is None] for p in self.peers}
        # NAT'd nodes whose every connection is a relay circuit: no transfer session can reach them.
        self.stranded = {p for p in self.peers if not self.direct[p]}
        self.members = {p: "worker" for p in self.peers}  # membership's view (MemberAddrs.members)
        self.dials = {p: DialBook(p) for p in self.peers}  # ShardsService.dials, shared by a node's downloads

    def addrs_of(self, peer: str) -> list[str]:
        """The addresses ``peer``'s member record advertises: its listen address, and for a NAT'd
        node its relayed one beside it (MemberAddrs.addrs_of)."""
        e = self.net.endpoints[peer]
        if e.nat:
            return ["/ip4/192.168.1.2/tcp/4001", f"/dns4/{e.relay}/tcp/4001/p2p/{e.relay}/p2p-circuit"]
        return [f"/dns4/{peer}/tcp/4001"]

    def reachability_of(self, peer: str) -> str:
        """What ``peer``'s record says of it (dial-back has answered every node here)."""
        return "private" if self.net.endpoints[peer].nat else "public"

    def dial_direct(self, a: str, b: str, done: Callable[[bool], object]) -> None:
        """``a`` dials public ``b``'s direct address; a relay circuit between them gives way to the
        direct connection once it is up (a circuit carries no checkpoint bytes). ``done(ok)`` then."""
        def opened(ok: bool) -> None:
            if ok and b not in self.direct[a]:
                self.direct[a].append(b)
                self.direct[b].append(a)
            done(ok)
        if self.net.links[a].get(b) is not None:
            self.net.close(a, b)
        self.net.dial(a, b, opened)

    def _connect(self, members: MembershipConfig) -> None:
        """Every node dials its bootstrap peer (the origin), then as the ConnectionManager plans;
        the origin prunes down to conn_high. A dial by a NAT'd node, or to a public one, is direct;
        otherwise the connection is a relay circuit (here: through the callee's relay)."""
        e, links = self.net.endpoints, self.net.links
        all_peers = {p: "worker" for p in self.peers}

        def connect(a: str, b: str) -> None:
            relay = e[b].relay if e[b].nat else None
            links[a][b] = links[b][a] = relay

        for p in self.peers[1:]:
            connect(p, ORIGIN)
        for p in self.rng.sample(self.peers[1:], len(self.peers) - 1):
            manager = ConnectionManager(members.conn_low, members.conn_high, members.dial_backoff,
                                        rng=random.Random(self.rng.random()))
            plan = manager.plan(set(links[p]), {q: r for q, r in all_peers.items() if q != p}, {ORIGIN}, 0.0)
            for q in plan.dial:
                connect(p, q)
        origin = ConnectionManager(members.conn_low, members.conn_high, members.dial_backoff,
                                   rng=random.Random(self.rng.random()))
        for q in origin.plan(set(links[ORIGIN]), all_peers, set(), 0.0).prune:
            self.net.close(ORIGIN, q)
