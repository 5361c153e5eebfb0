"""Membership on the simulated network: node/gossip/membership.py's own state machines, driven.

Each :class:`SimNode` holds what a running node's ``serve_membership`` holds (node/gossip/service.py):
the MemberTable, SyncPlanner, ConnectionManager, AddressBackoff, BootstrapRedial, CloseWatch and LocalHealth, all
imported, never re-implemented, and called at the moments and with the arguments the service uses
(its loops become timers: a probe round per ``probe_period``, a tick per ``TICK``, the connection
manager every 2 s, the record at once on a change and every ``refresh_interval(size)``).

What stands in for I/O:

* gossipsub (py-libp2p, not ours) as a model: our own message goes to every connected peer (v1.1
  flood publishing), a forwarded one to the mesh, up to D = 6 peers among the connections, kept
  between D_lo = 4 and D_hi = 12 each heartbeat with symmetric GRAFTs; each heartbeat sends IHAVE
  for the ids seen in the last 3 heartbeats to 6 non-mesh peers (with 6
  mesh copies a loss is mostly healed by another copy; a node outside every mesh that carried it
  asks for it with IWANT, and gets it, as gossipsub's repair does).
* records are not signed here (the signature check is the envelope layer's, not the table's);
  sizes are the measured ones the load model uses (RECORD_BYTES, GOSSIP_MSG_OVERHEAD, PROBE_BYTES).
* libp2p ping and the probe protocol's ping-req are one message each way on the connection.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from node.gossip.connections import AddressBackoff, BootstrapRedial, CloseWatch, ConnectionManager
from node.gossip.membership import (
    GOSSIP_ID_BYTES,
    GOSSIP_LAZY,
    GOSSIP_MSG_OVERHEAD,
    GOSSIP_WINDOW,
    PROBE_BYTES,
    RECORD_BYTES,
    LocalHealth,
    MembershipConfig,
    MemberState,
    MemberTable,
    RecordRefresh,
    SyncPlanner,
    Verdict,
    next_seq,
)
from node.gossip.records import Accusation, Goodbye, PeerRecord
from node.gossip.service import CONNECTION_PERIOD, DIAL_TIMEOUT, HOUSEKEEPING, SYNC_BATCH, TICK

from .events import Simulation
from .network import Endpoint, Network

RUN = "sim"
EPOCH_S = 1.8e9  # the simulated nodes' wall clock at virtual time 0 (seqs are wall-clock ms)
MESH_D, MESH_LO, MESH_HI = 6, 4, 12  # gossipsub mesh degree bounds (gossipsub v1.1 defaults)
HEARTBEAT = 1.0  # gossipsub heartbeat, seconds
SEEN_TTL = 120.0  # gossipsub seen-message cache, seconds
ACCUSATION_BYTES = 260  # signed accusation envelope (two peer ids, run, seq, key, signature)
GOODBYE_BYTES = 210
SMALL_BYTES = 80  # ping-req answer, Prune, GRAFT/PRUNE control
PING_REQ_BYTES = 200  # target id and its addresses
RPC_BYTES = 40  # per-RPC framing of a gossipsub control message


def wall_ms(now: float) -> int:
    return int((EPOCH_S + now) * 1000)


@dataclass
class Gossip:
    """One message on the members topic: (author, counter) is its id, as gossipsub's (from, seqno)."""

    author: str
    counter: int
    domain: str  # "record", "suspect", "dead", "goodbye"
    message: PeerRecord | Accusation | Goodbye
    size: int
    cause: str = ""  # why it was published, for the traffic breakdown (start, refresh, change, refute...)


@dataclass
class Counters:
    """Swarm-wide event counts the benchmark reads."""

    suspicions: list[tuple[float, str, str, bool]] = field(default_factory=list)  # (time, accuser, target, target up)
    refutations: int = 0


class SimNode:
    """One member: the state a running node's membership service holds, and its loops as timers."""

    def __init__(self, swarm: "Swarm", pid: str, bootstrap: list[str], rng: random.Random, reachability: str):
        self.swarm, self.pid, self.bootstrap, self.rng = swarm, pid, bootstrap, rng
        cfg = swarm.config
        self.table = MemberTable(pid, cfg, rng=random.Random(rng.random()))
        self.sync = SyncPlanner()
        self.conn = ConnectionManager(cfg.conn_low, cfg.conn_high, cfg.dial_backoff, rng=random.Random(rng.random()))
        self.backoff = AddressBackoff(cfg.dial_backoff, cfg.dial_backoff_max)
        self.redial = BootstrapRedial(rng=random.Random(pid))  # its own stream: the seeded draws above stay as they were
        self.watch = CloseWatch()
        self.health = LocalHealth()
        self.record = PeerRecord(run=RUN, peer_id=pid, role="relay", addrs=[swarm.address_of(pid)],
                                 software="sim", seq=next_seq(0, wall_ms(swarm.sim.now)),
                                 reachability=reachability)
        self.mesh: set[str] = set()
        self.seen: dict[tuple[str, int], float] = {}
        self.window: list[list[Gossip]] = [[] for _ in range(GOSSIP_WINDOW)]  # seen per heartbeat (mcache)
        self.counter = 0
        self.refresh = RecordRefresh()
        self.running = True
        self.started = swarm.sim.now
        self.ready: float | None = None  # when its loops started (after the bootstrap dial)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Dial the bootstrap peers first (the node's startup does, before its services run), then
        run the service's loops; the record is published at once, as the service's first change."""
        if not self.bootstrap:
            return self._run()
        pending = _Once(lambda ok: self._run())
        self.swarm.sim.after(DIAL_TIMEOUT, pending, False)
        for b in self.bootstrap:
            self.swarm.net.dial(self.pid, b, pending)

    def _run(self) -> None:
        if not self.running:
            return
        sim = self.swarm.sim
        self.ready = sim.now
        jitter = self.rng.random
        sim.after(jitter() * self.swarm.config.probe_period, self.probe_round)
        sim.after(jitter() * self.swarm.tick, self.tick)
        sim.after(jitter() * HEARTBEAT, self.heartbeat)
        sim.after(0.0, self.connection_loop)
        sim.after(0.0, self.publish_record, "start")

    def leave(self) -> None:
        """A clean shutdown: the goodbye goes out, then the endpoint stops."""
        self.publish("goodbye", Goodbye(run=RUN, peer_id=self.pid, seq=self.record.seq), GOODBYE_BYTES, "goodbye")
        self.swarm.sim.after(0.2, self.crash, True, 0.0)

    def crash(self, refuses: bool, notice: float) -> None:
        self.running = False
        self.swarm.net.go_down(self.pid, refuses=refuses, notice=notice)

    # ------------------------------------------------------------------ gossip

    def publish(self, domain: str, message, size: int, cause: str) -> None:
        self.counter += 1
        msg = Gossip(self.pid, self.counter, domain, message, size + GOSSIP_MSG_OVERHEAD, cause)
        self.seen[(self.pid, self.counter)] = self.swarm.sim.now
        self.window[-1].append(msg)
        for p in self.swarm.net.connected(self.pid):  # flood publishing (gossipsub v1.1)
            self.forward(p, msg)

    def forward(self, peer: str, msg: Gossip) -> None:
        other = self.swarm.nodes[peer]
        self.swarm.net.send(self.pid, peer, msg.size, other.on_gossip, msg, self.pid, skip=other.has_seen,
                            kind=f"gossip:{msg.cause}")

    def has_seen(self, msg: Gossip, _sender: str = "") -> bool:
        """A copy of ``msg`` would change nothing here (on_gossip drops it unread)."""
        return (msg.author, msg.counter) in self.seen

    def on_gossip(self, msg: Gossip, sender: str) -> None:
        if not self.running:
            return
        key = (msg.author, msg.counter)
        if key in self.seen:
            return
        now = self.swarm.sim.now
        self.seen[key] = now
        self.window[-1].append(msg)
        self.apply(msg, now)
        for p in self.mesh:
            if p != sender and p != msg.author:
                self.forward(p, msg)

    def apply(self, msg: Gossip, now: float) -> None:
        """What the service's ``apply`` does with one checked message from the topic."""
        m = msg.message
        if isinstance(m, PeerRecord):
            self.table.on_record(m, now, msg.author)
        elif isinstance(m, Accusation):
            verdict = self.table.on_accusation(m, msg.domain == "dead", now)
            if verdict is Verdict.SELF and m.seq >= self.record.seq:
                self.refute(m.seq)
                self.table.note_refuted(m.accuser, now)
        else:
            self.table.on_goodbye(m, now)

    def move_address(self) -> None:
        """Our relay changed (a NAT'd node's reservation): the service's housekeeping updates the
        record's addresses, which is a change, published at once."""
        now = self.swarm.sim.now
        self.record = replace(self.record, addrs=[self.swarm.address_of(self.pid)],
                              seq=next_seq(self.record.seq, wall_ms(now)))
        self.publish_record("change")

    def refute(self, above: int) -> None:
        now = self.swarm.sim.now
        self.record = replace(self.record, seq=next_seq(max(self.record.seq, above), wall_ms(now)))
        self.swarm.counters.refutations += 1
        self.publish_record("refute")

    def publish_record(self, cause: str) -> None:
        """The service's serve_record: at start and at once on a change; the tick republishes it
        when RecordRefresh says the refresh is due."""
        if not self.running:
            return
        self.refresh.on_published(self.swarm.sim.now, len(self.swarm.net.connected(self.pid)))  # flood publishing
        self.publish("record", self.record, RECORD_BYTES, cause)

    def heartbeat(self) -> None:
        """Gossipsub's heartbeat: keep the mesh between D_lo and D_hi, send IHAVE, expire seen ids."""
        if not self.running:
            return
        net, now = self.swarm.net, self.swarm.sim.now
        connected = net.connected(self.pid)
        self.mesh &= connected
        if len(self.mesh) < MESH_LO:
            spare = sorted(connected - self.mesh)
            self.rng.shuffle(spare)
            for p in spare[: MESH_D - len(self.mesh)]:
                self.mesh.add(p)
                net.send(self.pid, p, SMALL_BYTES, self.swarm.nodes[p].on_graft, self.pid, kind="graft")
        elif len(self.mesh) > MESH_HI:
            extra = sorted(self.mesh)
            self.rng.shuffle(extra)
            for p in extra[: len(self.mesh) - MESH_D]:
                self.mesh.discard(p)
                net.send(self.pid, p, SMALL_BYTES, self.swarm.nodes[p].on_graft_pruned, self.pid, kind="graft")
        have = [m for w in self.window for m in w]
        if have:
            lazy = sorted(connected - self.mesh)
            for p in self.rng.sample(lazy, min(GOSSIP_LAZY, len(lazy))):
                net.send(self.pid, p, RPC_BYTES + len(have) * GOSSIP_ID_BYTES, self.swarm.nodes[p].on_ihave,
                         self.pid, have, kind="ihave")
        self.window = self.window[1:] + [[]]
        if len(self.seen) > 64:  # entries are added in time order: the expired ones come first
            expired = list(itertools.takewhile(lambda kt: now - kt[1] >= SEEN_TTL, self.seen.items()))
            for k, _ in expired:
                del self.seen[k]
        self.swarm.sim.after(HEARTBEAT, self.heartbeat)

    def on_ihave(self, peer: str, have: list[Gossip]) -> None:
        """IHAVE: ask (IWANT) for the ids we have not seen; the peer answers with the messages."""
        if not self.running:
            return
        want = [m for m in have if (m.author, m.counter) not in self.seen]
        if want:
            self.swarm.net.send(self.pid, peer, RPC_BYTES + len(want) * GOSSIP_ID_BYTES,
                                self.swarm.nodes[peer].on_iwant, self.pid, want, kind="iwant")

    def on_iwant(self, peer: str, want: list[Gossip]) -> None:
        if self.running:
            for m in want:
                self.forward(peer, m)

    def on_graft(self, peer: str) -> None:
        if self.running and len(self.mesh) < MESH_HI and self.swarm.net.is_connected(self.pid, peer):
            self.mesh.add(peer)

    def on_graft_pruned(self, peer: str) -> None:
        self.mesh.discard(peer)

    # ------------------------------------------------------------------ probing (service.py's probe)

    def probe_round(self) -> None:
        if not self.running:
            return
        self.health.on_round(0.0, self.swarm.config.probe_timeout / 2)  # a simulated loop is never late
        now = self.swarm.sim.now
        connected = self.swarm.net.connected(self.pid)
        target = self.table.next_probe_target(connected - self.watch.closing(now))
        period = self.swarm.config.probe_period
        if target is None:
            self.swarm.sim.after(period, self.probe_round)
        else:
            # The service awaits the probe before sleeping again: a slow probe delays the next round.
            self.probe(target, self.health.scale(), lambda: self.swarm.sim.after(period, self.probe_round))

    def probe(self, target: str, scale: int, then: Callable[[], object] = lambda: None) -> None:
        cfg, started = self.swarm.config, self.swarm.sim.now

        def direct(ok: bool) -> None:
            if not self.running:  # crashed or left while it waited: a stopped process concludes nothing
                return
            if ok:
                self.table.on_probe_ok(target, self.swarm.sim.now)
                return then()
            self.health.on_probe_missed()
            helpers = self.table.indirect_helpers(target, self.swarm.net.connected(self.pid), cfg.indirect_probes)
            if not helpers:
                return verdict([])
            results: list[bool] = []
            for h in helpers:
                self.call_ping_req(h, target, cfg.indirect_timeout * scale + DIAL_TIMEOUT + 1,
                                   lambda ok: (results.append(ok), len(results) == len(helpers) and verdict(results)))

        def verdict(results: list[bool]) -> None:
            if not self.running:
                return
            now = self.swarm.sim.now
            if any(results):
                self.table.on_probe_ok(target, now)
            elif not self.watch.closed_on_purpose_since(target, started):
                alive = self.table.state_of(target) is MemberState.ALIVE
                acc = self.table.on_probe_failed(target, now)
                if alive:  # our suspicion, whether or not there is an accusation to publish
                    up = self.swarm.nodes[target].running
                    self.swarm.counters.suspicions.append((now, self.pid, target, up))
                if acc is not None:
                    self.publish("suspect", acc, ACCUSATION_BYTES, "suspect")
            then()

        self.ping_once(target, cfg.probe_timeout * scale, direct)

    def ping_once(self, peer: str, timeout: float, done: Callable[[bool], object]) -> None:
        """The service's ping_once: dial first if not connected (through the address backoff)."""
        sim, net = self.swarm.sim, self.swarm.net
        once = _Once(done)
        if net.is_connected(self.pid, peer):
            sim.after(timeout, once, False)
            self._ping(peer, once)
            return
        sim.after(timeout + DIAL_TIMEOUT, once, False)
        self.dial_limited(peer, lambda ok: self._ping(peer, once) if ok else once(False))

    def _ping(self, peer: str, once: "_Once") -> None:
        net = self.swarm.net  # the answer is the peer's transport's, not its membership's
        net.send(self.pid, peer, PROBE_BYTES // 2,
                 lambda: net.send(peer, self.pid, PROBE_BYTES // 2, once, True, kind="ping"), kind="ping")

    def call_ping_req(self, helper: str, target: str, timeout: float, done: Callable[[bool], object]) -> None:
        once = _Once(done)
        self.swarm.sim.after(timeout, once, False)
        h = self.swarm.nodes[helper]

        def ask(ok: bool) -> None:
            if ok:
                self.swarm.net.send(self.pid, helper, PING_REQ_BYTES, h.answer_ping_req, self.pid, target, once,
                                    kind="ping-req")
            else:
                once(False)

        if self.swarm.net.is_connected(self.pid, helper):
            ask(True)
        else:
            self.dial_limited(helper, ask)

    def answer_ping_req(self, asker: str, target: str, reply: "_Once") -> None:
        if not self.running:
            return
        def answer(ok: bool) -> None:
            self.swarm.net.send(self.pid, asker, SMALL_BYTES, reply, ok, kind="ping-req")
        if not self.table.is_live(target):
            return answer(False)
        self.ping_once(target, self.swarm.config.indirect_timeout, answer)

    # ------------------------------------------------------------------ dialling

    def dial_limited(self, peer: str, done: Callable[[bool], object]) -> None:
        """The service's dial_limited: only the addresses out of backoff; their outcome updates it."""
        now = self.swarm.sim.now
        m = self.table.members.get(peer)
        addrs = list(m.record.addrs) if m else ([self.swarm.address_of(peer)] if peer in self.bootstrap else [])
        ready = self.backoff.reserve(addrs, now)
        if not ready:
            self.swarm.sim.after(0.0, done, False)
            return
        once = _Once(done)

        def outcome(ok: bool) -> None:
            t = self.swarm.sim.now
            for a in ready:
                self.backoff.on_connected(a) if ok else self.backoff.on_failed(a, t)
            if ok:
                self.table.on_reached(peer, t)
            once(ok)

        self.swarm.sim.after(DIAL_TIMEOUT, outcome_once := _Once(outcome), False)
        self.swarm.net.dial(self.pid, peer, outcome_once)

    # ------------------------------------------------------------------ the tick (service.py's tick_loop)

    def tick(self) -> None:
        if not self.running:
            return
        sim, net, cfg = self.swarm.sim, self.swarm.net, self.swarm.config
        now = sim.now
        for acc in self.table.tick(now):
            self.publish("dead", acc, ACCUSATION_BYTES, "dead")
        if self.refresh.due(now, self.table.size(), cfg, len(net.connected(self.pid))):
            self.publish_record("refresh")
        connected = net.connected(self.pid)
        for p in connected:
            self.table.on_reached(p, now)
        for p in self.watch.lost(connected, now, self.table.is_live):
            self.probe(p, self.health.scale())
        for p in self.sync.plan(connected, now, cfg.sync_interval(self.table.size()), self.rng):
            self.push_pull(p)
        sim.after(self.swarm.tick, self.tick)

    def table_envelopes(self) -> list[PeerRecord]:
        return [self.record] + [m.record for m in self.table.members.values()
                                if m.state in (MemberState.ALIVE, MemberState.SUSPECT)]

    def push_pull(self, peer: str) -> None:
        source = None if not self.sync.joined else peer
        records = self.table_envelopes()
        self.swarm.net.send(self.pid, peer, _batch_bytes(len(records)), self.swarm.nodes[peer].handle_sync,
                            self.pid, records, source, kind="sync-join" if source is None else "sync")

    def handle_sync(self, peer: str, records: list[PeerRecord], their_source: str | None) -> None:
        if not self.running:
            return
        self.receive(records, peer)
        mine = self.table_envelopes()
        self.swarm.net.send(self.pid, peer, _batch_bytes(len(mine)), self.swarm.nodes[peer].receive, mine, their_source,
                            kind="sync-join-answer" if their_source is None else "sync-answer")

    def receive(self, records: list[PeerRecord], source: str | None) -> None:
        if not self.running:
            return
        now = self.swarm.sim.now
        for r in records:
            self.table.on_record(r, now, source, exchange=True)
        self.sync.on_synced()

    # ------------------------------------------------------------------ connections (service.py's serve_connections)

    def connection_loop(self) -> None:
        if not self.running:
            return
        net, now = self.swarm.net, self.swarm.sim.now
        connected = net.connected(self.pid)
        if self.redial.due(self.conn.needs_bootstrap(connected, set(self.bootstrap)), not connected, now):
            for b in self.bootstrap:
                net.dial(self.pid, b, _noop)
        plan = self.conn.plan(connected, self.table.alive_roles(), set(self.bootstrap), now,
                              dialable=lambda p: any(self.backoff.ready(a, now) for a in self.table.members[p].record.addrs))
        for p in plan.dial:
            self.dial_member(p)
        for p in plan.prune:
            self.prune(p)
        self.swarm.sim.after(CONNECTION_PERIOD, self.connection_loop)

    def dial_member(self, peer: str) -> None:
        def done(ok: bool) -> None:
            if ok:
                self.conn.on_connected(peer)
            else:
                self.conn.on_dial_failed(peer, self.swarm.sim.now)
        self.dial_limited(peer, done)

    def prune(self, peer: str) -> None:
        """Announce the close (Prune), then close once the peer has noted it."""
        net = self.swarm.net
        self.watch.on_prune_sent(peer, self.swarm.sim.now)
        other = self.swarm.nodes[peer]
        net.send(self.pid, peer, SMALL_BYTES, other.on_prune, self.pid, kind="prune")
        self.swarm.sim.after(2 * net.one_way(self.pid, peer) + 0.01, net.close, self.pid, peer)

    def on_prune(self, peer: str) -> None:
        if self.running:
            self.watch.on_prune_received(peer, self.swarm.sim.now)


class _Once:
    """A callback that runs once: the first of an answer and a timeout wins."""

    __slots__ = ("fn", "done")

    def __init__(self, fn: Callable[[bool], object]):
        self.fn, self.done = fn, False

    def __call__(self, ok: bool) -> None:
        if not self.done:
            self.done = True
            self.fn(ok)


def _noop(*_args) -> None:
    return None


def _batch_bytes(records: int) -> int:
    frames = max(1, math.ceil(records / SYNC_BATCH))
    return records * RECORD_BYTES + frames * RPC_BYTES


@dataclass
class Profile:
    """How endpoints are drawn: one-way latency to the core, link speeds, the share behind NAT."""

    latency: tuple[float, float] = (0.005, 0.06)  # seconds, uniform
    up_mbit: tuple[float, float] = (10.0, 100.0)
    down_mbit: tuple[float, float] = (50.0, 500.0)
    nat: float = 0.0  # fraction of non-bootstrap nodes behind NAT
    # The bootstrap nodes' up- and downlink: servers, as a swarm's bootstrap peers are. Every join
    # pulls the whole table from one (N * RECORD_BYTES: 400 kB at N = 1,000); drawn like a home
    # node's 10-100 Mbit/s, a ramp of 20 joins a second queued its uplink for tens of seconds (one
    # FIFO here, where a server's fair queueing would still answer pings) and left views at 61 %.
    server_mbit: float = 1000.0

    @classmethod
    def loopback(cls) -> "Profile":
        """One machine's loopback, as bench/membership.py runs: no NAT, ~0 latency, fast links."""
        return cls(latency=(0.00005, 0.00005), up_mbit=(8000.0, 8000.0), down_mbit=(8000.0, 8000.0), server_mbit=8000.0)


class Swarm:
    """Nodes on one simulated network; ``spawn``, ``leave`` and ``crash`` are the churn."""

    def __init__(self, config: MembershipConfig | None = None, *, seed: int = 0, loss: float = 0.0,
                 profile: Profile | None = None, tick: float = TICK):
        self.config = config or MembershipConfig()
        self.config.validate()
        self.rng = random.Random(seed)
        self.sim = Simulation()
        self.net = Network(self.sim, loss=loss, rng=random.Random(self.rng.random()))
        self.profile = profile or Profile()
        self.tick = tick
        self.nodes: dict[str, SimNode] = {}
        self.bootstrap: list[str] = []
        self.counters = Counters()
        self._ids = 0

    def address_of(self, pid: str) -> str:
        ep = self.net.endpoints[pid]
        if ep.nat:
            return f"/ip4/10.0.0.1/tcp/4001/p2p/{ep.relay}/p2p-circuit/p2p/{pid}"
        return f"/ip4/10.0.0.1/tcp/4001/p2p/{pid}"

    def live(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.running]

    def spawn(self, bootstrap: bool = False) -> SimNode:
        """A new node (a new identity) that dials the bootstrap nodes, as a fresh ``swarm-node start``."""
        self._ids += 1
        pid = f"sim{self._ids:06d}"
        p, r = self.profile, self.rng
        nat = not bootstrap and r.random() < p.nat
        relay = None
        if nat:
            relay = self.pick_relay()
            nat = relay is not None
        mbit = 1e6 / 8
        latency, up, down = r.uniform(*p.latency), r.uniform(*p.up_mbit), r.uniform(*p.down_mbit)
        if bootstrap:
            up = down = p.server_mbit  # drawn all the same: the seeded draws after it stay as they were
        self.net.add(pid, Endpoint(latency=latency, up=up * mbit, down=down * mbit, nat=nat, relay=relay))
        node = SimNode(self, pid, [] if bootstrap else list(self.bootstrap), random.Random(r.random()),
                       "private" if nat else "public")
        self.nodes[pid] = node
        if bootstrap:
            self.bootstrap.append(pid)
        node.start()
        return node

    def pick_relay(self) -> str | None:
        public = [n.pid for n in self.live() if not self.net.endpoints[n.pid].nat]
        return self.rng.choice(public) if public else None

    def leave(self, node: SimNode) -> None:
        node.leave()
        self.sim.after(0.2, self._rehome, node.pid)

    def crash(self, node: SimNode, refuses: bool = True, notice: float = 0.0) -> None:
        """``refuses``/``notice``: a killed process (RST at once) or a host gone (dials time out;
        its connections linger ``notice`` seconds)."""
        node.crash(refuses, notice)
        self._rehome(node.pid)

    def _rehome(self, relay: str) -> None:
        """NAT'd nodes whose relay went down reserve another one (node/net/relay's reservation loop)
        within a housekeeping period, and republish their record with the new address."""
        for n in self.live():
            ep = self.net.endpoints[n.pid]
            if ep.nat and ep.relay == relay:
                self.sim.after(HOUSEKEEPING, self._move, n)

    def _move(self, node: SimNode) -> None:
        relay = self.pick_relay()
        if node.running and relay is not None:
            self.net.endpoints[node.pid].relay = relay
            node.move_address()

    # ------------------------------------------------------------------ observations

    def known_by(self, pid: str) -> float:
        """Share of the other live nodes that hold ``pid`` as live."""
        others = [n for n in self.live() if n.pid != pid]
        return sum(1 for n in others if n.table.is_live(pid)) / max(1, len(others))

    def view_of(self, pid: str) -> float:
        """Share of the other live nodes that ``pid`` holds as live (its own view, however young)."""
        members = self.nodes[pid].table.members
        others = [n.pid for n in self.live() if n.pid != pid]
        return sum(1 for p in others if p in members and members[p].state in _LIVE) / max(1, len(others))

    def dead_everywhere(self, pid: str) -> bool:
        """No live node holds ``pid`` as live (DEAD, LEFT or forgotten)."""
        return not any(n.table.is_live(pid) for n in self.live() if n.pid != pid)

    def view_floor(self, older_than: float) -> tuple[float, int]:
        """The smallest share of live nodes (up for ``older_than`` s or more) that any such node holds
        as live, and how many live members are held DEAD somewhere (verdicts on live nodes)."""
        now = self.sim.now
        settled = [n for n in self.live() if now - n.started >= older_than]
        ids = {n.pid for n in settled}
        floor, dead_live = 1.0, 0
        for n in settled:
            members = n.table.members
            held = sum(1 for p in ids if p != n.pid and p in members and members[p].state in _LIVE)
            floor = min(floor, held / max(1, len(ids) - 1))
            dead_live += sum(1 for p in ids if p in members and members[p].state is MemberState.DEAD)
        return floor, dead_live

    def sample_views(self) -> "ViewSample":
        """Every live node's view now: its age and the live nodes it does not hold as live (one
        pass over all pairs; ViewSample answers for any age threshold from it)."""
        now = self.sim.now
        live = self.live()
        ages = {n.pid: now - n.started for n in live}
        missing: dict[str, dict[str, str]] = {}
        for n in live:
            members = n.table.members
            gone = {}
            for p in ages:
                if p == n.pid:
                    continue
                m = members.get(p)
                if m is None:
                    gone[p] = "absent"
                elif m.state not in _LIVE:
                    gone[p] = m.state.value
            missing[n.pid] = gone
        return ViewSample(now, ages, missing)

    def traffic(self) -> dict[str, tuple[int, int]]:
        """Per live node: (bytes sent, messages sent) so far."""
        e = self.net.endpoints
        return {n.pid: (e[n.pid].sent_bytes, e[n.pid].sent_msgs) for n in self.live()}

    def traffic_kinds(self) -> dict[str, dict[str, int]]:
        """Per live node: bytes sent so far by kind (sim/network.py's send labels: gossip by cause,
        ihave, iwant, sync, ping...)."""
        e = self.net.endpoints
        return {n.pid: dict(e[n.pid].sent_kinds) for n in self.live()}


_LIVE = (MemberState.ALIVE, MemberState.SUSPECT)


@dataclass
class ViewSample:
    """Who held whom at one instant: each live node's age (s since it started) and, per live node,
    the other live nodes it does not hold as live, with how it holds each ("absent": never learned,
    expired or forgotten; "dead"; "left")."""

    at: float
    ages: dict[str, float]
    missing: dict[str, dict[str, str]]

    def views(self, older_than: float) -> dict[str, float]:
        """Share of the other live nodes up ``older_than`` s or more that each such node holds."""
        settled = {p for p, a in self.ages.items() if a >= older_than}
        out = {}
        for p in settled:
            lacking = sum(1 for q in self.missing[p] if q in settled)
            out[p] = 1.0 - lacking / max(1, len(settled) - 1)
        return out

    def floor(self, older_than: float) -> tuple[float, str | None]:
        """The smallest such view, and whose (None when no node is that old)."""
        views = self.views(older_than)
        if not views:
            return 1.0, None
        worst = min(sorted(views), key=views.__getitem__)
        return views[worst], worst

    def dead_while_live(self, older_than: float) -> int:
        """Live nodes up ``older_than`` s held DEAD by live nodes that old (counted per holder)."""
        settled = {p for p, a in self.ages.items() if a >= older_than}
        return sum(1 for p in settled for q, how in self.missing[p].items() if q in settled and how == "dead")

