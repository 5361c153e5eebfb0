"""Back-pressure from the trainer to the workers: how long a worker should wait before its next batch.

How this works (issue 15). Pure, time passed in. The trainer knows how many acknowledged batches
wait for a verdict or for a step (``pending``) and how fast batches leave that set (trained, or
refused by a verdict; not expired, see below): :meth:`Pacer.on_drained` records each departure and the rate is
measured over the last ``WINDOW`` departures. Every ack carries ``retry_after_ms``
(node/rollouts/schema.py ``RolloutAck``):

* below ``target`` pending batches: 0, generate and send freely;
* at or above it: the time the trainer needs to drain back below ``target`` at the measured rate,
  ``(pending - target + 1) * seconds per batch``, capped at ``max_wait``. The batch is still
  accepted; the worker waits that long before it *generates* the next one
  (node/inference/outbox.py ``Outbox.generation_hold``), so it samples from newer weights instead of
  filling a queue whose tail would go stale;
* at ``max_pending`` the batch is refused as ``busy`` with the same wait: the worker keeps the
  batch and resubmits it then if it is still fresh (a ``busy`` costs it no attempt).

Without a measured rate yet (fewer than two departures) the wait is ``DEFAULT_INTERVAL`` seconds per
batch over the target. With several workers the wait each is told adds up to roughly the trainer's
drain rate shared among them: each ack reflects the queue at that moment.

**The target follows what can be checked in time** (issue 39). An acknowledged batch must be
verified and trained within ``horizon_steps`` trainer steps ([grpo] verify_grace_steps,
node/trainer/intake.py ``trainable_until``). With ``pending`` batches ahead of it, it waits about
``pending * seconds per batch`` to be trained, so no more than ``horizon_steps * seconds per step
/ seconds per batch`` may be queued: :meth:`Pacer.target_now` is half that (at least
``MIN_TARGET``), capped by the configured ``target``. A fixed target of half the queue (128 batches) let one slow
validator fall minutes behind on a busy machine, and a third of the honest samples expired. A batch
departs when it is trained, or refused by a verdict: the queue drains at the pace of the slower of
validators and trainer (a verdict rate measured alone let verified batches pile up past what the
capped steps, ``max_step_samples``, could take before they expired), and an expired batch does not
count (it took no validator time; counting it made the drain rate look faster the more was lost).
Half the horizon is the target: the other half absorbs the swings of step times and of each step's take.
"""

from __future__ import annotations

from collections import deque

WINDOW = 32  # departures the drain rate is measured over
DEFAULT_INTERVAL = 1.0  # seconds per batch assumed before the first departures are measured
MIN_INTERVAL = 0.01  # floor of the measured seconds per batch (a burst of departures at one instant)
STEP_WINDOW = 8  # trainer steps the step interval is measured over
MIN_TARGET = 2  # pending batches always allowed: one in a validator's check, one next
UNMEASURED_TARGET = 8  # target before two steps are measured (the adaptive target's starting point)


class Pacer:
    """The trainer's drain rate and the wait it puts in its acks."""

    def __init__(self, target: int, max_pending: int, max_wait: float, *, horizon_steps: int = 0) -> None:
        """``target``: the most pending batches before waits start; ``horizon_steps`` > 0 lowers it
        to what can be checked within that many trainer steps (module docstring)."""
        if not 1 <= target <= max_pending or max_wait <= 0 or horizon_steps < 0:
            raise ValueError("1 <= target <= max_pending, max_wait > 0, horizon_steps >= 0")
        self.target = target
        self.max_pending = max_pending
        self.max_wait = max_wait
        self.horizon_steps = horizon_steps
        self._departures: deque[float] = deque(maxlen=WINDOW)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW + 1)
        self.paced = 0  # acks that carried a wait

    def on_drained(self, count: int, now: float) -> None:
        """``count`` batches left the pending set at ``now``, judged (trained, or refused by a verdict)."""
        for _ in range(min(count, WINDOW)):
            self._departures.append(now)

    def on_step(self, now: float) -> None:
        """The trainer finished a step at ``now``."""
        self._steps.append(now)

    def seconds_per_step(self, now: float) -> float | None:
        """Measured time between trainer steps (up to ``now``: a stalled trainer counts), None before two."""
        if len(self._steps) < 2:
            return None
        return (max(now, self._steps[-1]) - self._steps[0]) / (len(self._steps) - 1)

    def target_now(self, now: float) -> int:
        """Pending batches at which waits start now (module docstring)."""
        if not self.horizon_steps:
            return self.target
        step_s = self.seconds_per_step(now)
        if step_s is None or len(self._departures) < 2:
            return min(self.target, UNMEASURED_TARGET)
        fits = int(self.horizon_steps * step_s / (2 * self.seconds_per_batch(now)))
        return min(self.target, max(MIN_TARGET, fits))

    def seconds_per_batch(self, now: float) -> float:
        """Measured time between departures over the window (up to ``now``: a stalled trainer slows its workers)."""
        if len(self._departures) < 2:
            return DEFAULT_INTERVAL
        span = max(now, self._departures[-1]) - self._departures[0]
        return max(MIN_INTERVAL, span / (len(self._departures) - 1))

    def retry_after(self, pending: int, now: float) -> float:
        """Seconds a worker should wait before its next batch, with ``pending`` batches queued now."""
        target = self.target_now(now)
        if pending < target:
            return 0.0
        wait = min(self.max_wait, (pending - target + 1) * self.seconds_per_batch(now))
        self.paced += 1
        return wait

    def busy(self, pending: int) -> bool:
        """True when a new batch must be refused (``busy``): the queue is at its bound."""
        return pending >= self.max_pending

    def status(self, pending: int, now: float) -> dict:
        target = self.target_now(now)
        return {"target": target, "max": self.max_pending, "seconds_per_batch": round(self.seconds_per_batch(now), 3),
                "wait_now_s": round(min(self.max_wait, max(0, pending - target + 1) * self.seconds_per_batch(now)), 3),
                "paced_acks": self.paced}
