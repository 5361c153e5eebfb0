"""Every reason a node refuses a peer's frame, stream or batch, and what follows from it: one table.

How this works (h11's "whose fault" split, STYLE.md 6): each :class:`Refusal` is one line, its wire
spelling and its traits. Code that decides what a refusal leads to reads the member's property, never
a set of its own:

* ``fault``: the sender's doing, so it is struck (the trainer's intake, node/trainer/service.py) or
  reported to the peer table (node/net/reqres.py). Not a fault: lag (``stale``), replays a third
  party can cause, our own load, a stream that broke (a peer that crashed leaves that behind), the
  step window (with several trainers an honest worker's steps jump: node/rollouts/steps.py, "Known
  limit"), the quota. ``stalled`` is a fault, struck where the stream layer sees it (node/net/budget.py);
* ``transient``: "not now" rather than "never": the worker's outbox keeps the batch and backs the
  trainer off (node/inference/outbox.py). Never a fault;
* ``keeps_window``: the batch did not use up its step in the worker's step window: the trainer's
  intake does not record the step, and the worker's outbox does not count it (node/rollouts/steps.py);
* ``recorded``: a refused batch is recorded against its worker in the ledger; not for refusals that
  say nothing about the worker's honesty or that a third party can cause (replaying a signed batch);
* ``transport``: the stream broke (reset, or EOF inside a frame), not a message that was wrong;
* ``verdict``: the validator's spelling (node/validator/pipeline.py ``BatchReason``, snake_case, in
  signed verdicts) of a step-window refusal, which the trainer and the worker spell in kebab-case.

The values travel (acks, metrics labels, status keys, ledger entries): never rename one that has
shipped. A new reason is one line here; its traits decide what every module does with it.
"""

from __future__ import annotations

import enum

FAULT = 1
TRANSIENT = 2
KEEPS_WINDOW = 4
UNRECORDED = 8  # not recorded against the worker in the ledger
TRANSPORT = 16
NOT_NOW = TRANSIENT | KEEPS_WINDOW | UNRECORDED  # busy, the quota: retried, nothing used up, nothing held against


class Refusal(enum.StrEnum):
    # --- the trainer's intake of a batch (node/trainer/intake.py, node/trainer/service.py)
    DUPLICATE = "duplicate", KEEPS_WINDOW | UNRECORDED  # a batch id seen before: anyone can replay a signed batch
    DUPLICATE_STEP = "duplicate-step", FAULT | KEEPS_WINDOW, "replayed"  # a second batch for one (worker, step)
    STEP_AHEAD = "step-ahead", KEEPS_WINDOW, "step_ahead"  # far above the worker's highest step
    STEP_BEHIND = "step-behind", KEEPS_WINDOW, "step_behind"  # below the worker's window
    BANNED = "banned", KEEPS_WINDOW, "banned"  # the sender is banned (peer table or ledger)
    WRONG_ROOT = "wrong-root", FAULT  # policy_root is not the root announced for its version
    STALE = "stale", 0  # a policy version older than the async level allows
    FUTURE = "future", 0  # a policy version newer than ours
    EMPTY = "empty", FAULT
    ENGINE_REFUSED = "engine_refused", FAULT  # snake_case: it shipped so, as the validator's reason
    WRONG_TEMPERATURE = "wrong-temperature", FAULT
    BAD_GROUP = "bad-group", FAULT
    EMPTY_SAMPLE = "empty-sample", FAULT
    TOO_LONG = "too-long", FAULT
    BAD_TOKEN = "bad-token", FAULT
    BUSY = "busy", NOT_NOW  # our queue or every stream slot is taken
    QUOTA = "quota", NOT_NOW  # this worker's allowance this interval (node/rollouts/quota.py)
    QUOTA_NEW = "quota-new", NOT_NOW  # the pool of workers without accepted history
    # A trainer still loading its model (node/trainer/readiness.py): it judged nothing.
    NOT_READY = "not-ready", NOT_NOW
    # Understood by the worker's outbox as "not now"; no trainer of this version sends them.
    OVERLOADED = "overloaded", TRANSIENT
    SHUTTING_DOWN = "shutting-down", TRANSIENT
    # --- opening a signed message (node/wire.py, node/rollouts/schema.py)
    OVERSIZED = "oversized", FAULT
    MALFORMED = "malformed", FAULT
    BAD_MESSAGE = "bad-message", FAULT
    UNKNOWN_TYPE = "unknown-type", FAULT
    WRONG_TYPE = "wrong-type", FAULT
    BAD_VERSION = "bad-version", FAULT
    UNKNOWN_FIELD = "unknown-field", FAULT
    MISSING_FIELD = "missing-field", FAULT
    BAD_FIELD = "bad-field", FAULT
    BAD_LENGTH = "bad-length", FAULT
    OUT_OF_BOUNDS = "out-of-bounds", FAULT
    WRONG_DOMAIN = "wrong-domain", FAULT
    BAD_SIGNATURE = "bad-signature", FAULT
    WRONG_RUN = "wrong-run", FAULT
    FORGED = "forged", FAULT  # signed by another key than the worker it names
    NOT_VALIDATOR = "not-validator", FAULT
    CONTRADICTORY_VERDICT = "contradictory-verdict", FAULT
    WRONG_ACK = "wrong-ack", FAULT  # an ack for another batch than the one sent
    # --- the stream (node/wire.py, node/net/budget.py, node/net/reqres.py)
    STREAM_ERROR = "stream-error", TRANSPORT
    TRUNCATED = "truncated", TRANSPORT
    TIMEOUT = "timeout", 0  # too slow: counted, never struck (a loaded honest peer is slow too)
    STALLED = "stalled", FAULT  # held a stream slot without sending
    PEER_STREAMS = "peer-streams", 0  # the peer already holds its share of streams: refused for a moment
    PEER_BYTES = "peer-bytes", 0  # its frames in flight hold its share of bytes
    BUSY_BYTES = "busy-bytes", 0  # the protocol's byte budget is spent
    STOPPING = "stopping", 0  # we are stopping: the sender retries later or elsewhere
    # --- a validator's answer to a trainer that asks for a verdict (node/validator/service.py)
    NO_CHECKPOINT = "no-checkpoint", 0  # it could not get the batch's checkpoint: judged by nobody yet

    def __new__(cls, wire: str, traits: int, verdict: str | None = None) -> Refusal:
        if traits & TRANSIENT and traits & FAULT:
            raise ValueError(f"{wire}: a transient refusal is nobody's fault")
        member = str.__new__(cls, wire)
        member._value_ = wire
        member.traits = traits
        member.verdict = verdict
        return member

    @property
    def fault(self) -> bool:
        return bool(self.traits & FAULT)

    @property
    def transient(self) -> bool:
        return bool(self.traits & TRANSIENT)

    @property
    def keeps_window(self) -> bool:
        return bool(self.traits & KEEPS_WINDOW)

    @property
    def recorded(self) -> bool:
        return not self.traits & UNRECORDED

    @property
    def transport(self) -> bool:
        return bool(self.traits & TRANSPORT)


def having(prop: str, value: bool = True) -> frozenset[str]:
    """The wire spellings of the refusals whose property ``prop`` is ``value``, for ``in`` tests on
    reasons read off the wire (plain strings)."""
    return frozenset(r.value for r in Refusal if getattr(r, prop) is value)


# A reason outside the table (another component's RemoteProtocolError) is a fault, as it always was:
# so the code tests "not in NOT_FAULTS", never "in" a set of faults.
NOT_FAULTS = having("fault", False)
TRANSIENT_REASONS = having("transient")
KEEPS_WINDOW_REASONS = having("keeps_window")
UNRECORDED_REASONS = having("recorded", False)
TRANSPORT_FAILURES = having("transport")
