"""Penalties and bans from verdicts: a pure book keeper, time passed in (wall seconds, so bans survive restarts).

How this works: every rejected batch costs its worker ``penalty_points`` unless all its reasons are
benign — reasons that an honest worker can hit through no fault of its own (its batch became stale
in transit, the validator could not get the checkpoint) or that cannot be pinned on the named worker
(a forged signature names somebody else). Points add up over a sliding ``penalty_window``; reaching
``ban_threshold`` bans the worker for ``ban_seconds`` and clears its points, so each further ban
needs a fresh run of offences. Each decision is what the validator writes to the ledger as a
``penalty`` entry (node/ledger/entries.py), so every peer can see who was punished and why.

A ban is written to the ledger as a penalty entry with ``ban_seconds``; trainers and the other
validators refuse the worker's batches once that entry reaches them (:meth:`node.ledger.chain.Ledger.ban_of`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from ..proofs.reasons import Reason
from .config import ValidatorConfig
from .pipeline import BatchReason

# Reasons that never cost points: not the worker's fault, or not provably the worker's doing.
BENIGN = frozenset({
    Reason.OK.value,
    Reason.STALE_POLICY.value,
    BatchReason.NO_CHECKPOINT.value,
    BatchReason.BANNED.value,
    BatchReason.FORGED.value,
    # Refused, not penalised: with several trainers an honest worker's steps can jump past one
    # validator's window (node/rollouts/steps.py, "Known limit"); the refusal alone stops grinding.
    BatchReason.STEP_AHEAD.value,
    BatchReason.STEP_BEHIND.value,
})
MAX_TRACKED_PEERS = 100_000  # workers with live points or bans kept in memory (least recent evicted)
MAX_EVENTS_PER_PEER = 1024  # point events kept per worker inside the window


@dataclass(frozen=True)
class PenaltyDecision:
    """A penalty to record (and a ban when ``ban_seconds`` > 0)."""

    peer: str
    reason: str
    points: int
    ban_seconds: int = 0


@dataclass
class _PeerState:
    events: deque  # (time, points)
    banned_until: float = 0.0
    ban_reason: str = ""


class PenaltyBook:
    """Points per worker over a sliding window, and the bans they lead to."""

    def __init__(self, cfg: ValidatorConfig) -> None:
        self.cfg = cfg
        self._peers: OrderedDict[str, _PeerState] = OrderedDict()

    def _state(self, peer: str) -> _PeerState:
        st = self._peers.get(peer)
        if st is None:
            st = self._peers[peer] = _PeerState(deque(maxlen=MAX_EVENTS_PER_PEER))
            while len(self._peers) > MAX_TRACKED_PEERS:
                self._peers.popitem(last=False)
        self._peers.move_to_end(peer)
        return st

    def points(self, peer: str, now: float) -> int:
        st = self._peers.get(peer)
        if st is None:
            return 0
        while st.events and st.events[0][0] <= now - self.cfg.penalty_window:
            st.events.popleft()
        return sum(p for _, p in st.events)

    def on_verdict(self, worker: str, reasons: Iterable[str], now: float) -> PenaltyDecision | None:
        """The penalty a verdict with these per-sample ``reasons`` earns (None if none)."""
        bad = [r for r in reasons if r not in BENIGN]
        if not bad or self.cfg.penalty_points == 0:
            return None
        reason = max(sorted(set(bad)), key=bad.count)
        st = self._state(worker)
        st.events.append((now, self.cfg.penalty_points))
        ban = 0
        if self.points(worker, now) >= self.cfg.ban_threshold and not self.is_banned(worker, now):
            ban = self.cfg.ban_seconds
            st.events.clear()
        decision = PenaltyDecision(worker, reason, self.cfg.penalty_points, ban)
        if ban:
            self.apply_ban(worker, reason, now + ban)
        return decision

    def apply_ban(self, peer: str, reason: str, until: float) -> None:
        """Record a ban (ours, or one read back from the store or another validator's ledger entry)."""
        st = self._state(peer)
        if until > st.banned_until:
            st.banned_until, st.ban_reason = until, reason

    def is_banned(self, peer: str, now: float) -> bool:
        st = self._peers.get(peer)
        return st is not None and st.banned_until > now

    def bans(self, now: float) -> dict[str, dict]:
        """Active bans: peer -> seconds left and why (for ``swarm-node status``)."""
        return {
            p: {"seconds_left": round(st.banned_until - now), "reason": st.ban_reason}
            for p, st in self._peers.items()
            if st.banned_until > now
        }
