"""Which validator checks a batch: rendezvous (highest-random-weight) hashing over live validators.

Thaler & Ravishankar, "Using name-based mappings to increase hit rates" (IEEE/ACM ToN 1998): each
(batch, validator) pair gets a score ``H(batch_id || validator)``; the batch goes to the validator
with the highest score. Every trainer computes the same answer from the same member view with no
coordination, the load spreads evenly, and when a validator leaves only *its* batches move (each to
its own second choice), which is what "re-assign after a timeout when one goes silent" needs:
the trainer walks :func:`validator_ranking` past the silent ones.

Pure: no clock, no network. The scores use the project's content hash (node/hashes.py). It lives
with the rollout batches, not in validator/, because trainers and validators both need it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from ..hashes import digest


def _score(batch_id: bytes, validator: str) -> bytes:
    # Length-prefix the id so (id, validator) pairs cannot collide by shifting bytes between parts.
    return digest(len(batch_id).to_bytes(2, "big") + batch_id + validator.encode())


def validator_ranking(batch_id: bytes, validators: Iterable[str]) -> list[str]:
    """All distinct ``validators`` in preference order for ``batch_id`` (first = assigned).

    Ties (impossible in practice with SHA-256) break by peer id so the order is total.
    """
    return sorted(set(validators), key=lambda v: (_score(batch_id, v), v), reverse=True)


def assign_validator(batch_id: bytes, live_validators: Collection[str], exclude: Collection[str] = ()) -> str | None:
    """The validator that should check ``batch_id``: the best-ranked live one not in ``exclude``.

    ``exclude`` holds validators that went silent on this batch (timed out), so a retry moves the
    batch to its next choice. ``None`` when no validator is left: the caller keeps the batch spooled.
    """
    skip = set(exclude)
    for v in validator_ranking(batch_id, live_validators):
        if v not in skip:
            return v
    return None
