"""The three request/response protocols of the loop, each one :class:`~node.net.reqres.RequestResponse`
shared by its server and its clients (DESIGN.md steps 3-5), all answered with the ack of
node/rollouts/ack.py:

* ``/swarm/rollouts/1.0.0``: a worker hands a signed batch to a trainer (node/inference/submit.py
  ``call_submit``); the trainer sizes its intake budget from ``[trainer]`` when it serves it;
* ``/swarm/verify/1.0.0``: a trainer hands a spooled batch to the validator the gate assigned;
* ``/swarm/verdicts/1.0.0``: a validator delivers its signed verdicts, many on one stream.

Budgets are for the few peers each server expects (trainers and validators are listed in the run):
a peer that needs more than its share waits for a slot, it is not refused.
"""

from __future__ import annotations

from ..net.budget import limits
from ..net.reqres import RequestResponse, raw
from ..wire import MAX_FRAME
from .ack import ACK_CODEC
from .schema import MAX_BATCH_BYTES, ROLLOUTS_PROTOCOL, VERDICTS_PROTOCOL, VERIFY_PROTOCOL

EXCHANGE_TIMEOUT = 30.0  # seconds a peer may take to send its frame, and to answer one
MAX_BATCH_FRAME = min(MAX_FRAME, MAX_BATCH_BYTES)  # a batch must also fit one frame to a validator
MAX_VERIFY_STREAMS = 16  # batches a validator reads from trainers at once (trainers are few; others wait)
# ... of which one trainer may hold: only trainers of the run are admitted, and a trainer hands
# over batches in bursts, so its share is large, but never all (node/net/budget.py).
MAX_VERIFY_PER_TRAINER = 12
MAX_VERDICT_FRAME = 1024 * 1024
MAX_VERDICT_STREAMS = 16  # verdict streams a trainer serves at once (validators are few; others wait)
MAX_VERDICTS_PER_STREAM = 256  # verdict frames on one stream before the trainer closes it (bounded work)

# The trainer's intake: its budget comes from [trainer] max_concurrent_intake / max_intake_per_peer.
ROLLOUTS: RequestResponse = RequestResponse(ROLLOUTS_PROTOCOL, raw(MAX_BATCH_FRAME), ACK_CODEC, EXCHANGE_TIMEOUT,
                                            source="rollouts")
VERIFY: RequestResponse = RequestResponse(VERIFY_PROTOCOL, raw(MAX_FRAME), ACK_CODEC, EXCHANGE_TIMEOUT,
                                          limits=limits(MAX_VERIFY_STREAMS, MAX_FRAME, per_peer=MAX_VERIFY_PER_TRAINER))
VERDICTS: RequestResponse = RequestResponse(VERDICTS_PROTOCOL, raw(MAX_VERDICT_FRAME), ACK_CODEC, EXCHANGE_TIMEOUT,
                                            max_inflight=MAX_VERDICT_STREAMS, per_stream=MAX_VERDICTS_PER_STREAM,
                                            source="verdicts")
