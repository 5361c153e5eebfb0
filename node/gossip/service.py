"""The membership service: feeds the pure member table from gossip, probes and syncs, and acts on it.

Tasks (one nursery): read the members topic; probe one member per period (libp2p ping, then
indirect ping-reqs over ``/swarm/probe/1.0.0``); tick the table (suspicion timeouts, record
refresh, periodic push-pull over ``/swarm/members/1.0.0``); run the connection manager and dial the
bootstrap peers until one answers. On shutdown it publishes a signed goodbye.
See membership.py for the protocol and its load model.

Probing follows the connections. The round-robin probe picks among the members we hold a
connection to, and a member whose connection drops without notice is probed at once (a redial,
then indirect pings). Every live member keeps ``conn_low`` or more connections, so each is still
probed about once per period in total, as in SWIM, and a killed one is probed by all its
neighbours within a tick. Probing every member instead made a node in a swarm larger than
``conn_high`` dial one member per period, and its connection manager prune another (often a
gossipsub mesh peer) right after: at N = 50 on one machine that churn starved the CPU and broke
the meshes, refutations got lost, and live members were declared dead faster than they could come
back. A deliberate close is announced first (``Prune`` on the probe protocol), so that the pruned
peer does not take it for a failure and redial. Because of that, a member whose last connections
were all closed on purpose and then crashed would be probed by no one: every ``far_probe_every``
rounds the table picks a live member we hold no connection to instead (node/gossip/membership.py).

What the table finds wrong with a remote peer (a refuted or flooding accuser, a source over its
new-member budget) is reported to the peer score owner under ``SOURCE``; we report an accuser
ourselves when the accusation is about us and we refute it. Every dial (the connection manager's,
a probe's redial, an indirect probe for another) goes through one :class:`AddressBackoff`.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import ClassVar

import trio

from .. import __version__
from ..context import NodeContext
from ..fds import Rarely, out_of_files
from ..net.budget import STALLED, StreamLimits, StreamsConfig
from ..net.reqres import CallFailure, Inbound, Refused, RequestResponse, close, messages
from ..peers import FaultRule
from ..wire import (
    MAX_FRAME,
    Message,
    decode,
    encode,
    RemoteProtocolError,
    bounded,
    read_message,
    register,
    seal,
    write_frame,
)
from .api import HeldVersions, RelayAPI
from .connections import AddressBackoff, BootstrapRedial, CloseWatch, ConnectionManager, RejoinBook
from .membership import (
    SEQ_CLOCK_SLACK_S,
    LocalHealth,
    MemberState,
    MembershipConfig,
    MemberTable,
    RecordRefresh,
    SyncPlanner,
    Verdict,
    next_seq,
    unlisted_role,
)
from .records import (
    DOMAIN_DEAD,
    DOMAIN_GOODBYE,
    DOMAIN_RECORD,
    DOMAIN_SUSPECT,
    MAX_ADDRS,
    MAX_PEER_ID,
    MAX_VERSIONS,
    Accusation,
    Goodbye,
    PeerRecord,
    Signed,
    open_membership,
)
from .topics import open_checked_topic

log = logging.getLogger(__name__)

SYNC_PROTOCOL = "/swarm/members/1.0.0"
PROBE_PROTOCOL = "/swarm/probe/1.0.0"
SYNC_BATCH = 256  # envelopes per frame in a push-pull exchange
MAX_SYNC_FRAMES = 128  # 32k records: above MembershipConfig.max_members
# Inbound push-pull sessions (node/net/budget.py): a peer syncs with us about once per interval,
# so 2 sessions per peer and 32 in all (a burst of joiners waits for a slot); frames are read one
# at a time per session, so 1 frame's bytes per peer and 8 in all.
SYNC_LIMITS = StreamLimits(streams=32, streams_per_peer=2, frame_cap=MAX_FRAME,
                           buffer_bytes=8 * MAX_FRAME, buffer_per_peer=MAX_FRAME)
MAX_PROBE_REQS = 8  # ping-reqs we serve at once for others
DIAL_TIMEOUT = 3.0
TICK = 0.25  # membership timers (suspicion, expiry) and lost connections
HOUSEKEEPING = 1.0  # seconds between refreshes of our record's fields and the member gauges
CONNECTION_PERIOD = 2.0  # seconds between the connection manager's plans
# How far ahead of our own seq an accusation about us may be and still be answered: members accept
# one up to their copy's seq + (time since they heard it + clock slack); they hear us at least once
# per refresh interval, so 3 of the longest ones (lost refreshes) plus the slack is ample.
REFUTABLE_AHEAD_MS = int((3 * MembershipConfig.max_refresh + SEQ_CLOCK_SLACK_S) * 1000)
SOURCE = "membership"  # fault source in the peer score table
FAULT_WEIGHT = 2.0  # score points per membership fault (a flood of 50 graylists the flooder in gossipsub)


@register
@dataclass(frozen=True)
class MemberBatch(Message):
    """Part of a push-pull exchange: signed record envelopes; ``last`` ends one side's turn."""

    TYPE: ClassVar[str] = "member.batch"
    envelopes: list[bytes] = bounded(max_len=SYNC_BATCH)
    last: bool = False


@register
@dataclass(frozen=True)
class PingRequest(Message):
    """Ask a peer to ping ``target`` for us (SWIM indirect probe)."""

    TYPE: ClassVar[str] = "member.ping-req"
    target: str = bounded(max_len=MAX_PEER_ID)
    addrs: list[str] = bounded(max_len=MAX_ADDRS)


@register
@dataclass(frozen=True)
class Prune(Message):
    """We are about to close our connection to you on purpose (the connection manager's choice)."""

    TYPE: ClassVar[str] = "member.prune"


@register
@dataclass(frozen=True)
class PingResult(Message):
    TYPE: ClassVar[str] = "member.ping-res"
    ok: bool = False


# SWIM's ping-req for others and the prune notice, served a few at once ("busy" beyond: the asker
# has other helpers); the deadlines follow [membership] indirect_timeout (set when served).
PROBE: RequestResponse = RequestResponse(PROBE_PROTOCOL, messages(PingRequest, Prune, max_size=4096),
                                         messages(PingResult, max_size=4096), MembershipConfig.indirect_timeout + DIAL_TIMEOUT + 2,
                                         max_inflight=MAX_PROBE_REQS, wait_for_slot=False)


def wall_ms() -> int:
    # Edge of the system: sequence numbers need a clock that survives restarts.
    return int(time.time() * 1000)


@dataclass
class Membership:
    """The running service's API, handed back by :func:`serve_membership` (node/gossip/api.py)."""

    node: NodeContext
    config: MembershipConfig
    table: MemberTable
    record: PeerRecord
    envelopes: dict[str, bytes] = field(default_factory=dict)  # peer id -> latest record envelope
    changed: trio.Event = field(default_factory=trio.Event)
    refresh: RecordRefresh = field(default_factory=RecordRefresh)  # when our record is next republished unchanged
    sync: SyncPlanner = field(default_factory=SyncPlanner)
    watch: CloseWatch = field(default_factory=CloseWatch)  # announced closes and lost connections
    conn: ConnectionManager | None = None
    backoff: AddressBackoff = field(default_factory=lambda: AddressBackoff(10.0, 300.0))
    health: LocalHealth = field(default_factory=LocalHealth)

    @property
    def closes(self) -> dict[str, int]:
        """Connections pruned by us / by the peer (announced), lost (probed at once)."""
        return self.watch.closes

    def update(self, **fields) -> None:
        """Change our record (checkpoints held, load, capacity...); it is republished at once. Of the
        checkpoint versions, the newest ``MAX_VERSIONS`` are kept: callers hand every version they hold."""
        if "checkpoints" in fields:
            fields["checkpoints"] = list(fields["checkpoints"])[-MAX_VERSIONS:]
        new = replace(self.record, **fields)
        if new != self.record:
            self.record = replace(new, seq=next_seq(self.record.seq, wall_ms()))
            self.changed.set()

    def refute(self, above: int = 0) -> None:
        """Someone accused us (at seq ``above``): republish our record with a higher sequence number
        (SWIM 4.2). Local health is not touched: see :class:`LocalHealth`."""
        self.record = replace(self.record, seq=next_seq(max(self.record.seq, above), wall_ms()))
        self.changed.set()

    def signed_record(self) -> bytes:
        return encode(seal(self.node.identity, DOMAIN_RECORD, self.record))

    def members(self) -> dict[str, str]:
        """Alive peer id -> role."""
        return {pid: self.table.members[pid].record.role for pid in self.table.alive()}

    def addrs_of(self, peer_id: str) -> list[str]:
        m = self.table.members.get(peer_id)
        return list(m.record.addrs) if m else []

    def reachability_of(self, peer_id: str) -> str:
        """What a member's record says of it: public, private (behind NAT) or unknown."""
        m = self.table.members.get(peer_id)
        return m.record.reachability if m else "unknown"

    def status(self) -> dict:
        now = trio.current_time()
        run = self.node.run
        return {
            "self": {
                "peer_id": self.node.peer_id,
                "role": self.record.role,
                "unlisted": unlisted_role(self.record.role, self.node.peer_id, run.trainers, run.validators),
                "seq": self.record.seq,
                "addrs": self.node.host.listen_addrs(),
                "checkpoints": list(self.record.checkpoints),
            },
            "counts": self.table.counts(),
            "members": self.table.rows(now, set(run.trainers), set(run.validators)),
            "connections": len(self.node.host.connected_peers()),
            "mesh": self.node.host.mesh_size(self.node.topic("members")),  # gossipsub mesh peers on our topic
            "closed": dict(self.closes),  # pruned by us / by the peer (announced), lost (probed at once)
            "local_health": self.health.score,
            "dropped": dict(self.table.dropped),  # expired, evicted, limited, distrusted, refuted
            "revived": self.table.revived,  # suspected or dead members whose own refresh showed them alive
            "rejected": self.node.metrics.rejections(),
        }


def advertised_addrs(node: NodeContext, relay: RelayAPI) -> list[str]:
    """Direct transport addresses, then relayed ones (a NAT'd node's only reachable addresses)."""
    return (node.host.transport_addrs() + relay.circuit_addrs())[:MAX_ADDRS]  # the record holds no more


def own_record(node: NodeContext, relay: RelayAPI, seq: int) -> PeerRecord:
    return PeerRecord(
        run=node.run.name,
        peer_id=node.peer_id,
        role=node.config.role,
        addrs=advertised_addrs(node, relay),
        software=f"swarm-node/{__version__}",
        seq=seq,
        capabilities=[node.config.role],
    )


async def serve_membership(node: NodeContext, cfg: MembershipConfig, streams: StreamsConfig, relay: RelayAPI,
                           shards: HeldVersions, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run membership until cancelled; hands back the :class:`Membership` API once it runs. ``cfg``
    is the run's ``[membership]`` table, ``streams`` its per-peer stream budgets. Our record
    advertises ``relay``'s circuit addresses and the versions ``shards`` holds."""
    membership = Membership(node, cfg, MemberTable(node.peer_id, cfg), own_record(node, relay, next_seq(0, wall_ms())))
    membership.conn = ConnectionManager(cfg.conn_low, cfg.conn_high, cfg.dial_backoff)
    membership.backoff = AddressBackoff(cfg.dial_backoff, cfg.dial_backoff_max)
    node.peers.set_rule(SOURCE, FaultRule(weight=FAULT_WEIGHT))
    node.status["membership"] = membership.status
    async with open_checked_topic(node, node.topic("members"), partial(open_membership, run=node.run.name)) as topic:
        await MembershipService(node, streams, relay, shards, topic, membership).run(task_status=task_status)


class MembershipService:
    """The trio shell around :class:`Membership`: its tasks (module docstring) and stream handlers.

    Every decision is the pure parts' (MemberTable, SyncPlanner, ConnectionManager, AddressBackoff,
    CloseWatch, LocalHealth): this class reads the topic, the streams and the clock, feeds them, and
    carries out what they return. ``serve_*`` methods are the nursery's tasks, ``handle_*`` answer a
    remote peer, ``call_*`` ask one.
    """

    def __init__(self, node: NodeContext, streams: StreamsConfig, relay: RelayAPI, shards: HeldVersions, topic,
                 membership: Membership):
        self.node, self.relay, self.shards, self.topic = node, relay, shards, topic
        self.membership = membership
        self.cfg, self.table = membership.config, membership.table
        self.members_gauge = node.metrics.gauge("members", "Known members by state", ["state"])
        self.verdicts = node.metrics.counter("membership_events_total", "Member table inputs by verdict", ["verdict"])
        self.sync_inbound = Inbound(SYNC_PROTOCOL, SYNC_LIMITS, config=streams, peers=node.peers,
                                    metrics=node.metrics)
        self.held: list[int] = []  # checkpoint versions in our record: the last list read from the data dir
        self.starved = Rarely()  # out of descriptors: said once a minute while it lasts
        self.nursery: trio.Nursery | None = None  # run()'s, for the probes and dials the loops start
        self.bootstrap_dials: set[str] = set()  # bootstrap addresses being dialled now
        self.closing_stale: set[str] = set()  # peers whose connection close_stale is closing now

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, then publish a signed goodbye."""
        sync_handler = partial(self.handle_sync)
        sync_handler.inbound = self.sync_inbound  # the host lists it in status (streams)
        self.node.host.set_handler(SYNC_PROTOCOL, sync_handler)
        self.node.host.set_handler(PROBE_PROTOCOL, self.probe_handler())
        try:
            async with trio.open_nursery() as self.nursery:
                for task in (self.serve_topic, self.serve_record, self.serve_probes, self.serve_tick,
                             self.serve_connections):
                    self.nursery.start_soon(task)
                self.membership.changed.set()
                task_status.started(self.membership)
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(1.0):
                    await self.publish(DOMAIN_GOODBYE, Goodbye(run=self.node.run.name, peer_id=self.node.peer_id,
                                                               seq=self.membership.record.seq))
                    await trio.sleep(0.2)  # let the pubsub writer flush before the host closes

    # The members topic

    async def publish(self, domain: str, msg) -> None:
        data = encode(seal(self.node.identity, domain, msg))
        try:
            await self.topic.publish(data)
        except Exception as e:  # a publish failure is ours to log, not fatal
            log.warning("publish failed: %s", e)

    def apply(self, signed: Signed, now: float, source: str | None, exchange: bool = False) -> Verdict:
        """One checked message; ``source``, ``exchange``: see MemberTable.on_record."""
        msg, table, m = signed.message, self.table, self.membership
        if isinstance(msg, PeerRecord):
            verdict = table.on_record(msg, now, source, exchange)
            if verdict in (Verdict.NEW, Verdict.UPDATED):
                m.envelopes[msg.peer_id] = _envelope_bytes(signed)
        elif isinstance(msg, Accusation):
            verdict = table.on_accusation(msg, signed.domain == DOMAIN_DEAD, now)
            # Refute above the accused seq: members accept an accusation of a seq a little
            # ahead of what they hold (clock skew), so the answer must outbid it. Not one far
            # beyond any seq we could have published, which no member accepts either: outbidding
            # 2**63 - 1 overflowed our seq (and its bound) and made every later record invalid.
            if verdict is Verdict.SELF and msg.seq >= m.record.seq:
                if msg.seq <= m.record.seq + REFUTABLE_AHEAD_MS:
                    m.refute(above=msg.seq)
                table.note_refuted(msg.accuser, now)  # we are alive: we know it is false
        else:
            verdict = table.on_goodbye(msg, now)
        self.verdicts.labels(verdict=verdict.value).inc()
        if verdict is Verdict.STALE:
            self.node.metrics.reject(self.topic.topic, "stale")
        elif verdict in (Verdict.LIMITED, Verdict.DISTRUSTED):
            self.node.metrics.reject(self.topic.topic, verdict.value)
        for peer, reason in table.take_faults():
            self.node.peers.report(peer, SOURCE, reason, now)
        return verdict

    async def serve_topic(self) -> None:
        async for delivery in self.topic:
            # The gossipsub author (signed: py-libp2p's strict signing), not the mesh peer that
            # relayed it: an honest relay forwarding a flood is not its source.
            self.apply(delivery.value, trio.current_time(), delivery.forwarder)

    def mesh(self) -> int:
        """Gossipsub mesh peers on the members topic: where a publication of ours goes."""
        return self.node.host.mesh_size(self.topic.topic)

    async def serve_record(self) -> None:
        """Publish our record at start and at once on a change; serve_tick sets ``changed`` when the
        refresh is due (RecordRefresh: the interval follows the table's size as it grows)."""
        m = self.membership
        while True:
            m.changed = trio.Event()
            m.refresh.on_published(trio.current_time(), self.mesh())  # before the await: a tick meanwhile finds it fresh
            await self.publish(DOMAIN_RECORD, m.record)
            await m.changed.wait()

    # Push-pull (full-table exchange)

    async def handle_sync(self, stream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            async with self.sync_inbound.open(stream, peer) as frames:
                with trio.fail_after(10):
                    await self.receive_batches(stream, peer, frames)
                    await self.send_batches(stream)
        except Refused as e:  # over the peer's share of streams or bytes, or no slot free
            self.node.metrics.reject(SYNC_PROTOCOL, e.reason)
        except (RemoteProtocolError, trio.TooSlowError) as e:
            if getattr(e, "reason", "") != STALLED:  # a stall is counted and struck by Inbound
                self.node.metrics.reject(SYNC_PROTOCOL, getattr(e, "reason", "timeout"))
        finally:
            await close(stream)

    async def call_push_pull(self, peer: str) -> None:
        # While joining, the exchanges we start bring the whole table from peers we chose:
        # exempt from the new-member budget (the records still expire unless vouched for).
        source = None if not self.membership.sync.joined else peer
        try:
            with trio.fail_after(10):
                stream = await self.node.host.open_stream(peer, SYNC_PROTOCOL)
                try:
                    await self.send_batches(stream)
                    await self.receive_batches(stream, source)
                finally:
                    await close(stream)
        except RemoteProtocolError as e:
            self.node.metrics.reject(SYNC_PROTOCOL, e.reason)
        except Exception as e:  # peer gone, stream refused: try another next time
            log.debug("push-pull with %s failed: %s", peer[:16], e)

    async def send_batches(self, stream) -> None:
        m = self.membership
        envs = [m.signed_record()] + [
            m.envelopes[p]
            for p, member in self.table.members.items()
            if member.state in (MemberState.ALIVE, MemberState.SUSPECT) and p in m.envelopes
        ]
        for i in range(0, max(len(envs), 1), SYNC_BATCH):
            chunk = envs[i : i + SYNC_BATCH]
            await write_frame(stream, MemberBatch(envelopes=chunk, last=i + SYNC_BATCH >= len(envs)))

    async def receive_batches(self, stream, source: str | None, frames=None) -> None:
        for _ in range(MAX_SYNC_FRAMES):
            if frames is None:  # our own push-pull: the peer we asked answers
                batch = await read_message(stream)
            else:  # an inbound session: each frame under the budget and its header deadline
                data = await frames.read()
                batch = None if data is None else decode(data)
            if batch is None:  # the peer went away (pruned, timed out): not garbage
                raise RemoteProtocolError("truncated", "stream closed before the last batch")
            if not isinstance(batch, MemberBatch):
                raise RemoteProtocolError("wrong-type", "expected member.batch")
            now = trio.current_time()
            for env in batch.envelopes:
                try:
                    signed = open_membership(env, self.node.run.name)
                except RemoteProtocolError as e:
                    self.node.metrics.reject(SYNC_PROTOCOL, e.reason)
                    continue
                if signed.domain == DOMAIN_RECORD:
                    self.apply(signed, now, source, exchange=True)
            if batch.last:
                self.membership.sync.on_synced()
                return
        raise RemoteProtocolError("oversized", "too many sync frames")

    # Probes (SWIM: direct ping, then indirect ping-reqs) and the prune notice

    def probe_handler(self):
        """The ``PROBE_PROTOCOL`` stream handler: ping-reqs for others, and prune notices."""
        timeout = self.cfg.indirect_timeout + DIAL_TIMEOUT + 2
        probe = replace(PROBE, timeout=timeout, stream_timeout=timeout)
        return probe.handler(self.handle_probe, peers=self.node.peers, metrics=self.node.metrics)

    async def handle_probe(self, peer: str, req) -> PingResult | None:
        if isinstance(req, Prune):  # the peer is closing our connection on purpose
            self.membership.watch.on_prune_received(peer, trio.current_time())
            return None
        # Only a member we know, at the addresses its own signed record gives: the request's
        # addresses are the asker's word, and taking them would let anyone make us dial anywhere.
        if self.table.state_of(req.target) not in (MemberState.ALIVE, MemberState.SUSPECT):
            return PingResult(ok=False)
        addrs = self.membership.addrs_of(req.target)
        return PingResult(ok=await self.ping_once(req.target, addrs, self.cfg.indirect_timeout))

    async def ping_once(self, peer: str, addrs: list[str], timeout: float) -> bool:
        host = self.node.host
        with trio.move_on_after(timeout + (0 if host.is_connected(peer) else DIAL_TIMEOUT)):
            try:
                if not host.is_connected(peer):
                    await self.dial_limited(peer, addrs)
                await host.ping(peer)
                return True
            except Exception:
                return False
        return False

    async def call_indirect(self, helper: str, target: str, addrs: list[str], results: list[bool], scale: int) -> None:
        try:
            res = await PROBE.call(self.node.host, helper, PingRequest(target=target, addrs=addrs[:MAX_ADDRS]),
                                   self.cfg.indirect_timeout * scale + DIAL_TIMEOUT + 1)
            results.append(res.ok)
        except CallFailure:
            results.append(False)

    async def probe(self, target: str, scale: int) -> None:
        """Direct ping (a dial if we hold no connection), then indirect pings, then suspicion."""
        m, table = self.membership, self.table
        addrs = m.addrs_of(target)
        started = trio.current_time()
        if await self.ping_once(target, addrs, self.cfg.probe_timeout * scale):
            table.on_probe_ok(target, trio.current_time())
            return
        m.health.on_probe_missed()  # our own missed ack (Lifeguard): maybe we are the slow one
        helpers = table.indirect_helpers(target, set(self.node.host.connected_peers()), self.cfg.indirect_probes)
        results: list[bool] = []
        async with trio.open_nursery() as n:
            for h in helpers:
                n.start_soon(self.call_indirect, h, target, addrs, results, scale)
        now = trio.current_time()
        if any(results):
            table.on_probe_ok(target, now)
            return
        if m.watch.closed_on_purpose_since(target, started):
            # The connection was closed on purpose while we probed (by us, or by the peer with
            # its notice): the ping died with it, which says nothing about the peer.
            return
        acc = table.on_probe_failed(target, now)
        if acc is not None:
            log.info("suspect %s (no ack from %d helpers)", target[:16], len(helpers))
            await self.publish(DOMAIN_SUSPECT, acc)

    async def serve_probes(self) -> None:
        m, cfg = self.membership, self.cfg
        while True:
            before = trio.current_time()
            await trio.sleep(cfg.probe_period)
            m.health.on_round(trio.current_time() - before - cfg.probe_period, cfg.probe_timeout / 2)
            # Only members we hold a connection to: no dial per probe (see the module docstring).
            # Not one whose connection is closing on purpose: it may still be listed as connected.
            closing = m.watch.closing(trio.current_time())
            connected = set(self.node.host.connected_peers())
            self.node.host.forget_ping_streams(connected)
            target = self.table.next_probe_target(connected - closing)
            if target is not None:
                await self.probe(target, m.health.scale())

    # Timers: suspicion and expiry, lost connections, push-pull, our record's fields

    async def serve_tick(self) -> None:
        m, table = self.membership, self.table
        housekeeping_at = -math.inf
        while True:
            await trio.sleep(TICK)
            now = trio.current_time()
            if now >= housekeeping_at:  # nothing here needs the tick's precision
                housekeeping_at = now + HOUSEKEEPING
                self.housekeeping(now)
            for acc in table.tick(now):
                log.info("dead %s", acc.target[:16])
                await self.publish(DOMAIN_DEAD, acc)
            if m.refresh.due(now, table.size(), self.cfg, self.mesh()):
                m.changed.set()  # serve_record republishes
            if len(m.envelopes) > len(table.members):  # entries expired, evicted or forgotten
                for pid in [p for p in m.envelopes if p not in table.members]:
                    del m.envelopes[pid]
            connected = set(self.node.host.connected_peers())
            for p in connected:
                table.on_reached(p, now)  # an authenticated connection: first-hand evidence
            self.node.metrics.connections.set(len(connected))
            for p in m.watch.lost(connected, now, table.is_live):
                self.nursery.start_soon(self.probe, p, m.health.scale())
            # Full-table exchanges: with new connections while joining, then one random peer.
            for p in m.sync.plan(connected, now, self.cfg.sync_interval(table.size()), random):
                self.nursery.start_soon(self.call_push_pull, p)

    def housekeeping(self, now: float) -> None:
        """Refresh our record's fields (a relay reservation adds an address; a new checkpoint version
        changes what we hold) and the member gauges."""
        try:
            self.held = self.shards.versions_held()  # reads the data dir
        except OSError as e:  # issue 42: out of descriptors ended the node here
            if not out_of_files(e):
                raise
            if self.starved.due(now):
                log.warning("membership: cannot list the checkpoints held (%s); the record keeps the last list", e)
        self.membership.update(addrs=advertised_addrs(self.node, self.relay), checkpoints=self.held)
        for state, count in self.table.counts().items():
            self.members_gauge.labels(state=state).set(count)

    # Connections: between conn_low and conn_high, the bootstrap peers until one answers

    async def serve_connections(self) -> None:
        m, node = self.membership, self.node
        bootstrap = list(node.config.bootstrap)
        bootstrap_peers = {_peer_of(a) for a in bootstrap}
        redial, rejoin = BootstrapRedial(), RejoinBook()
        connected_since: dict[str, float] = {}  # peer -> when this loop first saw its connection
        while True:
            now = trio.current_time()
            connected = set(node.host.connected_peers())
            connected_since = {p: connected_since.get(p, now) for p in connected}
            for p in m.conn.stale(connected_since, self.died_at):
                connected.discard(p)
                self.nursery.start_soon(self.close_stale, p)
            for p in connected:
                rejoin.note(p, m.addrs_of(p), now, connected_since[p])
            if redial.due(m.conn.needs_bootstrap(connected, bootstrap_peers), not connected, now):
                # Alone, the members we last held are a way back too: the bootstrap peers may be gone.
                extra = (rejoin.addresses(skip=lambda p: p in bootstrap_peers or node.peers.is_banned(p))
                         if not connected else [])
                for addr in bootstrap + extra:
                    if addr not in self.bootstrap_dials:  # one dial per address at a time
                        self.nursery.start_soon(self.dial_bootstrap, addr)
            plan = m.conn.plan(connected, self.table.alive_roles(), self.protected(), now,
                               dialable=lambda p: any(m.backoff.ready(a, now) for a in m.addrs_of(p)))
            for p in plan.dial:
                self.nursery.start_soon(self.dial_member, p)
            for p in plan.prune:
                self.nursery.start_soon(self.call_prune, p)
            await trio.sleep(CONNECTION_PERIOD)

    def died_at(self, peer: str) -> float | None:
        """When ``peer`` was declared dead; None while it is not."""
        m = self.table.members.get(peer)
        return m.since if m is not None and m.state is MemberState.DEAD else None

    def protected(self) -> set[str]:
        """Peers the connection manager never prunes: bootstrap peers, the run's trainers and validators,
        and the peers our checkpoint downloads chose (pruning one cut the download; shards.peers_in_use)."""
        node = self.node
        return ({_peer_of(a) for a in node.config.bootstrap} | set(node.run.trainers) | set(node.run.validators)
                | self.shards.peers_in_use())

    async def call_prune(self, peer: str) -> None:
        """Close a connection on purpose, telling the peer first so it does not probe us for it."""
        self.membership.watch.on_prune_sent(peer, trio.current_time())
        # Wait for the peer to close its side, i.e. to have noted the prune: closing the
        # connection at once dropped the frame before its handler read it.
        try:
            await PROBE.call(self.node.host, peer, Prune(), 2)
        except CallFailure as e:  # the expected end (closed without a reply), or it is gone already
            log.debug("prune notice to %s: %s", peer[:16], e)
        await self.node.host.disconnect(peer)

    async def close_stale(self, peer: str) -> None:
        """Close the connection to a member declared dead (ConnectionManager.stale says why)."""
        if peer in self.closing_stale:
            return
        self.closing_stale.add(peer)
        try:
            log.info("closing the connection to %s: declared dead", peer[:16])
            with trio.move_on_after(DIAL_TIMEOUT):
                await self.node.host.disconnect(peer)
        finally:
            self.closing_stale.discard(peer)

    async def dial_bootstrap(self, addr: str) -> None:
        self.bootstrap_dials.add(addr)
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                await self.relay.connect_addr(addr)
        except Exception as e:
            log.info("redial of %s (a bootstrap peer or one we last held) failed: %s", addr, type(e).__name__)
        finally:
            self.bootstrap_dials.discard(addr)

    async def dial_member(self, peer: str) -> None:
        conn = self.membership.conn
        try:
            with trio.fail_after(DIAL_TIMEOUT):
                await self.dial_limited(peer, self.membership.addrs_of(peer))
            conn.on_connected(peer)
        except Exception:
            conn.on_dial_failed(peer, trio.current_time())

    async def dial_limited(self, peer: str, addrs: list[str]) -> None:
        """:func:`dial` with only the addresses out of backoff; their outcome updates it."""
        backoff = self.membership.backoff
        ready = backoff.reserve(addrs, trio.current_time())
        if not ready:
            raise ConnectionError(f"every address of {peer[:16]} is in dial backoff")
        try:
            await dial(self.node, self.relay, peer, ready)
        except BaseException:
            for a in ready:
                backoff.on_failed(a, trio.current_time())
            raise
        for a in ready:
            backoff.on_connected(a)
        self.table.on_reached(peer, trio.current_time())


async def dial(node: NodeContext, relay: RelayAPI, peer: str, addrs: list[str]) -> None:
    """Dial a member: its direct addresses first, then its relayed ones (py-libp2p's swarm skips
    /p2p-circuit addresses, so those go through the relay module)."""
    direct = [a for a in addrs if "/p2p-circuit" not in a]
    relayed = [a for a in addrs if "/p2p-circuit" in a]
    if direct:
        try:
            await node.host.connect_peer(peer, direct)
            return
        except Exception:
            if not relayed:
                raise
    for i, addr in enumerate(relayed):
        try:
            await relay.connect_addr(addr)
            return
        except Exception:
            if i == len(relayed) - 1:
                raise
    if not direct and not relayed:
        raise ConnectionError(f"no address known for {peer[:16]}")


def _envelope_bytes(signed: Signed) -> bytes:
    return encode(signed.envelope)


def _peer_of(addr: str) -> str:
    return addr.rsplit("/p2p/", 1)[-1]
