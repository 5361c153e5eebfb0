"""Rewards to advantages: group-relative normalisation, zero-signal filtering, length reward.

Pure Python (no torch): validators recompute exactly these numbers from a rollout batch, so the
functions must be deterministic and cheap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

ADV_EPS = 1e-6  # INTELLECT-2 / GRPO: (r - mean) / (std + 1e-6)


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO advantages of one group: (r - mean) / (std + 1e-6).

    ``std`` is the population standard deviation (divide by G, not G - 1) — a convention, stated
    here so that the inference node, the trainer and the validators compute the same numbers.
    A group whose rewards are all equal gets all-zero advantages.
    """
    g = len(rewards)
    if g == 0:
        return []
    mean = math.fsum(rewards) / g
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / g)
    return [(r - mean) / (std + ADV_EPS) for r in rewards]


def has_signal(rewards: Sequence[float]) -> bool:
    """False when every reward in the group is equal: all advantages are 0 and GRPO learns nothing.

    INTELLECT-2's online filtering drops such groups and keeps sampling until a batch has enough
    samples with non-zero advantage.
    """
    return len(rewards) > 1 and max(rewards) != min(rewards)


def filter_groups(groups: Sequence[Sequence[float]]) -> list[int]:
    """Indices of the groups that carry a learning signal (see :func:`has_signal`)."""
    return [i for i, g in enumerate(groups) if has_signal(g)]


def length_penalty(num_tokens: int, budget: int) -> float:
    """Distance from the thinking budget, normalised by the budget: |len - budget| / budget.

    INTELLECT-2 puts a target length in the prompt ("think for N tokens") and subtracts
    ``alpha * |len - target|`` from the task reward so a model learns to respect a thinking budget.
    """
    if budget <= 0:
        raise ValueError("budget must be positive")
    return abs(num_tokens - budget) / budget


def combined_reward(task_reward: float, num_tokens: int, budget: int | None, alpha: float) -> float:
    """Task reward minus ``alpha`` times the length penalty (length reward off when budget is None)."""
    if budget is None or alpha == 0:
        return task_reward
    return task_reward - alpha * length_penalty(num_tokens, budget)


def budget_instruction(budget: int) -> str:
    """The text appended to a prompt to state its thinking budget."""
    return f"\n(Think for up to {budget} tokens.)\n"
