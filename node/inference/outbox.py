"""Delivering signed rollout batches to trainers: the outbox. Pure (no I/O, no clock).

How this works:

* One delivery is one call of ``/swarm/rollouts/1.0.0`` (node/inference/submit.py ``call_submit``),
  which ends in an ack or a :class:`~node.net.failure.FailureKind` naming whose fault it was.
* :class:`Outbox` is the pure state machine around it: a bounded queue of unsent batches (so a node
  with no reachable trainer keeps generating up to a bound, then waits: backpressure), per-trainer
  exponential backoff after failures (a dead or overloaded trainer is skipped, the batch goes to
  another one), a per-batch attempt limit, and dropping batches whose policy version became too old
  to be trained on (INTELLECT-2's async level: a trainer at step n takes versions >= n - async_level,
  so sending older ones only wastes both sides' bandwidth). Time is an argument; it never sleeps.
* Back-pressure (issue 15, node/trainer/pacing.py): an ack's ``retry_after_ms`` paces the worker:
  :meth:`Outbox.generation_hold` tells the generator to wait (until the earliest trainer is free
  again; batches already made are still sent, so they do not age in the outbox), so a saturated
  trainer or validator set slows the workers down instead of receiving work it would throw away. A
  ``busy`` refusal (or any transient one) costs the batch no attempt: it stays queued and is
  resubmitted after the wait if it is still fresh.
* Step headroom (issue 39, node/rollouts/steps.py): a trainer refuses a step more than its window
  above the highest step of ours it counted (``step-ahead``), and every batch we drop unsent (stale,
  undeliverable) leaves a gap there, since a step is never drawn twice. Enough such gaps in a row
  locked an honest worker out for good. So the outbox tracks the highest step a trainer counted
  (an accept, or a final refusal that the trainer's window records) and: generation waits
  (:meth:`Outbox.step_hold`) while the next step is past ``counted + window - STEP_SLACK`` (the
  edge) and a batch is still outstanding; a batch past the edge is never dropped as stale here, it
  is sent, so the trainer's "stale" refusal moves its window up to it. An attacker gains nothing:
  this only restrains the node that runs it; the trainers' windows are unchanged.

Batch states (one per batch, refused loudly when illegal)::

    QUEUED --take--> IN_FLIGHT --accepted--------> ACCEPTED
       ^                 |------refused (final)---> REFUSED
       |                 |------stale / attempts--> DROPPED
       +---retry---------+  (transport failure, or a refusal with a transient reason)
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


from ..net.failure import FailureKind
from ..wire import LocalProtocolError
from ..refusals import TRANSIENT_REASONS
from ..rollouts.steps import KEEPS_WINDOW, STEP_SLACK
from ..rollouts.schema import RolloutAck

# TRANSIENT_REASONS (node/refusals.py) say "not now" rather than "never": the batch goes back to the
# queue and the trainer is backed off. Every other reason is final (the batch itself is bad or unwanted).
# Refusals after which a trainer's step window did not record the batch's step (node/rollouts/steps.py
# KEEPS_WINDOW, the set the trainer's intake uses). Every other answer did.
UNCOUNTED_REASONS = KEEPS_WINDOW


class BatchState(enum.Enum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    ACCEPTED = "accepted"
    REFUSED = "refused"
    DROPPED = "dropped"


@dataclass
class Pending:
    """One signed batch waiting for delivery."""

    batch_id: bytes
    envelope: bytes  # encoded signed Envelope, exactly what goes on the wire
    policy_version: int
    num_samples: int
    created_at: float  # trio time it entered the outbox
    state: BatchState = BatchState.QUEUED
    attempts: int = 0  # failures after reaching a trainer, and transient refusals, so far
    tried: list[str] = field(default_factory=list)  # trainers it was sent to, in order
    not_before: float = 0.0  # earliest time of the next attempt
    step: int = -1  # the draw step it was made for (-1: unknown, no step headroom rule for it)


@dataclass
class _TrainerHealth:
    failures: int = 0  # consecutive failures; 0 after any ack
    blocked_until: float = 0.0
    paced_until: float = 0.0  # the trainer's last ack asked for no new batch before this time
    record_seq: int = 0  # sequence number of the newest member record of the trainer seen


@dataclass(frozen=True)
class Outcome:
    """What happened to a batch after a result (for counters and logs)."""

    state: BatchState
    reason: str  # "ok", the trainer's refusal reason, a FailureKind value, "stale" or "undeliverable"


class Outbox:
    """Bounded queue of unsent batches with trainer selection, retries and backoff. No I/O, no clock."""

    def __init__(
        self, capacity: int, *, max_attempts: int, backoff: float, backoff_max: float, async_level: int,
        step_window: int = 0, first_step: int = 0, counted_step: int | None = None,
    ) -> None:
        """``step_window``: the trainers' step window (node/rollouts/steps.py ``step_window_size``; 0:
        no step headroom rule); ``first_step``: the next step this node will draw; ``counted_step``:
        :attr:`counted_step` as persisted before that step (the node's data dir), or None when
        unknown: then the trainers counted at most the steps below ``first_step`` less those a
        crash loses unsent (the outbox and the step in generation)."""
        if capacity < 1 or max_attempts < 1 or not 0 < backoff <= backoff_max or async_level < 0:
            raise ValueError("capacity >= 1, max_attempts >= 1, 0 < backoff <= backoff_max, async_level >= 0")
        if step_window and step_window <= STEP_SLACK:
            raise ValueError(f"step_window must exceed STEP_SLACK ({STEP_SLACK})")
        self.capacity = capacity
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.async_level = async_level
        self._queue: OrderedDict[bytes, Pending] = OrderedDict()  # oldest first
        self._health: dict[str, _TrainerHealth] = {}
        self._rotation = 0  # spreads batches over equally healthy trainers
        self.newest_version = 0  # highest policy version / trainer step seen: staleness reference
        self.step_window = step_window
        # The highest step of ours a trainer counted, as far as we know (persisted by the caller: a
        # restart must not forget how many steps its lost batches burned).
        self.counted_step = first_step - 1 - (capacity + 1) if counted_step is None else counted_step
        self.step_ahead_refusals = 0  # times a trainer said our steps ran past its window
        self._listed: set[str] = set()  # the trainers :meth:`take` was last given (alive in the member table)

    # -- queue -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def full(self) -> bool:
        return len(self._queue) >= self.capacity

    def pending(self) -> list[Pending]:
        return list(self._queue.values())

    def offer(self, item: Pending) -> bool:
        """Queue a new batch; False (and nothing queued) when the outbox is full or it is known."""
        if self.full or item.batch_id in self._queue:
            return False
        if item.state is not BatchState.QUEUED:
            raise LocalProtocolError(f"offer of a batch in state {item.state}")
        self._queue[item.batch_id] = item
        return True

    def observe_version(self, version: int) -> list[Pending]:
        """A newer policy version or trainer step is known: drop queued batches now too old to train on.

        In-flight batches are left to finish (the trainer decides); returns the dropped ones.
        """
        self.newest_version = max(self.newest_version, version)
        floor = self.newest_version - self.async_level
        stale = [p for p in self._queue.values()
                 if p.state is BatchState.QUEUED and p.policy_version < floor and not self.past_edge(p.step)]
        for p in stale:
            self._finish(p, BatchState.DROPPED)
        return stale

    def is_stale(self, policy_version: int) -> bool:
        return policy_version < self.newest_version - self.async_level

    def drops_stale(self, step: int, policy_version: int) -> bool:
        """Whether a batch of ``step`` and ``policy_version`` is dropped here as too old (one past the
        edge is sent anyway: the trainer's refusal moves its window, see "Step headroom")."""
        return self.is_stale(policy_version) and not self.past_edge(step)

    # -- step headroom -----------------------------------------------------------------------

    @property
    def step_edge(self) -> float:
        """The highest step drawn freely: past it, a lost batch could put us beyond a trainer's window."""
        return self.counted_step + self.step_window - STEP_SLACK if self.step_window else math.inf

    def past_edge(self, step: int) -> bool:
        return step > self.step_edge

    def step_hold(self, next_step: int) -> bool:
        """Whether drawing ``next_step`` must wait: it is past the edge and a batch is outstanding,
        whose ack will move the edge (with none outstanding waiting would never end: draw it)."""
        return self.past_edge(next_step) and len(self._queue) > 0

    def _counted(self, item: Pending, ack: RolloutAck) -> None:
        if ack.reason == "step-ahead" and item.step >= 0:
            # The trainer's window is below ``item.step - window``: our view was wrong (its view was
            # lost, or another trainer counted our steps). Believe the trainer.
            self.step_ahead_refusals += 1
            self.counted_step = min(self.counted_step, item.step - self.step_window - 1)
        elif ack.accepted or ack.reason not in UNCOUNTED_REASONS:
            self.counted_step = max(self.counted_step, item.step)

    def too_old_to_start(self, policy_version: int) -> bool:
        """Whether a batch started now from ``policy_version`` would likely arrive stale: the version is
        already the oldest the trainer takes, so one more trainer step during generation and delivery
        makes it refused (measured: 4-6 % of the demo's honest samples each at the trainer and in the
        outbox). With async level 0 the loaded version must simply be the newest."""
        return policy_version < self.oldest_to_start()

    def oldest_to_start(self) -> int:
        """The oldest policy version a batch may start from now (see :meth:`too_old_to_start`)."""
        if self.async_level == 0:
            return self.newest_version
        return self.newest_version - self.async_level + 1

    # -- choosing what to send where ---------------------------------------------------------

    def take(self, trainers: Iterable[str], now: float) -> tuple[Pending, str] | None:
        """The oldest due batch and the trainer to send it to (marked IN_FLIGHT), or None.

        Trainer choice: only trainers not backed off; among them those this batch has not tried yet,
        then the fewest consecutive failures, then rotation (so several trainers share the load).
        A trainer back in ``trainers`` after it was left out (declared dead, then alive again: a
        restarted process) is tried at once: the backoff its failures built up while it was still
        listed (dead but not yet declared so) says nothing about the new process.
        """
        listed = set(trainers)
        for t in listed - self._listed:
            health = self._health_of(t)
            health.failures, health.blocked_until = 0, 0.0
        self._listed = listed
        ready = sorted(t for t in listed if self._health_of(t).blocked_until <= now)
        if not ready:
            return None
        for item in self._queue.values():
            if item.state is not BatchState.QUEUED or item.not_before > now:
                continue
            self._rotation += 1
            rank = {t: (t in item.tried, self._health_of(t).failures, (i - self._rotation) % len(ready))
                    for i, t in enumerate(ready)}
            trainer = min(ready, key=rank.__getitem__)
            item.state = BatchState.IN_FLIGHT
            item.tried.append(trainer)
            return item, trainer
        return None

    def on_record(self, trainer: str, seq: int) -> None:
        """The trainer's member record is at ``seq``. A newer one than seen before was signed by a
        running process (a restarted one publishes one at start; a live one at each version): the
        backoff that failures built, dialling a process that may be gone, says nothing of it, so it
        is tried at once. Only the trainer signs its records: no one else can end its backoff."""
        health = self._health_of(trainer)
        if seq > health.record_seq:
            if health.record_seq:
                health.failures, health.blocked_until = 0, 0.0
            health.record_seq = seq

    def next_wakeup(self, trainers: Iterable[str], now: float) -> float:
        """Earliest time :meth:`take` could return something (``math.inf`` if only new input can)."""
        ts = list(set(trainers))
        queued = [p for p in self._queue.values() if p.state is BatchState.QUEUED]
        if not ts or not queued:
            return math.inf
        trainer_ready = min(self._health_of(t).blocked_until for t in ts)
        batch_ready = min(p.not_before for p in queued)
        return max(now, trainer_ready, batch_ready)

    # -- results -----------------------------------------------------------------------------

    def on_ack(self, batch_id: bytes, trainer: str, ack: RolloutAck, now: float) -> Outcome:
        """The trainer answered. Accepted or finally refused: done; transiently refused: retry later."""
        item = self._in_flight(batch_id)
        health = self._health_of(trainer)
        if ack.trainer_step:
            self.observe_version(ack.trainer_step)
        self._counted(item, ack)
        wait = min(self.backoff_max, ack.retry_after_ms / 1000.0)  # a trainer cannot park us for longer
        health.paced_until = now + wait
        if ack.accepted:
            # The wait holds *generation* (generation_hold), not the batches already made: holding them
            # back too let them age past the trainer's async window in the outbox (measured: 15 % of
            # the demo's honest samples). The trainer's bound on its queue is "busy".
            health.failures, health.blocked_until = 0, 0.0
            self._finish(item, BatchState.ACCEPTED)
            return Outcome(BatchState.ACCEPTED, "ok")
        reason = ack.reason or "unspecified"
        if reason in TRANSIENT_REASONS:
            if wait > 0:  # the trainer said when: no guessing, and it is not a failure
                health.failures, health.blocked_until = 0, now + wait
            else:
                self._back_off(trainer, now)
            # "Not now" is no fault of the batch: it keeps its attempts and stays queued while fresh.
            return self._retry(item, now, reason, counts=False)
        health.failures, health.blocked_until = 0, 0.0  # it answered sensibly: it is alive
        self._finish(item, BatchState.REFUSED)
        return Outcome(BatchState.REFUSED, reason)

    def on_failure(self, batch_id: bytes, trainer: str, kind: FailureKind, now: float) -> Outcome:
        """No ack: back the trainer off and retry the batch elsewhere (up to ``max_attempts`` failures
        that happened after the batch reached a trainer)."""
        item = self._in_flight(batch_id)
        self._back_off(trainer, now)
        # Only a failure after the batch reached the trainer can be the batch's fault (a batch that
        # makes every trainer choke must not circulate forever); an unreachable trainer says nothing
        # about the batch, so it costs no attempt: staleness bounds how long such a batch waits.
        return self._retry(item, now, kind.value, counts=kind is not FailureKind.UNREACHABLE)

    def generation_hold(self, trainers: Iterable[str], now: float) -> float:
        """Time before which generating another batch is pointless: every trainer asked us to wait
        (the earliest of their waits), or ``now`` when one of them takes work (or none is known)."""
        ts = set(trainers)
        if not ts:
            return now
        return max(now, min(self._health_of(t).paced_until for t in ts))

    def backoff_of(self, trainer: str) -> float:
        """Seconds a trainer is skipped after its latest failure (exponential, capped)."""
        failures = self._health_of(trainer).failures
        return 0.0 if failures == 0 else min(self.backoff_max, self.backoff * 2 ** (failures - 1))

    def blocked_until(self, trainer: str) -> float:
        return self._health_of(trainer).blocked_until

    # -- internals ---------------------------------------------------------------------------

    def _retry(self, item: Pending, now: float, reason: str, counts: bool = True) -> Outcome:
        item.attempts += counts
        if self.drops_stale(item.step, item.policy_version):
            self._finish(item, BatchState.DROPPED)
            return Outcome(BatchState.DROPPED, "stale")
        if item.attempts >= self.max_attempts:
            self._finish(item, BatchState.DROPPED)
            return Outcome(BatchState.DROPPED, "undeliverable")
        item.state = BatchState.QUEUED
        # The batch may go to another trainer at once; only the failed trainer waits. A batch that
        # failed everywhere waits for the shortest trainer backoff (next_wakeup), not longer.
        item.not_before = now
        return Outcome(BatchState.QUEUED, reason)

    def _back_off(self, trainer: str, now: float) -> None:
        health = self._health_of(trainer)
        health.failures += 1
        health.blocked_until = now + self.backoff_of(trainer)

    def _in_flight(self, batch_id: bytes) -> Pending:
        item = self._queue.get(batch_id)
        if item is None or item.state is not BatchState.IN_FLIGHT:
            raise LocalProtocolError(f"result for a batch that is not in flight ({batch_id.hex()[:12]})")
        return item

    def _finish(self, item: Pending, state: BatchState) -> None:
        item.state = state
        self._queue.pop(item.batch_id, None)

    def _health_of(self, trainer: str) -> _TrainerHealth:
        return self._health.setdefault(trainer, _TrainerHealth())


def alive_trainers(members: dict[str, str], trainers: Sequence[str], self_id: str) -> list[str]:
    """Trainers of the run that membership currently sees alive (whatever role they advertise)."""
    return [t for t in trainers if t in members and t != self_id]
