"""Judging one rollout batch: every check a validator runs, in order, with one reason per sample.

How this works (DESIGN.md "The loop", step 4; TOPLOC paper §3-§6; INTELLECT-2 report §3):

1. **Batch rules** (:func:`check_batch_rules`, no model): the sampling parameters are the run's
   (temperature, top-p, length cap, group size, task set), the policy root is the manifest root
   announced for the claimed version (the draw is keyed by it: a worker cannot use a draw it computed
   before that version existed, nor another version's easier one), the base seed is the one the run
   assigns to the step key (``node.rl.spec.sampling_seed``: a worker cannot shop for lucky seeds), the
   batch is complete (every one of the ``prompts_per_batch`` drawn prompts, each with G samples: a
   worker cannot drop the prompts it failed, nor draw more and keep the easy ones), and the policy
   version is at most ``async_level`` behind the newest checkpoint and not from the future; the
   engine the batch states is one the run accepts, and its dtype the run's when the run fixes one. A
   failure here is the reason of every sample, and no model work is done. (Which step numbers a
   worker may use at all, the step window of node/rollouts/steps.py, is the service's check: it
   needs the store.)
2. **Per sample, cheap**: the task id and prompt tokens are the run's deterministic draw for
   (step key, prompt index) (anti cherry-picking); the completion stops at its first EOS or
   runs to the cap, and ``finish_reason`` says which.
3. **Per sample, with the checkpoint's model** (one batched prefill of prompt+completion, see
   :class:`CheckModel`): the TOPLOC proofs match the validator's own final hidden states at the
   decode positions; the claimed log-probs match log softmax(logits / T); and, when the batch's
   engine follows our sampler (``[inference] replay_engines``: torch and vLLM, whose engine samples
   with the same rule through a logits processor, node/engines/vllm_gumbel.py), every token is the seeded Gumbel-max choice (TOPLOC2 / prime-rl: the sampling noise comes from a counter-based hash
   of the per-sequence seed, so a validator holding the logits replays it exactly, up to
   ``sampling_tolerance`` of numeric noise). The proof binds the hidden states to the model and the
   tokens; the replay binds the tokens to the seed; together a worker can neither use another
   model, nor edit a completion after proving it, nor pick among several samples (within the
   sensitivity measured in tests/test_validator_pipeline.py: on the tiny random-init default model,
   weights perturbed by 3% of their std still pass the paper's proof thresholds, 10% do not; the
   thresholds a validator fits to accepted work, node/proofs/margins.py, catch 1%; in float32 the
   log-prob check, ``checks.logprob_tolerances``, catches 1% and an 8-bit copy, tests/test_cheap_model.py).
4. **Per sample, the verifier, last**: the reward recomputed here on the decoded completion equals
   the claimed task reward, length penalty and total, and the advantage is
   ``(r - mean) / (std + 1e-6)`` of its group (the rules are node/rl/spec.py's, as the worker's).
   Last because a verifier may run the completion as code: seconds of sandbox per sample, which a
   batch of endless loops would cost a validator for free were it scored before its proofs
   (issue 42). Only samples that passed 1-3 are scored, in one call per batch
   (:meth:`TaskSet.score_many`) under the run's ``score_budget_s``; a sample not reached within it
   is rejected as ``score_budget`` (the batch is refused and its worker earns a penalty point).

The first failing check names the sample's reason (``"ok"`` when all pass); the batch is accepted
only when every sample is. Reason codes are :class:`node.proofs.reasons.Reason` values plus the
batch-level ones in :class:`BatchReason`. Pure given a model: no I/O, no clock, no network.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..engines.sampling import sequence_seed, top_p_mask, uniform_noise
from ..proofs import checks
from ..proofs.capture import logits_from_hidden, recompute_decode_states
from ..proofs.config import ProofsConfig
from ..proofs.reasons import PASS, CheckResult, Reason, fail
from ..proofs.toploc import ChunkResult, verify_proofs
from ..rl.config import REPLAYABLE_ENGINES
from ..rl.spec import group_advantages, sampling_seed, step_key, token_logprobs
from ..rollouts.assemble import split_proofs
from ..rollouts.schema import RolloutBatch, RolloutSample, SignedBatch, open_batch
from ..wire import RemoteProtocolError

FINISH_STOP, FINISH_LENGTH = "stop", "length"  # as node.engines.base (not imported: keeps this module light)
PARAM_TOLERANCE = 1e-6  # temperature / top-p travel as floats: allow a round trip, nothing more
TOP_P_SLACK = 1e-4  # nucleus membership of the sampled token may differ by this much mass (numeric noise)
MAX_PREFILL_TOKENS = 32768  # tokens per batched prefill (bounds the validator's activation memory)


class BatchReason(str, enum.Enum):
    """Reasons a validator gives beyond the per-check ones in :class:`node.proofs.reasons.Reason`."""

    FORGED = "forged_signature"  # the envelope is not signed by the batch's worker
    MALFORMED = "malformed_batch"  # does not decode as a RolloutBatch of this run
    REPLAYED = "replayed"  # this (worker, step, prompt index) was already judged in another batch
    WRONG_PARAMS = "wrong_params"  # top-p, length cap, group size or task set differ from the run's
    BAD_GROUPS = "bad_groups"  # a drawn prompt or sample missing, duplicated, or beyond the step's draw
    WRONG_ROOT = "wrong_policy_root"  # policy_root is not the announced manifest root of policy_version
    STEP_AHEAD = "step_ahead"  # step beyond the worker's step window (node/rollouts/steps.py): grinding
    STEP_BEHIND = "step_behind"  # step below the worker's window: its number may have been used before
    WRONG_PROMPT = "wrong_prompt"  # prompt tokens are not the drawn task's prompt
    WRONG_FINISH = "wrong_finish"  # finish_reason contradicts the tokens
    SAMPLING_MISMATCH = "sampling_mismatch"  # a token is not the seeded Gumbel-max choice
    ENGINE_REFUSED = "engine_refused"  # the batch states an engine the run does not accept ([inference] engines)
    BANNED = "banned"  # the worker is banned (no checks run)
    NO_CHECKPOINT = "no_checkpoint"  # the claimed checkpoint could not be obtained (not the worker's fault)
    SCORE_BUDGET = "score_budget"  # the batch's verifier runs outlasted the run's scoring budget per batch


# --------------------------------------------------------------------------------------------
# What the run fixes, and what the validator needs from the task set and the model


@dataclass(frozen=True)
class BatchRules:
    """The run's parameters every batch must carry (from the run file's [rl], [grpo], [proofs])."""

    run: str
    taskset: str
    temperature: float
    top_p: float
    max_new_tokens: int
    group_size: int
    prompts_per_batch: int
    async_level: int
    proofs: ProofsConfig = field(default_factory=ProofsConfig)
    sampling_tolerance: float = 0.05
    check_sampling: bool = True
    check_seed: bool = True
    engines: tuple[str, ...] = ("torch",)  # engines the run accepts ([inference] engines)
    replay_engines: tuple[str, ...] = REPLAYABLE_ENGINES  # engines whose batches get the sampling replay
    dtype: str | None = None  # the dtype every batch must state (the run's [inference] dtype); None = any
    # Seconds of verifier work (the code sandbox above all) one batch may cost; samples not scored
    # within it are rejected as score_budget. Four code time limits (5 s each by default) plus slack:
    # an honest batch whose model wrote a few endless loops still fits.
    score_budget_s: float = 25.0

    def replays(self, engine: str) -> bool:
        """Whether a batch from ``engine`` gets the seeded-sampling replay (log-probs and proofs: always)."""
        return self.check_sampling and engine in self.replay_engines


@dataclass(frozen=True)
class DrawnTask:
    """What the run's deterministic draw gives a worker at (step, index)."""

    task_id: str
    prompt: str
    target_length: int = 0  # thinking budget in tokens (0 = none)
    data: Any = None  # whatever the scorer needs (answer, unit tests, ...)


@dataclass(frozen=True)
class Score:
    """A recomputed reward: ``reward`` is what the advantage is computed from."""

    task_reward: float
    length_penalty: float
    reward: float


class TaskSet(Protocol):
    """The run's task draw and verifiers, as the validator uses them."""

    def draw(self, key: bytes, index: int) -> DrawnTask:
        """The task of prompt ``index`` of the step whose key (``node.rl.spec.step_key``) is ``key``."""

    def score(self, task: DrawnTask, completion_text: str, completion_tokens: int) -> Score: ...

    def score_many(self, jobs: Sequence[tuple[DrawnTask, str, int]], budget_s: float) -> list[Score | None]:
        """:meth:`score` of each (task, completion text, completion tokens), in one call where the
        verifier allows; None for each job not started within ``budget_s`` seconds of the call."""

    def prompt_ids(self, task: DrawnTask, tokenizer: Tokenizer) -> list[int]:
        """The drawn task's prompt tokens as the run renders them with the checkpoint's ``tokenizer``."""


class Tokenizer(Protocol):
    eos_token_id: int
    pad_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class Recomputed:
    """The validator's own view of one sample: decode-position states and their logits."""

    hidden: torch.Tensor  # (T, H) final hidden states at the decode positions
    logits: torch.Tensor  # (T, V) logits they produce


class CheckModel:
    """A checkpoint loaded for checking: one batched prefill gives hidden states and logits."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, version: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.version = version
        self.eos_ids = frozenset({int(tokenizer.eos_token_id)})
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # the prefill's (log-prob tolerance)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @torch.no_grad()
    def recompute(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> list[Recomputed]:
        """Per sample, (T, H) states and (T, V) logits, prefilled in batches of bounded size."""
        out: list[Recomputed] = []
        start = 0
        while start < len(prompts):
            end, tokens = start, 0
            while end < len(prompts) and (end == start or tokens + len(prompts[end]) + len(completions[end]) <= MAX_PREFILL_TOKENS):
                tokens += len(prompts[end]) + len(completions[end])
                end += 1
            states = recompute_decode_states(self.model, prompts[start:end], completions[start:end], self.pad_id)
            for h in states:
                out.append(Recomputed(h, logits_from_hidden(self.model, h)))
            start = end
        return out


# --------------------------------------------------------------------------------------------
# Results


@dataclass
class Judgement:
    """One reason per sample (``"ok"`` if it passed), with human-readable details."""

    reasons: list[str]
    details: list[str]
    tokens: int = 0  # completion tokens checked (for throughput figures)
    proofs: list[tuple[ChunkResult, ...]] = field(default_factory=list)  # measurements of the proofs that passed
    rescore_s: float = 0.0  # seconds of the verifiers' re-scoring, when judge_batch was given a clock

    @property
    def accepted(self) -> bool:
        return bool(self.reasons) and all(r == Reason.OK.value for r in self.reasons)

    def main_reason(self) -> str:
        """The most frequent rejection reason ("ok" when accepted)."""
        bad = [r for r in self.reasons if r != Reason.OK.value]
        if not bad:
            return Reason.OK.value
        return max(sorted(set(bad)), key=bad.count)

    @classmethod
    def uniform(cls, n: int, check: CheckResult) -> Judgement:
        return cls([_code(check)] * max(n, 1), [check.detail] * max(n, 1))


def _code(check: CheckResult) -> str:
    return check.reason.value if isinstance(check.reason, enum.Enum) else str(check.reason)


def reject(reason: BatchReason, detail: str) -> CheckResult:
    """A failing CheckResult carrying one of the validator's own reasons."""
    return CheckResult(reason, detail)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# 0. Bytes to batch


def parse_batch(data: bytes, run: str) -> SignedBatch | CheckResult:
    """A checked signed batch, or why not: ``forged_signature`` (signature or signer wrong) or
    ``malformed_batch`` (size, schema, run). Never raises on bad bytes."""
    try:
        return open_batch(data, run)
    except RemoteProtocolError as e:
        reason = BatchReason.FORGED if e.reason in ("forged", "bad-signature") else BatchReason.MALFORMED
        return reject(reason, f"{e.reason}: {e.detail}"[:200])


# --------------------------------------------------------------------------------------------
# 1. Batch rules


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= PARAM_TOLERANCE * max(1.0, abs(b))


def check_batch_rules(batch: RolloutBatch, rules: BatchRules, current_version: int,
                      policy_root: bytes | None = None) -> CheckResult:
    """Parameters, policy root, seed, group structure and staleness of a whole batch (no model needed).

    ``policy_root`` is the manifest root this node knows for ``batch.policy_version`` (the service
    always passes it; None skips the check, for tests of other rules)."""
    if batch.engine not in rules.engines:
        return reject(BatchReason.ENGINE_REFUSED, f"engine {batch.engine!r} is not one this run accepts "
                                                  f"({', '.join(rules.engines)})")
    if policy_root is not None and batch.policy_root != policy_root:
        return reject(BatchReason.WRONG_ROOT, f"policy_root {batch.policy_root.hex()[:12]} is not v{batch.policy_version}'s "
                                              f"{policy_root.hex()[:12]}")
    key = step_key(rules.run, batch.worker, batch.policy_root, batch.step)
    seed = sampling_seed(key) if rules.check_seed else None
    check = checks.check_sampling_params(batch.temperature, batch.seed, run_temperature=rules.temperature, expected_seed=seed)
    if not check:
        return check
    wrong = [
        name
        for name, ok in (
            ("top_p", _close(batch.top_p, rules.top_p)),
            ("max_new_tokens", batch.max_new_tokens == rules.max_new_tokens),
            ("group_size", batch.group_size == rules.group_size),
            ("taskset", batch.taskset == rules.taskset),
            ("dtype", rules.dtype is None or batch.dtype == rules.dtype),
        )
        if not ok
    ]
    if wrong:
        return reject(BatchReason.WRONG_PARAMS, f"{', '.join(wrong)} differ from the run's")
    check = check_groups(batch.samples, rules.group_size, rules.prompts_per_batch)
    if not check:
        return check
    return checks.check_policy_version(batch.policy_version, current_step=current_version, async_level=rules.async_level)


def check_groups(samples: Sequence[RolloutSample], group_size: int, prompts_per_batch: int) -> CheckResult:
    """A complete batch: every prompt index 0..prompts_per_batch-1, each with sample indices 0..G-1 once.

    Every group present being complete is not enough: a worker could drop the prompts it failed
    (issue 13, "dropping groups") and its batch would lift the mean reward it is credited with. The
    inference side never trims a batch to fit a frame (node/rollouts/assemble.py): the run's
    ``prompts_per_batch`` must fit, and a step that does not is dropped whole."""
    if not samples:
        return reject(BatchReason.BAD_GROUPS, "empty batch")
    groups: dict[int, list[int]] = defaultdict(list)
    for s in samples:
        if s.prompt_index >= prompts_per_batch:
            return reject(BatchReason.BAD_GROUPS, f"prompt index {s.prompt_index} >= prompts_per_batch {prompts_per_batch}")
        groups[s.prompt_index].append(s.sample_index)
    missing = [p for p in range(prompts_per_batch) if p not in groups]
    if missing:
        return reject(BatchReason.BAD_GROUPS, f"drawn prompts {missing[:8]} missing: a batch holds all {prompts_per_batch}")
    for p, idx in groups.items():
        if sorted(idx) != list(range(group_size)):
            return reject(BatchReason.BAD_GROUPS, f"prompt {p}: sample indices {sorted(idx)[:8]} != 0..{group_size - 1}")
    return PASS


# --------------------------------------------------------------------------------------------
# 2. Cheap per-sample checks


def check_task(sample: RolloutSample, key: bytes, step: int, tasks: TaskSet, tokenizer: Tokenizer) -> tuple[CheckResult, DrawnTask | None]:
    """The sample's task is the draw's (``key``: the batch's step key), and its prompt tokens are that task's prompt."""
    task = tasks.draw(key, sample.prompt_index)
    if sample.task_id != task.task_id:
        return fail(Reason.WRONG_TASK, f"task {sample.task_id!r} != drawn {task.task_id!r} (step {step}, index {sample.prompt_index})"), None
    if list(sample.prompt_ids) != list(tasks.prompt_ids(task, tokenizer)):
        return reject(BatchReason.WRONG_PROMPT, f"prompt tokens are not task {task.task_id!r}'s prompt"), None
    if sample.target_length != task.target_length:
        return fail(Reason.OUT_OF_BOUNDS, f"target_length {sample.target_length} != drawn {task.target_length}"), None
    return PASS, task


def check_finish(sample: RolloutSample, eos_ids: Collection[int], max_new_tokens: int, vocab_size: int) -> CheckResult:
    """Token ids the model has, the termination rule, and a finish_reason that agrees with the tokens."""
    bad = next((t for t in sample.completion_ids if not 0 <= t < vocab_size), None)
    if bad is not None:  # would index past the embedding table in our prefill
        return fail(Reason.OUT_OF_BOUNDS, f"completion token id {bad} outside the vocabulary of {vocab_size}")
    check = checks.check_termination(sample.completion_ids, eos_ids, max_new_tokens)
    if not check:
        return check
    expected = FINISH_STOP if sample.completion_ids[-1] in eos_ids else FINISH_LENGTH
    if sample.finish_reason != expected:
        return reject(BatchReason.WRONG_FINISH, f"finish_reason {sample.finish_reason!r}, tokens say {expected!r}")
    return PASS


def score_results(samples: Sequence[RolloutSample], drawn: Sequence[DrawnTask], tasks: TaskSet, tokenizer: Tokenizer,
                  tolerance: float, budget_s: float) -> list[CheckResult]:
    """Per sample: claimed task reward, length penalty and total equal the verifier's, recomputed
    here in one scoring call of at most ``budget_s`` seconds (a sample it did not reach: ``score_budget``)."""
    jobs = [(task, tokenizer.decode(s.completion_ids, skip_special_tokens=True), len(s.completion_ids))
            for s, task in zip(samples, drawn)]
    out = []
    for s, mine in zip(samples, tasks.score_many(jobs, budget_s) if jobs else []):
        if mine is None:
            out.append(reject(BatchReason.SCORE_BUDGET, f"not scored within the batch's {budget_s:g} s scoring budget"))
            continue
        claimed = [s.task_reward, s.length_penalty, s.reward]
        out.append(checks.check_rewards(claimed, [mine.task_reward, mine.length_penalty, mine.reward], tolerance=tolerance))
    return out


def advantage_results(samples: Sequence[RolloutSample], tolerance: float) -> list[CheckResult]:
    """Per sample: its advantage equals the group-relative advantage of its group's claimed rewards.

    Claimed rewards are used (each is checked against the verifier separately), so a sample is
    blamed only for its own wrong advantage.
    """
    groups: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        groups[s.prompt_index].append(i)
    out: list[CheckResult] = [PASS] * len(samples)
    for members in groups.values():
        rewards = [float(samples[i].reward) for i in members]
        if not all(np.isfinite(rewards)):
            for i in members:
                out[i] = fail(Reason.OUT_OF_BOUNDS, "non-finite reward in the group")
            continue
        expected = group_advantages(rewards)  # the schema bounds |reward| <= 1e6: no overflow
        for i, e in zip(members, expected):
            a = samples[i].advantage
            if not np.isfinite(a) or abs(a - e) > tolerance:
                out[i] = fail(Reason.ADVANTAGE_MISMATCH, f"advantage {a} != {e:.6f}")
    return out


# --------------------------------------------------------------------------------------------
# 3. Model checks


@dataclass(frozen=True)
class Replay:
    """One sequence to replay: its (T, V) logits (validator's), sampled tokens and per-sequence seed."""

    logits: torch.Tensor
    tokens: Sequence[int]
    seed: int


def check_sampling_replay(replays: Sequence[Replay], temperature: float, top_p: float, tolerance: float) -> list[CheckResult]:
    """Per sequence: each token is the argmax of (logits/T + Gumbel noise of its seed and step) in the nucleus.

    Mirrors :func:`node.engines.sampling.sample_tokens`; ``tolerance`` (logit units) absorbs the
    difference between the worker's decode-time logits and this prefill's. Vectorised over the
    sequences at each step (one noise draw per step for all of them), as the engine samples.
    """
    results: list[CheckResult] = [PASS] * len(replays)
    longest = max((len(r.tokens) for r in replays), default=0)
    for t in range(longest):
        rows = [i for i, r in enumerate(replays) if len(r.tokens) > t and results[i].ok]
        if not rows:
            break
        vocab = replays[rows[0]].logits.shape[1]
        for i in rows:
            if not 0 <= replays[i].tokens[t] < vocab:
                results[i] = reject(BatchReason.SAMPLING_MISMATCH, f"token {t}: id {replays[i].tokens[t]} outside the vocabulary")
        rows = [i for i in rows if results[i].ok]
        if not rows:
            continue
        tokens = [int(replays[i].tokens[t]) for i in rows]
        z = torch.stack([replays[i].logits[t] for i in rows]).float() / temperature  # (R, V)
        keep = top_p_mask(z, min(1.0, top_p + TOP_P_SLACK)) if top_p < 1.0 else torch.ones_like(z, dtype=torch.bool)
        seeds = torch.tensor([replays[i].seed for i in rows], dtype=torch.int64, device=z.device)
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, t, vocab)))  # (R, V) float64
        scores = torch.where(keep, z.double() + gumbel, torch.tensor(float("-inf"), dtype=torch.float64, device=z.device))
        chosen = scores.gather(1, torch.tensor(tokens, device=z.device)[:, None]).squeeze(1)  # (R,)
        gaps = (scores.max(dim=1).values - chosen).tolist()
        for j, gap in enumerate(gaps):
            if not gap <= tolerance:  # also catches -inf (outside the nucleus) and NaN
                why = "outside the top-p nucleus" if gap == float("inf") else f"{gap:.4f} below the seeded choice"
                results[rows[j]] = reject(BatchReason.SAMPLING_MISMATCH, f"token {t}: {why}")
    return results


def model_results(
    batch: RolloutBatch,
    samples_to_check: Sequence[int],
    model: CheckModel,
    rules: BatchRules,
    measured: list[tuple[ChunkResult, ...]],
) -> dict[int, CheckResult]:
    """Proof, log-prob and sampling checks of the given samples against ``model``'s prefill.

    The measurements of every proof that passed are appended to ``measured`` (for
    :class:`node.proofs.margins.ProofMargins`)."""
    samples = [batch.samples[i] for i in samples_to_check]
    if not samples:
        return {}
    recomputed = model.recompute([s.prompt_ids for s in samples], [s.completion_ids for s in samples])
    out = {i: _proof_and_logprob_checks(batch, s, r, rules, measured, model.dtype)
           for i, s, r in zip(samples_to_check, samples, recomputed)}
    if rules.replays(batch.engine):
        todo = [(i, s, r) for i, s, r in zip(samples_to_check, samples, recomputed) if out[i].ok]
        replays = [Replay(r.logits, s.completion_ids, sequence_seed(batch.seed, s.prompt_index, s.sample_index))
                   for _, s, r in todo]
        for (i, _, _), check in zip(todo, check_sampling_replay(replays, batch.temperature, batch.top_p,
                                                                 rules.sampling_tolerance)):
            out[i] = check
    return out


def _proof_and_logprob_checks(
    batch: RolloutBatch, s: RolloutSample, r: Recomputed, rules: BatchRules, measured: list[tuple[ChunkResult, ...]],
    prefill_dtype: str,
) -> CheckResult:
    n, width = len(s.completion_ids), r.hidden.shape[1]
    chunks = split_proofs(s.proof, n, width, rules.proofs.chunk_tokens, rules.proofs.topk)
    if chunks is None:
        return fail(Reason.PROOF_COUNT, f"{len(s.proof)} proof bytes do not cut into chunk proofs for {n} tokens")
    verdict = verify_proofs(r.hidden, chunks, rules.proofs)
    if not verdict.ok:
        return verdict.check
    measured.append(verdict.chunks)
    mine = token_logprobs(r.logits, torch.tensor(s.completion_ids), batch.temperature)
    mean, most = checks.logprob_tolerances(rules.proofs, batch.dtype, prefill_dtype)
    return checks.check_logprobs(s.logprobs, mine, tolerance_mean=mean, tolerance_max=most)


# --------------------------------------------------------------------------------------------
# Everything together


def judge_batch(
    batch: RolloutBatch,
    rules: BatchRules,
    *,
    current_version: int,
    tasks: TaskSet,
    model: CheckModel | None,
    replayed: Callable[[int], bool] = lambda prompt_index: False,
    policy_root: bytes | None = None,
    clock: Callable[[], float] | None = None,
) -> Judgement:
    """All checks of one batch; ``model`` is the checkpoint of ``batch.policy_version`` and
    ``policy_root`` its manifest root (see :func:`check_batch_rules`). With a ``clock``, the
    judgement says how long the re-scoring took (the rest of a check is the model's; node/steptime.py).

    ``replayed(prompt_index)`` says whether (worker, step, prompt_index) was already judged in
    another batch (the caller's replay store). ``model=None`` is allowed only when the batch rules
    fail (then no sample needs the model); otherwise it is our bug.
    """
    n = len(batch.samples)
    rule = check_batch_rules(batch, rules, current_version, policy_root)
    if not rule:
        return Judgement.uniform(n, rule)
    if model is None:
        raise ValueError("judge_batch needs the checkpoint's model for a batch that passes the batch rules")
    results: list[CheckResult] = [PASS] * n
    drawn: dict[int, DrawnTask] = {}
    key = step_key(rules.run, batch.worker, batch.policy_root, batch.step)
    for i, s in enumerate(batch.samples):
        if replayed(s.prompt_index):
            results[i] = reject(BatchReason.REPLAYED, f"step {batch.step}, prompt {s.prompt_index} already judged")
            continue
        check, task = check_task(s, key, batch.step, tasks, model.tokenizer)
        if check:
            check = check_finish(s, model.eos_ids, rules.max_new_tokens, model.vocab_size)
            drawn[i] = task
        results[i] = check
    # The model checks before the verifier: scoring runs untrusted code (seconds of sandbox per
    # sample), so only samples that proved their tokens come from the checkpoint reach it (issue 42).
    todo = [i for i, r in enumerate(results) if r.ok]
    measured: list[tuple[ChunkResult, ...]] = []
    for i, check in model_results(batch, todo, model, rules, measured).items():
        results[i] = check
    todo = [i for i, r in enumerate(results) if r.ok]
    scoring_from = clock() if clock is not None else 0.0
    scored = score_results([batch.samples[i] for i in todo], [drawn[i] for i in todo], tasks, model.tokenizer,
                           rules.proofs.reward_tolerance, rules.score_budget_s)
    rescore_s = clock() - scoring_from if clock is not None else 0.0
    advantages = advantage_results(batch.samples, rules.proofs.advantage_tolerance)
    for i, check in zip(todo, scored):
        results[i] = check if not check.ok else advantages[i]
    tokens = sum(len(s.completion_ids) for s in batch.samples)
    return Judgement([_code(r) for r in results], [r.detail for r in results], tokens, measured, rescore_s)
