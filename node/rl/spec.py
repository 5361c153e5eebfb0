"""The one rollout spec: what an honest rollout step is, for everyone who builds or checks one.

The inference role's generator (node/inference/generate.py), the validator (node/validator/), the
local loop (``swarm-node rl-local``, node/rl/loop.py) and the test helpers all import these
definitions; nothing else restates them, so a worker and a validator cannot drift apart.

How a step is defined (DESIGN.md "The loop", steps 3-4; INTELLECT-2 report §3):

1. **Draw.** Every input a worker might want to choose is a hash of the step key
   (:func:`step_key`: run, peer id, root of the claimed checkpoint's manifest, step) and the prompt
   index: the tasks (:func:`draw_tasks`, ``node.rl.tasks.draw_task``), the base sampling seed
   (:func:`sampling_seed`; per-sequence seeds follow from ``node.engines.sampling.sequence_seed``)
   and, when the length reward is on, each prompt's thinking budget (:func:`thinking_budget`).
   :func:`draw_step` returns all of it for one step. The steps a worker may use are bounded by the
   step window (node/rollouts/steps.py), so it cannot shop among thousands of steps' draws.
2. **Prompt.** The task's prompt plus the thinking-budget line when there is one
   (:func:`prompt_text`), rendered as the model expects it (:func:`render_prompt`): through the
   tokenizer's chat template when it has one and the run's ``[rl] chat_template`` is ``auto``
   (system turn, user turn, generation prompt), else raw; then the prefilled answer tag when the
   run sets ``[rl] answer_prefill`` (:func:`answer_prefill`); then tokenised without adding special
   tokens (:func:`prompt_ids`). The run pins the inputs (its system prompt and template mode; the
   template travels in every checkpoint's tokenizer), so a worker that renders otherwise sends
   prompt tokens the validator's rendering does not give: ``wrong_prompt``.
3. **Score.** The task's verifier (``node.rl.verifiers.task_reward``, code run in the sandbox
   under :func:`code_limits`; reasoning-gym's scorers in the bounded scoring server under
   :func:`score_bound`) minus ``length_alpha`` times the length penalty
   (:func:`length_penalty`) when the prompt stated a budget (:func:`score`).
4. **Advantages.** Group-relative: (r - mean) / (std + 1e-6) over the G completions of a prompt
   (:func:`group_advantages`); a group without signal (:func:`has_signal`) teaches nothing.
5. **Log-probs.** log softmax(logits / T) at the sampled token over the full vocabulary
   (:func:`token_logprobs`), the quantity the trainer's importance ratio is taken over.

Pure: no I/O, no clock (the code verifier's sandbox is the verifier's business, not this module's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..hashes import digest
from . import gym
from .bounded import Bound
from .config import RLConfig
from .sandbox import Limits
from .tasks import Task, TaskSet, draw_task
from .verifiers import task_reward

ADV_EPS = 1e-6  # INTELLECT-2 / GRPO: (r - mean) / (std + 1e-6)


# --------------------------------------------------------------------------------------------
# 1. Draw


def _hash_int(tag: bytes, *parts: bytes) -> int:
    return int.from_bytes(digest(tag + b"\x00" + b"\x00".join(parts)), "big")


# Offline use (``rl-local``, ``swarm-node rollout``): no trainer published a manifest, so no root.
OFFLINE_ROOT = bytes(32)


def step_key(run: str, peer_id: str, policy_root: bytes, step: int) -> bytes:
    """The 32-byte key every draw of a worker's step is a hash of.

    ``policy_root`` is the root (manifest id, node/shards/manifest.py) of the checkpoint version the
    batch claims as ``policy_version``: a draw cannot be computed before that version is published,
    and a step's draw is another one under every version, so a worker cannot scan and pre-solve
    draws offline. The run name is in it so that one key in two runs gets different tasks. Which
    steps a worker may use at all is node/rollouts/steps.py's rule (the step window).
    """
    if step < 0:
        raise ValueError("step must be >= 0")
    if len(policy_root) != 32:
        raise ValueError("a policy root is 32 bytes")
    run_b, peer_b = run.encode(), peer_id.encode()
    return digest(b"swarm-step-key\x00" + len(run_b).to_bytes(2, "big") + run_b + len(peer_b).to_bytes(2, "big")
                  + peer_b + policy_root + step.to_bytes(8, "big"))


def sampling_seed(key: bytes) -> int:
    """The base sampling seed (63 bits) a worker must use at the step of :func:`step_key` ``key``."""
    h = _hash_int(b"swarm-sampling-seed", key)
    return (h >> 193) & ((1 << 63) - 1)  # the top 63 bits of the 256-bit digest


def thinking_budget(budgets: Sequence[int], key: bytes, index: int) -> int:
    """The thinking budget (tokens) of prompt ``index`` of the step ``key``: one of ``budgets``, by hash."""
    if not budgets:
        raise ValueError("no budgets")
    h = _hash_int(b"swarm-thinking-budget", key, index.to_bytes(8, "big"))
    return int(budgets[h % len(budgets)])


def drawn_budget(rl: RLConfig, key: bytes, index: int) -> int:
    """Prompt ``index``'s thinking budget under the run's ``[rl]`` table; 0 when the length reward is off."""
    if not rl.length_reward:
        return 0
    return thinking_budget(rl.thinking_budgets or [rl.max_new_tokens], key, index)


def draw_tasks(taskset: TaskSet, key: bytes, count: int) -> list[Task]:
    """The ``count`` tasks of the step ``key``, index order (``node.rl.tasks.draw_task``)."""
    return [draw_task(taskset, key, i) for i in range(count)]


@dataclass(frozen=True)
class DrawnStep:
    """Everything a worker must use at one step; a validator rebuilds it from the batch header."""

    step: int
    seed: int  # RolloutBatch.seed
    tasks: list[Task]  # by prompt index (RolloutSample.task_id = tasks[i].id)
    budgets: list[int]  # thinking budget per prompt index (RolloutSample.target_length); 0 = none


def draw_step(taskset: TaskSet, rl: RLConfig, run: str, peer_id: str, policy_root: bytes, step: int) -> DrawnStep:
    """The tasks, budgets and seed of ``step`` for ``peer_id`` on the checkpoint whose manifest root is
    ``policy_root``, under the run's ``[rl]`` table: all ``prompts_per_batch`` of them, and a batch
    must hold every one (node/validator/pipeline.py ``check_groups``)."""
    key = step_key(run, peer_id, policy_root, step)
    tasks = draw_tasks(taskset, key, rl.prompts_per_batch)
    budgets = [drawn_budget(rl, key, i) for i in range(len(tasks))]
    return DrawnStep(step, sampling_seed(key), tasks, budgets)


# --------------------------------------------------------------------------------------------
# 2. Prompt


def budget_instruction(budget: int) -> str:
    """The text appended to a prompt to state its thinking budget."""
    return f"\n(Think for up to {budget} tokens.)\n"


def prompt_text(task: Task, budget: int) -> str:
    """The prompt a model sees: the task's prompt, plus the thinking-budget line when there is one."""
    return task.prompt + (budget_instruction(budget) if budget else "")


def system_prompt(rl: RLConfig) -> str:
    """The run's system prompt: its own, or for reasoning-gym the answer-format instruction (without
    an example answer when the tag is prefilled)."""
    if rl.system_prompt:
        return rl.system_prompt
    if rl.taskset != gym.NAME:
        return ""
    return gym.PREFILL_INSTRUCTION if rl.answer_prefill else gym.ANSWER_INSTRUCTION


def uses_chat_template(tokenizer, rl: RLConfig) -> bool:
    """Whether prompts go through ``tokenizer``'s chat template under the run's ``[rl] chat_template``."""
    return rl.chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, task: Task, budget: int, rl: RLConfig) -> str:
    """The prompt as text, as the model expects it (module docstring, step 2).

    With the chat template: [system (when there is one), user] and the generation prompt. Without:
    today's raw prompt, after the system prompt and a blank line when there is one.
    """
    text, system, chat = prompt_text(task, budget), system_prompt(rl), uses_chat_template(tokenizer, rl)
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        rendered = f"{system}\n\n{text}" if system else text
    return rendered + answer_prefill(rl, chat)


def answer_prefill(rl: RLConfig, chat: bool) -> str:
    """The start of the model's answer that the prompt already holds (``[rl] answer_prefill``): the
    reasoning-gym answer tag, on a line of its own after a raw prompt."""
    if not rl.answer_prefill:
        return ""
    return gym.ANSWER_OPEN if chat else "\n" + gym.ANSWER_OPEN


def prompt_ids(tokenizer, task: Task, budget: int, rl: RLConfig) -> list[int]:
    """The prompt's token ids (the rendering's own special tokens, none added): what
    ``RolloutSample.prompt_ids`` must be."""
    return list(tokenizer(render_prompt(tokenizer, task, budget, rl), add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------------------------
# 3. Score


def code_limits(rl: RLConfig) -> Limits:
    """The sandbox limits of code tasks under the run's ``[rl]`` table (CPU seconds: at least 1)."""
    return Limits(wall_s=rl.code_timeout_s, cpu_s=max(1, int(rl.code_timeout_s)),
                  memory_mb=rl.code_memory_mb, output_kb=rl.code_output_kb)


def score_bound(rl: RLConfig) -> Bound:
    """The time and memory bound of one scoring call on untrusted text (node/rl/bounded.py)."""
    return Bound(rl.score_timeout_s, rl.score_memory_mb)


def length_penalty(num_tokens: int, budget: int) -> float:
    """Distance from the thinking budget, normalised by the budget: |len - budget| / budget.

    INTELLECT-2 puts a target length in the prompt ("think for N tokens") and subtracts
    ``alpha * |len - target|`` from the task reward so a model learns to respect a thinking budget.
    """
    if budget <= 0:
        raise ValueError("budget must be positive")
    return abs(num_tokens - budget) / budget


@dataclass(frozen=True)
class Scored:
    """A verifier's judgement of one completion."""

    task_reward: float  # the verifier's score
    length_penalty: float = 0.0  # subtracted from the task reward (INTELLECT-2 length reward)
    target_length: int = 0  # thinking budget given in the prompt, 0 = none

    @property
    def reward(self) -> float:
        return self.task_reward - self.length_penalty


def with_length_penalty(task_reward: float, num_tokens: int, budget: int, rl: RLConfig) -> Scored:
    """A verifier reward of a completion of ``num_tokens`` tokens, with the run's length penalty."""
    penalty = rl.length_alpha * length_penalty(num_tokens, budget) if budget else 0.0
    return Scored(task_reward, penalty, budget)


def score(task: Task, completion_text: str, num_tokens: int, budget: int, rl: RLConfig, limits: Limits) -> Scored:
    """One completion's reward: the task's verifier, minus the length penalty when a budget was stated."""
    return score_many([(task, completion_text, num_tokens, budget)], rl, limits)[0]


def task_rewards(tasks: Sequence[Task], texts: Sequence[str], rl: RLConfig, limits: Limits) -> list[float]:
    """The verifier's reward of each (task, completion) pair; reasoning-gym's all in one bounded batch."""
    gym_at = [i for i, t in enumerate(tasks) if t.kind == gym.KIND]
    out = [0.0 if t.kind == gym.KIND else float(task_reward(t, x, limits)) for t, x in zip(tasks, texts)]
    for i, r in zip(gym_at, gym.score_calls([tasks[i] for i in gym_at], [texts[i] for i in gym_at], score_bound(rl),
                                            rl.format_reward, rl.answer_prefill)):
        out[i] = r
    return out


def score_many(jobs: Sequence[tuple[Task, str, int, int]], rl: RLConfig, limits: Limits) -> list[Scored]:
    """:func:`score` of each (task, completion text, completion tokens, budget)."""
    rewards = task_rewards([j[0] for j in jobs], [j[1] for j in jobs], rl, limits)
    return [with_length_penalty(r, n, b, rl) for r, (_, _, n, b) in zip(rewards, jobs)]


# --------------------------------------------------------------------------------------------
# 4. Advantages


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO advantages of one group: (r - mean) / (std + 1e-6).

    ``std`` is the population standard deviation (divide by G, not G - 1): a group of one gets
    advantage 0 instead of a division by zero degrees of freedom. A group whose rewards are all
    equal gets all-zero advantages. Rewards must be finite (a batch's are bounded by its schema).
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


# --------------------------------------------------------------------------------------------
# 5. Log-probs


def token_logprobs(logits, tokens, temperature: float):
    """(T, V) logits, (T,) tokens -> (T,) float32 log-probs under softmax(logits / temperature).

    The definition the inference engine, the trainer and the validator share: the
    temperature-scaled full distribution, before any top-p/top-k truncation (the quantity GRPO's
    ratio is taken over; the INTELLECT-2 recipe divides logits by the sampling temperature).
    Takes torch tensors (their own methods: this module does not import torch).
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    logp = (logits.float() / temperature).log_softmax(dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
