"""The one rollout builder: a drawn step -> sampled, scored and normalised groups, without networking.

:func:`build_groups` prompts the engine with a :class:`~node.rl.spec.DrawnStep`'s tasks, samples
``group_size`` completions each, scores them and computes group-relative advantages, all by the
rules of node/rl/spec.py. The inference role's generator (node/inference/generate.py) adds proofs,
signing and submission on top; the local loop (``node.rl.loop``, :func:`make_groups`) feeds the
groups straight to ``train_step``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from .config import RLConfig
from .grpo import TrainSample
from .sandbox import Limits
from .spec import (OFFLINE_ROOT, DrawnStep, Scored, code_limits, draw_step, group_advantages, has_signal, prompt_ids,
                   score_many)
from .tasks import Task, TaskSet

SCORING_THREADS = 4  # code-task sandboxes run at once (each is a subprocess with its own limits)


@dataclass
class ScoredGroup:
    """G completions of one task with their scores and advantages."""

    task: Task
    prompt_ids: list[int]
    samples: list  # node.engines.base.Sample
    scores: list[Scored]
    advantages: list[float]
    budget: int = 0  # thinking budget stated in the prompt, 0 = none

    @property
    def task_rewards(self) -> list[float]:
        return [sc.task_reward for sc in self.scores]

    @property
    def rewards(self) -> list[float]:
        """Task reward minus the length penalty (if on): what the advantages are computed from."""
        return [sc.reward for sc in self.scores]

    @property
    def has_signal(self) -> bool:
        return has_signal(self.rewards)


@dataclass
class BuiltStep:
    """The groups of one step and where the time went."""

    groups: list[ScoredGroup]
    generate_s: float  # sampling (with hidden-state capture when asked)
    score_s: float  # verifiers


def build_groups(engine, drawn: DrawnStep, rl: RLConfig, limits: Limits, *, capture_hidden: bool = True,
                 clock: Callable[[], float] = time.perf_counter) -> BuiltStep:
    """Sample ``rl.group_size`` completions per drawn task with ``drawn.seed``, score and normalise them."""
    prompts = [prompt_ids(engine.tokenizer, t, b, rl) for t, b in zip(drawn.tasks, drawn.budgets)]
    t0 = clock()
    groups = engine.generate(prompts, n=rl.group_size, temperature=rl.temperature, top_p=rl.top_p,
                             max_new_tokens=rl.max_new_tokens, seed=drawn.seed, capture_hidden=capture_hidden)
    t1 = clock()
    scores = score_groups(drawn, groups, rl, limits)
    out = [ScoredGroup(t, p, samples, sc, group_advantages([s.reward for s in sc]), b)
           for t, b, p, samples, sc in zip(drawn.tasks, drawn.budgets, prompts, groups, scores)]
    return BuiltStep(out, t1 - t0, clock() - t1)


def score_groups(drawn: DrawnStep, groups: list[list], rl: RLConfig, limits: Limits) -> list[list[Scored]]:
    """Scores per group. Code tasks run in sandboxed subprocesses that mostly wait (on their time
    limits or on the OS), so they are scored ``SCORING_THREADS`` at a time; others in one batch
    (reasoning-gym's: one bounded scoring batch, node/rl/bounded.py)."""
    jobs = [(task, s.text, s.num_tokens, budget) for task, budget, group in zip(drawn.tasks, drawn.budgets, groups)
            for s in group]
    if any(job[0].kind == "code" for job in jobs):
        with ThreadPoolExecutor(max_workers=SCORING_THREADS) as pool:
            flat = list(pool.map(lambda job: score_many([job], rl, limits)[0], jobs))
    else:
        flat = score_many(jobs, rl, limits)
    it = iter(flat)
    return [[next(it) for _ in group] for group in groups]


def make_groups(engine, taskset: TaskSet, cfg: RLConfig, peer_id: str, step: int, seed: int) -> list[ScoredGroup]:
    """Draw, sample and score ``cfg.prompts_per_batch`` groups for (peer, step), sampling from ``seed``."""
    drawn = replace(draw_step(taskset, cfg, "", peer_id, OFFLINE_ROOT, step), seed=seed)  # rl-local picks its own seed
    return build_groups(engine, drawn, cfg, code_limits(cfg)).groups


def train_samples(groups: list[ScoredGroup], version: int = 0) -> list[TrainSample]:
    """Samples of the groups that carry signal (zero-advantage groups are dropped: online filtering)."""
    out = []
    for g in groups:
        if not g.has_signal:
            continue
        for s, a in zip(g.samples, g.advantages):
            out.append(TrainSample(g.prompt_ids, s.completion_ids, s.logprobs, a, version))
    return out
