"""The step window: which step numbers a worker may still use. Pure (no I/O, no clock).

The attack it stops (issue 13, "step grinding"): a worker's tasks and sampling seed are a hash of
(run, worker, policy root, step) (``node.rl.spec.step_key``), and hashing is free. If any unused
step number counted, a worker could hash thousands of steps, keep the few whose tasks it finds
easiest and submit honest batches for only those: every check would pass and the gradient would
learn from a hand-picked curriculum. Keying the draw by the policy root (the checkpoint's manifest
id) means no draw exists before its version does; this window bounds how many draws of one version a
worker can choose among.

The rule, kept per worker by the trainer (its spool) and the validator (its store), durably:

* ``high`` is the highest step accepted from the worker; a step above ``high + window`` is
  refused (``step-ahead``). Every batch moves ``high`` up by at most ``window``, so over a run a
  worker submits one batch per ``window`` step numbers at the very least: it chooses among at most
  ``window`` draws per batch, not among thousands;
* a step at or below ``high - window`` is refused (``step-behind``), and one inside the window that
  was seen is refused (``duplicate-step``): each step number is used once, even after the batch
  tables forget old rows, so a skipped step cannot come back later with a fresh draw under a newer
  version. Within the window, late steps are fine (a retried batch delivered after a newer one).

This is the anti-replay sliding window of IPsec (RFC 4303 §3.4.3) applied to step numbers.

First sight: a worker the node has never seen may start at any step. A fresh identity is a fresh
set of draws anyway (keys are free: grinding identities is the Sybil problem, bounded by the quota on
new identities in node/rollouts/quota.py, not by this window), and it lets a validator join a run that is under way.

Honest workers never trip it (tests/test_redteam_steps.py): an inference node uses consecutive steps
and persists its next step before each one (node/roles/inference.py), so a gap at a trainer is the
batches it never delivered: at most its outbox plus the step in generation lost in a crash
(``max_pending_batches + 1``), the same again for batches dropped as stale in one burst, and a few
failed steps; :func:`step_window_size` allows twice that plus ``STEP_SLACK``. The size comes from the
run file's ``[worker] max_pending_batches``, which the trainer and validators read too. Gaps could
still add up over a long run (batches lost again and again), so a worker also never draws a step past
(the highest step a trainer counted) + window - ``STEP_SLACK`` while a batch is outstanding, and sends
rather than drops a stale batch past that edge, whose refusal moves the trainer's window
(node/inference/outbox.py, ``Outbox.step_hold``); the counted step is saved beside the next step, so a
restart keeps it.

Who judges what (issue 39). Only a trainer sees every batch a worker sends it, so only a trainer can
bound ``step-ahead`` by the worker's real progress. A validator sees the batches trainers forward to
it, which leave out the ones a trainer expired before any check (its queueing, not the worker's
doing): a ``step-ahead`` bound there measured the trainer's backlog, and once a worker's steps had
climbed more than ``window`` past the last batch forwarded, it refused every later batch of that
honest worker for good (and kept doing so across restarts: the window is on disk). So a validator
calls :meth:`StepWindow.reason` with ``ahead=False``: a step above its window moves the window, and
the validator still refuses a step used twice (``duplicate-step``, across trainers too) and one
below its window (``step-behind``), over the wider :data:`VALIDATOR_WINDOW`, because trainers
forward in deadline order, not step order. What that leaves an attacker: the trainers' windows bound
each batch's choice to ``window`` draws; the validator no longer bounds a jump between trainers,
so a worker may choose a fresh starting step once per trainer of the run (a handful, named in the
run file), as a fresh identity may anyway.

Known limit: with several trainers, each sees only the steps sent to it; a trainer that was
unreachable while a worker delivered more than a window of batches elsewhere refuses that worker's
next batches as ``step-ahead`` (no strike: the worker is not at fault), and the worker's outbox
uses its other trainers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..refusals import KEEPS_WINDOW_REASONS

# Refusals that do not use up the batch's step in the worker's window (the window must not move for
# them). The trainer's intake records steps by it and the worker's outbox reads its answers by it
# (node/trainer/intake.py, node/inference/outbox.py "Step headroom"): one set, so they cannot disagree.
KEEPS_WINDOW = KEEPS_WINDOW_REASONS

STEP_SLACK = 8  # steps lost to failed generations (an error, an oversized batch) between two deliveries
MAX_WINDOW = 4096  # bounds the seen-mask a node stores per worker (max_pending_batches is at most 1024)
# A validator's window below the highest step it judged: batches reach it in each trainer's deadline
# order, up to every trainer's queue of pending batches apart, so it is as wide as a node stores.
VALIDATOR_WINDOW = MAX_WINDOW


def step_window_size(max_pending_batches: int) -> int:
    """How far above the highest step seen a worker may go, for the run's ``[worker] max_pending_batches``."""
    return min(MAX_WINDOW, 2 * (max_pending_batches + 1) + STEP_SLACK)


@dataclass(frozen=True)
class StepWindow:
    """One worker's used steps as far as they matter: ``high`` (-1: none yet) and which of the
    ``window`` steps at and below it were seen (bit i set = step ``high - i`` was used)."""

    high: int = -1
    seen: int = 0

    EMPTY: ClassVar[StepWindow]

    def reason(self, step: int, window: int, *, ahead: bool = True) -> str | None:
        """None if ``step`` may be used now, else ``step-ahead``, ``step-behind`` or ``duplicate-step``;
        with ``ahead`` False (a validator: "Who judges what") a step above the window is no refusal."""
        if self.high < 0:
            return None
        if step > self.high + window:
            return "step-ahead" if ahead else None
        if step > self.high:
            return None
        back = self.high - step
        if back >= window:
            return "step-behind"
        return "duplicate-step" if self.seen >> back & 1 else None

    def after(self, step: int, window: int) -> StepWindow:
        """The window once ``step`` is used (call only when :meth:`reason` allowed it)."""
        mask = (1 << window) - 1
        if self.high < 0:
            return StepWindow(step, 1)
        if step > self.high:
            return StepWindow(step, ((self.seen << (step - self.high)) | 1) & mask)
        return StepWindow(self.high, self.seen | 1 << (self.high - step))

    def to_bytes(self) -> bytes:
        return self.seen.to_bytes((MAX_WINDOW + 7) // 8, "big").lstrip(b"\x00")

    @classmethod
    def from_row(cls, high: int, seen: bytes) -> StepWindow:
        return cls(high, int.from_bytes(seen, "big"))


StepWindow.EMPTY = StepWindow()
