"""The validator gate: which batch goes to which validator, when to give up on one, what a verdict means.

How this works
--------------
Pure state machine, time passed in. Each gated batch is in one of these states:

    UNASSIGNED ──due()──> SENDING ──sent()──> AWAITING ──verdict──> (removed: decided)
         ^                   │                    │
         └──send_failed()────┘                    │ (now >= deadline: that validator is
         └──────────────── expire() ──────────────┘  skipped for this batch; reassigned)

* Assignment is rendezvous hashing over the *live* validators of the run
  (:func:`node.rollouts.assign.assign_validator`, Thaler & Ravishankar 1998): every trainer picks
  the same validator for a batch, load spreads evenly, and when one goes silent only its batches move,
  each to its own next choice. The validators that failed a batch are skipped for it; once every live
  validator has failed it, the list is cleared and the batch starts over, so a batch is never dropped
  while it waits (the spool holds it on disk; this table is rebuilt from the spool on restart).
* A verdict counts whoever signed it, as long as the signer is a validator of the run (checked by
  ``open_verdict`` before it reaches here): a late verdict from a validator we had given up on is as
  good as the one we were waiting for, and the second verdict for a batch is ignored (``decided``).
* At most ``max_in_flight`` batches are SENDING or AWAITING at once (bounded work on validators),
  and at most ``per_validator`` on any one validator: a validator holds only the batch it checks and
  the next, so the order of verification is decided here, where the batches' ages are known, and not
  by the first-come queue of a validator that fell behind (issue 15).
* **Order and skipping** (issue 15). Each batch carries the last trainer step at which it can still
  be trained (``expires``, :func:`node.trainer.intake.trainable_until`) and its policy version.
  :meth:`drop_expired` removes the batches the trainer can no longer use *before* any validator
  spends a prefill on them (the trainer rejects them as ``expired``, no blame: our queueing, not the
  worker's fault). The others go out earliest deadline first, then freshest version first, then
  oldest arrival. Why that order rather than "freshest first": every batch here was fresh when
  acknowledged and has a deadline; serving the nearest deadline first loses none of them whenever
  any order could keep them all (Jackson's rule for unit jobs with deadlines), while freshest-first
  would let older ones expire whenever fresh work keeps coming — exactly the honest work this is
  meant to save. Among batches with the same deadline, the fresher one is the better gradient.
  Overload (more batches than validators can check in time) is handled upstream: the trainer's
  acks tell workers to slow down (node/trainer/pacing.py).
* **"Cannot judge yet"** (:meth:`not_now`): a validator that does not hold a batch's checkpoint says
  so at once, in its ack (``no-checkpoint``) or in a signed verdict of the ``unjudged`` kind, instead
  of sitting on the batch until ``timeout``. That is no verdict on the worker: the batch goes back to
  UNASSIGNED with that validator skipped, so it moves to the next live validator at once; when every
  live validator has said "not now", it waits ``retry`` seconds (``retry_at``) before starting over,
  so a lone validator still fetching the checkpoint is not asked again in a loop, and its slot serves
  a batch it can judge meanwhile.
* **A validator that lost its queue** (:meth:`release`): a validator keeps the batches it queued in
  memory only, so one killed and restarted never judges them, and its share stayed full of them
  until their timeout: in issue 45's soak a restarted validator got nothing for ~33 s after it was
  ready. The trainer releases a validator's awaiting batches when its connection to it is gone; they
  go out again by the same rule (not marked failed: to the same validator once it is back, which
  queues them afresh, or answers "accepted" for one it still holds, so nothing is checked twice).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from ..rollouts.assign import assign_validator
from ..validator.policy import BENIGN  # verdict reasons the worker does not answer for

MAX_DECIDED = 65536  # batch ids remembered as decided, to answer duplicate verdicts cheaply


class Phase(enum.Enum):
    UNASSIGNED = "unassigned"
    SENDING = "sending"
    AWAITING = "awaiting"


@dataclass
class Gated:
    batch_id: bytes
    phase: Phase = Phase.UNASSIGNED
    validator: str | None = None
    deadline: float = 0.0
    failed: set[str] = field(default_factory=set)  # validators that timed out or refused this batch
    attempts: int = 0
    policy_version: int = 0
    expires: int | None = None  # last trainer step at which the batch can be trained (None: never expires)
    seq: int = 0  # arrival order
    retry_at: float = 0.0  # after a "not now", the batch starts over no earlier than this


@dataclass(frozen=True)
class VerdictOutcome:
    """What a verdict did: ``decided`` False means it was ignored (``reason`` says why)."""

    decided: bool
    passed: bool = False
    reason: str = ""
    workers_fault: bool = False  # a failure the worker answers for (not staleness, a missing checkpoint...)


class ValidatorGate:
    """Routing of gated batches to validators (see the module docstring)."""

    def __init__(self, timeout: float, max_in_flight: int, per_validator: int | None = None,
                 retry: float = 2.0) -> None:
        self.timeout = timeout
        self.retry = retry  # seconds a batch every validator said "not now" to waits before starting over
        self.max_in_flight = max_in_flight
        self.per_validator = max_in_flight if per_validator is None else per_validator
        self.batches: dict[bytes, Gated] = {}
        self.decided: dict[bytes, bool] = {}  # insertion-ordered; bounded by MAX_DECIDED
        self.timeouts = 0
        self.reassignments = 0
        self.skipped = 0  # batches dropped as expired before any validator checked them
        self.not_now_count = 0  # "cannot judge yet" answers (ack or unjudged verdict)
        self.released = 0  # batches taken back from a validator whose connection was gone
        self._seq = 0

    def add(self, batch_id: bytes, policy_version: int = 0, expires: int | None = None) -> None:
        if batch_id not in self.batches and batch_id not in self.decided:
            self._seq += 1
            self.batches[batch_id] = Gated(batch_id, policy_version=policy_version, expires=expires, seq=self._seq)

    def in_flight(self) -> int:
        return sum(1 for g in self.batches.values() if g.phase is not Phase.UNASSIGNED)

    def drop_expired(self, step: int) -> list[bytes]:
        """Forget the waiting (UNASSIGNED) batches that the trainer at ``step`` can no longer train;
        returns them, for the trainer to reject without blame. Batches already with a validator are
        left to finish: their prefill is being spent, and a verdict is what credits the worker."""
        out = [g.batch_id for g in self.batches.values()
               if g.phase is Phase.UNASSIGNED and g.expires is not None and step > g.expires]
        for b in out:
            del self.batches[b]
        self.skipped += len(out)
        return out

    def expiring(self, step: int) -> int:
        """Batches still waiting for a verdict that the step after ``step`` would leave expired: the
        trainer holds that step a little for them (service ``_hold_step``), since a step that
        takes one batch as soon as it is verified advances the version while the rest are checked."""
        return sum(1 for g in self.batches.values() if g.expires is not None and g.expires <= step)

    @staticmethod
    def _order(g: Gated) -> tuple:
        # Earliest deadline first, then freshest version, then oldest arrival (module docstring).
        return (g.expires if g.expires is not None else float("inf"), -g.policy_version, g.seq)

    def due(self, live_validators: Collection[str], now: float) -> list[tuple[bytes, str]]:
        """(batch id, validator) pairs to send now; each is SENDING until sent() or send_failed()."""
        self.expire(now)
        out: list[tuple[bytes, str]] = []
        budget = self.max_in_flight - self.in_flight()
        if budget <= 0 or not live_validators:
            return out
        load: dict[str, int] = {}
        for g in self.batches.values():
            if g.phase is not Phase.UNASSIGNED and g.validator is not None:
                load[g.validator] = load.get(g.validator, 0) + 1
        for g in sorted((g for g in self.batches.values() if g.phase is Phase.UNASSIGNED), key=self._order):
            if len(out) >= budget:
                break
            full = {v for v in live_validators if load.get(v, 0) >= self.per_validator}
            if len(full) >= len(set(live_validators)):
                break  # every validator holds its share: the rest wait, in order
            v = assign_validator(g.batch_id, live_validators, exclude=g.failed | full)
            if v is None and assign_validator(g.batch_id, live_validators, exclude=g.failed) is None:
                if now < g.retry_at:
                    continue  # every live validator said "not now": wait, keep the slots for others
                g.failed.clear()  # every live validator failed this batch: start over
                v = assign_validator(g.batch_id, live_validators, exclude=full)
            if v is None:
                continue
            if g.attempts:
                self.reassignments += 1
            g.phase, g.validator, g.attempts = Phase.SENDING, v, g.attempts + 1
            load[v] = load.get(v, 0) + 1
            out.append((g.batch_id, v))
        return out

    def sent(self, batch_id: bytes, now: float) -> None:
        """The validator queued the batch: wait for its verdict until now + timeout."""
        g = self.batches.get(batch_id)
        if g is not None and g.phase is Phase.SENDING:
            g.phase, g.deadline = Phase.AWAITING, now + self.timeout

    def send_failed(self, batch_id: bytes) -> None:
        """The validator could not be reached or refused (busy): try the next one."""
        g = self.batches.get(batch_id)
        if g is not None and g.phase is Phase.SENDING:
            g.failed.add(g.validator)
            g.phase, g.validator = Phase.UNASSIGNED, None

    def not_now(self, batch_id: bytes, validator: str, now: float) -> bool:
        """``validator`` cannot judge the batch yet (its checkpoint not held): skip it for this batch
        without waiting for the deadline. True if that freed a slot (the batch was with ``validator``);
        an answer from a validator the batch already left only marks it skipped."""
        g = self.batches.get(batch_id)
        if g is None:
            return False
        self.not_now_count += 1
        g.failed.add(validator)
        g.retry_at = now + self.retry
        if g.phase is Phase.UNASSIGNED or g.validator != validator:
            return False
        g.phase, g.validator = Phase.UNASSIGNED, None
        return True

    def holding(self) -> set[str]:
        """The validators with batches awaiting their verdict."""
        return {g.validator for g in self.batches.values() if g.phase is Phase.AWAITING and g.validator}

    def release(self, validator: str) -> list[bytes]:
        """``validator`` may have lost the batches awaiting its verdict (see "A validator that lost its
        queue"): they go back to UNASSIGNED, not held against it; returns them."""
        out = [g.batch_id for g in self.batches.values() if g.phase is Phase.AWAITING and g.validator == validator]
        for b in out:
            g = self.batches[b]
            g.phase, g.validator = Phase.UNASSIGNED, None
        self.released += len(out)
        return out

    def expire(self, now: float) -> list[bytes]:
        """Batches whose validator stayed silent past the deadline go back to UNASSIGNED."""
        out = []
        for g in self.batches.values():
            if g.phase is Phase.AWAITING and now >= g.deadline:
                g.failed.add(g.validator)
                g.phase, g.validator = Phase.UNASSIGNED, None
                self.timeouts += 1
                out.append(g.batch_id)
        return out

    def next_deadline(self, now: float | None = None) -> float | None:
        """The next time something changes without a message: an AWAITING deadline, or (given
        ``now``) the end of a "not now" wait."""
        ds = [g.deadline for g in self.batches.values() if g.phase is Phase.AWAITING]
        if now is not None:
            ds += [g.retry_at for g in self.batches.values() if g.phase is Phase.UNASSIGNED and g.retry_at > now]
        return min(ds) if ds else None

    def on_verdict(self, batch_id: bytes, accepted: bool, reasons: Iterable[str]) -> VerdictOutcome:
        """A checked verdict (signature, run, validator of the run) for ``batch_id``."""
        if batch_id in self.decided:
            return VerdictOutcome(False, reason="already-decided")
        if batch_id not in self.batches:
            return VerdictOutcome(False, reason="unknown-batch")
        del self.batches[batch_id]
        self.decided[batch_id] = accepted
        while len(self.decided) > MAX_DECIDED:
            self.decided.pop(next(iter(self.decided)))
        if accepted:
            return VerdictOutcome(True, True)
        bad = [r for r in reasons if r != "ok"] or ["rejected"]
        return VerdictOutcome(True, False, f"verdict:{bad[0]}"[:64], workers_fault=any(r not in BENIGN for r in bad))

    def status(self) -> dict:
        by_phase: dict[str, int] = {}
        per_validator: dict[str, int] = {}
        for g in self.batches.values():
            by_phase[g.phase.value] = by_phase.get(g.phase.value, 0) + 1
            if g.validator:
                per_validator[g.validator] = per_validator.get(g.validator, 0) + 1
        return {"waiting": by_phase, "per_validator": per_validator, "timeouts": self.timeouts,
                "reassignments": self.reassignments, "not_now": self.not_now_count, "decided": len(self.decided), "skipped_expired": self.skipped,
                "released": self.released}
