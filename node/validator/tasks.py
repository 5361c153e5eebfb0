"""The run's task set as the validator sees it: the rollout spec of node/rl/spec.py, nothing else.

Glue only: the draw, the prompt (with the thinking-budget line when the run turns the length reward
on, rendered through the checkpoint's chat template as the run says), the sandbox limits and the
score are ``node.rl.spec``'s — the same functions the inference role's
generator calls, so honest workers and validators cannot disagree by construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..rl import spec
from ..rl.config import RLConfig
from ..rl.rollout import SCORING_THREADS
from ..rl.tasks import TaskSet, draw_task, load_run_tasks
from .pipeline import DrawnTask, Score


class RunTasks:
    """:class:`node.validator.pipeline.TaskSet` over a node/rl task set and the run's [rl] table."""

    def __init__(self, rl: RLConfig, taskset: TaskSet | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rl = rl
        self.clock = clock  # seconds, for the scoring budget (tests pass a fake one)
        self.taskset = taskset if taskset is not None else load_run_tasks(rl)
        self.limits = spec.code_limits(rl)

    def draw(self, key: bytes, index: int) -> DrawnTask:
        task = draw_task(self.taskset, key, index)
        budget = spec.drawn_budget(self.rl, key, index)
        return DrawnTask(task.id, spec.prompt_text(task, budget), budget, task)

    def score(self, task: DrawnTask, completion_text: str, completion_tokens: int) -> Score:
        return self._score([(task, completion_text, completion_tokens)])[0]

    def score_many(self, jobs: Sequence[tuple[DrawnTask, str, int]], budget_s: float) -> list[Score | None]:
        """Reasoning-gym and other in-process verifiers in one bounded call; code tasks in sandboxes
        ``SCORING_THREADS`` at a time (they mostly wait, as the inference side's), none started once
        ``budget_s`` has passed (each started one may still run its own time limit)."""
        out: list[Score | None] = [None] * len(jobs)
        code = [i for i, (task, _, _) in enumerate(jobs) if task.data.kind == "code"]
        rest = [i for i, (task, _, _) in enumerate(jobs) if task.data.kind != "code"]
        start = self.clock()
        if rest:
            for i, sc in zip(rest, self._score([jobs[i] for i in rest])):
                out[i] = sc

        def within_budget(i: int) -> Score | None:
            return self._score([jobs[i]])[0] if self.clock() - start < budget_s else None

        if code:
            with ThreadPoolExecutor(max_workers=SCORING_THREADS) as pool:
                for i, sc in zip(code, pool.map(within_budget, code)):
                    out[i] = sc
        return out

    def _score(self, jobs: Sequence[tuple[DrawnTask, str, int]]) -> list[Score]:
        scored = spec.score_many([(t.data, text, n, t.target_length) for t, text, n in jobs], self.rl, self.limits)
        return [Score(sc.task_reward, sc.length_penalty, sc.reward) for sc in scored]

    def prompt_ids(self, task: DrawnTask, tokenizer) -> list[int]:
        return spec.prompt_ids(tokenizer, task.data, task.target_length, self.rl)
