"""Reachability: can other peers dial us? Pure decisions for the dial-back protocol (node/reach/dialback.py).

libp2p AutoNAT's idea, in our own small protocol: a node asks up to :data:`ASK_PEERS` connected
peers to dial it back on its advertised TCP ports. Each answer is a vote (reached / not reached);
the votes decide ``public | private | unknown`` (:class:`Reachability`). A private node reserves
circuit-relay slots (:func:`choose_relays`) and advertises its ``/p2p-circuit`` addresses.

The dialer side is what keeps the protocol from being a DDoS tool: :func:`dialback_targets` turns a
request into addresses **on the requester's own observed IP** only (the IP its connection to us
comes from), whatever addresses the request names; only the ports are the requester's choice, and
only a few of them. So a request can make us dial nobody but the requester itself.

Everything here takes its inputs, the time included, as arguments.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field

import multiaddr

PUBLIC = "public"
PRIVATE = "private"
UNKNOWN = "unknown"
STATES = (PUBLIC, PRIVATE, UNKNOWN)

ASK_PEERS = 3  # peers asked per round (AutoNAT asks a few, so one liar cannot decide alone)
MIN_VOTES = 2  # agreeing votes from distinct peers needed to leave "unknown"
VOTE_TTL_S = 1800.0  # a vote older than this no longer counts (addresses and NATs change)
MAX_VOTES = 16  # peers whose last vote we remember
MAX_DIAL_PORTS = 4  # ports of one request we dial at most
MAX_RELAYS_CHOSEN = 2  # relays a private node reserves on by itself


class Vote(enum.Enum):
    REACHED = "reached"  # the peer dialled us back and completed the handshake
    NOT_REACHED = "not-reached"  # it tried every port and got no handshake


@dataclass
class Reachability:
    """The votes of distinct peers and the verdict they give (``state``).

    A peer's newer vote replaces its older one, so one peer answering often counts once. The
    verdict moves to ``public`` (or ``private``) when at least ``min_votes`` fresh votes say so
    and they outnumber the others; otherwise the last verdict stands until its votes expire, then
    it falls back to ``unknown``.
    """

    min_votes: int = MIN_VOTES
    vote_ttl_s: float = VOTE_TTL_S
    votes: dict[str, tuple[Vote, float]] = field(default_factory=dict)  # peer -> (vote, when)
    state: str = UNKNOWN
    changed_at: float = 0.0

    def record(self, peer: str, vote: Vote, now: float) -> str:
        """Count ``peer``'s vote at ``now``; returns the (possibly new) verdict."""
        self.votes[peer] = (vote, now)
        if len(self.votes) > MAX_VOTES:  # forget the oldest
            oldest = min(self.votes, key=lambda p: self.votes[p][1])
            del self.votes[oldest]
        return self.decide(now)

    def fresh(self, now: float) -> dict[str, Vote]:
        return {p: v for p, (v, t) in self.votes.items() if now - t <= self.vote_ttl_s}

    def decide(self, now: float) -> str:
        fresh = list(self.fresh(now).values())
        yes = fresh.count(Vote.REACHED)
        no = fresh.count(Vote.NOT_REACHED)
        if yes >= self.min_votes and yes > no:
            new = PUBLIC
        elif no >= self.min_votes and no > yes:
            new = PRIVATE
        elif not fresh:
            new = UNKNOWN
        else:
            new = self.state  # too few or split votes: keep what we had
        if new != self.state:
            self.state, self.changed_at = new, now
        return self.state

    def needs_votes(self, now: float) -> bool:
        """True while the verdict is not backed by ``min_votes`` fresh agreeing votes."""
        fresh = list(self.fresh(now).values())
        if self.state == PUBLIC:
            return fresh.count(Vote.REACHED) < self.min_votes
        if self.state == PRIVATE:
            return fresh.count(Vote.NOT_REACHED) < self.min_votes
        return True


# ---------------------------------------------------------------------------------------------
# The dialer's side


def _direct(addr: str) -> multiaddr.Multiaddr | None:
    """``addr`` parsed, or None when it does not parse or goes through a relay circuit."""
    try:
        ma = multiaddr.Multiaddr(addr)
    except Exception:
        return None
    return None if "/p2p-circuit" in str(ma) else ma


def ip_of(addr: str) -> str | None:
    """The IPv4/IPv6 address of a direct multiaddr (None for circuit or DNS addresses)."""
    ma = _direct(addr)
    for proto in ("ip4", "ip6") if ma is not None else ():
        try:
            return ma.value_for_protocol(proto)
        except Exception:
            continue
    return None


def tcp_port_of(addr: str) -> int | None:
    ma = _direct(addr)
    if ma is None:
        return None
    try:
        port = int(ma.value_for_protocol("tcp"))
    except Exception:
        return None
    return port if 0 < port < 65536 else None


def dialback_targets(requested: list[str], observed_ip: str | None) -> list[str]:
    """The addresses we dial for a dial-back request: the requester's own ``observed_ip`` with each
    TCP port its request names (at most :data:`MAX_DIAL_PORTS`, no duplicates).

    The IPs in the request are ignored: a requester behind NAT advertises its private address, and
    a malicious one would name a victim's. [] when the IP is unknown (e.g. a relayed connection).
    """
    if observed_ip is None:
        return []
    try:
        ip = ipaddress.ip_address(observed_ip)
    except ValueError:
        return []
    proto = "ip4" if ip.version == 4 else "ip6"
    ports: list[int] = []
    for a in requested:
        port = tcp_port_of(a)
        if port is not None and port not in ports:
            ports.append(port)
        if len(ports) >= MAX_DIAL_PORTS:
            break
    return [f"/{proto}/{ip}/tcp/{p}" for p in ports]


# ---------------------------------------------------------------------------------------------
# The private node's side


def choose_relays(candidates: dict[str, list[str]], k: int = MAX_RELAYS_CHOSEN,
                  exclude: tuple[str, ...] = ()) -> list[str]:
    """Pick up to ``k`` relays from ``candidates`` (relay peer id -> advertised addresses) to reserve
    on; returns full ``<addr>/p2p/<relay>`` multiaddrs, one per relay.

    Relays on different IPs first (one operator's machine going down should not take both slots),
    then the rest; ties broken by peer id so the choice is stable. ``exclude``: relays already held.
    """
    options: list[tuple[str, str, str]] = []  # (peer, ip, addr)
    for peer in sorted(candidates):
        if peer in exclude:
            continue
        direct = [a for a in candidates[peer] if ip_of(a) is not None and tcp_port_of(a) is not None]
        if not direct:
            continue
        addr = direct[0]
        ip = ip_of(addr) or ""
        if "/p2p/" not in addr:
            addr = f"{addr}/p2p/{peer}"
        options.append((peer, ip, addr))
    chosen: list[tuple[str, str, str]] = []
    seen_ips: set[str] = set()
    for opt in options:  # one per IP first
        if len(chosen) < k and opt[1] not in seen_ips:
            chosen.append(opt)
            seen_ips.add(opt[1])
    for opt in options:  # then fill up
        if len(chosen) < k and opt not in chosen:
            chosen.append(opt)
    return [addr for _, _, addr in chosen]


def advice(state: str, ports: list[int]) -> str | None:
    """The one line a private node logs for its operator (None unless private)."""
    if state != PRIVATE:
        return None
    port = ", ".join(str(p) for p in ports) or "<your listen port>"
    return (f"reachability: private (peers could not dial us back); reachable through relays for now. "
            f"For direct connections forward TCP port {port} on your router to this machine, "
            f"or set --listen to an address peers can reach")
