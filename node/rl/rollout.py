"""From drawn tasks to scored groups: the inference side of one rollout step, without networking.

``make_groups`` draws ``prompts_per_batch`` tasks for (peer, step), samples ``group_size``
completions each with an engine, scores them with the verifiers (plus the optional length reward) and
computes group-relative advantages. The networked inference role wraps this and adds proofs,
signing and submission; the local loop (``node.rl.loop``) feeds it straight to ``train_step``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import RLConfig
from .grpo import TrainSample
from .rewards import budget_instruction, combined_reward, group_advantages, has_signal
from .sandbox import Limits
from .tasks import Task, TaskSet, draw_task
from .verifiers import task_reward


@dataclass
class ScoredGroup:
    """G completions of one task with their rewards and advantages."""

    task: Task
    draw_index: int  # the counter used in draw_task(taskset, peer, step, draw_index)
    prompt_ids: list[int]
    samples: list  # node.engines.base.Sample
    task_rewards: list[float]
    rewards: list[float]  # task reward combined with the length reward (if on)
    advantages: list[float]
    budget: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def has_signal(self) -> bool:
        return has_signal(self.rewards)


def thinking_budget(cfg: RLConfig, peer_id: str, step: int, index: int) -> int | None:
    """The budget stated in the prompt when the length reward is on (else None).

    Drawn by hash like the task so a node cannot choose it: the inference role's own rule
    (``node.rollouts.draw.thinking_budget``), reused so the local loop and the swarm agree.
    """
    if not cfg.length_reward:
        return None
    from ..rollouts.draw import thinking_budget as drawn_budget

    return drawn_budget(cfg.thinking_budgets or [cfg.max_new_tokens], peer_id, step, index)


def encode_prompt(tokenizer, task: Task, budget: int | None) -> list[int]:
    text = task.prompt + (budget_instruction(budget) if budget is not None else "")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def code_limits(cfg: RLConfig) -> Limits:
    return Limits(wall_s=cfg.code_timeout_s, cpu_s=max(1, int(cfg.code_timeout_s)),
                  memory_mb=cfg.code_memory_mb, output_kb=cfg.code_output_kb)


def score(task: Task, samples: list, cfg: RLConfig, budget: int | None) -> tuple[list[float], list[float]]:
    """(task rewards, combined rewards) of one group."""
    limits = code_limits(cfg)
    task_r = [task_reward(task, s.text, limits) for s in samples]
    total = [combined_reward(r, s.num_tokens, budget, cfg.length_alpha) for r, s in zip(task_r, samples)]
    return task_r, total


def make_groups(engine, taskset: TaskSet, cfg: RLConfig, peer_id: str, step: int, seed: int,
                first_index: int = 0) -> list[ScoredGroup]:
    """Draw, sample and score ``cfg.prompts_per_batch`` groups for (peer, step)."""
    tok = engine.tokenizer
    indices = list(range(first_index, first_index + cfg.prompts_per_batch))
    tasks = [draw_task(taskset, peer_id, step, i) for i in indices]
    budgets = [thinking_budget(cfg, peer_id, step, i) for i in indices]
    prompts = [encode_prompt(tok, t, b) for t, b in zip(tasks, budgets)]
    groups = engine.generate(prompts, cfg.group_size, cfg.temperature, cfg.top_p, cfg.max_new_tokens, seed)
    out = []
    for i, t, b, p, samples in zip(indices, tasks, budgets, prompts, groups):
        task_r, total = score(t, samples, cfg, b)
        out.append(ScoredGroup(t, i, p, samples, task_r, total, group_advantages(total), b))
    return out


def train_samples(groups: list[ScoredGroup], version: int = 0) -> list[TrainSample]:
    """Samples of the groups that carry signal (zero-advantage groups are dropped: online filtering)."""
    out = []
    for g in groups:
        if not g.has_signal:
            continue
        for s, a in zip(g.samples, g.advantages):
            out.append(TrainSample(g.prompt_ids, s.completion_ids, s.logprobs, a, version))
    return out
