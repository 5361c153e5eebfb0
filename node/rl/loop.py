"""The whole RL loop in one process, no networking: draw -> sample -> score -> GRPO step -> repeat.

Used to check that a model + task + hyper-parameters learn at all (``swarm-node rl-local``), by the
benchmarks, and as the reference the networked loop must match: the same rules (node/rl/spec.py), the
same builder (``rollout.build_groups``, via ``rollout.make_groups``) and ``grpo.train_step`` run inside
the inference and trainer roles, only with the network in between.

Synchronous by default (async level 0): the engine samples from the very weights being trained.
With ``async_level`` k > 0, step s samples from the weights of version max(0, s - k) (a copy of the
model that lags k steps, as INTELLECT-2's workers do when the trainer runs k steps ahead of the
checkpoints they hold, §3) and trains the current weights on those samples with their own
log-probs, so the levels can be compared on the same seeds (bench/async_levels.py).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .config import GRPOConfig, RLConfig
from .grpo import make_optimizer, train_step
from .rollout import make_groups, train_samples
from .spec import code_limits, prompt_ids, task_rewards
from .tasks import TaskSet


@dataclass
class LoopStep:
    step: int
    mean_reward: float  # over every sample of the step (before filtering)
    groups_with_signal: int
    samples_trained: int
    entropy: float
    clip_frac: float
    seconds: float  # wall time of this step (generate + score + train)
    policy_version: int = 0  # version the step's rollouts were sampled from (step - async_level, at least 0)
    masked_frac: float = 0.0  # tokens the [grpo] loss clipped or masked (node/rl/losses.py)
    mismatch_kl: float = 0.0  # k3 KL(sampler || trained weights) over the step's tokens


def run_local_loop(engine, taskset: TaskSet, rl: RLConfig, grpo: GRPOConfig, steps: int, *,
                   peer_id: str = "local", seed: int = 0, max_seconds: float | None = None,
                   clock: Callable[[], float] = time.monotonic,
                   on_step: Callable[[LoopStep], None] | None = None, async_level: int = 0) -> list[LoopStep]:
    """Run up to ``steps`` rollout steps (or until ``max_seconds``), training ``engine.model`` in place
    (sampling from a copy that lags ``async_level`` versions, see the module docstring)."""
    model = engine.model
    opt, sched = make_optimizer(model, grpo)
    pad = engine.tokenizer.pad_token_id or 0
    history: list[LoopStep] = []
    sampler = engine
    versions: deque = deque(maxlen=async_level + 1)  # state dicts of the last async_level + 1 versions
    if async_level:
        sampler = copy.copy(engine)
        sampler.model = copy.deepcopy(model)
    start = clock()
    for step in range(steps):
        t0 = clock()
        version = step
        if async_level:
            versions.append({k: v.detach().clone() for k, v in model.state_dict().items()})  # version `step`
            version = max(0, step - async_level)
            sampler.model.load_state_dict(versions[0])  # the oldest kept: version step - async_level
        groups = make_groups(sampler, taskset, rl, peer_id, step, seed=seed * 1_000_003 + step)
        rewards = [r for g in groups for r in g.rewards]
        batch = train_samples(groups, version=version)
        stats = train_step(model, opt, sched, batch, grpo, pad_id=pad, version=step)
        rec = LoopStep(step, statistics.fmean(rewards), sum(g.has_signal for g in groups), len(batch),
                       stats.entropy, stats.clip_frac, clock() - t0, version, stats.masked_frac, stats.mismatch_kl)
        history.append(rec)
        if on_step is not None:
            on_step(rec)
        if max_seconds is not None and clock() - start >= max_seconds:
            break
    return history


def greedy_score(engine, taskset: TaskSet, rl: RLConfig, count: int = 64) -> float:
    """Mean task reward of greedy (temperature 0) completions on ``count`` of the set's evaluation
    tasks (a file's first ones; reasoning-gym's held-out seeds, node/rl/gym.py).

    Separates learning from sharpening: sampled reward also rises when the policy merely gets more
    confident in what greedy decoding already answers; greedy reward rises only when answers improve.
    """
    tasks = taskset.evaluation(count)
    prompts = [prompt_ids(engine.tokenizer, t, 0, rl) for t in tasks]
    groups = engine.generate(prompts, 1, 0.0, 1.0, rl.max_new_tokens, seed=0, capture_hidden=False)
    return statistics.fmean(task_rewards(tasks, [g[0].text for g in groups], rl, code_limits(rl)))
