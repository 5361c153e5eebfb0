"""Why a request/response call got no usable reply: the outcome every caller sorts on, kept apart
from the trio code of node/net/reqres.py so that pure state machines (the worker's outbox,
node/inference/outbox.py) can take it as an input. Pure: no I/O."""

from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    """Why a call got no usable reply. All are the remote's or the network's doing, never ours."""

    UNREACHABLE = "unreachable"  # could not open a stream
    TIMEOUT = "timeout"  # no reply before the deadline
    STREAM = "stream"  # the stream broke (reset, EOF before the reply)
    GARBAGE = "garbage"  # a reply that does not decode, or answers another request


class CallFailure(Exception):
    def __init__(self, kind: FailureKind, detail: str = "", reason: str = "") -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind
        self.detail = detail
        self.reason = reason or kind.value  # the RemoteProtocolError reason for GARBAGE
