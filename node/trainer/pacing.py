"""Back-pressure from the trainer to the workers: how long a worker should wait before its next batch.

How this works (issue 15). Pure, time passed in. The trainer knows how many acknowledged batches
wait for a verdict or for a step (``pending``) and how fast batches leave that set (verified and
trained, rejected, expired): :meth:`Pacer.on_drained` records each departure and the rate is
measured over the last ``WINDOW`` departures. Every ack carries ``retry_after_ms``
(node/rollouts/schema.py ``RolloutAck``):

* below ``target`` pending batches: 0, generate and send freely;
* at or above it: the time the trainer needs to drain back below ``target`` at the measured rate,
  ``(pending - target + 1) * seconds per batch``, capped at ``max_wait``. The batch is still
  accepted; the worker waits that long before it *generates* the next one
  (node/rollouts/submit.py ``Outbox.generation_hold``), so it samples from newer weights instead of
  filling a queue whose tail would go stale;
* at ``max_pending`` the batch is refused as ``busy`` with the same wait: the worker keeps the
  batch and resubmits it then if it is still fresh (a ``busy`` costs it no attempt).

Without a measured rate yet (fewer than two departures) the wait is ``DEFAULT_INTERVAL`` seconds per
batch over the target. With several workers the wait each is told adds up to roughly the trainer's
drain rate shared among them: each ack reflects the queue at that moment.
"""

from __future__ import annotations

from collections import deque

WINDOW = 32  # departures the drain rate is measured over
DEFAULT_INTERVAL = 1.0  # seconds per batch assumed before the first departures are measured
MIN_INTERVAL = 0.01  # floor of the measured seconds per batch (a burst of departures at one instant)


class Pacer:
    """The trainer's drain rate and the wait it puts in its acks."""

    def __init__(self, target: int, max_pending: int, max_wait: float) -> None:
        if not 1 <= target <= max_pending or max_wait <= 0:
            raise ValueError("1 <= target <= max_pending, max_wait > 0")
        self.target = target
        self.max_pending = max_pending
        self.max_wait = max_wait
        self._departures: deque[float] = deque(maxlen=WINDOW)
        self.paced = 0  # acks that carried a wait

    def on_drained(self, count: int, now: float) -> None:
        """``count`` batches left the pending set at ``now`` (trained, rejected or expired)."""
        for _ in range(min(count, WINDOW)):
            self._departures.append(now)

    def seconds_per_batch(self, now: float) -> float:
        """Measured time between departures over the window (up to ``now``: a stalled trainer slows its workers)."""
        if len(self._departures) < 2:
            return DEFAULT_INTERVAL
        span = max(now, self._departures[-1]) - self._departures[0]
        return max(MIN_INTERVAL, span / (len(self._departures) - 1))

    def retry_after(self, pending: int, now: float) -> float:
        """Seconds a worker should wait before its next batch, with ``pending`` batches queued now."""
        if pending < self.target:
            return 0.0
        wait = min(self.max_wait, (pending - self.target + 1) * self.seconds_per_batch(now))
        self.paced += 1
        return wait

    def busy(self, pending: int) -> bool:
        """True when a new batch must be refused (``busy``): the queue is at its bound."""
        return pending >= self.max_pending

    def status(self, pending: int, now: float) -> dict:
        return {"target": self.target, "max": self.max_pending, "seconds_per_batch": round(self.seconds_per_batch(now), 3),
                "wait_now_s": round(min(self.max_wait, max(0, pending - self.target + 1) * self.seconds_per_batch(now)), 3),
                "paced_acks": self.paced}
