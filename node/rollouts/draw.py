"""What a worker must do at a step, derived from (run, peer id, step) so it cannot choose.

INTELLECT-2 seeds each worker's task sampling from its address, a counter and the step, so a worker
cannot pick easy problems. Here every input of a batch that a worker might want to choose is a
hash of (peer id, step, index), and a validator recomputes all of it:

* the tasks: ``node.rl.tasks.draw_task(taskset, peer_id, step, index)`` (the ML core's draw);
* the base sampling seed: :func:`sampling_seed` (per-sequence seeds then follow from
  ``node.engines.sampling.sequence_seed(seed, prompt_index, sample_index)``, so a validator can
  replay the Gumbel-max sampling from its own prefill logits);
* the thinking budget when the length reward is on: :func:`thinking_budget`.

Pure functions; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..hashes import digest

CHERRY_PICK_CANDIDATES = 4  # the "cherry-pick" cheat looks at this many draws per slot


def _hash_int(tag: bytes, *parts: bytes) -> int:
    return int.from_bytes(digest(tag + b"\x00" + b"\x00".join(parts)), "big")


def sampling_seed(run: str, peer_id: str, step: int) -> int:
    """The base sampling seed (63 bits) a worker must use at ``step``."""
    if step < 0:
        raise ValueError("step must be >= 0")
    h = _hash_int(b"swarm-sampling-seed", run.encode(), peer_id.encode(), step.to_bytes(8, "big"))
    return (h >> 193) & ((1 << 63) - 1)  # the top 63 bits of the 256-bit digest


def thinking_budget(budgets: Sequence[int], peer_id: str, step: int, index: int) -> int:
    """The thinking budget (tokens) of prompt ``index`` at ``step``: one of ``budgets``, by hash."""
    if not budgets:
        raise ValueError("no budgets")
    h = _hash_int(b"swarm-thinking-budget", peer_id.encode(), step.to_bytes(8, "big"), index.to_bytes(8, "big"))
    return int(budgets[h % len(budgets)])


@dataclass(frozen=True)
class DrawnStep:
    """Everything a worker must use at one step; a validator rebuilds it from the batch header."""

    step: int
    seed: int  # RolloutBatch.seed
    tasks: list  # node.rl.tasks.Task, by prompt index (RolloutSample.task_id = tasks[i].id)
    budgets: list[int]  # thinking budget per prompt index (RolloutSample.target_length); 0 = none


def draw_step(taskset, rl, run: str, peer_id: str, step: int) -> DrawnStep:
    """The tasks, budgets and seed of ``step`` for ``peer_id`` under the run's ``[rl]`` table."""
    tasks = draw_tasks(taskset, peer_id, step, rl.prompts_per_batch)
    budgets = [thinking_budget(rl.thinking_budgets or [rl.max_new_tokens], peer_id, step, i) if rl.length_reward else 0
               for i in range(len(tasks))]
    return DrawnStep(step, sampling_seed(run, peer_id, step), tasks, budgets)


def prompt_text(task, budget: int) -> str:
    """The prompt a model sees: the task's prompt, plus the thinking-budget line when there is one."""
    from ..rl.rewards import budget_instruction

    return task.prompt + (budget_instruction(budget) if budget else "")


def prompt_ids(tokenizer, task, budget: int) -> list[int]:
    """The prompt's token ids (no special tokens added): what ``RolloutSample.prompt_ids`` must be."""
    return list(tokenizer(prompt_text(task, budget), add_special_tokens=False)["input_ids"])


def draw_tasks(taskset, peer_id: str, step: int, count: int) -> list:
    """The ``count`` tasks of ``step`` for ``peer_id``, index order (``node.rl.tasks.draw_task``)."""
    from ..rl.tasks import draw_task

    return [draw_task(taskset, peer_id, step, i) for i in range(count)]


def cherry_picked_tasks(taskset, peer_id: str, step: int, count: int) -> list:
    """The "cherry-pick" cheat: per slot, the easiest-looking (shortest prompt) of a few draws taken
    at other steps. A validator's task check must reject every batch made this way."""
    from ..rl.tasks import draw_task

    out = []
    for i in range(count):
        candidates = [draw_task(taskset, peer_id, step * CHERRY_PICK_CANDIDATES + c + 1, i)
                      for c in range(CHERRY_PICK_CANDIDATES)]
        out.append(min(candidates, key=lambda t: (len(t.prompt), t.id)))
    return out
