"""The trainer's intake before it can take batches: ``not-ready``, with a retry time.

A trainer node starts its core first, membership included, so its record is in every member table
while its model and spool are still loading (15-36 s at the soak's load, issue 45). A worker that
submits then used to find no ``/swarm/rollouts/1.0.0`` handler, counted a failure and backed the
trainer off exponentially (8-16 s by the time the trainer was ready). So the role serves the
protocol from before its core starts with :func:`not_ready_handler`, and the trainer service
replaces it with the real intake once it takes batches. The answer is the transient refusal
``not-ready`` (node/refusals.py) with ``retry_after_ms``: the worker's outbox keeps the batch,
counts no failure and tries again after that wait (node/inference/outbox.py ``on_ack``).

Why this and not a record published only when ready: membership, shards and the ledger need the
record at once (the trainer seeds its checkpoints and syncs its ledger while it loads). Why it
cannot be abused: workers submit only to the run's trainers, the answer comes on a stream to that
peer id, and the outbox caps any wait a trainer names at its ``backoff_max_s``.
"""

from __future__ import annotations

from dataclasses import replace

from ..hashes import digest
from ..net.budget import limits
from ..refusals import Refusal
from ..rollouts.protocols import MAX_BATCH_FRAME, ROLLOUTS
from ..rollouts.schema import RolloutAck, batch_id_of
from ..wire import Envelope, RemoteProtocolError, decode_as
from .config import TrainerConfig

# Seconds a worker waits before offering a batch again to a trainer that is still loading. Short:
# the worker is back at most this long after the trainer is ready; each try is one small frame.
NOT_READY_RETRY_S = 2.0


def intake_protocol(tcfg: TrainerConfig):
    """``/swarm/rollouts/1.0.0`` under the trainer's intake budget (the same before and after ready)."""
    return replace(ROLLOUTS, limits=limits(tcfg.max_concurrent_intake, MAX_BATCH_FRAME,
                                           per_peer=tcfg.max_intake_per_peer))


def not_ready_ack(data: bytes) -> RolloutAck:
    """``not-ready`` for the batch in ``data`` (its id is what the worker checks the ack against);
    a frame that is no envelope gets its digest, as the real intake answers it."""
    try:
        batch_id = batch_id_of(decode_as(Envelope, data, MAX_BATCH_FRAME))
    except RemoteProtocolError:
        batch_id = digest(data)
    return RolloutAck(batch_id=batch_id, accepted=False, reason=Refusal.NOT_READY.value,
                      retry_after_ms=int(NOT_READY_RETRY_S * 1000))


def not_ready_handler(node, tcfg: TrainerConfig, streams):
    """The stream handler that answers every batch :func:`not_ready_ack` (no strike: nothing was judged)."""

    async def answer(sender: str, data: bytes) -> RolloutAck:
        return not_ready_ack(data)

    return intake_protocol(tcfg).handler(answer, streams=streams, peers=node.peers, metrics=node.metrics)
