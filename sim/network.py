"""The simulated internet: endpoints with latency, uplink and downlink bandwidth, message loss,
connections, and NAT'd endpoints reachable only through a relay.

A message from a to b is serialized on a's uplink (a FIFO: it waits for what a sent before), takes
a's one-way latency to the core plus b's, and is serialized on b's downlink. A connection to a
NAT'd endpoint that the NAT'd side did not open goes through its relay (a circuit, as
node/net/relay's /p2p-circuit addresses): one more hop whose bytes the relay pays both ways.
Hole punching is not modelled (conservative: every inbound connection to a NAT'd node is relayed).
Loss drops a whole message with probability ``loss`` (harsher than TCP, which delays instead).

What a node cannot do here is as important as what it can: a message on a connection that closed
while it was in flight, or to an endpoint that is down, is dropped; a dial to a down endpoint
fails after ``refused_s`` when its host answers (a killed process: RST) or never (the caller's
timeout) when the host is gone.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from .events import Simulation

HANDSHAKE_TRIPS = 3  # one-way trips to open a connection: TCP, Noise, multistream-select (pipelined)


@dataclass
class Endpoint:
    latency: float  # one-way seconds to the core of the network
    up: float  # uplink bytes/s
    down: float  # downlink bytes/s
    nat: bool = False  # behind NAT: inbound connections only through ``relay``
    relay: str | None = None  # the public endpoint holding our reservation
    running: bool = True
    refuses: bool = True  # when down: the host answers dials with RST (process killed) or not at all (host gone)
    up_free: float = 0.0  # when the uplink is next idle
    down_free: float = 0.0
    sent_bytes: int = 0
    sent_msgs: int = 0
    recv_bytes: int = 0
    recv_msgs: int = 0
    relayed_bytes: int = 0  # bytes carried for others' circuits (counted in sent/recv too)
    sent_kinds: dict[str, int] = field(default_factory=dict)  # sent bytes by the sender's label (send's kind)


@dataclass
class Network:
    sim: Simulation
    loss: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    links: dict[str, dict[str, str | None]] = field(default_factory=dict)  # a -> {b: relay or None}
    dropped: int = 0  # messages lost (loss, closed connection, endpoint down)

    def add(self, name: str, endpoint: Endpoint) -> None:
        if name in self.endpoints and self.endpoints[name].running:
            raise ValueError(f"{name} is already on the network")
        self.endpoints[name] = endpoint
        self.links[name] = {}

    def connected(self, a: str) -> set[str]:
        return set(self.links.get(a, ()))

    def is_connected(self, a: str, b: str) -> bool:
        return b in self.links.get(a, ())

    def one_way(self, a: str, b: str, relay: str | None = None) -> float:
        e = self.endpoints
        if relay is None:
            return e[a].latency + e[b].latency
        return e[a].latency + 2 * e[relay].latency + e[b].latency

    def send(self, a: str, b: str, nbytes: int, deliver: Callable[..., object], *args, lossy: bool = True,
             skip: Callable[..., bool] | None = None, kind: str = "other") -> bool:
        """Send one message on the a-b connection; ``deliver(*args)`` runs at b when it arrives.
        Returns False (nothing sent) if a holds no connection to b.

        Each link is a FIFO served in the order messages reach it: the sender's uplink now, each
        downlink (and a relay's uplink) when the message gets there, not when it was sent (a
        reservation made in advance would make earlier arrivals wait behind later ones).

        ``skip(*args)``, asked when the message reaches b: True when handing it over could change
        nothing (a gossip copy b has already seen, which stays seen). It is then counted and takes
        its downlink time all the same, but no delivery is scheduled: most gossip copies are such
        duplicates, and their delivery events were a third of a large swarm's events.

        ``kind`` labels the bytes in ``Endpoint.sent_kinds`` (what a per-node cost is made of); a
        relay counts what it carries for a circuit as ``relayed``."""
        links = self.links.get(a)
        if links is None or b not in links:
            return False
        src = self.endpoints[a]
        src.sent_bytes += nbytes
        src.sent_msgs += 1
        src.sent_kinds[kind] = src.sent_kinds.get(kind, 0) + nbytes
        if lossy and self.loss and self.rng.random() < self.loss:
            self.dropped += 1
            return True
        relay = links[b]
        hops = (a, b) if relay is None else (a, relay, b)
        self._up(hops, 0, nbytes, deliver, args, skip)
        return True

    def _up(self, hops: tuple[str, ...], i: int, nbytes: int, deliver, args, skip) -> None:
        e, now = self.endpoints, self.sim.now
        s, d = e[hops[i]], e[hops[i + 1]]
        s.up_free = max(now, s.up_free) + nbytes / s.up
        self.sim.at(s.up_free + s.latency + d.latency, self._down, hops, i + 1, nbytes, deliver, args, skip)

    def _down(self, hops: tuple[str, ...], i: int, nbytes: int, deliver, args, skip) -> None:
        e, now = self.endpoints, self.sim.now
        node = hops[i]
        d = e.get(node)
        a, b = hops[0], hops[-1]
        if d is None or not d.running or (i == len(hops) - 1 and a not in self.links.get(b, ())):
            self.dropped += 1  # the endpoint is down, or the connection closed in flight
            return
        d.down_free = max(now, d.down_free) + nbytes / d.down
        d.recv_bytes += nbytes
        if i < len(hops) - 1:  # a relay: forwarded once received, on its own uplink
            d.relayed_bytes += 2 * nbytes
            d.sent_bytes += nbytes
            d.sent_kinds["relayed"] = d.sent_kinds.get("relayed", 0) + nbytes
            self.sim.at(d.down_free, self._up, hops, i, nbytes, deliver, args, skip)
            return
        d.recv_msgs += 1
        if skip is None or not skip(*args):
            self.sim.at(d.down_free, deliver, *args)

    def dial(self, a: str, b: str, done: Callable[[bool], object]) -> None:
        """Open a connection from a to b; ``done(True)`` when it is up, ``done(False)`` when refused
        (a down endpoint whose host answers, or a NAT'd one whose relay is down or NAT'd itself).
        A gone host never answers: the caller's timeout decides."""
        e = self.endpoints
        if self.is_connected(a, b):
            self.sim.after(0.0, done, True)
            return
        dst = e.get(b)
        relay = dst.relay if dst is not None and dst.nat and not e[a].nat else None
        if dst is not None and dst.nat and e[a].nat:
            relay = dst.relay  # no hole punching: two NAT'd nodes talk through the callee's relay
        relay_up = relay is None or (relay in e and e[relay].running and not e[relay].nat)
        if dst is None or (dst.nat and relay is None):
            self.sim.after(2 * e[a].latency, done, False)
            return
        trip = self.one_way(a, b, relay)
        if not dst.running or not relay_up:
            if dst.running or dst.refuses:  # the relay or the host answers: refused
                self.sim.after(2 * trip, done, False)
            return
        self.sim.after(HANDSHAKE_TRIPS * trip, self._open, a, b, relay, done)

    def _open(self, a: str, b: str, relay: str | None, done) -> None:
        e = self.endpoints
        if not (e[a].running and e[b].running and (relay is None or e[relay].running)):
            if e[a].running:
                done(False)
            return
        self.links[a][b] = relay
        self.links[b][a] = relay
        done(True)

    def close(self, a: str, b: str) -> None:
        self.links.get(a, {}).pop(b, None)
        self.links.get(b, {}).pop(a, None)

    def go_down(self, a: str, refuses: bool = True, notice: float = 0.0) -> None:
        """The endpoint stops. Its connections close at once for it; its peers see them close after
        ``notice`` seconds (an RST from a killed process; a gone host's connections linger until
        their peers' keepalives give up). Circuits it relayed close with it."""
        ep = self.endpoints[a]
        ep.running, ep.refuses = False, refuses
        peers = list(self.links[a])
        self.links[a] = {}
        circuits = [(x, y) for x in self.links for y, r in self.links[x].items() if r == a]
        for x, y in circuits:
            self.close(x, y)
        for p in peers:
            self.sim.after(notice, self._drop_half, p, a)

    def _drop_half(self, p: str, a: str) -> None:
        if not self.endpoints[a].running:
            self.links.get(p, {}).pop(a, None)
