"""Turning one step's generations into a signed, size-capped rollout batch. Pure (no I/O, no clock).

Inputs are what the inference loop already has: the drawn tasks, the engine's samples grouped per
prompt (token ids, log-probs, finish reason), the verifier rewards, and one list of TOPLOC chunk
proofs per sample. Outputs are :class:`~node.rollouts.schema.RolloutSample` messages and the sealed
envelope of a :class:`~node.rollouts.schema.RolloutBatch`.

Proof bytes: ``RolloutSample.proof`` is the concatenation of the sample's chunk proofs in chunk
order (:func:`join_proofs`). Each chunk proof is ``2 + 2k`` bytes (TOPLOC 0.1.6 format, see
node/proofs/toploc.py) with ``k = min(topk, tokens_in_chunk * hidden_size)``, so a validator that
knows the model's hidden size splits them back with :func:`split_proofs`.

Size cap: one batch must fit one wire frame, and a batch must hold every prompt drawn for its step
(node/validator/pipeline.py ``check_groups``: otherwise a worker could drop the prompts it failed).
So nothing is trimmed: a step whose batch does not fit is not sent at all (:func:`seal_within`
returns None, the role counts it as ``dropped/oversized`` and logs how to fix the run file: fewer
``[rl] prompts_per_batch`` or ``max_new_tokens``). Dropping a whole step pays nothing: its step number
is used up, and the worker cannot choose another draw in its place (node/rollouts/steps.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..rl.spec import Scored
from ..wire import encode, seal
from .schema import DOMAIN_BATCH, RolloutBatch, RolloutSample, batch_id_of


def join_proofs(chunks: Sequence[bytes]) -> bytes:
    return b"".join(chunks)


def chunk_proof_sizes(num_tokens: int, hidden_size: int, chunk_tokens: int, topk: int) -> list[int]:
    """Byte size of each chunk proof of a completion of ``num_tokens`` tokens."""
    sizes = []
    for start in range(0, num_tokens, chunk_tokens):
        k = min(topk, min(chunk_tokens, num_tokens - start) * hidden_size)
        sizes.append(2 + 2 * k)
    return sizes


def split_proofs(data: bytes, num_tokens: int, hidden_size: int, chunk_tokens: int, topk: int) -> list[bytes] | None:
    """The chunk proofs of :func:`join_proofs` output, or None when the length does not fit."""
    sizes = chunk_proof_sizes(num_tokens, hidden_size, chunk_tokens, topk)
    if sum(sizes) != len(data):
        return None
    out, at = [], 0
    for n in sizes:
        out.append(bytes(data[at : at + n]))
        at += n
    return out


def make_samples(
    groups: Sequence[Sequence[object]],
    task_ids: Sequence[str],
    scores: Sequence[Sequence[Scored]],
    advantages: Sequence[Sequence[float]],
    proofs: Sequence[Sequence[bytes]],
) -> list[RolloutSample]:
    """RolloutSamples from engine samples (``node.engines.base.Sample``), grouped per prompt.

    ``proofs`` is flat, one list of chunk proofs per sample, in group order.
    """
    if not len(groups) == len(task_ids) == len(scores) == len(advantages):
        raise ValueError("one task id, score list and advantage list per group")
    out: list[RolloutSample] = []
    flat = iter(proofs)
    for group, task_id, group_scores, group_adv in zip(groups, task_ids, scores, advantages):
        if not len(group) == len(group_scores) == len(group_adv):
            raise ValueError("one score and one advantage per sample")
        for s, sc, adv in zip(group, group_scores, group_adv):
            out.append(RolloutSample(
                prompt_index=s.prompt_index,
                sample_index=s.sample_index,
                task_id=task_id,
                prompt_ids=list(s.prompt_ids),
                completion_ids=list(s.completion_ids),
                logprobs=[float(x) for x in s.logprobs],
                finish_reason=s.finish_reason,
                reward=float(sc.reward),
                task_reward=float(sc.task_reward),
                length_penalty=float(sc.length_penalty),
                target_length=int(sc.target_length),
                advantage=float(adv),
                proof=join_proofs(next(flat)),
            ))
    if next(flat, None) is not None:
        raise ValueError("more proof lists than samples")
    return out


@dataclass(frozen=True)
class Sealed:
    batch: RolloutBatch
    batch_id: bytes
    envelope: bytes  # encoded signed Envelope, what goes on the wire


def seal_batch(identity, batch: RolloutBatch) -> tuple[bytes, bytes]:
    """(batch id, encoded envelope) of ``batch`` signed by ``identity`` for the rollout-batch domain."""
    env = seal(identity, DOMAIN_BATCH, batch)
    return batch_id_of(env), encode(env)


def seal_within(identity, batch: RolloutBatch, max_bytes: int) -> Sealed | None:
    """Sign ``batch`` whole; None when it does not fit ``max_bytes`` (never trimmed: see the module doc)."""
    batch_id, envelope = seal_batch(identity, batch)
    return Sealed(batch, batch_id, envelope) if len(envelope) <= max_bytes else None
