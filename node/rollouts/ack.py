"""How the answer frame of the rollout protocols is read: a :class:`RolloutAck` (the trainer's
answer to a worker's batch, a validator's to a trainer's batch, a trainer's to a validator's
verdict), at most :data:`MAX_ACK_BYTES`. One codec for every caller, so they cannot drift apart."""

from __future__ import annotations

from ..net.reqres import Codec
from ..wire import decode_as
from .schema import RolloutAck

MAX_ACK_BYTES = 4096  # a RolloutAck is ~100 bytes; anything bigger is garbage
ACK_CODEC: Codec[RolloutAck] = Codec(MAX_ACK_BYTES, lambda frame: decode_as(RolloutAck, frame, MAX_ACK_BYTES))
