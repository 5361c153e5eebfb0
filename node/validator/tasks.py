"""The run's task set as the validator sees it: the deterministic draw and the verifiers of node/rl.

Glue only: the draw is ``node.rl.tasks.draw_task`` (SHA-256 of set digest, peer id, step, index), the
prompt ``node.rollouts.draw.prompt_text`` (with the ``thinking_budget`` line when the run turns the
length reward on), the rewards ``node.rl.verifiers.task_reward`` and ``node.rl.rewards`` — the same
functions the inference role calls, so honest workers and validators cannot disagree by construction.
"""

from __future__ import annotations

from ..rl.config import RLConfig
from ..rl.rewards import length_penalty
from ..rl.sandbox import Limits
from ..rl.tasks import TaskSet, draw_task, load_taskset
from ..rl.verifiers import task_reward
from ..rollouts.draw import prompt_text, thinking_budget
from .pipeline import DrawnTask, Score


class RunTasks:
    """:class:`node.validator.pipeline.TaskSet` over a node/rl task set and the run's [rl] table."""

    def __init__(self, rl: RLConfig, taskset: TaskSet | None = None) -> None:
        self.rl = rl
        self.taskset = taskset if taskset is not None else load_taskset(rl.taskset)
        self.limits = Limits(wall_s=rl.code_timeout_s, cpu_s=max(1, int(rl.code_timeout_s)),
                             memory_mb=rl.code_memory_mb, output_kb=rl.code_output_kb)

    def draw(self, worker: str, step: int, index: int) -> DrawnTask:
        task = draw_task(self.taskset, worker, step, index)
        budget = thinking_budget(self.rl.thinking_budgets or [self.rl.max_new_tokens], worker, step, index) \
            if self.rl.length_reward else 0
        return DrawnTask(task.id, prompt_text(task, budget), budget, task)

    def score(self, task: DrawnTask, completion_text: str, completion_tokens: int) -> Score:
        r = float(task_reward(task.data, completion_text, self.limits))
        penalty = self.rl.length_alpha * length_penalty(completion_tokens, task.target_length) if task.target_length else 0.0
        return Score(r, penalty, r - penalty)
