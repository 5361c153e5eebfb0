"""The rollout protocols' answer frame is read by one codec (node/rollouts/ack.py) at every caller:
the worker's submit, the trainer's hand-over to a validator, the validator's verdict delivery."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.rollouts.ack import ACK_CODEC, MAX_ACK_BYTES
from node.rollouts.schema import RolloutAck
from node.wire import RemoteProtocolError, encode

NODE = Path(__file__).resolve().parents[1] / "node"


def test_an_ack_round_trips():
    ack = RolloutAck(batch_id=bytes(range(32)), accepted=False, reason="quota", trainer_step=7, retry_after_ms=1500)
    assert ACK_CODEC.decode(encode(ack)) == ack


def test_a_frame_that_is_not_an_ack_is_garbage():
    from node.rollouts.schema import Verdict  # another message of the same protocols

    assert ACK_CODEC.max_size == MAX_ACK_BYTES
    with pytest.raises(RemoteProtocolError) as e:
        ACK_CODEC.decode(b"\x00" * (MAX_ACK_BYTES + 1))
    assert e.value.reason == "oversized"
    verdict = Verdict(run="r", batch_id=bytes(32), worker="w", validator="v", reasons=["ok"], policy_version=1,
                      created_ms=1)
    with pytest.raises(RemoteProtocolError) as e:
        ACK_CODEC.decode(encode(verdict))
    assert e.value.reason == "wrong-type"


def test_no_caller_builds_its_own_ack_codec():
    own = [p.relative_to(NODE) for p in NODE.rglob("*.py")
           if p.name != "ack.py" and "decode_as(RolloutAck" in p.read_text()]
    assert not own, f"decode RolloutAck through node.rollouts.ack.ACK_CODEC: {own}"
