"""Connection manager: keep between ``low`` and ``high`` connections. Pure: decisions, no sockets.

Below ``low`` it dials a random sample of live members it is not connected to, preferring roles it
has fewest connections to (a node meshed only with relays learns little about trainers' load, and a
partition along roles would cut the loop). Members that failed to dial wait ``backoff`` seconds.
Above ``high`` it prunes the most-represented roles first, never a protected peer (bootstrap
peers, and the trainers/validators of the run, whom the loop needs).

Dials are also limited per *address* (:class:`AddressBackoff`): records are anyone's to sign, so
900 throwaway identities advertising one address made a relay dial it 202 times in 15 s (issue
14); a per-peer backoff cannot see that they are one target. One dial to an address at a time,
and after each failure a wait that doubles from ``dial_backoff`` up to ``dial_backoff_max``.

After a partition (issue 45's soak) a node held its connections across it, closed by neither side,
and so dialled nobody until TCP retransmitted into them, 16-40 s after the heal. Connections to
members declared dead are closed (:meth:`ConnectionManager.stale`), and the bootstrap peers are
redialled on a short, jittered, capped backoff while we hold no connection (:class:`BootstrapRedial`).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

MAX_BACKOFF_ADDRS = 4096  # addresses whose failures are remembered; the oldest is forgotten first
BOOTSTRAP_FIRST_S = 2.0  # the wait after a first bootstrap redial (one connection period)
BOOTSTRAP_ISOLATED_CAP_S = 8.0  # the cap of the wait while we hold no connection at all
REJOIN_PEERS = 8  # members last held, redialled with the bootstrap peers while we hold no connection
BOOTSTRAP_CAP_S = 60.0  # the cap while some connections are left (members come through them)
BOOTSTRAP_JITTER = 0.25  # each wait is drawn within +-25 %, so nodes cut off together do not redial in step


@dataclass
class AddressBackoff:
    """Exponential backoff per dialled address (pure: time passed in).

    ``try_dial`` reserves the address (no second dial until this one's outcome or ``base``
    seconds), ``on_failed`` doubles the wait, ``on_connected`` forgets the address.
    """

    base: float
    cap: float
    max_addrs: int = MAX_BACKOFF_ADDRS
    _entries: dict[str, tuple[int, float]] = field(default_factory=dict)  # addr -> (failures, not before)

    def ready(self, addr: str, now: float) -> bool:
        entry = self._entries.get(addr)
        return entry is None or now >= entry[1]

    def try_dial(self, addr: str, now: float) -> bool:
        """May we dial ``addr`` now? If so it is reserved for this dial."""
        if not self.ready(addr, now):
            return False
        failures = self._entries.pop(addr, (0, 0.0))[0]
        self._put(addr, failures, now + self.base)
        return True

    def reserve(self, addrs: list[str], now: float) -> list[str]:
        """Those of ``addrs`` we may dial now (out of backoff), each reserved for this dial."""
        return [a for a in addrs if self.try_dial(a, now)]

    def on_failed(self, addr: str, now: float) -> None:
        failures = self._entries.pop(addr, (0, 0.0))[0] + 1
        self._put(addr, failures, now + min(self.cap, self.base * 2 ** min(failures - 1, 32)))

    def on_connected(self, addr: str) -> None:
        self._entries.pop(addr, None)

    def _put(self, addr: str, failures: int, not_before: float) -> None:
        if len(self._entries) >= self.max_addrs:
            del self._entries[next(iter(self._entries))]
        self._entries[addr] = (failures, not_before)


@dataclass
class BootstrapRedial:
    """When to dial the bootstrap peers again (pure: time passed in).

    While they are needed (:meth:`ConnectionManager.needs_bootstrap`) the first dial is at once and
    each later one waits twice as long as the one before, from ``first`` up to a cap, drawn within
    ``jitter``. The cap is short while we hold no connection at all: the bootstrap peers are then our
    only way back, so a node cut off by a partition is back within about ``isolated_cap`` of the
    heal, and a bootstrap that is really down still gets one dial per ``isolated_cap`` from it.
    With connections left, members come through those and the cap is ``cap``. The schedule starts
    over only after ``isolated_cap`` without need, so a bootstrap that takes us and drops us again
    at once does not get a dial per connection period.
    """

    first: float = BOOTSTRAP_FIRST_S
    isolated_cap: float = BOOTSTRAP_ISOLATED_CAP_S
    cap: float = BOOTSTRAP_CAP_S
    jitter: float = BOOTSTRAP_JITTER
    rng: random.Random = field(default_factory=random.Random)
    _dials: int = 0  # redials since the schedule started
    _last: float = -math.inf  # when the last one was due
    _factor: float = 1.0  # the last wait's jitter

    def wait(self, isolated: bool) -> float:
        """Seconds from the last redial to the next one."""
        cap = self.isolated_cap if isolated else self.cap
        return min(cap, self.first * 2 ** min(max(self._dials - 1, 0), 32)) * self._factor

    def due(self, needed: bool, isolated: bool, now: float) -> bool:
        """Dial the bootstrap peers now? ``needed``: needs_bootstrap's answer; ``isolated``: we hold
        no connection at all."""
        if not needed:
            if now - self._last >= self.isolated_cap:
                self._dials = 0
            return False
        if self._dials and now < self._last + self.wait(isolated):
            return False
        self._dials += 1
        self._last = now
        self._factor = self.rng.uniform(1 - self.jitter, 1 + self.jitter)
        return True


@dataclass
class RejoinBook:
    """The members we last held connections to, with their addresses: the way back besides the
    bootstrap peers for a node that lost every connection (pure).

    The bootstrap list is set once at start, and in a long run its peers can be gone for good
    (issue 45's soak: both relays a worker was started with were replaced before a partition cut it
    off; after the heal it redialled only them and stayed alone for the last 40 minutes). The member
    table is no help by then: a cut-off node declares everyone dead and forgets the tombstones after
    ``tombstone_ttl``. The book keeps the ``size`` members most recently seen connected, whatever the
    table says, so the node dials them with its bootstrap peers. Only peers whose identity a
    connection proved and whose addresses their own signed record gave are noted.
    """

    size: int = REJOIN_PEERS
    _seen: dict[str, tuple[float, float, tuple[str, ...]]] = field(default_factory=dict)  # peer -> (seen, since, addrs)

    def note(self, peer: str, addrs: list[str], now: float, since: float) -> None:
        """``peer`` is connected at ``now``, on a connection we first saw at ``since``, and its
        record lists ``addrs``."""
        if not addrs:
            return
        self._seen[peer] = (now, since, tuple(addrs))
        if len(self._seen) > self.size:
            del self._seen[min(self._seen, key=self._rank)]

    def _rank(self, peer: str) -> tuple[float, float]:
        """Higher is kept and dialled first: seen more recently, then held longer (a burst of fresh
        connections does not push out members held for hours)."""
        seen, since, _ = self._seen[peer]
        return seen, -since

    def addresses(self, skip: Callable[[str], bool]) -> list[str]:
        """Full multiaddrs (``/p2p/`` included) of the members in the book, best first, except the
        peers ``skip`` names (the bootstrap peers, dialled anyway; the banned). An address that
        names another peer is dropped: a member vouches only for its own."""
        out = []
        for peer in sorted(self._seen, key=self._rank, reverse=True):
            if skip(peer):
                continue
            for a in self._seen[peer][2]:
                target = a.rpartition("/p2p-circuit")[2] if "/p2p-circuit" in a else a  # past the relay
                named = target.partition("/p2p/")[2].split("/")[0]
                if named and named != peer:
                    continue
                out.append(a if named else f"{a}/p2p/{peer}")
        return out


@dataclass
class ConnectionPlan:
    dial: list[str]
    prune: list[str]


@dataclass
class ConnectionManager:
    low: int
    high: int
    backoff: float
    rng: random.Random = field(default_factory=random.Random)
    _failed_at: dict[str, float] = field(default_factory=dict)

    def on_dial_failed(self, peer_id: str, now: float) -> None:
        self._failed_at.pop(peer_id, None)
        if len(self._failed_at) >= MAX_BACKOFF_ADDRS:
            del self._failed_at[next(iter(self._failed_at))]  # the oldest failure
        self._failed_at[peer_id] = now

    def on_connected(self, peer_id: str) -> None:
        self._failed_at.pop(peer_id, None)

    def needs_bootstrap(self, connected: set[str], bootstrap: set[str]) -> bool:
        """Dial the bootstrap peers (again)? Only while we hold none of them and fewer than ``low``
        connections in all: a node that holds one, or enough members, joins through those."""
        return bool(bootstrap) and not connected & bootstrap and len(connected) < self.low

    def stale(self, connected_since: dict[str, float], died_at: Callable[[str], float | None]) -> list[str]:
        """Connections to close: those held since before their member was declared dead
        (``connected_since``: peer -> when we first saw the connection; ``died_at``: when the member
        was declared dead, None while it is not). Across a partition a TCP connection is closed by
        neither side (nothing reaches the other), so it stays listed, and after the heal it carries
        nothing until TCP retransmits, which its backoff puts tens of seconds later (issue 45's soak:
        16-40 s); listed, it also kept us from dialling anyone, the bootstrap peers included. A
        connection made after the death is kept: it is fresh evidence, and the member's next record
        revives it."""
        return sorted(p for p, since in connected_since.items() if (at := died_at(p)) is not None and since <= at)

    def plan(
        self,
        connected: set[str],
        alive: Mapping[str, str],  # peer id -> role, live members (MemberTable.alive_roles: a view)
        protected: set[str],
        now: float,
        dialable: Callable[[str], bool] | None = None,  # e.g. has an address out of AddressBackoff
    ) -> ConnectionPlan:
        n = len(connected)
        if n < self.low:
            candidates = [
                p
                for p in alive
                if p not in connected and now - self._failed_at.get(p, -1e18) >= self.backoff
                and (dialable is None or dialable(p))
            ]
            return ConnectionPlan(self._diverse_sample(candidates, alive, connected, self.low - n), [])
        if n > self.high:
            return ConnectionPlan([], self._prune(connected, alive, protected, n - self.high))
        return ConnectionPlan([], [])

    def _diverse_sample(self, candidates: list[str], roles: Mapping[str, str], connected: set[str], k: int) -> list[str]:
        have = Counter(roles.get(p, "?") for p in connected)
        self.rng.shuffle(candidates)
        chosen: list[str] = []
        pool = list(candidates)
        while pool and len(chosen) < k:
            best = min(pool, key=lambda p: have[roles.get(p, "?")])  # stable after shuffle: random ties
            pool.remove(best)
            chosen.append(best)
            have[roles.get(best, "?")] += 1
        return chosen

    def _prune(self, connected: set[str], roles: Mapping[str, str], protected: set[str], k: int) -> list[str]:
        have = Counter(roles.get(p, "?") for p in connected)
        pool = sorted(p for p in connected if p not in protected)  # set order varies with the hash seed
        self.rng.shuffle(pool)
        out: list[str] = []
        while pool and len(out) < k:
            worst = max(pool, key=lambda p: have[roles.get(p, "?")])
            pool.remove(worst)
            out.append(worst)
            have[roles.get(worst, "?")] -= 1
        return out


CLOSING_S = 5.0  # seconds after a deliberate close during which the connection may still be listed
PRUNE_MEMORY = 30.0  # seconds a deliberate close (ours or theirs) keeps a lost connection from looking like a failure


@dataclass
class CloseWatch:
    """Which dropped connections look like failures (pure: time passed in; the membership service's
    tick and the simulator in sim/ feed it the connected set).

    A deliberate close is announced first (``Prune``): the pruner and the pruned peer both note it,
    so that neither takes the drop for a failure and probes (a redial the other prunes again).
    A connection that drops unannounced is *lost*: its member is probed at once, but at most once
    per ``PRUNE_MEMORY`` for a peer that keeps dropping us, so a redial and a prune cannot loop.
    """

    memory: float = PRUNE_MEMORY
    closing_s: float = CLOSING_S
    was_connected: set[str] = field(default_factory=set)  # connections at the last look
    pruned: dict[str, float] = field(default_factory=dict)  # peer -> announced close, or last probe for a loss
    deliberate: dict[str, float] = field(default_factory=dict)  # peer -> announced close only (ours or theirs)
    closes: dict[str, int] = field(default_factory=lambda: {"pruned": 0, "pruned_by_peer": 0, "lost": 0})

    def on_prune_sent(self, peer: str, now: float) -> None:
        """We are closing ``peer``'s connection on purpose (the notice is on its way)."""
        self.pruned[peer] = self.deliberate[peer] = now
        self.closes["pruned"] += 1

    def on_prune_received(self, peer: str, now: float) -> None:
        """``peer`` told us it is closing our connection on purpose."""
        self.pruned[peer] = self.deliberate[peer] = now
        self.closes["pruned_by_peer"] += 1

    def closing(self, now: float) -> set[str]:
        """Peers whose connection is closing on purpose: it may still be listed as connected."""
        return {p for p, at in self.deliberate.items() if now - at < self.closing_s}

    def closed_on_purpose_since(self, peer: str, since: float) -> bool:
        """Was ``peer``'s connection closed on purpose at or after ``since`` (a probe's ping died with it)?"""
        return self.deliberate.get(peer, -math.inf) >= since

    def lost(self, connected: set[str], now: float, live: Callable[[str], bool]) -> list[str]:
        """Live members (``live``) whose connection dropped since the last look without a notice."""
        for notes in (self.pruned, self.deliberate):
            for p, at in list(notes.items()):
                if now - at > self.memory:
                    del notes[p]
        lost = [p for p in self.was_connected - connected if p not in self.pruned and live(p)]
        self.was_connected = connected
        self.closes["lost"] += len(lost)
        for p in lost:
            self.pruned[p] = now
        return lost
