"""The rollout checks around the proof: termination, sampling and data. Pure functions.

A TOPLOC proof shows that the completion's hidden states came from the run's model on this prompt;
it says nothing about *how* tokens were picked from those states, when generation stopped, which
task was solved or what reward was claimed. These checks close those gaps (TOPLOC paper §6 on
sampling attacks; INTELLECT-2 report on deterministic task sampling and rollout fields). Each
returns a :class:`~node.proofs.reasons.CheckResult` whose ``reason`` names what failed, so a
validator can sign a per-sample verdict with a reason code and metrics can count rejections.

Inputs are plain values (lists, numbers, tensors) so any message schema can call them; no I/O,
no clock, no network imports. What the right values are (the draw, the advantages, the log-prob
definition) is node/rl/spec.py's; these functions only compare.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import torch

from .config import ProofsConfig
from .reasons import PASS, CheckResult, Reason, fail

PARAM_RTOL = 1e-6  # temperatures travel as floats; allow a float32 round trip, nothing more


# --------------------------------------------------------------------------------------------
# Termination


def check_termination(completion: Sequence[int], eos_token_ids: Collection[int], max_new_tokens: int) -> CheckResult:
    """The completion ends at its first EOS, or runs exactly to the maximum length without one.

    A node that stops early (to save compute on a long answer) or keeps going after EOS (to pad a
    reward-relevant answer) is caught here; the proof alone cannot see either.
    """
    n = len(completion)
    if n == 0:
        return fail(Reason.EMPTY_COMPLETION, "no completion tokens")
    if n > max_new_tokens:
        return fail(Reason.TOO_LONG, f"{n} tokens > max_new_tokens {max_new_tokens}")
    eos = set(eos_token_ids)
    first = next((i for i, t in enumerate(completion) if t in eos), None)
    if first is not None and first != n - 1:
        return fail(Reason.TOKENS_AFTER_EOS, f"EOS at {first}, then {n - 1 - first} more tokens")
    if first is None and n != max_new_tokens:
        return fail(Reason.NOT_TERMINATED, f"{n} tokens, no EOS, below max_new_tokens {max_new_tokens}")
    return PASS


# --------------------------------------------------------------------------------------------
# Sampling


def check_logprobs(
    claimed: Sequence[float], recomputed: Sequence[float] | torch.Tensor, *, tolerance_mean: float, tolerance_max: float
) -> CheckResult:
    """Claimed per-token log-probs agree with the validator's recomputation.

    Mean and max absolute difference are both bounded: the mean catches a systematic change of
    distribution (another temperature, a biased sampler), the max a single forced token.
    """
    mine = np.asarray(recomputed.detach().cpu() if isinstance(recomputed, torch.Tensor) else recomputed, dtype=np.float64)
    try:
        theirs = np.asarray(claimed, dtype=np.float64)
    except (TypeError, ValueError):
        return fail(Reason.LOGPROB_SHAPE, "log-probs are not numbers")
    if theirs.shape != mine.shape:
        return fail(Reason.LOGPROB_SHAPE, f"{theirs.shape} log-probs for {mine.shape} tokens")
    if mine.size == 0:
        return PASS
    if not np.isfinite(theirs).all() or (theirs > 0).any():
        return fail(Reason.LOGPROB_MISMATCH, "log-probs must be finite and <= 0")
    diff = np.abs(theirs - mine)
    if diff.mean() > tolerance_mean:
        return fail(Reason.LOGPROB_MISMATCH, f"mean |diff| {diff.mean():.4f} > {tolerance_mean}")
    if diff.max() > tolerance_max:
        return fail(Reason.LOGPROB_MISMATCH, f"token {int(diff.argmax())}: |diff| {diff.max():.4f} > {tolerance_max}")
    return PASS


def logprob_tolerances(cfg: ProofsConfig, *dtypes: str) -> tuple[float, float]:
    """The (mean, max) log-prob tolerances for a batch computed in the given dtypes (the worker's
    stated one and the validator's prefill's): ``cfg``'s float32 ones when all are float32, else the
    bf16-sized ones.

    Why by dtype (issue 42, hole 7): the bf16-sized tolerances let a model fake-quantised to 8 bits
    (mean |diff| 3e-3 to 5e-3) through every time, while in float32 an honest worker's decoding and a
    validator's prefill agree far below 1e-3: worst mean |diff| 4.8e-7 (max 9.5e-7) over 1,000 honest
    batches of the embedded model (bench/cheap_model.py) and over 100 of vLLM's CPU build, 1.4e-5
    (max 2.3e-5) over 10 of SmolLM2-135M's, all on one CPU (no GPU worker measured yet). A batch that
    states a lower precision gets the looser tolerance: a run that wants the tight one for everyone
    pins ``[inference] dtype``.
    """
    if dtypes and all(d == "float32" for d in dtypes):
        return cfg.logprob_tolerance_mean_fp32, cfg.logprob_tolerance_max_fp32
    return cfg.logprob_tolerance_mean, cfg.logprob_tolerance_max


def check_sampling_params(
    temperature: float, seed: int, *, run_temperature: float, expected_seed: int | None
) -> CheckResult:
    """The sampling temperature is the run's, and the seed is the one the task draw assigned.

    ``expected_seed=None`` when the run does not fix seeds.
    """
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        return fail(Reason.WRONG_TEMPERATURE, f"temperature {temperature!r} is not a finite number")
    if abs(temperature - run_temperature) > PARAM_RTOL * max(1.0, abs(run_temperature)):
        return fail(Reason.WRONG_TEMPERATURE, f"temperature {temperature} != run's {run_temperature}")
    if expected_seed is not None and seed != expected_seed:
        return fail(Reason.WRONG_SEED, f"seed {seed} != assigned {expected_seed}")
    return PASS


# --------------------------------------------------------------------------------------------
# Data


def _floats(values: Sequence[float]) -> np.ndarray | None:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    return arr if arr.ndim == 1 and np.isfinite(arr).all() else None


def check_rewards(claimed: Sequence[float], recomputed: Sequence[float], *, tolerance: float) -> CheckResult:
    """Each claimed reward equals the validator's own verifier score."""
    theirs, mine = _floats(claimed), _floats(recomputed)
    if theirs is None or mine is None or theirs.shape != mine.shape:
        return fail(Reason.REWARD_MISMATCH, "rewards must be finite numbers, one per recomputed reward")
    bad = np.flatnonzero(np.abs(theirs - mine) > tolerance)
    if bad.size:
        i = int(bad[0])
        return fail(Reason.REWARD_MISMATCH, f"sample {i}: claimed {theirs[i]} != recomputed {mine[i]}")
    return PASS


def check_bounds(values: Mapping[str, float], bounds: Mapping[str, tuple[float, float]]) -> CheckResult:
    """Every named scalar is a finite number within its inclusive ``(low, high)`` bounds."""
    for name, (low, high) in bounds.items():
        if name not in values:
            return fail(Reason.OUT_OF_BOUNDS, f"{name}: missing")
        v = values[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return fail(Reason.OUT_OF_BOUNDS, f"{name}: {v!r} is not a finite number")
        if not low <= v <= high:
            return fail(Reason.OUT_OF_BOUNDS, f"{name}: {v} outside [{low}, {high}]")
    return PASS


def check_policy_version(policy_version: int, *, current_step: int, async_level: int) -> CheckResult:
    """The rollout's policy is at most ``async_level`` steps old and not from the future.

    INTELLECT-2 trains step n on rollouts from policies n - async_level .. n (async level 2 in the
    report); anything older is off-policy beyond what the clipped objective is tuned for.
    """
    if isinstance(policy_version, bool) or not isinstance(policy_version, int):
        return fail(Reason.OUT_OF_BOUNDS, f"policy version {policy_version!r} is not an integer")
    if policy_version > current_step:
        return fail(Reason.FUTURE_POLICY, f"version {policy_version} > current step {current_step}")
    if policy_version < current_step - async_level:
        return fail(Reason.STALE_POLICY, f"version {policy_version} older than {current_step} - {async_level}")
    return PASS


def first_failure(results: Sequence[CheckResult]) -> CheckResult:
    """The first failing result, or PASS: one reason code per sample for a verdict."""
    return next((r for r in results if not r.ok), PASS)
