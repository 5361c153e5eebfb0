"""Honest batches and named cheats, for the validator's tests, benchmark and demo checks.

:func:`make_batch` builds a batch the way the contract in node/rollouts/schema.py and
node/rl/spec.py say an honest inference node must (draw, seeded sampling with the torch
engine, verifier rewards, group advantages, TOPLOC proofs, signature). It is written from the
contract, independently of the inference role's code, so the validator's tests check the contract
rather than one implementation of it.

:data:`FAULTS` are cheats a dishonest worker might try (hivemind's named ``Fault`` cases are the
model), each with the reasons a validator must give. Not imported by the running node.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..identity import Identity
from ..proofs.capture import logits_from_hidden, recompute_decode_states
from ..proofs.reasons import Reason
from ..proofs.toploc import build_proofs_many
from ..rl.spec import group_advantages, sampling_seed, step_key, token_logprobs
from ..rollouts.schema import (
    DOMAIN_BATCH,
    RolloutAck,
    RolloutBatch,
    RolloutSample,
    SignedBatch,
    Verdict,
    batch_id_of,
    open_verdict,
)
from ..wire import encode, read_frame, seal, write_frame
from .pipeline import BatchReason, BatchRules, DrawnTask, TaskSet


ROOT = b"\x5a" * 32  # the manifest root the tests' checkpoint version is announced with


def verdict_sink(run: str, validators: set[str], on_verdict: Callable[[Verdict, bytes], None]):
    """A trainer's ``/swarm/verdicts/1.0.0`` handler: each verdict opened (signed by one of
    ``validators``), handed to ``on_verdict`` with its raw frame, and acknowledged."""

    async def handle(stream) -> None:
        while (data := await read_frame(stream)) is not None:
            v = open_verdict(data, run, validators)
            on_verdict(v, data)
            await write_frame(stream, RolloutAck(batch_id=v.batch_id, accepted=True))

    return handle


def sign_batch(identity: Identity, batch: RolloutBatch) -> SignedBatch:
    env = seal(identity, DOMAIN_BATCH, batch)
    return SignedBatch(batch, batch_id_of(env), encode(env))


def make_batch(
    engine,
    identity: Identity,
    rules: BatchRules,
    tasks: TaskSet,
    *,
    step: int,
    policy_version: int,
    created_ms: int = 0,
    seed: int | None = None,
    draw_step: int | None = None,
    policy_root: bytes = ROOT,
) -> SignedBatch:
    """An honest batch of ``identity``'s worker at ``step`` on the checkpoint whose manifest root is
    ``policy_root`` (``seed``/``draw_step`` override for cheats)."""
    worker = identity.peer_id
    tok = engine.tokenizer
    key = step_key(rules.run, worker, policy_root, step)
    draw_key = key if draw_step is None else step_key(rules.run, worker, policy_root, draw_step)
    drawn = [tasks.draw(draw_key, i) for i in range(rules.prompts_per_batch)]
    prompts = [tasks.prompt_ids(t, tok) for t in drawn]
    base_seed = sampling_seed(key) if seed is None else seed
    groups = engine.generate(prompts, rules.group_size, rules.temperature, rules.top_p, rules.max_new_tokens, base_seed)
    flat = [s for g in groups for s in g]
    proofs = build_proofs_many([s.hidden for s in flat], rules.proofs.chunk_tokens, rules.proofs.topk)
    samples = []
    for task, group in zip(drawn, groups):
        scores = [tasks.score(task, s.text, len(s.completion_ids)) for s in group]
        advantages = group_advantages([sc.reward for sc in scores])
        for s, sc, adv in zip(group, scores, advantages):
            samples.append(RolloutSample(
                prompt_index=s.prompt_index, sample_index=s.sample_index, task_id=task.task_id,
                prompt_ids=list(s.prompt_ids), completion_ids=list(s.completion_ids),
                logprobs=[float(x) for x in s.logprobs], finish_reason=s.finish_reason,
                reward=sc.reward, task_reward=sc.task_reward, length_penalty=sc.length_penalty,
                target_length=task.target_length, advantage=float(adv), proof=b"".join(proofs[len(samples)]),
            ))
    batch = RolloutBatch(
        run=rules.run, worker=worker, step=step, policy_version=policy_version, policy_root=policy_root,
        taskset=rules.taskset,
        seed=base_seed, temperature=rules.temperature, top_p=rules.top_p, max_new_tokens=rules.max_new_tokens,
        group_size=rules.group_size, created_ms=created_ms, samples=samples,
        engine=engine.name, dtype=engine.dtype_name,
    )
    return sign_batch(identity, batch)


def perturbed_model(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """The model plus Gaussian noise of ``scale`` x each tensor's std (another fine-tune, a cheap quantisation)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_((scale * p.float().std() * torch.randn(p.shape, generator=g)).to(p.dtype))
    return other


def with_samples(signed: SignedBatch, identity: Identity, edit: Callable[[int, RolloutSample], RolloutSample], **fields) -> SignedBatch:
    """Re-sign ``signed`` with each sample replaced by ``edit(i, sample)`` and batch fields changed."""
    samples = [edit(i, s) for i, s in enumerate(signed.batch.samples)]
    return sign_batch(identity, replace(signed.batch, samples=samples, **fields))


def regroup_advantages(samples: list[RolloutSample]) -> list[RolloutSample]:
    """Recompute every group's advantages from its (possibly edited) rewards, as a careful cheat would."""
    out = list(samples)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.prompt_index, []).append(i)
    for members in groups.values():
        adv = group_advantages([samples[i].reward for i in members])
        for i, a in zip(members, adv):
            out[i] = replace(samples[i], advantage=float(a))
    return out


EXIT_PROGRAM = "import os;os._exit(0)"  # leaves before any test runs


def reproved(samples: list[RolloutSample], edits: dict[int, list[int]], engine, rules: BatchRules) -> list[RolloutSample]:
    """``samples`` with the completion of each index in ``edits`` replaced by its tokens, and its
    log-probs, finish reason and proofs rebuilt from ``engine``'s model on them: what a careful cheat
    holding the checkpoint does, so the proofs and log-probs hold and only the sampling replay (or
    the verifier) can tell."""
    tok = engine.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    which = list(edits)
    states = recompute_decode_states(engine.model, [samples[i].prompt_ids for i in which], [edits[i] for i in which], pad)
    proofs = build_proofs_many(states, rules.proofs.chunk_tokens, rules.proofs.topk)
    out = list(samples)
    for k, i in enumerate(which):
        ids = list(edits[i])
        lps = token_logprobs(logits_from_hidden(engine.model, states[k]), torch.tensor(ids), rules.temperature)
        out[i] = replace(samples[i], completion_ids=ids, logprobs=[float(x) for x in lps],
                         finish_reason="stop" if ids[-1] == tok.eos_token_id else "length", proof=b"".join(proofs[k]))
    return out


def early_exit(signed: SignedBatch, identity: Identity, engine, rules: BatchRules) -> SignedBatch:
    """Half of every group's completions replaced by :data:`EXIT_PROGRAM`, each claiming reward 1.0
    (what a harness that trusts exit status 0 gives it), so the group still has signal; re-proved
    (:func:`reproved`)."""
    tok = engine.tokenizer
    ids = tok.encode(EXIT_PROGRAM, add_special_tokens=False) + [tok.eos_token_id]
    forced = [i for i, s in enumerate(signed.batch.samples) if s.sample_index < max(1, rules.group_size // 2)]
    samples = reproved(list(signed.batch.samples), {i: ids for i in forced}, engine, rules)
    for i in forced:
        samples[i] = replace(samples[i], reward=1.0, task_reward=1.0, length_penalty=0.0)
    return sign_batch(identity, replace(signed.batch, samples=regroup_advantages(samples)))


def pasted_completions(signed: SignedBatch, identity: Identity, engine, rules: BatchRules, tasks: TaskSet,
                       text_of: Callable[[DrawnTask], str], claim: str = "vllm") -> SignedBatch:
    """Every completion replaced by text the worker wrote, ``text_of(drawn task)`` (the right answer,
    an injected URL) and eos, re-proved (:func:`reproved`), scored by the run's own verifier (so its
    rewards are true) and the batch stating engine ``claim`` (issue 42 hole 1: once, a vLLM batch
    skipped the sampling replay on its own say-so, so this passed; only the replay can tell)."""
    tok = engine.tokenizer
    b = signed.batch
    key = step_key(b.run, b.worker, b.policy_root, b.step)
    drawn = {s.prompt_index: tasks.draw(key, s.prompt_index) for s in b.samples}
    edits = {i: tok.encode(text_of(drawn[s.prompt_index]), add_special_tokens=False)[: rules.max_new_tokens - 1]
             + [tok.eos_token_id] for i, s in enumerate(b.samples)}
    samples = reproved(list(b.samples), edits, engine, rules)
    for i, s in enumerate(samples):
        sc = tasks.score(drawn[s.prompt_index], tok.decode(s.completion_ids, skip_special_tokens=True), len(s.completion_ids))
        samples[i] = replace(s, reward=sc.reward, task_reward=sc.task_reward, length_penalty=sc.length_penalty)
    return sign_batch(identity, replace(b, samples=regroup_advantages(samples), engine=claim))


ENDLESS_PROGRAM = "while 1:pass"  # runs until the sandbox's time limit stops it


def free_sandbox(signed: SignedBatch, identity: Identity, engine) -> SignedBatch:
    """Every completion replaced by :data:`ENDLESS_PROGRAM` with garbage proofs and log-probs, each
    claiming reward 1.0: no model work at all, and each sample would hold a validator's code sandbox
    for its whole time limit were it scored before the proofs are checked (issue 42, hole 2)."""
    tok = engine.tokenizer
    ids = tok.encode(ENDLESS_PROGRAM, add_special_tokens=False) + [tok.eos_token_id]
    return with_samples(signed, identity, lambda i, s: replace(
        s, completion_ids=list(ids), logprobs=[-1.0] * len(ids), finish_reason="stop", reward=1.0, task_reward=1.0,
        length_penalty=0.0, advantage=0.0, proof=b"\x00" * 7))


PROOF_REASONS = frozenset({Reason.PROOF_EXPONENT.value, Reason.PROOF_MANTISSA_MEAN.value, Reason.PROOF_MANTISSA_MEDIAN.value})
# The sampling checks: log-probs recomputed from the validator's logits, and the seeded Gumbel-max replay.
SAMPLING_REASONS = frozenset({Reason.LOGPROB_MISMATCH.value, BatchReason.SAMPLING_MISMATCH.value})


@dataclass(frozen=True)
class Fault:
    """A named cheat: the reasons the validator must give to (at least one of) its tampered samples."""

    name: str
    expected: frozenset[str]
    doc: str


FAULTS = {
    f.name: f
    for f in (
        Fault("wrong_model_weights", PROOF_REASONS, "generated with perturbed weights, claims the run's checkpoint"),
        # On the tiny random-init model an edited early token moves the later states only a little (chunk
        # mantissa means of 10.6-12.4 against the threshold 10, measured), so some edited samples pass
        # the proof and are caught by the sampling replay instead: both are the right reason.
        Fault("altered_completion", PROOF_REASONS | SAMPLING_REASONS, "completion tokens edited after the proof was built"),
        Fault("copied_proofs", PROOF_REASONS, "proofs taken from other sequences of the same length"),
        Fault("reward_inflation", frozenset({Reason.REWARD_MISMATCH.value}), "every reward claimed as 1.0"),
        Fault("stale_policy", frozenset({Reason.STALE_POLICY.value}), "a policy version older than the async level allows"),
        Fault("replayed_batch", frozenset({BatchReason.REPLAYED.value}), "an already judged batch re-signed with a new time"),
        Fault("cherry_picked_tasks", frozenset({Reason.WRONG_TASK.value}), "tasks drawn at another step, not the assigned ones"),
        Fault("forged_signature", frozenset({BatchReason.FORGED.value}), "a batch naming another worker, signed by the cheat"),
        Fault("chosen_seed", frozenset({Reason.WRONG_SEED.value}), "sampled with a seed of the worker's choosing"),
        Fault("early_exit", frozenset({Reason.REWARD_MISMATCH.value}) | SAMPLING_REASONS,
              "code completions that exit before the tests run, claimed as passing"),
        Fault("free_sandbox", frozenset({Reason.PROOF_COUNT.value}) | PROOF_REASONS,
              "endless-loop code with garbage proofs: refused on its proofs, before any sandbox runs"),
        Fault("pasted_completion", SAMPLING_REASONS,
              "text the model never sampled (right answers, an injected URL), re-proved, truly scored, stated as vLLM's"),
        Fault("altered_last_token", SAMPLING_REASONS,
              "last token edited: the proof cannot see it (no later state), the sampling checks must"),
        Fault("dropped_group", frozenset({BatchReason.BAD_GROUPS.value}),
              "the group of a prompt the worker failed left out, every other group complete"),
        Fault("draw_of_another_version", frozenset({BatchReason.WRONG_ROOT.value}),
              "tasks and seed drawn under another manifest root than the claimed version's"),
        # Refused by the trainer's intake as "step-ahead" (it sees every batch of the worker), not by a
        # validator (node/rollouts/steps.py "Who judges what"); a step used twice the validator's
        # service refuses against its store: tests/test_redteam_steps.py.
        Fault("ground_step", frozenset({"step-ahead"}),
              "a step far above the worker's last, picked by scanning free draws for easy tasks"),
    )
}
