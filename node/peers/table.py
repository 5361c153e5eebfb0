"""The one peer score table: every component reports remote faults here; it decides bans.

How this works
--------------
* A component that catches a peer sending garbage calls ``on_fault(peer, source, reason, now)``.
  ``source`` names the component (a protocol or topic); its :class:`FaultRule` says what one fault
  costs: ``weight`` points off the peer's score, and whether ``strikes`` faults within ``window``
  seconds earn a ban of ``ban_seconds`` (the per-component numbers that existed before this table:
  trainer intake strikes, the shards picker's smart ban, ledger sync's step). The answer is a list
  of :class:`Action` for the caller's edge to carry out (node/peers/service.py).
* A banning rule's ``fold``: faults of one peer from one source within ``fold`` seconds after its last
  strike are the same event and cost nothing more (counted in ``faults`` only). A partition or one
  stalled connection cuts every stream on it at once: four stalls within 0.2 s are one piece of
  evidence, not four (issue 45: an honest relay banned for 600 s so). A peer that misbehaves on
  purpose gains one event per ``fold`` seconds, so ``strikes`` of them take ``(strikes - 1) * fold``.
  With ``first_ban`` the bans a rule gives one peer grow: ``first_ban``, twice that, ... up to
  ``ban_seconds``: a wrong ban of an honest peer (a link that failed thrice) costs a minute, not ten,
  while a peer that keeps misbehaving soon spends most of its time banned. The count starts over
  when ``window`` seconds pass between the end of a peer's last ban and the first strike of its
  next: a strike that old no longer counts toward a ban, so neither does a ban that old toward
  escalation (an honest relay banned once a week ago gets ``first_ban`` again, not twice it).
* :meth:`PeerTable.excuse`: a fault the caller may blame on itself (a stream cut while our side had
  not read its connection's bytes) is excused for one event (faults within ``fold`` seconds of the
  first excused one) per ``window`` per peer and source; later ones are faults. A peer that can keep
  our side's evidence true on purpose (a native sender outrunning our reader) buys one event, not
  immunity.
* A ban decided elsewhere (a penalty entry in the ledger) arrives through :meth:`PeerTable.ban`.
* Scores *add up* across components (the bug this table fixes: one ``set_app_score`` per peer let a
  later -20 replace a -1000 ban) and decay toward 0 with half-life ``half_life``; bans expire.
  Bans are kept per source, so each component still enforces its own (``is_banned(.., source)``);
  the gossipsub app score is :data:`BAN_SCORE` while any disconnecting ban holds.
* Bounded: at most ``max_peers`` entries; a new peer past that evicts the least relevant one (not
  banned, smallest score magnitude, least recently seen).

Pure: no I/O, no clock; ``now`` is an argument (seconds, the caller's monotonic clock).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

BAN_SCORE = -1000.0  # gossipsub app score of a banned peer: far below the -100 graylist threshold
HALF_LIFE = 600.0  # seconds for a penalty to halve
MAX_PEERS = 4096  # peers the table remembers
MAX_SOURCES = 64  # rules (components) one table knows; sources are code constants, never remote input
_FORGET_BELOW = 0.01  # a decayed score this small counts as zero for eviction


class ActionKind(enum.Enum):
    BAN = "ban"  # refuse the peer until ``until``
    DISCONNECT = "disconnect"  # close our connections to it now


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    peer: str
    source: str
    reason: str
    until: float = 0.0  # for BAN: end of the ban (same clock as ``now``)


@dataclass(frozen=True)
class FaultRule:
    """What one fault reported by a source costs."""

    weight: float = 0.0  # score points taken per fault (decaying)
    strikes: int = 0  # faults within ``window`` that earn a ban; 0: this source never bans
    window: float = math.inf  # seconds a strike counts toward a ban
    ban_seconds: float = 0.0  # length of a ban this source gives
    disconnect: bool = True  # a ban from this source closes connections and sets BAN_SCORE
    fold: float = 0.0  # faults within this many seconds after the peer's last strike are the same event
    first_ban: float = 0.0  # > 0: a peer's first ban lasts this long, each later one twice the last (<= ban_seconds)

    def __post_init__(self) -> None:
        if self.weight < 0:  # a fault worth points would reward the peer that commits it
            raise ValueError(f"a fault's weight is the points it takes, >= 0 (got {self.weight})")
        if self.fold < 0 or self.first_ban < 0:
            raise ValueError(f"a rule's fold and first_ban are seconds, >= 0 (got {self.fold}, {self.first_ban})")

    def ban_length(self, earlier: int) -> float:
        """How long a ban lasts for a peer this source banned ``earlier`` times before."""
        if self.first_ban <= 0:
            return self.ban_seconds
        return min(self.ban_seconds, self.first_ban * 2.0 ** min(earlier, 32))


@dataclass
class Ban:
    until: float
    reason: str
    disconnect: bool


@dataclass
class PeerEntry:
    score: float = 0.0  # <= 0, as of ``updated``
    updated: float = 0.0
    seen: float = 0.0  # last report
    faults: int = 0
    last: str = ""  # "source/reason" of the last fault
    strikes: dict[str, list[float]] = field(default_factory=dict)  # source -> recent fault times
    bans: dict[str, Ban] = field(default_factory=dict)  # source -> ban
    banned: dict[str, int] = field(default_factory=dict)  # source -> bans its rule gave (escalation)
    excused: dict[str, float] = field(default_factory=dict)  # source -> when its last excused event began


class PeerTable:
    def __init__(self, rules: dict[str, FaultRule] | None = None, *, max_peers: int = MAX_PEERS,
                 half_life: float = HALF_LIFE) -> None:
        self.rules: dict[str, FaultRule] = {}
        for source, rule in (rules or {}).items():
            self.set_rule(source, rule)
        self.max_peers = max_peers
        self.half_life = half_life
        self.peers: dict[str, PeerEntry] = {}
        self.evicted = 0

    def set_rule(self, source: str, rule: FaultRule) -> None:
        """Say what a fault from ``source`` costs (a component's policy numbers, from its config)."""
        if source not in self.rules and len(self.rules) >= MAX_SOURCES:
            raise ValueError(f"more than {MAX_SOURCES} fault sources")
        self.rules[source] = rule

    # ------------------------------------------------------------------ inputs

    def on_fault(self, peer: str, source: str, reason: str, now: float) -> list[Action]:
        """Record a remote fault; the actions (ban, disconnect) it earns. Unknown sources cost 0."""
        rule = self.rules.get(source, FaultRule())
        entry = self._entry(peer, now)
        entry.faults += 1
        entry.last = f"{source}/{reason}"
        if self.is_banned(peer, now, source):
            return []  # already out: a banned peer's further faults earn nothing new
        recent = entry.strikes.get(source, [])
        if recent and now - recent[-1] < rule.fold:
            return []  # the same event as the last strike (see "fold" in the module docstring)
        self._add(entry, -rule.weight, now)
        if rule.strikes <= 0:
            return []
        times = [t for t in entry.strikes.pop(source, []) if t > now - rule.window] + [now]
        if len(times) < rule.strikes:
            entry.strikes[source] = times[-rule.strikes:]
            return []
        earlier = entry.banned.get(source, 0)
        last = entry.bans.get(source)
        if last is not None and times[0] - last.until >= rule.window:
            earlier = 0  # quiet for a window since its last ban: escalation starts over
        entry.banned[source] = earlier + 1
        return self._ban(peer, entry, source, reason, now + rule.ban_length(earlier), rule.disconnect)

    def excuse(self, peer: str, source: str, now: float) -> bool:
        """Whether a fault of ``peer`` that the caller may blame on itself is excused: the first of an
        event (then the rest of it, within the rule's ``fold``) per ``window``; the caller reports
        the fault (:meth:`on_fault`) when not."""
        rule = self.rules.get(source, FaultRule())
        entry = self._entry(peer, now)
        began = entry.excused.get(source)
        if began is None or now - began >= rule.window:
            entry.excused[source] = now
            return True
        return now - began < rule.fold

    def ban(self, peer: str, source: str, reason: str, until: float, now: float) -> list[Action]:
        """A ban decided outside the table (e.g. a ledger penalty entry); the source's rule says
        whether it disconnects. A ban never shortens one already held from the same source."""
        if until <= now:
            return []
        rule = self.rules.get(source, FaultRule())
        entry = self._entry(peer, now)
        held = entry.bans.get(source)
        if held is not None and held.until >= until:
            return []
        return self._ban(peer, entry, source, reason, until, rule.disconnect)

    # ------------------------------------------------------------------ queries

    def is_banned(self, peer: str, now: float, source: str | None = None) -> bool:
        """Banned by ``source`` (by any source when None)."""
        entry = self.peers.get(peer)
        if entry is None:
            return False
        bans = entry.bans.values() if source is None else filter(None, [entry.bans.get(source)])
        return any(b.until > now for b in bans)

    def score(self, peer: str, now: float) -> float:
        """The decayed penalty (<= 0), without bans."""
        entry = self.peers.get(peer)
        return 0.0 if entry is None else self._decayed(entry, now)

    def app_score(self, peer: str, now: float) -> float:
        """What gossipsub's P5 (application-specific score) should see for ``peer``."""
        entry = self.peers.get(peer)
        if entry is None:
            return 0.0
        score = self._decayed(entry, now)
        if any(b.disconnect and b.until > now for b in entry.bans.values()):
            return min(score, 0.0) + BAN_SCORE
        return score

    def bans(self, now: float) -> dict[str, dict]:
        """Active bans: {peer: {source: {"seconds_left", "reason"}}} (for status views)."""
        out: dict[str, dict] = {}
        for peer, entry in self.peers.items():
            active = {s: {"seconds_left": round(b.until - now), "reason": b.reason}
                      for s, b in entry.bans.items() if b.until > now}
            if active:
                out[peer] = active
        return out

    def snapshot(self, now: float, worst: int = 10) -> dict:
        """A bounded view for status: counts, active bans, the ``worst`` scores."""
        scored = sorted(((self.app_score(p, now), p) for p in self.peers), key=lambda sp: sp[0])[:worst]
        return {
            "tracked": len(self.peers),
            "evicted": self.evicted,
            "bans": self.bans(now),
            "worst": [{"peer": p, "score": round(s, 1), "faults": self.peers[p].faults, "last": self.peers[p].last}
                      for s, p in scored if s < 0],
        }

    # ------------------------------------------------------------------ internals

    def _ban(self, peer: str, entry: PeerEntry, source: str, reason: str, until: float,
             disconnect: bool) -> list[Action]:
        entry.strikes.pop(source, None)
        entry.bans[source] = Ban(until, reason, disconnect)
        actions = [Action(ActionKind.BAN, peer, source, reason, until)]
        if disconnect:
            actions.append(Action(ActionKind.DISCONNECT, peer, source, reason))
        return actions

    def _decayed(self, entry: PeerEntry, now: float) -> float:
        if entry.score == 0.0 or now <= entry.updated:
            return entry.score
        return entry.score * 0.5 ** ((now - entry.updated) / self.half_life)

    def _add(self, entry: PeerEntry, delta: float, now: float) -> None:
        entry.score = self._decayed(entry, now) + delta
        entry.updated = max(entry.updated, now)

    def _entry(self, peer: str, now: float) -> PeerEntry:
        entry = self.peers.get(peer)
        if entry is None:
            if len(self.peers) >= self.max_peers:
                self._evict(now)
            entry = self.peers[peer] = PeerEntry(updated=now, seen=now)
        entry.seen = max(entry.seen, now)
        return entry

    def _evict(self, now: float) -> None:
        """Forget the least relevant peer: not banned, smallest |score|, least recently seen."""

        def relevance(peer: str) -> tuple:
            entry = self.peers[peer]
            banned = any(b.until > now for b in entry.bans.values())
            magnitude = abs(self._decayed(entry, now))
            return (banned, magnitude if magnitude >= _FORGET_BELOW else 0.0, entry.seen)

        del self.peers[min(self.peers, key=relevance)]
        self.evicted += 1
