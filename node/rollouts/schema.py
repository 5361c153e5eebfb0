"""Rollout batches and verdicts: the messages between inference nodes, trainers and validators.

This is the contract of the loop (DESIGN.md steps 3-5):

* An inference node draws ``prompts_per_batch`` tasks deterministically from (run, its peer id,
  the manifest root of ``policy_version``, ``step``, index; ``step`` inside the window of
  node/rollouts/steps.py), samples ``group_size`` completions of every drawn prompt with that policy,
  scores them, computes group-relative advantages, builds TOPLOC proofs, and signs the batch
  (domain ``rollout-batch``). The batch id is the SHA-256 of the signed payload, so the same
  content signed twice is the same batch (replays are detected by id) and any change is a new id.
* Trainers receive batches over ``/swarm/rollouts/1.0.0`` and answer with a :class:`RolloutAck`.
* Validators sign a :class:`Verdict` (domain ``verdict``) per batch: accept/reject with a reason
  code per sample.

Fields follow what INTELLECT-2 kept per rollout (input/output tokens, advantages, rewards, task
rewards, length penalties, proofs, step, target lengths; later logprobs, problem id, seed,
temperature). Bounds are generous for real models and hard, so a peer cannot make us allocate more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..hashes import digest
from ..identity import peer_id_of
from ..wire import Envelope, Message, RemoteProtocolError, bounded, decode_as, register

ROLLOUTS_PROTOCOL = "/swarm/rollouts/1.0.0"
# Trainer -> assigned validator: one frame holding the signed batch envelope (as received from the
# worker, i.e. ``SignedBatch.envelope``); the validator answers one RolloutAck frame (accepted =
# queued for checking; reason "busy" when its queue is full, so the trainer tries the next one).
VERIFY_PROTOCOL = "/swarm/verify/1.0.0"
# Validator -> trainer, later, on a stream the validator opens: frames each holding one signed Verdict
# envelope; the trainer answers each with a RolloutAck (batch_id of the verdict; accepted = recorded).
VERDICTS_PROTOCOL = "/swarm/verdicts/1.0.0"
DOMAIN_BATCH = "rollout-batch"
DOMAIN_VERDICT = "verdict"

MAX_TOKENS = 8192  # prompt or completion tokens per sample
MAX_SAMPLES = 1024  # samples per batch (e.g. 64 prompts x G = 16)
MAX_PROOF_BYTES = (MAX_TOKENS // 32 + 1) * 258  # TOPLOC proofs for MAX_TOKENS at 32 tokens/chunk
MAX_BATCH_BYTES = 16 * 1024 * 1024  # one signed batch on the wire
MAX_ID = 128
# A sampled token had probability e^-1000 at the least: far below anything a sampler ever draws,
# far above what overflows exp() in the GRPO ratio once the trainer bounds the log-ratio.
MIN_LOGPROB = -1000.0
MAX_ENGINE_NAME = 16
BATCH_DTYPES = ("float32", "bfloat16", "float16")  # the model dtype a batch states it was generated in
# (r - mean) / (std + eps) over a group of G is at most sqrt(G - 1) in size: 32 for G = 1024.
MAX_ADVANTAGE = 1000.0


@register
@dataclass(frozen=True, kw_only=True)
class RolloutSample(Message):
    """One completion of one prompt, with everything a validator needs to re-check it."""

    TYPE: ClassVar[str] = "rollout.sample"
    prompt_index: int = bounded(min=0, max=MAX_SAMPLES)  # index of the task draw within the step
    sample_index: int = bounded(min=0, max=MAX_SAMPLES)  # 0..G-1 within its group
    task_id: str = bounded(max_len=MAX_ID)  # id of the drawn task (checked against the draw)
    prompt_ids: list[int] = bounded(max_len=MAX_TOKENS)
    completion_ids: list[int] = bounded(max_len=MAX_TOKENS)
    # per completion token, tempered distribution: a sampled token was likely enough to be drawn
    logprobs: list[float] = bounded(max_len=MAX_TOKENS, item_min=MIN_LOGPROB, item_max=0.0)
    finish_reason: str = bounded(max_len=16)  # "stop" (eos) | "length"
    reward: float = bounded(min=-1e6, max=1e6)  # total reward used for the advantage
    task_reward: float = bounded(min=-1e6, max=1e6)  # verifier's score
    length_penalty: float = bounded(min=-1e6, max=1e6, default=0.0)
    target_length: int = bounded(min=0, max=MAX_TOKENS, default=0)  # thinking budget, 0 = none
    advantage: float = bounded(min=-MAX_ADVANTAGE, max=MAX_ADVANTAGE)
    proof: bytes = bounded(max_len=MAX_PROOF_BYTES)  # concatenated TOPLOC chunk proofs

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError("one logprob per completion token")


@register
@dataclass(frozen=True, kw_only=True)
class RolloutBatch(Message):
    """Groups of samples from one worker at one step, all made with one policy version."""

    TYPE: ClassVar[str] = "rollout.batch"
    VERSION: ClassVar[int] = 3  # 2: policy_root (the draw is keyed by it); 3: engine and dtype
    run: str = bounded(max_len=64)
    worker: str = bounded(max_len=MAX_ID)  # peer id of the inference node (must be the signer)
    step: int = bounded(min=0, max=2**62)  # the worker's draw step (task draw input)
    policy_version: int = bounded(min=0, max=2**62)  # checkpoint version that generated it
    # Root (manifest id) of that version's signed manifest: a draw input (node.rl.spec.step_key), so
    # no draw exists before the version does. Trainers and validators check it is the announced one.
    policy_root: bytes = bounded(exact_len=32, default=bytes(32))
    taskset: str = bounded(max_len=MAX_ID)
    seed: int = bounded(min=0, max=2**63 - 1)  # base sampling seed (per-sequence seeds derive from it)
    temperature: float = bounded(min=0.0, max=100.0)
    top_p: float = bounded(min=0.0, max=1.0)
    max_new_tokens: int = bounded(min=1, max=MAX_TOKENS)
    group_size: int = bounded(min=1, max=MAX_SAMPLES)
    created_ms: int = bounded(min=0, max=2**62)
    samples: list[RolloutSample] = bounded(max_len=MAX_SAMPLES)
    # The engine that generated the batch (``Engine.name``: "torch" | "vllm") and the dtype it ran the
    # model in. Signed with the rest: the run file says which engines it accepts and which checks
    # apply to each ([inference] engines / replay_engines), so a batch is judged by what made it.
    engine: str = bounded(max_len=MAX_ENGINE_NAME, default="torch")
    dtype: str = bounded(max_len=16, default="float32")

    def __post_init__(self) -> None:
        if self.dtype not in BATCH_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(BATCH_DTYPES)}")
        if not self.engine or not self.engine.isascii() or not self.engine.replace("-", "").isalnum():
            raise ValueError(f"engine {self.engine[:16]!r} is not an engine name")


@register
@dataclass(frozen=True, kw_only=True)
class RolloutAck(Message):
    """A trainer's answer to a submitted batch."""

    TYPE: ClassVar[str] = "rollout.ack"
    batch_id: bytes = bounded(exact_len=32)
    accepted: bool = False
    reason: str = bounded(max_len=64, default="")  # reason code when refused
    trainer_step: int = bounded(min=0, max=2**62, default=0)  # lets the worker notice it is stale
    # Back-pressure (node/trainer/pacing.py): the sender should not send (nor generate) another batch
    # for this trainer before this many milliseconds; with ``busy`` it says when to resubmit this one.
    retry_after_ms: int = bounded(min=0, max=3_600_000, default=0)


@register
@dataclass(frozen=True, kw_only=True)
class Verdict(Message):
    """A validator's signed judgement of one batch."""

    TYPE: ClassVar[str] = "rollout.verdict"
    run: str = bounded(max_len=64)
    batch_id: bytes = bounded(exact_len=32)
    worker: str = bounded(max_len=MAX_ID)
    validator: str = bounded(max_len=MAX_ID)  # must be the signer, and a validator of the run
    accepted: bool = False
    reasons: list[str] = bounded(max_len=MAX_SAMPLES)  # one reason code per sample ("ok" if it passed)
    policy_version: int = bounded(min=0, max=2**62)
    created_ms: int = bounded(min=0, max=2**62)
    # Non-empty: not a judgement but "cannot judge yet" (e.g. "no-checkpoint"): no reasons, not
    # accepted, nothing recorded against the worker; the trainer moves the batch on (node/trainer/gate.py).
    unjudged: str = bounded(max_len=64, default="")


# Why a validator cannot judge a batch yet, in its ack or an ``unjudged`` verdict: "not now", no blame.
UNJUDGED_NO_CHECKPOINT = "no-checkpoint"


@dataclass(frozen=True)
class SignedBatch:
    """A checked batch, its id and the envelope bytes (kept for spooling and forwarding)."""

    batch: RolloutBatch
    batch_id: bytes
    envelope: bytes


def batch_id_of(envelope: Envelope) -> bytes:
    return digest(envelope.payload)


def open_batch(data: bytes, run: str) -> SignedBatch:
    """Check a signed batch from the network: size, signature, schema, run, signer == worker."""
    if len(data) > MAX_BATCH_BYTES:
        raise RemoteProtocolError("oversized", f"batch of {len(data)} bytes")
    env = decode_as(Envelope, data, MAX_BATCH_BYTES)
    batch = env.open_as(DOMAIN_BATCH, RolloutBatch, MAX_BATCH_BYTES)
    if batch.run != run:
        raise RemoteProtocolError("wrong-run", batch.run)
    if peer_id_of(env.public_key) != batch.worker:
        raise RemoteProtocolError("forged", "batch not signed by its worker")
    return SignedBatch(batch, batch_id_of(env), data)


def open_verdict(data: bytes, run: str, validators: set[str]) -> Verdict:
    """Check a signed verdict: signature, schema, run, signer == validator, validator of the run."""
    env = decode_as(Envelope, data, 1024 * 1024)
    verdict = env.open_as(DOMAIN_VERDICT, Verdict, 1024 * 1024)
    if verdict.run != run:
        raise RemoteProtocolError("wrong-run", verdict.run)
    signer = peer_id_of(env.public_key)
    if signer != verdict.validator:
        raise RemoteProtocolError("forged", "verdict not signed by its validator")
    if signer not in validators:
        raise RemoteProtocolError("not-validator", signer[:16])
    if verdict.unjudged and (verdict.accepted or verdict.reasons):
        raise RemoteProtocolError("contradictory-verdict", "an unjudged verdict with a judgement")
    return verdict
