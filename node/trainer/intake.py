"""Pure checks of a rollout batch that has already passed :func:`node.rollouts.schema.open_batch`.

``open_batch`` checked size, signature, schema, run and signer; what is left depends on the
trainer's state, so it lives here, as a function of that state (no I/O, no clock):

* **staleness** (INTELLECT-2 §3, "asynchronous RL"), judged **once, here**: a batch made with policy
  version ``v`` is acknowledged at step ``a`` only if ``v >= a - async_level``; a version newer than
  ours cannot exist (``future``). An acknowledged batch then stays trainable until step
  ``a + verify_grace_steps`` (:func:`trainable_until`), whatever its verification costs: the time
  it waits for a validator is the system's queueing, not the worker's lag, and judging staleness
  again after that wait threw away honest work (issue 15: 40 % of it on a loaded 2-core machine).
  The bound on how far behind a trained sample can be stays fixed (``async_level +
  verify_grace_steps`` versions), which INTELLECT-2's two-sided clipping is there to absorb; a batch
  that can no longer be trained is dropped before any validator spends a prefill on it;
* **replay**: a batch id seen before (spooled, trained or refused) is refused; batch ids are content
  hashes of the signed payload, so a replay is byte-identical and always caught. A different batch
  for a (worker, step) already spooled is refused too: a worker must not sample many batches for one
  task draw and send the best (cherry-picking; INTELLECT-2's deterministic draw assumes one per step);
* **step window** (node/rollouts/steps.py): a step far above the worker's highest (``step-ahead``:
  a step picked by scanning free draws for easy ones) or below its window (``step-behind``) is
  refused; and **policy root**: the batch's ``policy_root`` must be the manifest root we announced
  for its ``policy_version`` (``wrong-root``), since the task draw is keyed by it;
* **shape**: sampling temperature equal to the trainer's (the GRPO ratio divides logits by it),
  an engine the run accepts, token ids inside the vocabulary, every sequence fits a packed row, groups no larger than claimed.

Each refusal is a short reason code (a metrics label, a status key, a ledger entry's reason).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..refusals import NOT_FAULTS, UNRECORDED_REASONS
from ..rollouts.schema import RolloutBatch
from ..rollouts.steps import KEEPS_WINDOW  # noqa: F401 (the trainer's window rules read it from here)

TEMPERATURE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class IntakeLimits:
    """What the trainer can train on (from the model and the [grpo] table)."""

    vocab_size: int
    pack_length: int  # longest prompt + completion a packed row holds
    temperature: float
    async_level: int
    # Engines the run accepts ([inference] engines). Checked here too, not only by validators: a run
    # without validators would otherwise train on batches from an engine its operators refused.
    engines: tuple[str, ...] = ("torch",)


def staleness_reason(policy_version: int, step: int, async_level: int) -> str | None:
    """None if a batch of ``policy_version`` may be trained at ``step``, else "stale" / "future"."""
    if policy_version > step:
        return "future"
    if policy_version < step - async_level:
        return "stale"
    return None


def trainable_until(policy_version: int, accepted_step: int | None, async_level: int, grace: int) -> int:
    """The last trainer step (current policy version) at which a batch may still be trained.

    ``accepted_step`` is the trainer's step when it acknowledged the batch (None for rows spooled
    before it was recorded: they keep the old rule, ``policy_version + async_level``). Never earlier
    than the old rule, so a batch that is fresh by its version is never dropped for its wait.
    """
    by_version = policy_version + async_level
    if accepted_step is None:
        return by_version
    return max(by_version, accepted_step + grace)


def expired(policy_version: int, accepted_step: int | None, step: int, async_level: int, grace: int) -> bool:
    """True once the trainer at ``step`` may no longer train an acknowledged batch (see :func:`trainable_until`)."""
    return step > trainable_until(policy_version, accepted_step, async_level, grace)


def shape_reason(batch: RolloutBatch, limits: IntakeLimits) -> str | None:
    """None if every sample of ``batch`` can be trained on, else why not."""
    if not batch.samples:
        return "empty"
    if batch.engine not in limits.engines:
        return "engine_refused"
    if abs(batch.temperature - limits.temperature) > TEMPERATURE_TOLERANCE:
        return "wrong-temperature"
    per_prompt = Counter(s.prompt_index for s in batch.samples)
    if max(per_prompt.values()) > batch.group_size:
        return "bad-group"
    for s in batch.samples:
        if not s.prompt_ids or not s.completion_ids:
            return "empty-sample"
        if len(s.prompt_ids) + len(s.completion_ids) > limits.pack_length:
            return "too-long"
        if min(s.prompt_ids) < 0 or min(s.completion_ids) < 0:
            return "bad-token"
        if max(s.prompt_ids) >= limits.vocab_size or max(s.completion_ids) >= limits.vocab_size:
            return "bad-token"
    return None


def intake_reason(
    batch: RolloutBatch,
    *,
    known_batch: bool,
    known_worker_step: bool,
    step: int,
    limits: IntakeLimits,
    window_reason: str | None = None,
    root_ok: bool = True,
) -> str | None:
    """The first reason to refuse ``batch`` given the trainer's state, or None to accept it.

    ``known_batch``: the batch id is already in the spool. ``known_worker_step``: another batch of
    this worker for ``batch.step`` is. ``window_reason``: the worker's step window's verdict on
    ``batch.step`` (:meth:`node.rollouts.steps.StepWindow.reason`). ``root_ok``: ``batch.policy_root``
    is not another root than the one announced for its version. Cheapest checks first.
    """
    if known_batch:
        return "duplicate"
    if known_worker_step:
        return "duplicate-step"
    if window_reason:
        return window_reason
    if not root_ok:
        return "wrong-root"
    stale = staleness_reason(batch.policy_version, step, limits.async_level)
    if stale:
        return stale
    return shape_reason(batch, limits)


# Refusals that say nothing about the worker's honesty or that a third party can cause (replaying a
# worker's signed batch) are not recorded against the worker in the ledger (node/refusals.py).
NOT_ATTRIBUTABLE = UNRECORDED_REASONS


# Refusals that are no fault of the sender (lag, replays, our own load, a worker that died
# mid-upload, the step window, the quota): not struck (node/refusals.py says why, per reason).
NOT_STRIKES = NOT_FAULTS
