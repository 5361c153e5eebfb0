"""The run's task set as the validator sees it: the rollout spec of node/rl/spec.py, nothing else.

Glue only: the draw, the prompt (with the thinking-budget line when the run turns the length reward
on, rendered through the checkpoint's chat template as the run says), the sandbox limits and the
score are ``node.rl.spec``'s — the same functions the inference role's
generator calls, so honest workers and validators cannot disagree by construction.
"""

from __future__ import annotations

from ..rl import spec
from ..rl.config import RLConfig
from ..rl.tasks import TaskSet, draw_task, load_run_tasks
from .pipeline import DrawnTask, Score


class RunTasks:
    """:class:`node.validator.pipeline.TaskSet` over a node/rl task set and the run's [rl] table."""

    def __init__(self, rl: RLConfig, taskset: TaskSet | None = None) -> None:
        self.rl = rl
        self.taskset = taskset if taskset is not None else load_run_tasks(rl)
        self.limits = spec.code_limits(rl)

    def draw(self, key: bytes, index: int) -> DrawnTask:
        task = draw_task(self.taskset, key, index)
        budget = spec.drawn_budget(self.rl, key, index)
        return DrawnTask(task.id, spec.prompt_text(task, budget), budget, task)

    def score(self, task: DrawnTask, completion_text: str, completion_tokens: int) -> Score:
        sc = spec.score(task.data, completion_text, completion_tokens, task.target_length, self.rl, self.limits)
        return Score(sc.task_reward, sc.length_penalty, sc.reward)

    def prompt_ids(self, task: DrawnTask, tokenizer) -> list[int]:
        return spec.prompt_ids(tokenizer, task.data, task.target_length, self.rl)
