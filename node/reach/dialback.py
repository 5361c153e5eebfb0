"""Dial-back: find out whether peers can dial us, and reserve relay slots when they cannot.

The protocol (``/swarm/dialback/1.0.0``, one request and one reply on a stream):

* the asker sends :class:`DialBackRequest` with its advertised TCP addresses;
* the dialer dials **the asker's observed IP** (its connection's remote address) on the ports
  those addresses name, at most :data:`~node.reach.reachability.MAX_DIAL_PORTS` of them, each on a
  fresh TCP connection with a full Noise handshake that must prove the asker's peer id, and
  answers :class:`DialBackReply` (reached or not). The IPs in the request are never dialled
  (:func:`~node.reach.reachability.dialback_targets`): nobody can point us at a third party. A
  request over a relayed connection has no observed IP of its own and is refused.

The asker (every role but ``relay``, which must be dialable to do its job) asks up to
:data:`~node.reach.reachability.ASK_PEERS` directly connected peers per round, counts the answers
in :class:`~node.reach.reachability.Reachability`, and when the verdict is ``private`` reserves slots
on two relays from the membership table (different IPs first) through the relay client, which
advertises the ``/p2p-circuit`` addresses and renews them. It logs one line of advice. Nothing
needs configuring; ``relay_via`` relays given by hand (the relay client's ``given``) are kept as they are.
"""

from __future__ import annotations

import contextvars
import logging
import random
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import trio
from libp2p.peer.id import ID

from ..context import NodeContext
from ..net.budget import STALLED, StreamsConfig, limits
from ..net.host import STREAM_ERRORS, SwarmHost, is_relayed, parse_multiaddr, remote_ip_of
from ..net.reqres import CallFailure, Inbound, Refused, call, close, messages, peer_of, reset
from ..peers.table import FaultRule
from ..wire import Message, RemoteProtocolError, bounded, decode_as, register, write_frame
from .relay import RelayClient, RelayError, relay_peer_id_of
from .reachability import (
    ASK_PEERS,
    MAX_VOTES,
    MAX_DIAL_PORTS,
    MAX_RELAYS_CHOSEN,
    PRIVATE,
    PUBLIC,
    Reachability,
    Vote,
    advice,
    choose_relays,
    dialback_targets,
    tcp_port_of,
)

log = logging.getLogger(__name__)

DIALBACK_PROTOCOL = "/swarm/dialback/1.0.0"
SOURCE = "dialback"
MAX_REQUEST_ADDRS = 8
MAX_ADDR_LEN = 256
MAX_REPLY_BYTES = 2048
DIAL_TIMEOUT_S = 5.0  # one dial back: TCP connect + Noise handshake
REQUEST_TIMEOUT_S = 5.0  # reading the request
ANSWER_TIMEOUT_S = DIAL_TIMEOUT_S * MAX_DIAL_PORTS + 5.0  # the asker's wait for the reply
MAX_INFLIGHT = 4  # dial-back requests we serve at once (others are refused as busy)
# One peer may hold at most one of those slots (node/net/budget.py): a silent asker cannot keep
# the others from learning their reachability; it is cut at the header deadline and struck.
DIALBACK_LIMITS = limits(MAX_INFLIGHT, 4096, per_peer=1)
FIRST_ROUND_S = 3.0  # after start, how often we look for peers to ask until we have some
RETRY_ROUND_S = 15.0  # next round while the verdict lacks votes (or relays are missing)
RECHECK_ROUND_S = 600.0
MAX_LAST_ANSWERS = MAX_VOTES  # peers whose last answer status shows, the latest asked (issue 45: it kept all)
NOISE_GRACE_S = 10.0  # after a round, how long our side's failed muxer upgrades are expected  # next round once the verdict is settled
FAULT_RULE = FaultRule(weight=5.0)  # a garbage request or reply


@register
@dataclass(frozen=True)
class DialBackRequest(Message):
    """Please dial me back on these addresses (only their TCP ports are used)."""

    TYPE: ClassVar[str] = "net.dialback-req"
    addrs: list[str] = bounded(max_len=MAX_REQUEST_ADDRS, item_max_len=MAX_ADDR_LEN)


@register
@dataclass(frozen=True)
class DialBackReply(Message):
    """``result``: ``reached`` | ``not-reached`` | ``refused`` (then ``reason`` says why; no vote)."""

    TYPE: ClassVar[str] = "net.dialback-reply"
    result: str = bounded(max_len=16)
    dialled: list[str] = bounded(max_len=MAX_DIAL_PORTS, default_factory=list)
    reason: str = bounded(max_len=64, default="")


class MembersAPI(Protocol):
    """What dial-back needs from membership (node/gossip/api.py's MembershipAPI is the real one)."""

    def members(self) -> dict[str, str]: ...

    def addrs_of(self, peer_id: str) -> list[str]: ...

    def update(self, **fields) -> None: ...


# ---------------------------------------------------------------------------------------------
# Dialer side


def observed_ip(stream) -> str | None:
    """The IP the asker's connection comes from; None over a relay (that would be the relay's)."""
    return None if is_relayed(stream.muxed_conn) else remote_ip_of(stream)


async def dial_verified(host: SwarmHost, peer_id: str, addr: str, timeout: float = DIAL_TIMEOUT_S) -> bool:
    """True when a fresh TCP connection to ``addr`` completes a Noise handshake proving ``peer_id``.

    Not ``host.connect``: the swarm would reuse the connection the request came on and prove
    nothing. The connection is closed right after the handshake (it never joins the swarm).
    """
    _quiet_dial_logs()
    swarm = host.host.get_network()
    ma = parse_multiaddr(addr)
    transport = swarm.transport_manager.transport_for_dialing(ma)
    if transport is None:
        return False
    token = _IN_DIALBACK.set(True)
    try:
        return await _dial_and_handshake(swarm, transport, ma, peer_id, addr, timeout)
    finally:
        _IN_DIALBACK.reset(token)


async def _dial_and_handshake(swarm, transport, ma, peer_id: str, addr: str, timeout: float) -> bool:
    raw = None
    with trio.move_on_after(timeout):
        try:
            raw = await transport.dial(ma)
            secured = await swarm.upgrader.upgrade_security(raw, True, ID.from_base58(peer_id))
            await secured.close()
            return True
        except Exception as e:  # refused, reset, wrong peer id: not reached
            log.debug("dial-back to %s at %s failed: %s", peer_id[-8:], addr, e)
            return False
        finally:
            if raw is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    try:
                        await raw.close()
                    except Exception:
                        pass
    return False


# A failed dial-back is an answer, not an error: py-libp2p logs ERROR lines for refused TCP dials
# (transport/tcp/tcp.py:483) and handshakes cut short (multiselect_client.py:49). Dropped for the
# dials this module makes (a context variable marks them), kept for every other dial.
_IN_DIALBACK: contextvars.ContextVar[bool] = contextvars.ContextVar("in_dialback", default=False)
_DIAL_LOGGERS = ("libp2p.transport.tcp.tcp", "libp2p.protocol_muxer.multiselect_client",
                 "libp2p.transport.upgrader", "libp2p.network.swarm")


class _DialerNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _IN_DIALBACK.get()


def _quiet_dial_logs() -> None:
    for name in _DIAL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DialerNoise) for f in logger.filters):
            logger.addFilter(_DialerNoise())


@dataclass
class DialBackServer:
    host: SwarmHost
    peers: object  # node/peers' Peers (report)
    inbound: Inbound | None = None  # the per-peer and total budget (serve_dialback sets it)
    busy_ips: set[str] = field(default_factory=set)
    served: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    dialled: list[str] = field(default_factory=list)  # the last addresses dialled (status, tests)

    def _refuse(self, reason: str) -> DialBackReply:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return DialBackReply(result="refused", reason=reason)

    async def answer(self, peer: str, req: DialBackRequest, ip: str | None) -> DialBackReply:
        targets = dialback_targets(req.addrs, ip)
        if ip is None:
            return self._refuse("no-observed-ip")  # relayed: the IP we see is the relay's
        if not targets:
            return self._refuse("no-tcp-port")
        if ip in self.busy_ips:  # one dial-back per IP at a time
            return self._refuse("busy")
        self.busy_ips.add(ip)
        try:
            self.served += 1
            self.dialled = list(targets)
            for addr in targets:
                if await dial_verified(self.host, peer, addr):
                    return DialBackReply(result="reached", dialled=[addr])
            return DialBackReply(result="not-reached", dialled=targets)
        finally:
            self.busy_ips.discard(ip)

    def __post_init__(self) -> None:
        if self.inbound is None:
            self.inbound = Inbound(DIALBACK_PROTOCOL, DIALBACK_LIMITS, peers=self.peers, source=SOURCE)

    async def handle(self, stream) -> None:
        peer = peer_of(stream)
        try:
            async with self.inbound.open(stream, peer, wait=False) as frames:
                data = await frames.read(max_size=4096)  # within the header deadline, or struck
                if data is None:
                    return
                req = decode_as(DialBackRequest, data, 4096)
                reply = await self.answer(peer, req, observed_ip(stream))
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    await write_frame(stream, reply)
        except Refused as e:  # over its share, or every slot taken: told, nothing read
            await write_busy(stream, self._refuse("busy" if e.reason != "banned" else "banned"))
        except RemoteProtocolError as e:
            if e.reason != STALLED and self.peers is not None:  # a stall is struck by Inbound
                self.peers.report(peer, SOURCE, e.reason)
            await reset(stream)
        except trio.TooSlowError:
            await reset(stream)
        except STREAM_ERRORS:
            await reset(stream)
        finally:
            await close(stream)


async def write_busy(stream, reply: DialBackReply) -> None:
    with trio.move_on_after(REQUEST_TIMEOUT_S):
        try:
            await write_frame(stream, reply)
        except Exception:
            pass
    await close(stream)


# ---------------------------------------------------------------------------------------------
# Asker side


class _DialBackNoise(logging.Filter):
    """Drop py-libp2p's ERROR line for the dial-backs we asked for: the dialer stops after the
    Noise handshake (that is the proof), so our side's muxer negotiation fails on purpose
    (network/swarm.py:2185 logs it). Only for the peers asked, only during the round."""

    def __init__(self) -> None:
        super().__init__()
        self.until: dict[str, float] = {}  # dialer peer id -> trio time its dial-backs may still come

    def expect(self, peers: list[str], until: float) -> None:
        now = trio.current_time()
        self.until = {p: t for p, t in self.until.items() if t > now}  # bounded by the peers asked lately
        for p in peers:
            self.until[p] = until
        logger = logging.getLogger("libp2p.network.swarm")
        if self not in logger.filters:
            logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if not msg.startswith("fail to upgrade mux for peer "):
            return True
        until = self.until.get(msg.rsplit(" ", 1)[-1])
        try:
            now = trio.current_time()
        except RuntimeError:  # logged outside a trio run
            return True
        return until is None or now > until


_QUIET = _DialBackNoise()


@dataclass
class ReachabilityService:
    """The asker's state: the verdict, the relays we reserved on by ourselves, the last answers."""

    node: NodeContext
    relay: RelayClient | None
    members: MembersAPI | None
    reach: Reachability = field(default_factory=Reachability)
    auto_relays: set[str] = field(default_factory=set)  # relay peer ids we chose
    last: dict[str, str] = field(default_factory=dict)  # peer -> its last answer, the latest MAX_LAST_ANSWERS peers asked
    rounds: int = 0
    advised: bool = False
    rng: random.Random = field(default_factory=random.Random)

    def my_ports(self) -> list[int]:
        ports = [tcp_port_of(a) for a in self.node.host.transport_addrs()]
        return list(dict.fromkeys(p for p in ports if p is not None))

    async def ask(self, peer: str) -> Vote | None:
        req = DialBackRequest(addrs=[a for a in self.node.host.transport_addrs() if tcp_port_of(a)][:MAX_REQUEST_ADDRS])
        try:
            reply = await call(self.node.host, peer, DIALBACK_PROTOCOL, req, ANSWER_TIMEOUT_S,
                               reply=messages(DialBackReply, max_size=MAX_REPLY_BYTES),
                               peers=self.node.peers, source=SOURCE)
        except CallFailure as e:
            self._answered(peer, f"no answer ({e.kind.value})")
            return None
        self._answered(peer, reply.result + (f" ({reply.reason})" if reply.reason else ""))
        if reply.result == "reached":
            return Vote.REACHED
        if reply.result == "not-reached":
            return Vote.NOT_REACHED
        if reply.result != "refused":
            self.node.peers.report(peer, SOURCE, "bad-result")
        return None

    def _answered(self, peer: str, answer: str) -> None:
        """Keep ``peer``'s answer as the newest, forgetting the oldest past MAX_LAST_ANSWERS: peers
        come and go, and a map of every peer ever asked only grows."""
        self.last.pop(peer, None)
        self.last[peer] = answer
        while len(self.last) > MAX_LAST_ANSWERS:
            del self.last[next(iter(self.last))]

    async def round(self) -> str:
        """Ask up to ASK_PEERS direct peers at once; returns the verdict after their answers."""
        peers = self.node.host.direct_peers()
        self.rng.shuffle(peers)
        votes: list[tuple[str, Vote]] = []

        async def one(p: str) -> None:
            v = await self.ask(p)
            if v is not None:
                votes.append((p, v))

        asked = peers[:ASK_PEERS]
        _QUIET.expect(asked, trio.current_time() + ANSWER_TIMEOUT_S + NOISE_GRACE_S)
        async with trio.open_nursery() as nursery:
            for p in asked:
                nursery.start_soon(one, p)
        now = trio.current_time()
        before = self.reach.state
        for p, v in votes:
            self.reach.record(p, v, now)
        state = self.reach.decide(now)
        self.rounds += 1
        if state != before:
            log.info("reachability: %s -> %s (%s)", before, state,
                     ", ".join(f"{p[-8:]}: {v.value}" for p, v in votes) or "no votes")
            if self.members is not None:
                self.members.update(reachability=state)
        await self.follow(state)
        return state

    async def follow(self, state: str) -> None:
        """Reserve on relays when private (up to MAX_RELAYS_CHOSEN held); drop ours when public."""
        if self.relay is None:
            return
        if state == PUBLIC:
            for relay in list(self.auto_relays):
                self.relay.held.pop(relay, None)
                self.auto_relays.discard(relay)
            return
        if state != PRIVATE:
            return
        if not self.advised:
            log.warning(advice(state, self.my_ports()))
            self.advised = True
        if self.members is None or self.relay.given:
            return  # relays given by hand: the relay client keeps those
        held = [r for r in self.relay.held if self.relay.has_reservation_on(r)]
        if len(held) >= MAX_RELAYS_CHOSEN:
            return
        relays = {p: self.members.addrs_of(p) for p, role in self.members.members().items()
                  if role == "relay" and p != self.node.peer_id}
        for addr in choose_relays(relays, MAX_RELAYS_CHOSEN - len(held), exclude=tuple(self.relay.held)):
            try:
                await self.relay.reserve_on(addr)
            except (RelayError, RemoteProtocolError, ValueError) as e:
                log.warning("reachability: reservation on relay %s failed: %s", addr, e)
                rid = relay_peer_id_of(addr)
                self.relay.held.pop(rid, None)  # choose again next round
                continue
            self.auto_relays.add(relay_peer_id_of(addr))
            log.info("reachability: reserved a relay slot on %s", addr)

    def status(self) -> dict:
        now = trio.current_time()
        # What `swarm-node status` shows in one line comes first: the verdict and the relays.
        relays = self.relay.status()["relays"] if self.relay is not None else []
        return {
            "reachability": self.reach.state,
            "relays": [{"relay": r["relay"], "reserved": r["reserved"], "expires_in_s": r["expires_in_s"]}
                       for r in relays],
            "advice": advice(self.reach.state, self.my_ports()),
            "rounds": self.rounds,
            "votes": {p: v.value for p, v in self.reach.fresh(now).items()},
            "last_answers": dict(self.last),
            "auto_relays": sorted(self.auto_relays),
        }

    def short_of_relays(self) -> bool:
        return (self.reach.state == PRIVATE and self.relay is not None
                and sum(1 for r in self.relay.held if self.relay.has_reservation_on(r)) < MAX_RELAYS_CHOSEN)

    async def keep_asking(self) -> None:
        """Rounds of dial-backs until the verdict is backed by enough votes, then one every
        RECHECK_ROUND_S; in between, a private node short of relays looks for more every
        RETRY_ROUND_S (relays join later) without asking anyone to dial it again."""
        next_round = 0.0
        while True:
            if not self.node.host.direct_peers():
                await trio.sleep(FIRST_ROUND_S)
                continue
            now = trio.current_time()
            if now >= next_round or self.reach.needs_votes(now):
                await self.round()
                now = trio.current_time()
                next_round = now + (RETRY_ROUND_S if self.reach.needs_votes(now) else RECHECK_ROUND_S)
            elif self.short_of_relays():
                await self.follow(self.reach.state)
            wait = next_round - trio.current_time()
            if self.short_of_relays():
                wait = min(wait, RETRY_ROUND_S)
            await trio.sleep(max(1.0, wait))


async def serve_dialback(node: NodeContext, streams: StreamsConfig, relay, members: MembersAPI | None, *,
                         task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Answer dial-back requests under ``streams`` (the run's per-peer stream budgets); on every
    role but relay also find our own reachability (and reserve relay slots when private). Hands
    back the :class:`ReachabilityService`."""
    node.peers.set_rule(SOURCE, FAULT_RULE)
    server = DialBackServer(node.host, node.peers,
                            Inbound(DIALBACK_PROTOCOL, DIALBACK_LIMITS, config=streams,
                                    peers=node.peers, metrics=node.metrics, source=SOURCE))

    async def handle(stream) -> None:
        await server.handle(stream)

    handle.inbound = server.inbound  # the host lists it in status (streams)
    node.host.set_handler(DIALBACK_PROTOCOL, handle)
    client = relay if isinstance(relay, RelayClient) else None
    svc = ReachabilityService(node, client, members)
    if client is None:  # a relay is dialable by its operator's promise; it only answers
        svc.reach.state = PUBLIC
    if members is not None:
        members.update(reachability=svc.reach.state)
    node.status["reachability"] = lambda: {**svc.status(), "served": server.served,
                                           "refused": dict(server.refused)}
    async with trio.open_nursery() as nursery:
        if client is not None:
            nursery.start_soon(svc.keep_asking)
        task_status.started(svc)
        await trio.sleep_forever()
