"""One submission of a signed rollout batch to a trainer over ``/swarm/rollouts/1.0.0`` (I/O).

Client side of node/rollouts/protocols.py ``ROLLOUTS``: open a stream to a trainer, write one
length-prefixed frame holding the encoded signed :class:`~node.wire.Envelope` of a
:class:`~node.rollouts.schema.RolloutBatch` (at most ``MAX_FRAME`` bytes: a step too big for one
frame is not sent, node/rollouts/assemble.py), read one frame holding a
:class:`~node.rollouts.schema.RolloutAck` for that batch id, close. :func:`call_submit` does this
with a deadline and turns every way it can fail into a :class:`SubmitFailure` naming whose fault it
was; the outbox (node/inference/outbox.py) decides what follows.
"""

from __future__ import annotations

from ..net.failure import CallFailure, FailureKind
from ..rollouts.protocols import ROLLOUTS
from ..rollouts.schema import RolloutAck
from ..wire import LocalProtocolError

# Why a submission got no ack, and the exception that says so (node/net/failure.py).
SubmitFailure = CallFailure


async def call_submit(host, trainer: str, batch_id: bytes, envelope: bytes, timeout: float) -> RolloutAck:
    """Send one signed batch to ``trainer`` and return its ack; :class:`SubmitFailure` otherwise.

    ``host`` is a :class:`~node.net.host.SwarmHost` (anything with ``open_stream(peer, protocol)``).
    """
    if len(envelope) > ROLLOUTS.request.max_size:  # what the trainer reads (node/rollouts/protocols.py)
        raise LocalProtocolError(f"batch of {len(envelope)} bytes exceeds one frame: split it before signing")
    ack = await ROLLOUTS.call(host, trainer, envelope, timeout)
    if ack.batch_id != batch_id:
        raise SubmitFailure(FailureKind.GARBAGE, "ack for another batch", "wrong-ack")
    return ack
