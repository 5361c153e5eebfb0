"""The member table: who is in the swarm and whether they are alive. Pure: no I/O, time passed in.

How this works
--------------
Dissemination and failure detection are split, as in SWIM (Das, Gupta, Motivala, DSN 2002):

* **Records** (what a peer says about itself) travel on the gossipsub members topic when they
  change, and are refreshed every ``refresh_interval(N)`` so that lost messages heal. Records carry
  a sequence number that only grows; an older or equal one changes nothing.
* **Liveness** comes from probing, not from records: every ``probe_period`` a node pings one member
  it holds a connection to (round-robin over a shuffled list, SWIM 4.3), every ``far_probe_every``
  rounds one it holds none to (a member whose last connections closed on purpose before it crashed
  has no neighbour to notice), and at once any member whose connection dropped without notice; on
  failure it asks ``indirect_probes`` others to ping it.
  Only when all fail does it *suspect* the member and publish a signed accusation naming the
  record's sequence number. Every node that hears it opens a suspicion on the member; after
  ``suspicion_timeout(N)`` without a newer record the member is DEAD (see below for why the
  hearers keep it ALIVE meanwhile). A live member that hears an
  accusation about itself refutes it by publishing its record with a higher sequence number.
* A clean shutdown publishes a signed goodbye (LEFT). A restarted peer with the same key comes back
  with a higher sequence number (it starts at wall-clock milliseconds) and is ALIVE again.
* A joining node learns the table by a push-pull exchange of all records with the first peers it
  connects to (memberlist's full-state sync); after that only one random peer every
  ``sync_interval(N)`` (see ``SyncPlanner``).

Membership that cannot be forged into a verdict (issue 14)
-----------------------------------------------------------
Anyone can sign an accusation or a record, so the table believes only what the protocol lets a
peer prove:

* **Hearsay is not a verdict.** Someone else's accusation (SUSPECT or DEAD alike) opens a
  *suspicion* on the member but leaves its state ALIVE: it stays in the live set while it has
  ``suspicion_timeout(N)`` to answer, and becomes DEAD only if it does not. Only our own failed
  probes make a member SUSPECT at once (first-hand evidence). Memberlist likewise keeps suspects
  among the members; a DEAD message here cannot skip the suspicion (SWIM 4.2's confirm is the
  accuser's own word). An accused seq must be one the member can have published by now.
* **Accusers are accountable.** Each accuser has a token bucket (``accusation_burst``,
  ``accusation_rate``); a refutation (a newer record signed by the accused while its suspicion is
  pending) counts against the accuser, and one refuted ``refuted_limit`` times within
  ``refuted_window`` is ignored. Both are reported as faults to the peer score owner.
* **Unreachable members expire.** A live entry is kept while there is first-hand evidence it can
  be reached (our probe answered, we hold a connection) or it refreshes its record itself on
  gossip (the gossipsub author is the member: it takes part in the mesh); otherwise it is dropped
  after ``member_ttl(N)`` = ``unreached_ttl_mult`` refresh intervals. Copies of its record from
  others (push-pull, republished gossip) do not keep it.
* **New members per source are budgeted.** Each source (the gossipsub author of a record, or the
  peer of a push-pull exchange) may introduce ``new_member_burst`` members at once and
  ``new_member_rate`` per second after; an honest node introduces one, itself. Over-limit records
  are dropped, and a gossip author reported (a push-pull table may honestly hold members we lack:
  its surplus waits for those members' own refreshes). Only the exchanges a joining node starts are exempt (they
  bring the whole table, from peers it chose). At the table bound, tombstones and then the entry
  longest unreached make room for a newcomer.

States::

    (unknown) --record--> ALIVE --our probe failed--> SUSPECT --timeout--> DEAD
        ALIVE --someone else's accusation--> ALIVE + pending suspicion --timeout--> DEAD
        ALIVE/SUSPECT/DEAD --newer record--> ALIVE (clears a suspicion)   any --goodbye--> LEFT
        SUSPECT/DEAD --the same record, published by the member itself--> ALIVE (it never heard)
        ALIVE/SUSPECT --member_ttl(N) with nobody reachable vouching--> (forgotten)
    DEAD and LEFT entries are kept as tombstones for ``tombstone_ttl`` so that old records
    still circulating cannot resurrect them.

Load model (messages and bytes per node per second, N members, D = 6 gossipsub degree,
r = record envelope size, ~400 B; g = gossipsub's per-message framing, 186 B (from, seqno,
topic, signature, key); p = probe period; lambda = failures per node per second):

    records     N / refresh_interval(N) msgs/s received, each forwarded to D mesh peers and its
                id (48 B) announced in IHAVE to D_lazy = 6 others on each of the 3 heartbeats of
                the gossip window: D * (r + g) + 3 * 6 * 48 ~ 4.4 kB sent per record.
                refresh_interval = clamp(N / record_rate, 30 s, 3600 s), record_rate = 0.25/s
                -> received <= 0.25 msg/s (<= ~1.1 kB/s sent) for 7.5 <= N <= 900, and
                N/3600 beyond (2.8 msg/s at 10,000: the hour cap keeps tables from going stale).
                Refreshes only heal lost messages (changes are published at once, and push-pull
                heals too): each costs every node ~10 ms of CPU at N=25 (its copies in and
                out through py-libp2p), so 0.5/s was about a third of an idle relay's CPU
                (issue 16). The price: a lost change, a push-pull surplus and an unreachable
                member's expiry (``member_ttl``) wait twice as long.
    probes      1/p pings sent + ~1/p answered = 2 msgs/s at p = 1 s, ~100 B each: constant in N.
                Plus one dial made and one received per far_probe_every periods (its handshake is
                not in this model, nor in sim/'s byte counts).
    indirect    3 ping-reqs per failed direct probe: only under loss or failure.
    sync        a node starts one push-pull every sync_interval = max(30 s, N * 1 s) and answers
                one on average, sending all N records in each: 2 * N * r / max(30, N) <= 2r B/s
                (~0.8 kB/s): constant in N. New connections are synced only while joining.
    churn       2 accusations per failure, seen by all: 2 * lambda * N msgs/s (SWIM piggybacks
                the same information; it is inherent to everyone learning every failure), plus
                the replacement's start record. Only those accusers whose probes fail before the
                first accusation reaches them publish one (on_probe_failed): every neighbour of a
                crashed member did, 5-8 floods per crash in bench/sim_membership.py at N=100-300.

So a node pays O(1) messages per second in a steady swarm instead of O(N) for all-to-all
heartbeats. First detection is ~e/(e-1) probe periods after a failure on average (SWIM), then
``suspicion_timeout`` = suspicion_mult * max(1, log10 N) periods (memberlist) before DEAD.
"""

from __future__ import annotations

import enum
import itertools
import math
import random
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

from .records import Accusation, Goodbye, PeerRecord


class MemberState(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


@dataclass
class MembershipConfig:
    """Membership and failure-detection timing (run file table ``[membership]``)."""

    probe_period: float = 1.0  # seconds between direct probes (SWIM protocol period)
    probe_timeout: float = 0.5  # seconds to wait for a direct ping (memberlist LAN default)
    indirect_probes: int = 3  # peers asked to ping a member that missed a direct probe
    indirect_timeout: float = 1.5  # seconds to wait for indirect acks
    suspicion_mult: float = 4.0  # suspicion timeout = mult * max(1, log10 N) probe periods
    record_rate: float = 0.25  # target record refreshes received per node per second (see the load model)
    min_refresh: float = 30.0  # record refresh interval bounds, seconds
    max_refresh: float = 3600.0
    min_sync: float = 30.0  # push-pull interval = max(min_sync, N * sync_per_member) seconds
    sync_per_member: float = 1.0
    tombstone_ttl: float = 600.0  # how long DEAD/LEFT entries are remembered
    conn_low: int = 8  # connection manager: dial more below this many connections
    conn_high: int = 24  # prune above this
    dial_backoff: float = 10.0  # seconds before redialing a member that failed to connect (and an address's first wait)
    max_members: int = 20_000  # table bound; at it, tombstones and unreached entries make room, else records are refused
    dial_backoff_max: float = 300.0  # cap of the per-address backoff (dial_backoff, doubling per failed dial)
    accusation_burst: int = 8  # accusations one accuser may make at once (token bucket size)
    accusation_rate: float = 0.2  # ... and per second after that; more are dropped and the accuser scored down
    refuted_limit: int = 3  # an accuser refuted this many times within refuted_window is ignored
    refuted_window: float = 600.0  # seconds a refuted accusation counts toward refuted_limit
    new_member_burst: int = 8  # members one source (gossip author, push-pull peer) may introduce at once
    new_member_rate: float = 0.1  # ... and per second after that; more are dropped and the source scored down
    unreached_ttl_mult: float = 3.0  # a member nobody reachable vouches for expires after this many refresh intervals
    far_probe_every: int = 10  # every this many probe rounds, probe a member we hold no connection to (0: never)

    def validate(self) -> None:
        if self.probe_period <= 0 or self.probe_timeout <= 0 or self.indirect_timeout <= 0:
            raise ValueError("periods and timeouts must be positive")
        if self.probe_timeout >= self.probe_period + self.indirect_timeout:
            raise ValueError("probe_timeout must be shorter than a probe round")
        if not 0 < self.conn_low <= self.conn_high:
            raise ValueError("need 0 < conn_low <= conn_high")
        if self.suspicion_mult < 1:
            raise ValueError("suspicion_mult must be >= 1")
        if self.accusation_burst < 1 or self.new_member_burst < 1 or self.refuted_limit < 1:
            raise ValueError("accusation_burst, new_member_burst and refuted_limit must be >= 1")
        if self.accusation_rate < 0 or self.new_member_rate < 0:
            raise ValueError("rates must be >= 0")
        if self.unreached_ttl_mult < 1:
            raise ValueError("unreached_ttl_mult must be >= 1 (a member refreshes once per interval)")
        if self.dial_backoff_max < self.dial_backoff:
            raise ValueError("dial_backoff_max must be >= dial_backoff")
        if self.far_probe_every < 0:
            raise ValueError("far_probe_every must be >= 0")

    def refresh_interval(self, n: int) -> float:
        return min(self.max_refresh, max(self.min_refresh, n / self.record_rate))

    def sync_interval(self, n: int) -> float:
        return max(self.min_sync, n * self.sync_per_member)

    def suspicion_timeout(self, n: int) -> float:
        return self.suspicion_mult * max(1.0, math.log10(max(n, 1))) * self.probe_period

    def member_ttl(self, n: int) -> float:
        """How long a live entry lasts without first-hand evidence or a refresh by the member itself."""
        return self.unreached_ttl_mult * self.refresh_interval(n)


class Verdict(enum.Enum):
    """What the table did with an input (reasons are counted in metrics/status)."""

    NEW = "new"  # first record of a peer
    UPDATED = "updated"  # newer record (also: revived from suspect/dead)
    SAME = "same"  # same seq, nothing changed
    STALE = "stale"  # older seq than known
    SELF = "self"  # about us: handled by the caller (refute)
    IGNORED = "ignored"  # accusation about an unknown peer or an outdated or implausible seq
    DISTRUSTED = "distrusted"  # accusation by an accuser refuted too often
    LIMITED = "limited"  # over the source's budget (accusations, or new members)
    SUSPECTED = "suspected"
    DIED = "died"
    LEFT = "left"
    FULL = "full"  # table bound reached


@dataclass(frozen=True)
class Suspicion:
    """Someone else's accusation, pending: the member has until ``since + suspicion_timeout``."""

    accuser: str
    seq: int
    since: float


@dataclass
class Member:
    record: PeerRecord
    state: MemberState
    since: float  # when the current state began
    last_heard: float  # last record, refresh or successful probe
    accuser: str = ""  # who suspected it (for status)
    reached: float | None = None  # last first-hand evidence it is reachable (probe answered, connection held)
    vouched: float = 0.0  # when first learned, or last refreshed by a record it published itself
    hearsay: Suspicion | None = None  # a third party's pending accusation (the state stays ALIVE)

    @property
    def peer_id(self) -> str:
        return self.record.peer_id


@dataclass
class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second (pure: time passed in)."""

    rate: float
    burst: float
    tokens: float
    stamp: float

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> "TokenBucket":
        return cls(rate, burst, burst, now)

    def take(self, now: float, n: float = 1.0) -> bool:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)
        if self.tokens < n:
            return False
        self.tokens -= n
        return True


@dataclass
class SourceRecord:
    """What the table remembers about one accuser or source of records."""

    accusations: TokenBucket
    new_members: TokenBucket
    refuted: list[float] = field(default_factory=list)  # times its accusations were refuted (last refuted_limit)


MAX_SOURCES = 4096  # accusers/sources remembered; the least recently used is forgotten (its budget refills)
MAX_FAULTS = 1024  # faults waiting for the service to report them
EVICTION_SCAN = 256  # entries looked at for one to forget when the table is full


@dataclass
class MemberTable:
    """All known members except ourselves."""

    self_id: str
    config: MembershipConfig = field(default_factory=MembershipConfig)
    members: dict[str, Member] = field(default_factory=dict)
    _probe_order: list[str] = field(default_factory=list)
    _far_order: list[str] = field(default_factory=list)  # live members to probe though not connected (shuffled)
    _rounds: int = 0  # calls of next_probe_target with an eligible set, for far_probe_every
    # What keeps tick() and size() from scanning every entry (issue 46: at N = 10,000 the scans cost
    # each node ~120,000 entry visits a second): the live count, the members with a timer running
    # (SUSPECT, or a pending accusation), and the earliest time any other entry can expire.
    _live: int = 0
    _timed: set[str] = field(default_factory=set)
    _sweep_at: float = -math.inf  # the next full scan for expiry and tombstones
    _sweep_ttl: float = math.inf  # the member_ttl that _sweep_at was computed with
    rng: random.Random = field(default_factory=random.Random)
    # How many times any member entered each state through _set (new members enter ALIVE without
    # it): "nobody was ever suspected" is then a fact to read, not the absence of a sighting.
    entered: dict[MemberState, int] = field(default_factory=lambda: dict.fromkeys(MemberState, 0))
    probes: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})  # outcomes reported to us
    sources: dict[str, SourceRecord] = field(default_factory=dict)  # LRU order, bounded by MAX_SOURCES
    revived: int = 0  # suspected or dead members brought back by a record they published themselves
    # Remote faults found here, (peer, reason), for the service to report to the peer score owner.
    faults: list[tuple[str, str]] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=lambda: {
        "expired": 0, "evicted": 0, "limited_members": 0, "limited_accusations": 0, "distrusted": 0, "refuted": 0})

    # ---------------------------------------------------------------- inputs

    def on_record(self, record: PeerRecord, now: float, source: str | None = None, exchange: bool = False) -> Verdict:
        """A checked record (signature already verified against record.peer_id).

        ``source`` is whose word it is: the gossipsub author, or the peer of a push-pull exchange;
        ``None`` only for the exchanges a joining node starts (exempt from the new-member budget).
        A record vouches for the member (keeps it from expiring) only when it published it itself.
        ``exchange``: it came in a push-pull table, which may honestly hold many members we lack:
        over the budget it is dropped (the member's own refresh brings it) but is no fault; on
        gossip an honest author only ever introduces itself.
        """
        if record.peer_id == self.self_id:
            return Verdict.SELF
        m = self.members.get(record.peer_id)
        vouch = source == record.peer_id
        if m is None:
            if source is not None and not self._source(source, now).new_members.take(now):
                self.dropped["limited_members"] += 1
                if not exchange:
                    self._fault(source, "new-member-flood")
                return Verdict.LIMITED
            # Only a budgeted source makes room: an exempt join exchange fills what is free.
            if len(self.members) >= self.config.max_members and (source is None or not self._make_room()):
                return Verdict.FULL
            self.members[record.peer_id] = Member(record, MemberState.ALIVE, now, now, vouched=now)
            self._live += 1
            self._sweep_at = min(self._sweep_at, now + self._sweep_ttl)
            return Verdict.NEW
        if record.seq < m.record.seq:
            return Verdict.STALE
        if vouch and m.state in (MemberState.ALIVE, MemberState.SUSPECT):
            m.vouched = now
        if record.seq == m.record.seq:
            if m.state is MemberState.ALIVE:
                m.last_heard = now
            elif vouch and not exchange and m.state in (MemberState.SUSPECT, MemberState.DEAD):
                # It published this itself, just now (the gossipsub author, signed): it is alive, and
                # still at this seq because it never heard the verdict. Refutation needs the SUSPECT or
                # DEAD notice to reach it; one lost notice would otherwise leave a live, connected
                # member dead here for good (seen under load in tests/test_adversarial_processes.py).
                # Only the member can author this, so no third party can revive a dead peer with it.
                self._set(m, MemberState.ALIVE, now, "")
                m.last_heard = m.vouched = now
                m.hearsay = None
                self.revived += 1
                return Verdict.UPDATED
            return Verdict.SAME
        m.record = record
        m.last_heard = now
        if m.hearsay is not None and record.seq > m.hearsay.seq:
            # The accused answered within its suspicion timeout: the accusation was false.
            self.note_refuted(m.hearsay.accuser, now)
            m.hearsay = None
        if m.state is not MemberState.ALIVE:
            if m.state in (MemberState.DEAD, MemberState.LEFT):
                self._revive(m)
            m.state, m.since, m.accuser = MemberState.ALIVE, now, ""
            m.vouched = max(m.vouched, now)
        return Verdict.UPDATED

    def on_accusation(self, acc: Accusation, dead: bool, now: float) -> Verdict:
        """Someone suspects (or declares dead) ``acc.target`` at record ``acc.seq``.

        Either opens a suspicion (see "Hearsay is not a verdict" above); ``dead`` only names the
        kind for the caller, a death declaration from someone else cannot skip the suspicion.
        """
        if acc.target == self.self_id:
            return Verdict.SELF
        if acc.accuser == self.self_id:
            return Verdict.SAME  # our own, echoed back: applied when we made it
        m = self.members.get(acc.target)
        # An accusation about an older record than ours is outdated: the peer already refuted it.
        # One about a newer record than any the member can have published by now is forged (seqs
        # are its wall-clock ms): a seq of 2**63 - 1 could never be refuted by a higher one.
        newest_plausible = m.record.seq + (max(0.0, now - m.last_heard) + SEQ_CLOCK_SLACK_S) * 1000 if m else 0
        if (m is None or acc.seq < m.record.seq or acc.seq > newest_plausible
                or m.state in (MemberState.DEAD, MemberState.LEFT)):
            return Verdict.IGNORED
        if self.distrusted(acc.accuser, now):
            self.dropped["distrusted"] += 1
            self._fault(acc.accuser, "distrusted-accusation")  # still accusing after being shown wrong
            return Verdict.DISTRUSTED
        if m.hearsay is not None or m.state is MemberState.SUSPECT:
            # One pending suspicion at a time: a second accuser does not shorten it, and an honest
            # accuser's death declaration after its suspicion costs it no token.
            return Verdict.SAME
        if not self._source(acc.accuser, now).accusations.take(now):
            self.dropped["limited_accusations"] += 1
            self._fault(acc.accuser, "accusation-flood")
            return Verdict.LIMITED
        m.hearsay = Suspicion(acc.accuser, acc.seq, now)
        self._timed.add(m.peer_id)
        return Verdict.SUSPECTED

    def note_refuted(self, accuser: str, now: float) -> None:
        """An accusation by ``accuser`` was refuted (here, or by us when it was about us)."""
        if not accuser or accuser == self.self_id:
            return  # our own suspicion was wrong: LocalHealth's business, not a fault
        rec = self._source(accuser, now)
        recent = [t for t in rec.refuted if now - t < self.config.refuted_window] + [now]
        rec.refuted = recent[-self.config.refuted_limit:]  # bounded: only the last few matter
        self.dropped["refuted"] += 1
        self._fault(accuser, "refuted-accusation")

    def distrusted(self, accuser: str, now: float) -> bool:
        rec = self.sources.get(accuser)
        if rec is None:
            return False
        recent = [t for t in rec.refuted if now - t < self.config.refuted_window]
        return len(recent) >= self.config.refuted_limit

    def take_faults(self) -> list[tuple[str, str]]:
        """The remote faults found since the last call, (peer, reason), for the peer score owner."""
        out, self.faults = self.faults, []
        return out

    def on_goodbye(self, bye: Goodbye, now: float) -> Verdict:
        m = self.members.get(bye.peer_id)
        if m is None or bye.seq < m.record.seq:
            return Verdict.IGNORED
        if m.state is MemberState.LEFT:
            return Verdict.SAME
        self._set(m, MemberState.LEFT, now, "")
        return Verdict.LEFT

    def on_probe_ok(self, peer_id: str, now: float) -> None:
        """We reached the member directly or indirectly: it is alive as far as we can tell."""
        self.probes["ok"] += 1
        m = self.members.get(peer_id)
        if m is None or m.state in (MemberState.DEAD, MemberState.LEFT):
            return
        m.last_heard = m.reached = now
        m.hearsay = None  # we reached it ourselves: someone else's doubt no longer counts here
        if m.state is MemberState.SUSPECT:
            self._set(m, MemberState.ALIVE, now, "")

    def on_reached(self, peer_id: str, now: float) -> None:
        """First-hand evidence that ``peer_id`` is reachable (we hold a connection to it)."""
        m = self.members.get(peer_id)
        if m is not None and m.state in (MemberState.ALIVE, MemberState.SUSPECT):
            m.reached = now

    def on_probe_failed(self, peer_id: str, now: float) -> Accusation | None:
        """Direct and indirect probes failed: suspect it; returns the accusation to publish, or None
        when there is nothing to say.

        Not when someone else's accusation is pending here (a newer record clears it): everyone has
        heard that one, and a second changes nothing anywhere (a second accuser never shortens a
        suspicion, see on_accusation). Each of a crashed member's 8-24 neighbours used to flood its
        own, the largest share of a node's bytes that grew with the swarm's size under churn (issue
        46: bench/sim_membership.py's breakdown). Our own suspicion is kept (first-hand evidence);
        the member is DEAD here when the pending one times out, as everywhere else."""
        self.probes["failed"] += 1
        m = self.members.get(peer_id)
        if m is None or m.state is not MemberState.ALIVE:
            return None
        self._set(m, MemberState.SUSPECT, now, self.self_id)
        if m.hearsay is not None:
            return None
        return Accusation(run=m.record.run, target=peer_id, seq=m.record.seq, accuser=self.self_id)

    # ---------------------------------------------------------------- time

    def tick(self, now: float) -> list[Accusation]:
        """Advance timers. Returns death declarations *we* must publish (for members we suspected).

        Each call looks at the members with a timer running; all entries (expiry, tombstones) only
        at the first call on or after the earliest time one of them can be due, which only moves
        later as evidence arrives: the outcome is that of a scan of every entry at every call."""
        size = self.size()
        timeout = self.config.suspicion_timeout(size)
        ttl = self.config.member_ttl(size)
        sweep = now >= self._sweep_at or ttl < self._sweep_ttl
        if sweep:
            batch = list(self.members.values())
            self._sweep_at, self._sweep_ttl = math.inf, ttl
        else:
            batch = [m for m in map(self.members.get, self._timed) if m is not None]
        declare: list[Accusation] = []
        for m in batch:
            if m.state is MemberState.SUSPECT and now - m.since >= timeout:
                if m.accuser == self.self_id:
                    declare.append(
                        Accusation(run=m.record.run, target=m.peer_id, seq=m.record.seq, accuser=self.self_id)
                    )
                self._set(m, MemberState.DEAD, now, m.accuser)
                m.hearsay = None
            elif m.hearsay is not None and now - m.hearsay.since >= timeout:
                self._set(m, MemberState.DEAD, now, m.hearsay.accuser)  # not refuted in time
                m.hearsay = None
            elif m.state in (MemberState.DEAD, MemberState.LEFT):
                if now - m.since >= self.config.tombstone_ttl:
                    del self.members[m.peer_id]
                elif sweep:
                    self._sweep_at = min(self._sweep_at, m.since + self.config.tombstone_ttl)
            elif now - max(m.vouched, m.reached if m.reached is not None else -math.inf) > ttl:
                # Nobody who can be reached vouches for it: a record anyone may keep re-sending.
                del self.members[m.peer_id]
                self._live -= 1
                self.dropped["expired"] += 1
            elif sweep:
                evidence = max(m.vouched, m.reached if m.reached is not None else -math.inf)
                self._sweep_at = min(self._sweep_at, evidence + ttl)
        self._timed = {p for p in self._timed if (m := self.members.get(p)) is not None
                       and (m.state is MemberState.SUSPECT or m.hearsay is not None)}
        return declare

    def next_probe_target(self, eligible: set[str] | None = None) -> str | None:
        """Round-robin over a shuffled list of live members, reshuffled each round (SWIM 4.3).

        ``eligible`` (the members we hold a connection to) restricts the choice; see the service's
        probe loop for why. A round is then made from ``eligible`` alone (sorted: a set's order
        varies with the hash seed), not from a walk of the table, which cost each node N /
        connections entry visits per probe (issue 46).

        Except every ``far_probe_every``-th call, which probes a live member outside ``eligible``
        (the service's probe dials it). Probing only connections leaves a member that crashes
        after its last connections closed on purpose (pruned, or redialled within PRUNE_MEMORY of
        a prune, so that the drop is no "loss") probed by nobody: no accusation, and its expiry
        never comes either, as every peer's push-pull hands its record back to those that expired
        it (issue 46: at N = 20 such a member was held alive by all for 4,000 s and counting).
        Every node drawing one far member each ``far_probe_every`` rounds probes each member about
        once per ``far_probe_every`` periods swarm-wide, whatever N, for one dial per node per
        ``far_probe_every`` periods; junk records can only choose which member a far probe dials,
        never make more of them.
        """
        if eligible is not None and self.config.far_probe_every:
            self._rounds += 1
            if self._rounds % self.config.far_probe_every == 0:
                far = self._next_far(eligible)
                if far is not None:
                    return far
        for _ in range(2):  # the rest of this round, then one fresh round
            while self._probe_order:
                pid = self._probe_order.pop()
                if self.is_live(pid) and (eligible is None or pid in eligible):
                    return pid
            if eligible is None:
                live = [pid for pid, m in self.members.items() if m.state in (MemberState.ALIVE, MemberState.SUSPECT)]
            else:
                live = [pid for pid in sorted(eligible) if self.is_live(pid)]
            if not live:
                return None
            self.rng.shuffle(live)
            self._probe_order = live
        return None

    def _next_far(self, near: set[str]) -> str | None:
        """The next live member not in ``near``, from a shuffled list of the table refilled when
        used up: one walk of the table per N far probes."""
        for refill in (False, True):
            while self._far_order:
                pid = self._far_order.pop()
                if pid not in near and self.is_live(pid):
                    return pid
            if refill:
                return None
            self._far_order = [pid for pid, m in self.members.items()
                               if pid not in near and m.state in (MemberState.ALIVE, MemberState.SUSPECT)]
            self.rng.shuffle(self._far_order)
        return None

    def indirect_helpers(self, target: str, connected: set[str], k: int) -> list[str]:
        """Up to k alive members to ping ``target`` for us: those we are connected to, then those we
        reached once, and only then members nobody showed us reachable. Throwaway records (anyone
        may publish them) are never reached: chosen as helpers they answer nothing, and a slow direct
        probe then becomes a false suspicion (seen under a member flood in the adversarial suite).
        The table is walked only when our connections cannot supply ``k`` (issue 46: a walk per
        missed probe was N entry visits, a few times a minute per node under 1 % loss)."""
        near = [p for p in sorted(connected) if p != target and self.state_of(p) is MemberState.ALIVE]
        self.rng.shuffle(near)
        if len(near) >= k:
            return near[:k]
        alive = [p for p in self.alive() if p != target and p not in connected]
        reached = [p for p in alive if self.members[p].reached is not None]
        unknown = [p for p in alive if self.members[p].reached is None]
        for group in (reached, unknown):
            self.rng.shuffle(group)
        return (near + reached + unknown)[:k]

    # ---------------------------------------------------------------- views

    def _source(self, peer: str, now: float) -> SourceRecord:
        rec = self.sources.pop(peer, None)
        if rec is None:
            if len(self.sources) >= MAX_SOURCES:
                del self.sources[next(iter(self.sources))]  # least recently used
            c = self.config
            rec = SourceRecord(TokenBucket.full(c.accusation_rate, c.accusation_burst, now),
                               TokenBucket.full(c.new_member_rate, c.new_member_burst, now))
        self.sources[peer] = rec  # most recently used last
        return rec

    def _fault(self, peer: str, reason: str) -> None:
        if len(self.faults) >= MAX_FAULTS:
            del self.faults[0]
        self.faults.append((peer, reason))

    def _make_room(self) -> bool:
        """At the bound: forget a tombstone, else the live entry longest without first-hand evidence.

        Looks only at the ``EVICTION_SCAN`` entries learned first (dicts keep insertion order), so
        that a full table costs O(1) per newcomer, not a scan of 20,000 entries."""
        oldest = list(itertools.islice(self.members.values(), EVICTION_SCAN))
        tombs = [m for m in oldest if m.state in (MemberState.DEAD, MemberState.LEFT)]
        if tombs:
            victim = min(tombs, key=lambda m: m.since)
        else:
            unreached = [m for m in oldest if m.reached is None]
            if not unreached:
                return False
            victim = min(unreached, key=lambda m: m.vouched)
        del self.members[victim.peer_id]
        self._live -= victim.state in (MemberState.ALIVE, MemberState.SUSPECT)
        self.dropped["evicted"] += 1
        return True

    def _set(self, m: Member, state: MemberState, now: float, accuser: str) -> None:
        if state is not m.state:
            self.entered[state] += 1
        live = (MemberState.ALIVE, MemberState.SUSPECT)
        if state in live and m.state not in live:
            self._revive(m)
        elif state not in live and m.state in live:
            self._live -= 1
            self._sweep_at = min(self._sweep_at, now + self.config.tombstone_ttl)
        if state is MemberState.SUSPECT:
            self._timed.add(m.peer_id)
        m.state, m.since, m.accuser = state, now, accuser

    def _revive(self, m: Member) -> None:
        """A DEAD or LEFT entry becomes live again: counted, and looked at on the next tick."""
        self._live += 1
        self._sweep_at = -math.inf

    def state_of(self, peer_id: str) -> MemberState | None:
        m = self.members.get(peer_id)
        return m.state if m else None

    def is_live(self, peer_id: str) -> bool:
        """ALIVE or SUSPECT: still in the live set (probed, kept connected)."""
        return self.state_of(peer_id) in (MemberState.ALIVE, MemberState.SUSPECT)

    def alive(self) -> list[str]:
        return [pid for pid, m in self.members.items() if m.state is MemberState.ALIVE]

    def alive_roles(self) -> "AliveRoles":
        """Alive member -> role, as a view of the table (see :class:`AliveRoles`)."""
        return AliveRoles(self.members)

    def size(self) -> int:
        """Swarm size estimate used to scale timers: live members plus ourselves."""
        return 1 + self._live

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in MemberState}
        for m in self.members.values():
            out[m.state.value] += 1
        return out

    def rows(self, now: float, trainers: Collection[str] = (), validators: Collection[str] = ()) -> list[dict]:
        """JSON-able rows for status views, sorted by role then peer id. ``unlisted``: the record
        claims a role only the run file grants (``trainers``, ``validators``) and is not listed."""
        rows = [
            {
                "peer_id": m.peer_id,
                "role": m.record.role,
                "unlisted": unlisted_role(m.record.role, m.peer_id, trainers, validators),
                "state": m.state.value,
                "for_s": round(now - m.since, 1),
                # A pending accusation by someone else: shown, but it is no verdict until it times out.
                "suspected_by": m.hearsay.accuser if m.hearsay else "",
                "seq": m.record.seq,
                "addrs": list(m.record.addrs),
                "checkpoints": list(m.record.checkpoints),
                "load": m.record.load,
                "software": m.record.software,
            }
            for m in self.members.values()
        ]
        return sorted(rows, key=lambda r: (r["role"], r["peer_id"]))


class AliveRoles(Mapping[str, str]):
    """Alive peer id -> role, read from the member table when asked, not copied.

    The connection manager plans every connection period, and looks at the members only to dial
    (below ``conn_low``: a walk) or prune (above ``conn_high``: its connections' roles). Handing it
    a dict built from every entry cost each node N entry visits a period however many connections
    it held (issue 46). Use it at once: it shows the table as it is when read."""

    def __init__(self, members: dict[str, Member]):
        self._members = members

    def __getitem__(self, peer_id: str) -> str:
        m = self._members.get(peer_id)
        if m is None or m.state is not MemberState.ALIVE:
            raise KeyError(peer_id)
        return m.record.role

    def __iter__(self) -> Iterator[str]:
        return (pid for pid, m in self._members.items() if m.state is MemberState.ALIVE)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def unlisted_role(role: str, peer_id: str, trainers: Collection[str], validators: Collection[str]) -> bool:
    """Does a record claim "trainer" or "validator" for a peer the run file does not list as one?
    Anyone may write any role in its own record; only the run file makes a trainer or validator
    trusted (selection reads the run file: node/inference/service.py, node/trainer/gate.py), so
    status views show such a claim as untrusted ("trainer (unlisted)") instead of taking it."""
    listed = {"trainer": trainers, "validator": validators}.get(role)
    return listed is not None and peer_id not in listed


RECORD_BYTES = 400  # a signed record envelope with two addresses (measured: ~330-420 B)
PROBE_BYTES = 2 * (32 + 60)  # libp2p ping payload both ways plus Yamux/Noise framing, approx.
# gossipsub's framing of one published message (py-libp2p's protobuf: from 38 B, seqno 8, topic,
# signature 64, key 36, tags and length prefix), and of one message id in an IHAVE.
GOSSIP_MSG_OVERHEAD = 186
GOSSIP_ID_BYTES = 48
GOSSIP_LAZY = 6  # peers sent IHAVE per heartbeat (gossipsub D_lazy)
GOSSIP_WINDOW = 3  # heartbeats a message id is announced for


def load_model(n: int, config: MembershipConfig, degree: int = 6, record_bytes: int = RECORD_BYTES) -> dict:
    """Steady-state membership load per node (no failures), from the module's load model.

    Returns messages/s received and bytes/s sent by one node in a swarm of ``n``. Gossipsub
    delivers each record to every node and each node forwards it to up to ``degree`` mesh peers.
    """
    records_in = n / config.refresh_interval(n)
    per_record = degree * (record_bytes + GOSSIP_MSG_OVERHEAD) + GOSSIP_WINDOW * GOSSIP_LAZY * GOSSIP_ID_BYTES
    probes = 2.0 / config.probe_period  # one probe sent, one answered on average
    sync_bytes = 2 * n * record_bytes / config.sync_interval(n)  # one exchange started, one answered
    by_kind = {"records": records_in * per_record, "probes": probes / 2 * PROBE_BYTES, "sync": sync_bytes}
    return {"msgs_per_s": records_in + probes, "bytes_per_s": sum(by_kind.values()), "bytes_by_kind": by_kind,
            "records_per_s": records_in}


@dataclass
class LocalHealth:
    """Lifeguard's local health multiplier (Dadgar et al., "Lifeguard: Local Health Awareness for
    More Accurate Failure Detection", 2018, section 4.1).

    A node that is itself slow (CPU starved, paused) sees its probes time out and would accuse
    healthy peers; on a loaded machine those false suspicions, refutations and redials add load
    and feed on themselves. The score rises only on what this node measures of itself: its own
    event loop lagging, and its own direct probes missing their ack (Lifeguard's "failed probe");
    it falls with each timely probe round, and stretches our probe timeouts by ``1 + score`` so a
    sick node waits longer before it suspects anyone.

    Not on refuting an accusation, which Lifeguard also counts: accusations are anyone's signed
    word, so that let a peer that never probed us stretch our timeouts at will (issue 14).
    """

    max_score: int = 8
    score: int = 0

    def on_round(self, lag: float, tolerance: float) -> None:
        """One probe round: ``lag`` = how late our own timer fired."""
        if lag > tolerance:
            self.score = min(self.max_score, self.score + 1)
        elif self.score:
            self.score -= 1

    def on_probe_missed(self) -> None:
        """A direct ping of ours got no ack in time."""
        self.score = min(self.max_score, self.score + 1)

    def scale(self) -> int:
        return 1 + self.score


JOIN_SYNC_FANOUT = 4  # new connections push-pulled with at once while joining
JOIN_SYNC_RETRY = 10.0  # seconds before a peer whose join exchange brought nothing is asked again (the service's exchange limit)


@dataclass
class SyncPlanner:
    """Which connected peers to push-pull with now.

    Joining (at start, and again after losing every connection), each new connection is synced,
    ``JOIN_SYNC_FANOUT`` at a time, until one exchange succeeds: that is what makes a join fast.
    After that, one random connected peer every ``sync_interval``, which heals what gossip lost.
    Not one exchange per new connection: SWIM probes dial members and the connection manager
    prunes, so in a swarm larger than ``conn_high`` connections come and go every probe period,
    and a full-table exchange on each made the per-node cost grow with N (measured: 16 kB/s per
    node at N = 25 while connections were filling in, against ~1 kB/s at N = 10).
    """

    joined: bool = False
    last_random: float | None = None  # when the interval last began (first plan, then each random pick)
    tried: dict[str, float] = field(default_factory=dict)  # peer -> when its join exchange was started

    def plan(self, connected: set[str], now: float, interval: float, rng: random.Random) -> list[str]:
        """``interval``: ``sync_interval`` of the table's size now. The next random exchange is due
        ``interval`` after the last one by the interval of each call, not of the call that began it: a
        node that starts alone (30 s) and learns 1,000 members in its join exchange waits 1,000 s,
        where a deadline fixed at start made every join cost the swarm one more full-table exchange
        at 30 s (issue 46)."""
        if not connected:
            self.joined = False
            self.tried.clear()
            return []
        out: list[str] = []
        if not self.joined:
            # A join exchange that brought nothing (lost, timed out) is tried again after
            # JOIN_SYNC_RETRY: a joiner's only connection is its bootstrap peer, and one lost
            # exchange left it with an empty table until gossip happened to name a member it could
            # dial (23 s at N = 40 in bench/sim_membership.py --quick; issue 46).
            ready = {p for p in connected if now - self.tried.get(p, -math.inf) >= JOIN_SYNC_RETRY}
            out = sorted(ready)[:JOIN_SYNC_FANOUT]
            self.tried.update(dict.fromkeys(out, now))
        if self.last_random is None:
            self.last_random = now
        elif now >= self.last_random + interval:
            self.last_random = now
            pick = rng.choice(sorted(connected))
            if pick not in out:
                out.append(pick)
        return out

    def on_synced(self) -> None:
        """A full table arrived (from an exchange we started or one a peer started)."""
        self.joined = True
        self.tried.clear()


HEARD_BY = 2  # peers a publication of our record must go to, so that one lost copy does not lose it


@dataclass
class RecordRefresh:
    """When our own record is republished though it did not change: ``refresh_interval`` of the
    table's size *now* after the last publication (a change publishes at once and restarts it).

    Asked on every tick, so the deadline follows the table: a node publishes at start with only
    itself in its table (30 s), and a deadline fixed then republished every joiner's record to the
    whole swarm 30 s later, at 1,000 members where the interval is an hour (issue 46). Shared by
    the service (serve_tick) and the simulator (sim/membership.py), so both time it alike.

    ``mesh``: the gossipsub mesh peers on the members topic when asked. A publication made with
    none reached nobody, and is due again as soon as there is one. A node publishes its record at
    start, before its bootstrap dial has made a connection: a restarted member held DEAD or LEFT
    came back only in the tables of the peers its join exchange reached (they do not forward what
    an exchange brings), and stayed dead in every other until its next change or refresh (issue
    45: validator-2 of the hour soak, held dead by the trainer it was connected to).

    A publication that went to fewer than ``HEARD_BY`` peers is made again as soon as more can hear
    it: a joiner's start record goes to its one bootstrap peer, and when that one copy was lost
    nobody but the peers of its join exchange learned the member until push-pull (every N s) or
    its refresh (an hour at N >= 900) brought it (issue 46: 1 % loss lost 1 of 300 start records
    in bench/sim_membership.py's ramp, every node that joined before it held 99.7 % for minutes)."""

    last_published: float = -math.inf
    reached: int = HEARD_BY  # mesh peers the last publication went to

    def due(self, now: float, size: int, config: MembershipConfig, mesh: int) -> bool:
        if self.reached < HEARD_BY and mesh > self.reached:
            return True
        if self.reached == 0:
            return False  # it reached nobody, and would reach nobody again now
        return now >= self.last_published + config.refresh_interval(size)

    def on_published(self, now: float, mesh: int) -> None:
        self.last_published = now
        self.reached = mesh


SEQ_CLOCK_SLACK_S = 300.0  # how far members' wall clocks (and so their seqs) may disagree


def next_seq(previous: int, now_ms: int) -> int:
    """Sequence numbers only grow, also across restarts: wall-clock ms, or previous + 1."""
    return max(previous + 1, now_ms)
