"""Is the trainer making progress, and if not, what it waits for. Pure: time passed in.

How this works (issue 39). :class:`Progress` records when each step ended (the trio clock) and
gives the figures an operator checks first: seconds since the last step and steps per minute. Once
no step has ended for ``STALL_AFTER_S`` (the liveness bound of issue 39: no gap over 90 s between
steps), the trainer is *stalled*, and :func:`stall_cause` names what it can see holding it up,
from a :class:`Backlog` snapshot of its queues:

* a step running that long: the training itself is slow;
* batches waiting for a verdict with no validator of the run reachable;
* batches waiting for a verdict, some not even sent (``validator backlog``: the validators check
  slower than workers send; the trainer's acks slow the workers down, node/trainer/pacing.py);
* batches with validators and nothing else queued (``waiting for verdicts``);
* verified batches with too few samples that carry signal (online filtering);
* nothing queued at all (``no batches``: no worker reaches this trainer, or every batch is refused).

The service logs one warning when a stall starts or its cause changes, and shows the cause in
status (``stalled``; empty when it steps).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

STALL_AFTER_S = 90.0  # seconds without a step after which the trainer says it is stalled
RATE_WINDOW = 10  # steps the steps-per-minute figure is measured over


@dataclass(frozen=True)
class Backlog:
    """What the trainer holds when it cannot step."""

    stepping_s: float | None  # seconds the running step has taken so far (None: no step running)
    gated_unsent: int  # acknowledged batches waiting to be sent to a validator
    gated_sent: int  # ... sent, awaiting a verdict
    ready: int  # verified batches waiting for a step
    samples_in_hand: int  # samples with signal among them
    min_samples: int  # [grpo] min_batch_samples: the least a step waits for
    validators: int  # validators of the run (0: no gate)
    live_validators: int


def stall_cause(b: Backlog) -> str:
    """Why the trainer is not stepping: ``"<kind>: <detail>"``, the kind one of :data:`STALL_KINDS`
    (see the module docstring)."""
    if b.stepping_s is not None:
        return f"training: the running step has taken {b.stepping_s:.0f} s"
    gated = b.gated_unsent + b.gated_sent
    ready = f"{b.samples_in_hand} of {b.min_samples} samples ready"
    if gated and b.validators and not b.live_validators:
        return f"no validator: none of the run's {b.validators} is reachable; {gated} batches wait for a verdict"
    if b.gated_unsent:
        return f"validator backlog: {b.gated_unsent} batches not yet sent, {b.gated_sent} with validators ({ready})"
    if b.gated_sent:
        return f"waiting for verdicts: {b.gated_sent} batches with validators ({ready})"
    if b.ready:
        return f"too few samples: {b.samples_in_hand} of {b.min_samples} with signal in {b.ready} verified batches"
    return "no batches: none queued (no worker reaches this trainer, or its batches are refused)"


STALL_KINDS = ("training", "no validator", "validator backlog", "waiting for verdicts", "too few samples", "no batches")


def stall_kind(cause: str) -> str:
    """The kind of a :func:`stall_cause` ("" for no stall)."""
    return cause.split(":", 1)[0]


def idle_fraction(idle_s: float, busy_s: float, stepping_s: float | None) -> float | None:
    """The share of the trainer's time spent waiting for rollouts: waited / (waited + stepped), the
    running step's time so far counted as stepped (a long step is not idle time). None before either."""
    total = idle_s + busy_s + (stepping_s or 0.0)
    return round(idle_s / total, 4) if total > 0 else None


class Progress:
    """Step times of one trainer process, and whether it is stalled. The clock starts at the first
    batch acknowledged (:meth:`on_work`): a trainer no worker has reached yet waits, it is not stalled."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.working_since: float | None = None
        self._steps: deque[float] = deque(maxlen=RATE_WINDOW + 1)

    def on_work(self, now: float) -> None:
        """A batch was acknowledged."""
        if self.working_since is None:
            self.working_since = now

    def on_step(self, now: float) -> None:
        self._steps.append(now)

    def last_step(self) -> float | None:
        return self._steps[-1] if self._steps else None

    def seconds_since_step(self, now: float) -> float:
        """Since the last step, or since start before the first."""
        return now - (self._steps[-1] if self._steps else self.started)

    def steps_per_minute(self, now: float) -> float | None:
        """Over the last ``RATE_WINDOW`` steps, up to ``now`` (a stall brings it down); None before two steps."""
        if len(self._steps) < 2:
            return None
        return 60.0 * (len(self._steps) - 1) / max(now - self._steps[0], 1e-9)

    def stalled(self, now: float) -> bool:
        if self._steps:
            return now - self._steps[-1] >= STALL_AFTER_S
        return self.working_since is not None and now - self.working_since >= STALL_AFTER_S
