"""The one rollout spec (node/rl/spec.py): the worker's builder and the validator's check agree with
values computed here independently (exact fractions, hand-worked examples), not with each other.

Checking the worker's function against itself could never catch a worker/validator mismatch; each
side is checked against an oracle instead: the worker side is ``node.rl.rollout.build_groups`` (what
the generator and rl-local run), the validator side ``node.validator.pipeline.advantage_results``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.proofs.reasons import Reason
from node.rl.config import RLConfig
from node.rl.rollout import build_groups
from node.rl.spec import code_limits, draw_step, group_advantages, prompt_text, sampling_seed, step_key
from node.rl.synthetic import reversal_reward
from node.rl.tasks import load_taskset
from node.rollouts.schema import RolloutSample
from node.validator.pipeline import advantage_results

TOLERANCE = 1e-4  # [proofs] advantage_tolerance's default


def oracle_advantages(rewards: list[float]) -> list[float]:
    """(r - mean) / (pstd + 1e-6), mean and variance in exact rationals; independent of node/."""
    exact = [Fraction(r) for r in rewards]
    mean = sum(exact) / len(exact)
    std = math.sqrt(sum((r - mean) ** 2 for r in exact) / len(exact))
    return [float(r - mean) / (std + 1e-6) for r in exact]


def samples_of(groups: list[list[float]], advantages: list[list[float]]) -> list[RolloutSample]:
    return [RolloutSample(prompt_index=p, sample_index=g, task_id="t", prompt_ids=[1], completion_ids=[2],
                          logprobs=[-1.0], finish_reason="stop", reward=r, task_reward=r, advantage=a, proof=b"")
            for p, (rewards, advs) in enumerate(zip(groups, advantages)) for g, (r, a) in enumerate(zip(rewards, advs))]


# -- hand-worked values ----------------------------------------------------------------------


HAND = [
    # rewards 1, 0, 0, 1: mean 1/2, population std 1/2
    ([1.0, 0.0, 0.0, 1.0], [0.5 / 0.500001, -0.5 / 0.500001, -0.5 / 0.500001, 0.5 / 0.500001]),
    # rewards 3, 1, 2: mean 2, population std sqrt(2/3)
    ([3.0, 1.0, 2.0], [1 / (math.sqrt(2 / 3) + 1e-6), -1 / (math.sqrt(2 / 3) + 1e-6), 0.0]),
    ([3.0, 3.0, 3.0], [0.0, 0.0, 0.0]),  # no signal, no division by zero
    ([2.0], [0.0]),  # a group of one: population std 0
]


@pytest.mark.parametrize("rewards, expected", HAND)
def test_advantages_by_hand_worker_and_validator(rewards, expected):
    assert group_advantages(rewards) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert all(advantage_results(samples_of([rewards], [expected]), TOLERANCE))
    if any(expected):
        doubled = [2 * a for a in expected]
        results = advantage_results(samples_of([rewards], [doubled]), TOLERANCE)
        assert [r.reason for r in results] == [Reason.ADVANTAGE_MISMATCH if a else Reason.OK for a in expected]


# -- seeded random groups: both sides against the oracle ---------------------------------------


@dataclass
class FakeSample:
    text: str

    @property
    def num_tokens(self) -> int:
        return len(self.text) + 1


class FakeEngine:
    """Returns the given completion texts, one group per prompt, whatever the prompts and seed."""

    def __init__(self, texts: list[list[str]]) -> None:
        self.texts = texts
        self.calls: list[tuple] = []
        self.tokenizer = lambda text, add_special_tokens: {"input_ids": [ord(c) for c in text]}

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, seed, capture_hidden=True):
        self.calls.append((prompts, n, seed))
        return [[FakeSample(t) for t in group] for group in self.texts]


RL = RLConfig(group_size=4, prompts_per_batch=2, max_new_tokens=8, length_reward=True, thinking_budgets=[3, 6],
              length_alpha=0.25)
TASKS = load_taskset("synthetic")
ROOT = b"r" * 32
DIGITS = st.text("0123456789", max_size=7)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(DIGITS, min_size=4, max_size=4), min_size=2, max_size=2), st.integers(0, 1000))
def test_builder_and_validator_match_an_independent_computation(texts, step):
    drawn = draw_step(TASKS, RL, "run", "peer", ROOT, step)
    engine = FakeEngine(texts)
    groups = build_groups(engine, drawn, RL, code_limits(RL)).groups
    (prompts, n, seed), = engine.calls
    assert seed == sampling_seed(step_key("run", "peer", ROOT, step)) and n == RL.group_size
    oracle_rewards = []
    for g, task, budget, group_texts, prompt in zip(groups, drawn.tasks, drawn.budgets, texts, prompts):
        assert prompt == [ord(c) for c in task.prompt + f"\n(Think for up to {budget} tokens.)\n"]
        assert prompt_text(task, budget).startswith(task.prompt) and budget in (3, 6)
        # reward by hand: the verifier's score minus alpha * |len - budget| / budget (INTELLECT-2)
        expected = [reversal_reward(t, task.answer) - 0.25 * abs(len(t) + 1 - budget) / budget for t in group_texts]
        assert g.rewards == pytest.approx(expected, abs=1e-12)
        assert g.advantages == pytest.approx(oracle_advantages(expected), rel=1e-9, abs=1e-9)
        oracle_rewards.append(expected)
    oracle = [oracle_advantages(r) for r in oracle_rewards]
    assert all(advantage_results(samples_of(oracle_rewards, oracle), TOLERANCE))
    # the validator blames exactly the sample whose advantage is off by more than the tolerance
    tampered = [list(a) for a in oracle]
    tampered[1][2] += 10 * TOLERANCE
    results = advantage_results(samples_of(oracle_rewards, tampered), TOLERANCE)
    assert [r.reason for r in results] == [Reason.OK] * 6 + [Reason.ADVANTAGE_MISMATCH, Reason.OK]
