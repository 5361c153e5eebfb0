"""Typed run-file tables of the ML core: ``[rl]`` (tasks and rollouts), ``[grpo]`` (the update) and
``[inference]`` (the engine). Kept free of torch so ``node.config`` can import it cheaply.

Defaults follow the INTELLECT-2 report (Prime Intellect, 2025) where it gives one; values sized for
the tiny CPU demo say so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TASK_KINDS = ("synthetic", "math", "code")
CHAT_TEMPLATE_MODES = ("auto", "none")
ENGINES = ("auto", "torch", "vllm")
ENGINE_NAMES = ("torch", "vllm")  # what a batch may state (RolloutBatch.engine)
# Engines whose sampling is node.engines.sampling's seeded Gumbel-max, so a validator can replay it:
# the vLLM engine samples with it too, as a logits processor (node/engines/vllm_gumbel.py).
REPLAYABLE_ENGINES = ("torch", "vllm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DECODE_MODES = ("auto", "dynamic", "static", "compiled")  # node.engines.torch_engine.DECODE_MODES
LOSSES = ("intellect2", "dppo-tv", "tis")  # node/rl/losses.py


@dataclass
class RLConfig:
    """``[rl]``: which tasks a node draws and how it samples and scores them."""

    taskset: str = "synthetic"  # packaged set name (synthetic | math | code), "reasoning-gym", or a path to a JSONL file
    taskset_sha256: str = ""  # SHA-256 (hex) of the task file: required for a file path; a node whose file differs refuses
    # reasoning-gym generators, when taskset = "reasoning-gym": name -> {weight = 1, <the generator's options>}
    # (node/rl/gym.py; only audited generators). Their version is part of the run: a node with another refuses.
    reasoning_gym: dict[str, dict] = field(default_factory=dict)
    reasoning_gym_version: str = "0.1.25"  # the reasoning-gym release every node must have installed
    # Prompts: with chat_template = "auto" a model whose tokenizer has a chat template gets
    # [system, user] rendered through it with the generation prompt; "none" (or a model without a
    # template) gets the raw text, the system prompt as its first paragraph (node/rl/spec.py).
    chat_template: str = "auto"  # auto | none
    system_prompt: str = ""  # "" = none, or for reasoning-gym its answer-format instruction (node/rl/gym.py; no example answer with answer_prefill)
    # reasoning-gym: share of the reward paid for one well-formed <answer>...</answer>, right or not
    # (r = (1 - f) * score + f * tagged): a model that never writes the tag gets a signal to learn it. 0 = off.
    format_reward: float = 0.0
    # reasoning-gym: the assistant's turn starts with "<answer>" (part of the prompt), so the completion is
    # the answer itself, up to "</answer>" or its end: a small model that never writes the tag still answers.
    answer_prefill: bool = False
    score_timeout_s: float = 2.0  # wall-clock bound of one scoring call on untrusted text (node/rl/bounded.py)
    score_memory_mb: int = 256  # memory bound of one scoring call, beyond the scorer's own size
    group_size: int = 16  # G: completions sampled per prompt (INTELLECT-2: 16; the demo uses fewer)
    prompts_per_batch: int = 4  # prompts drawn per rollout batch
    max_new_tokens: int = 16  # completion length cap (tokens)
    temperature: float = 1.0  # sampling temperature (the trainer divides logits by the same value)
    top_p: float = 1.0  # nucleus sampling mass; 1.0 = off
    length_reward: bool = False  # add INTELLECT-2's length reward with a thinking budget (off by default)
    length_alpha: float = 0.1  # weight of the length term: r = r_task - alpha * |len - budget| / budget
    thinking_budgets: list[int] | None = None  # budgets (tokens) a task may draw; None = [max_new_tokens]
    code_timeout_s: float = 5.0  # wall-clock limit of one code-task run (CPU limit is the same)
    code_memory_mb: int = 512  # address-space limit of one code-task run (RLIMIT_AS)
    code_output_kb: int = 64  # stdout+stderr kept from one code-task run

    def validate(self) -> None:
        if self.group_size < 2:
            raise ValueError("group_size: at least 2 (advantages are relative to the group)")
        if self.prompts_per_batch < 1:
            raise ValueError("prompts_per_batch: at least 1")
        if not 1 <= self.max_new_tokens <= 32768:
            raise ValueError("max_new_tokens: 1..32768")
        if self.temperature <= 0:
            raise ValueError("temperature: must be > 0 for RL sampling")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p: in (0, 1]")
        if self.length_alpha < 0:
            raise ValueError("length_alpha: must be >= 0")
        if self.thinking_budgets is not None and any(b < 1 for b in self.thinking_budgets):
            raise ValueError("thinking_budgets: every budget >= 1")
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat_template: one of {', '.join(CHAT_TEMPLATE_MODES)}")
        if len(self.system_prompt) > 8192:
            raise ValueError("system_prompt: at most 8192 characters")
        if self.taskset_sha256 and not re.fullmatch(r"[0-9a-fA-F]{64}", self.taskset_sha256):
            raise ValueError("taskset_sha256: 64 hex digits (sha256sum of the task file)")
        if self.answer_prefill and self.taskset != "reasoning-gym":
            raise ValueError("answer_prefill: only with taskset = \"reasoning-gym\" (its answers are tagged)")
        if not 0 <= self.format_reward < 1:
            raise ValueError("format_reward: in [0, 1)")
        if not 0 < self.score_timeout_s <= 600 or self.score_memory_mb < 16:
            raise ValueError("score limits: 0 < score_timeout_s <= 600, score_memory_mb >= 16")
        if self.code_timeout_s <= 0 or self.code_memory_mb < 16 or self.code_output_kb < 1:
            raise ValueError("code limits: timeout > 0, memory >= 16 MB, output >= 1 KB")


@dataclass
class GRPOConfig:
    """``[grpo]``: the policy update (INTELLECT-2 recipe; tiny-model values noted)."""

    # The policy term (node/rl/losses.py): intellect2 (two-sided clip, epsilon and delta) | dppo-tv
    # (prime-rl's probability-difference masking, tv_bound and tv_tau) | tis (truncated importance sampling, tis_cap).
    loss: str = "intellect2"  # intellect2 | dppo-tv | tis: the policy term every trainer of the run uses
    epsilon: float = 0.2  # PPO clip: ratio clipped to [1 - eps, 1 + eps]
    delta: float = 4.0  # two-sided clip: for negative advantages the ratio is bounded above by delta
    tv_bound: float = 0.2  # dppo-tv: mask a token once p_trainer - p_engine passes this in the advantage's direction
    tv_tau: float = 1e-3  # dppo-tv: weight of tau * log(ratio)^2 on every token (Kimi K2.5)
    tis_cap: float = 2.0  # tis: importance weights truncated at this value (Yao et al. 2025 use 2)
    kl_coef: float = 0.001  # weight of the KL penalty to the reference policy (0 = no reference model)
    entropy_coef: float = 1e-4  # entropy bonus weight
    lr: float = 3e-4  # peak learning rate (INTELLECT-2: 3e-7 at 32B). Tuned on the tiny demo model:
    #                   3e-3 collapses its entropy and the reward falls; 5e-4 peaks early then sags;
    #                   3e-4 kept rising for 200 steps (0.18 -> 0.47 mean reward)
    warmup_steps: int = 5  # linear lr warm-up, in optimizer steps (INTELLECT-2: 25)
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient-norm clip (INTELLECT-2: 0.1 at 32B scale)
    optimizer_steps: int = 4  # optimizer steps per rollout step: the batch is split in this many parts
    pack_length: int = 512  # tokens per packed row (INTELLECT-2: 32k)
    micro_batch_tokens: int = 2048  # tokens in one forward/backward pass (whole rows); a bigger mini-batch accumulates gradients over several, so memory grows with this, not with the step's samples
    temperature: float = 1.0  # logits are divided by the sampling temperature before log-softmax
    async_level: int = 2  # accept rollouts made with policy version >= step - async_level
    # Staleness is judged once, at intake (node/trainer/intake.py): a batch fresh when the trainer
    # acknowledged it at step a stays trainable until step a + verify_grace_steps, however long its
    # verification takes, so it is trained at most async_level + this many versions behind, and
    # never more than max_off_policy_steps (the grace shrinks to fit: off_policy_bound()).
    verify_grace_steps: int = 2  # steps an acknowledged batch stays trainable: staleness is judged once, at intake
    # Off-policy steps of a sample = version trained - version that generated it, queueing included
    # (prime-rl's count). A level-k run of bench/async_levels.py trains every sample k steps off-policy.
    max_off_policy_steps: int = 8  # no sample is trained more than this many versions after the one that made it
    min_batch_samples: int = 16  # online filtering: wait for this many non-zero-advantage samples

    def validate(self) -> None:
        if not 0 < self.epsilon < 1:
            raise ValueError("epsilon: in (0, 1)")
        if self.delta <= 1 + self.epsilon:
            raise ValueError("delta: must exceed 1 + epsilon")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef: >= 0")
        if self.lr <= 0 or self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("lr > 0, warmup_steps >= 0, weight_decay >= 0")
        if self.max_grad_norm <= 0:
            raise ValueError("max_grad_norm: > 0")
        if self.micro_batch_tokens < 1:
            raise ValueError("micro_batch_tokens: >= 1 (rounded down to whole pack_length rows, at least one)")
        if self.optimizer_steps < 1 or self.pack_length < 8:
            raise ValueError("optimizer_steps >= 1, pack_length >= 8")
        if self.temperature <= 0:
            raise ValueError("temperature: > 0")
        if not 0 <= self.async_level <= 64:
            raise ValueError("async_level: 0..64")
        if not 0 <= self.verify_grace_steps <= 64:
            raise ValueError("verify_grace_steps: 0..64")
        if not self.async_level <= self.max_off_policy_steps <= 64:
            raise ValueError(f"max_off_policy_steps: async_level ({self.async_level})..64 (a batch accepted "
                             "at async_level must still be trainable)")
        if self.loss not in LOSSES:
            raise ValueError(f"loss: one of {', '.join(LOSSES)}")
        if not 0 < self.tv_bound < 1 or self.tv_tau < 0 or self.tis_cap < 1:
            raise ValueError("tv_bound in (0, 1), tv_tau >= 0, tis_cap >= 1")
        if self.min_batch_samples < 1:
            raise ValueError("min_batch_samples: >= 1")

    def grace_steps(self) -> int:
        """``verify_grace_steps`` cut so that a batch acknowledged at the edge of ``async_level`` is
        still trained no more than ``max_off_policy_steps`` behind."""
        return min(self.verify_grace_steps, self.max_off_policy_steps - self.async_level)

    def off_policy_bound(self) -> int:
        """The most versions a sample can be behind when it is trained (and so when a validator checks it)."""
        return self.async_level + self.grace_steps()


@dataclass
class InferenceConfig:
    """``[inference]``: which engine generates and where."""

    engine: str = "auto"  # auto (vllm when it imports, CUDA is present and the run accepts it; else torch) | torch | vllm
    device: str = "auto"  # auto | cpu | cuda | cuda:N (torch engine)
    dtype: str = "auto"  # auto (the checkpoint's dtype) | float32 | bfloat16 | float16
    gpu_memory_utilization: float = 0.85  # vLLM's KV-cache budget as a fraction of GPU memory
    decode: str = "auto"  # torch engine decode path: auto (compiled on CUDA, dynamic on CPU) | dynamic | static | compiled
    # Run-wide (validators and workers read the same file): the engines whose batches the run accepts
    # ("auto" picks only among them), and those whose batches also get the seeded-sampling replay.
    # Both engines sample with our seeded Gumbel-max (vLLM through a logits processor), so both are
    # replayed by default; an engine left out of replay_engines gets the log-prob and proof checks
    # only, which trusts the worker's token choices (any text, proved and scored, would pass).
    engines: list[str] = field(default_factory=lambda: ["torch"])  # engines the run accepts; ["torch", "vllm"] lets GPU workers run vLLM
    replay_engines: list[str] = field(default_factory=lambda: list(REPLAYABLE_ENGINES))  # engines whose batches get the sampling replay

    def accepted_engines(self) -> tuple[str, ...]:
        return tuple(self.engines)

    def replayed_engines(self) -> tuple[str, ...]:
        return tuple(self.replay_engines)

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine: one of {', '.join(ENGINES)}")
        for name, names in (("engines", self.accepted_engines()), ("replay_engines", self.replayed_engines())):
            bad = [e for e in names if e not in ENGINE_NAMES]
            if bad:
                raise ValueError(f"{name}: {bad} not among {', '.join(ENGINE_NAMES)}")
        if not self.accepted_engines():
            raise ValueError("engines: at least one")
        if self.engine != "auto" and self.engine not in self.accepted_engines():
            raise ValueError(f"engine: {self.engine!r} is not in this run's engines {list(self.accepted_engines())}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: one of {', '.join(DTYPES)}")
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode: one of {', '.join(DECODE_MODES)}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError("gpu_memory_utilization: 0.05..0.99")
