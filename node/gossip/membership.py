"""The member table: who is in the swarm and whether they are alive. Pure: no I/O, time passed in.

How this works
--------------
Dissemination and failure detection are split, as in SWIM (Das, Gupta, Motivala, DSN 2002):

* **Records** (what a peer says about itself) travel on the gossipsub members topic when they
  change, and are refreshed every ``refresh_interval(N)`` so that lost messages heal. Records carry
  a sequence number that only grows; an older or equal one changes nothing.
* **Liveness** comes from probing, not from records: every ``probe_period`` a node pings one member
  it holds a connection to (round-robin over a shuffled list, SWIM 4.3), and at once any member
  whose connection dropped without notice; on failure it asks ``indirect_probes`` others to ping it.
  Only when all fail does it *suspect* the member and publish a signed accusation naming the
  record's sequence number. Every node that hears it marks the member SUSPECT; after
  ``suspicion_timeout(N)`` without a newer record the member is DEAD. A live member that hears an
  accusation about itself refutes it by publishing its record with a higher sequence number.
* A clean shutdown publishes a signed goodbye (LEFT). A restarted peer with the same key comes back
  with a higher sequence number (it starts at wall-clock milliseconds) and is ALIVE again.
* A joining node learns the table by a push-pull exchange of all records with the first peers it
  connects to (memberlist's full-state sync); after that only one random peer every
  ``sync_interval(N)`` (see ``SyncPlanner``).

States::

    (unknown) --record--> ALIVE --probe failed / accusation--> SUSPECT --timeout--> DEAD
        ALIVE/SUSPECT/DEAD --newer record--> ALIVE          any --goodbye--> LEFT
    DEAD and LEFT entries are kept as tombstones for ``tombstone_ttl`` so that old records
    still circulating cannot resurrect them.

Load model (messages and bytes per node per second, N members, D = 6 gossipsub degree,
r = record envelope size, ~400 B; g = gossipsub's per-message framing, 186 B (from, seqno,
topic, signature, key); p = probe period; lambda = failures per node per second):

    records     N / refresh_interval(N) msgs/s received, each forwarded to D mesh peers and its
                id (48 B) announced in IHAVE to D_lazy = 6 others on each of the 3 heartbeats of
                the gossip window: D * (r + g) + 3 * 6 * 48 ~ 4.4 kB sent per record.
                refresh_interval = clamp(N / record_rate, 30 s, 3600 s), record_rate = 0.5/s
                -> received <= 0.5 msg/s (<= ~2.2 kB/s sent) for 15 <= N <= 1800, and
                N/3600 beyond (2.8 msg/s at 10,000: the hour cap keeps tables from going stale).
    probes      1/p pings sent + ~1/p answered = 2 msgs/s at p = 1 s, ~100 B each: constant in N.
    indirect    3 ping-reqs per failed direct probe: only under loss or failure.
    sync        a node starts one push-pull every sync_interval = max(30 s, N * 1 s) and answers
                one on average, sending all N records in each: 2 * N * r / max(30, N) <= 2r B/s
                (~0.8 kB/s): constant in N. New connections are synced only while joining.
    churn       2 accusations per failure, seen by all: 2 * lambda * N msgs/s (SWIM piggybacks
                the same information; it is inherent to everyone learning every failure).

So a node pays O(1) messages per second in a steady swarm instead of O(N) for all-to-all
heartbeats. First detection is ~e/(e-1) probe periods after a failure on average (SWIM), then
``suspicion_timeout`` = suspicion_mult * max(1, log10 N) periods (memberlist) before DEAD.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Collection
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
    record_rate: float = 0.5  # target record refreshes received per node per second
    min_refresh: float = 30.0  # record refresh interval bounds, seconds
    max_refresh: float = 3600.0
    min_sync: float = 30.0  # push-pull interval = max(min_sync, N * sync_per_member) seconds
    sync_per_member: float = 1.0
    tombstone_ttl: float = 600.0  # how long DEAD/LEFT entries are remembered
    conn_low: int = 8  # connection manager: dial more below this many connections
    conn_high: int = 24  # prune above this
    dial_backoff: float = 10.0  # seconds before redialing a member that failed to connect
    max_members: int = 20_000  # table bound; records beyond it are refused

    def validate(self) -> None:
        if self.probe_period <= 0 or self.probe_timeout <= 0 or self.indirect_timeout <= 0:
            raise ValueError("periods and timeouts must be positive")
        if self.probe_timeout >= self.probe_period + self.indirect_timeout:
            raise ValueError("probe_timeout must be shorter than a probe round")
        if not 0 < self.conn_low <= self.conn_high:
            raise ValueError("need 0 < conn_low <= conn_high")
        if self.suspicion_mult < 1:
            raise ValueError("suspicion_mult must be >= 1")

    def refresh_interval(self, n: int) -> float:
        return min(self.max_refresh, max(self.min_refresh, n / self.record_rate))

    def sync_interval(self, n: int) -> float:
        return max(self.min_sync, n * self.sync_per_member)

    def suspicion_timeout(self, n: int) -> float:
        return self.suspicion_mult * max(1.0, math.log10(max(n, 1))) * self.probe_period


class Verdict(enum.Enum):
    """What the table did with an input (reasons are counted in metrics/status)."""

    NEW = "new"  # first record of a peer
    UPDATED = "updated"  # newer record (also: revived from suspect/dead)
    SAME = "same"  # same seq, nothing changed
    STALE = "stale"  # older seq than known
    SELF = "self"  # about us: handled by the caller (refute)
    IGNORED = "ignored"  # accusation about an unknown peer or an outdated seq
    SUSPECTED = "suspected"
    DIED = "died"
    LEFT = "left"
    FULL = "full"  # table bound reached


@dataclass
class Member:
    record: PeerRecord
    state: MemberState
    since: float  # when the current state began
    last_heard: float  # last record, refresh or successful probe
    accuser: str = ""  # who suspected it (for status)

    @property
    def peer_id(self) -> str:
        return self.record.peer_id


@dataclass
class MemberTable:
    """All known members except ourselves."""

    self_id: str
    config: MembershipConfig = field(default_factory=MembershipConfig)
    members: dict[str, Member] = field(default_factory=dict)
    _probe_order: list[str] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    # How many times any member entered each state through _set (new members enter ALIVE without
    # it): "nobody was ever suspected" is then a fact to read, not the absence of a sighting.
    entered: dict[MemberState, int] = field(default_factory=lambda: dict.fromkeys(MemberState, 0))
    probes: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0})  # outcomes reported to us

    # ---------------------------------------------------------------- inputs

    def on_record(self, record: PeerRecord, now: float) -> Verdict:
        """A checked record (signature already verified against record.peer_id)."""
        if record.peer_id == self.self_id:
            return Verdict.SELF
        m = self.members.get(record.peer_id)
        if m is None:
            if len(self.members) >= self.config.max_members:
                return Verdict.FULL
            self.members[record.peer_id] = Member(record, MemberState.ALIVE, now, now)
            return Verdict.NEW
        if record.seq < m.record.seq:
            return Verdict.STALE
        if record.seq == m.record.seq:
            if m.state is MemberState.ALIVE:
                m.last_heard = now
            return Verdict.SAME
        m.record = record
        m.last_heard = now
        if m.state is not MemberState.ALIVE:
            m.state, m.since, m.accuser = MemberState.ALIVE, now, ""
        return Verdict.UPDATED

    def on_accusation(self, acc: Accusation, dead: bool, now: float) -> Verdict:
        """Someone suspects (or declares dead) ``acc.target`` at record ``acc.seq``."""
        if acc.target == self.self_id:
            return Verdict.SELF
        m = self.members.get(acc.target)
        # An accusation about an older record than ours is outdated: the peer already refuted it.
        # One about a newer record than any the member can have published by now is forged (seqs
        # are its wall-clock ms): a seq of 2**63 - 1 could never be refuted by a higher one.
        newest_plausible = m.record.seq + (max(0.0, now - m.last_heard) + SEQ_CLOCK_SLACK_S) * 1000 if m else 0
        if (m is None or acc.seq < m.record.seq or acc.seq > newest_plausible
                or m.state in (MemberState.DEAD, MemberState.LEFT)):
            return Verdict.IGNORED
        if dead:
            self._set(m, MemberState.DEAD, now, acc.accuser)
            return Verdict.DIED
        if m.state is MemberState.SUSPECT:
            return Verdict.SAME
        self._set(m, MemberState.SUSPECT, now, acc.accuser)
        return Verdict.SUSPECTED

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
        m.last_heard = now
        if m.state is MemberState.SUSPECT:
            self._set(m, MemberState.ALIVE, now, "")

    def on_probe_failed(self, peer_id: str, now: float) -> Accusation | None:
        """Direct and indirect probes failed: suspect it; returns the accusation to publish."""
        self.probes["failed"] += 1
        m = self.members.get(peer_id)
        if m is None or m.state is not MemberState.ALIVE:
            return None
        self._set(m, MemberState.SUSPECT, now, self.self_id)
        return Accusation(run=m.record.run, target=peer_id, seq=m.record.seq, accuser=self.self_id)

    # ---------------------------------------------------------------- time

    def tick(self, now: float) -> list[Accusation]:
        """Advance timers. Returns death declarations *we* must publish (for members we suspected)."""
        timeout = self.config.suspicion_timeout(self.size())
        declare: list[Accusation] = []
        for m in list(self.members.values()):
            if m.state is MemberState.SUSPECT and now - m.since >= timeout:
                if m.accuser == self.self_id:
                    declare.append(
                        Accusation(run=m.record.run, target=m.peer_id, seq=m.record.seq, accuser=self.self_id)
                    )
                self._set(m, MemberState.DEAD, now, m.accuser)
            elif m.state in (MemberState.DEAD, MemberState.LEFT) and now - m.since >= self.config.tombstone_ttl:
                del self.members[m.peer_id]
        return declare

    def next_probe_target(self, eligible: set[str] | None = None) -> str | None:
        """Round-robin over a shuffled list of live members, reshuffled each round (SWIM 4.3).

        ``eligible`` (the members we hold a connection to) restricts the choice; see the service's
        probe loop for why.
        """
        for _ in range(2):  # the rest of this round, then one fresh round
            while self._probe_order:
                pid = self._probe_order.pop()
                m = self.members.get(pid)
                if m is not None and m.state in (MemberState.ALIVE, MemberState.SUSPECT) and (
                    eligible is None or pid in eligible
                ):
                    return pid
            live = [pid for pid, m in self.members.items() if m.state in (MemberState.ALIVE, MemberState.SUSPECT)]
            if eligible is not None:
                live = [pid for pid in live if pid in eligible]
            if not live:
                return None
            self.rng.shuffle(live)
            self._probe_order = live
        return None

    def indirect_helpers(self, target: str, connected: set[str], k: int) -> list[str]:
        """Up to k alive members (preferring ones we are connected to) to ping ``target`` for us."""
        alive = [p for p in self.alive() if p != target]
        near = [p for p in alive if p in connected]
        far = [p for p in alive if p not in connected]
        self.rng.shuffle(near)
        self.rng.shuffle(far)
        return (near + far)[:k]

    # ---------------------------------------------------------------- views

    def _set(self, m: Member, state: MemberState, now: float, accuser: str) -> None:
        if state is not m.state:
            self.entered[state] += 1
        m.state, m.since, m.accuser = state, now, accuser

    def state_of(self, peer_id: str) -> MemberState | None:
        m = self.members.get(peer_id)
        return m.state if m else None

    def alive(self) -> list[str]:
        return [pid for pid, m in self.members.items() if m.state is MemberState.ALIVE]

    def size(self) -> int:
        """Swarm size estimate used to scale timers: live members plus ourselves."""
        return 1 + sum(1 for m in self.members.values() if m.state in (MemberState.ALIVE, MemberState.SUSPECT))

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
                "seq": m.record.seq,
                "addrs": list(m.record.addrs),
                "checkpoints": list(m.record.checkpoints),
                "load": m.record.load,
                "software": m.record.software,
            }
            for m in self.members.values()
        ]
        return sorted(rows, key=lambda r: (r["role"], r["peer_id"]))


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
    bytes_sent = records_in * per_record + probes / 2 * PROBE_BYTES + sync_bytes
    return {"msgs_per_s": records_in + probes, "bytes_per_s": bytes_sent}


@dataclass
class LocalHealth:
    """Lifeguard's local health multiplier (Dadgar et al., "Lifeguard: Local Health Awareness for
    More Accurate Failure Detection", 2018, section 4.1).

    A node that is itself slow (CPU starved, paused) sees its probes time out and would accuse
    healthy peers; on a loaded machine those false suspicions, refutations and redials add load
    and feed on themselves. The score rises when our own event loop lags or we had to refute an
    accusation, falls with each timely probe round, and stretches our probe timeouts by
    ``1 + score`` so a sick node waits longer before it suspects anyone.
    """

    max_score: int = 8
    score: int = 0

    def on_round(self, lag: float, tolerance: float) -> None:
        """One probe round: ``lag`` = how late our own timer fired."""
        if lag > tolerance:
            self.score = min(self.max_score, self.score + 1)
        elif self.score:
            self.score -= 1

    def on_refute(self) -> None:
        self.score = min(self.max_score, self.score + 1)

    def scale(self) -> int:
        return 1 + self.score


JOIN_SYNC_FANOUT = 4  # new connections push-pulled with at once while joining


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
    next_random: float | None = None
    tried: set[str] = field(default_factory=set)

    def plan(self, connected: set[str], now: float, interval: float, rng: random.Random) -> list[str]:
        if not connected:
            self.joined = False
            self.tried.clear()
            return []
        out: list[str] = []
        if not self.joined:
            out = sorted(connected - self.tried)[:JOIN_SYNC_FANOUT]
            self.tried.update(out)
        if self.next_random is None:
            self.next_random = now + interval
        elif now >= self.next_random:
            self.next_random = now + interval
            pick = rng.choice(sorted(connected))
            if pick not in out:
                out.append(pick)
        return out

    def on_synced(self) -> None:
        """A full table arrived (from an exchange we started or one a peer started)."""
        self.joined = True
        self.tried.clear()


SEQ_CLOCK_SLACK_S = 300.0  # how far members' wall clocks (and so their seqs) may disagree


def next_seq(previous: int, now_ms: int) -> int:
    """Sequence numbers only grow, also across restarts: wall-clock ms, or previous + 1."""
    return max(previous + 1, now_ms)
