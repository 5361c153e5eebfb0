"""Membership messages: peer records, suspicion, death and goodbye, each in a signed envelope.

A record is signed by the peer it describes; suspicion and death are signed by the accuser and
name the record sequence number they are about, so a live peer refutes them simply by publishing a
record with a higher sequence number (SWIM's incarnation numbers, Das et al. 2002, section 4.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..identity import peer_id_of
from ..wire import Envelope, Message, RemoteProtocolError, bounded, decode_as, register

MAX_ADDRS = 8
MAX_ADDR_LEN = 256
MAX_PEER_ID = 64
MAX_RECORD_BYTES = 4096  # one envelope on the members topic
MAX_VERSIONS = 16  # checkpoint versions advertised in a record
REACHABILITY = ("public", "private", "unknown")  # node/reach/reachability.py's states

DOMAIN_RECORD = "member-record"
DOMAIN_SUSPECT = "member-suspect"
DOMAIN_DEAD = "member-dead"
DOMAIN_GOODBYE = "member-goodbye"


@register
@dataclass(frozen=True)
class PeerRecord(Message):
    """What a peer says about itself. ``seq`` only grows (wall-clock ms at start, +1 per change)."""

    TYPE: ClassVar[str] = "member.record"
    run: str = bounded(max_len=64)
    peer_id: str = bounded(max_len=MAX_PEER_ID)
    role: str = bounded(max_len=16)
    addrs: list[str] = bounded(max_len=MAX_ADDRS, item_max_len=MAX_ADDR_LEN)
    software: str = bounded(max_len=32)
    seq: int = bounded(min=0, max=2**63 - 1)
    capabilities: list[str] = bounded(max_len=16, default_factory=list)
    checkpoints: list[int] = bounded(max_len=MAX_VERSIONS, default_factory=list)  # versions held
    load: float = bounded(min=0.0, max=1e9, default=0.0)  # role-defined (queue depth, GPU busy...)
    capacity: float = bounded(min=0.0, max=1e12, default=0.0)  # role-defined (tokens/s, upload B/s)
    # Can peers dial us directly? ``public | private | unknown`` (node/reach/reachability.py); a
    # private peer is reached through the /p2p-circuit addresses among ``addrs``.
    reachability: str = bounded(max_len=16, default="unknown")

    def __post_init__(self) -> None:
        if self.reachability not in REACHABILITY:
            raise ValueError(f"reachability {self.reachability!r} is not one of {', '.join(REACHABILITY)}")


@register
@dataclass(frozen=True)
class Accusation(Message):
    """``accuser`` believes ``target`` (at record ``seq``) is suspect or dead."""

    TYPE: ClassVar[str] = "member.accusation"
    run: str = bounded(max_len=64)
    target: str = bounded(max_len=MAX_PEER_ID)
    seq: int = bounded(min=0, max=2**63 - 1)
    accuser: str = bounded(max_len=MAX_PEER_ID)


@register
@dataclass(frozen=True)
class Goodbye(Message):
    """A peer leaves on purpose (clean shutdown)."""

    TYPE: ClassVar[str] = "member.goodbye"
    run: str = bounded(max_len=64)
    peer_id: str = bounded(max_len=MAX_PEER_ID)
    seq: int = bounded(min=0, max=2**63 - 1)


@dataclass(frozen=True)
class Signed:
    """A checked membership message with the envelope it came in (kept for re-gossip/sync)."""

    domain: str
    message: PeerRecord | Accusation | Goodbye
    envelope: Envelope


_DOMAINS: dict[str, type[Message]] = {
    DOMAIN_RECORD: PeerRecord,
    DOMAIN_SUSPECT: Accusation,
    DOMAIN_DEAD: Accusation,
    DOMAIN_GOODBYE: Goodbye,
}


def open_membership(data: bytes, run: str) -> Signed:
    """Check one membership message from the network: size, envelope, signature, schema, run, signer.

    Raises RemoteProtocolError with a reason code; nothing unchecked leaves this function.
    """
    if len(data) > MAX_RECORD_BYTES:
        raise RemoteProtocolError("oversized", f"{len(data)} bytes")
    env = decode_as(Envelope, data, MAX_RECORD_BYTES)
    cls = _DOMAINS.get(env.domain)
    if cls is None:
        raise RemoteProtocolError("wrong-domain", env.domain)
    msg = env.open_as(env.domain, cls, MAX_RECORD_BYTES)
    if msg.run != run:
        raise RemoteProtocolError("wrong-run", msg.run)
    signer = peer_id_of(env.public_key)
    subject = msg.accuser if isinstance(msg, Accusation) else msg.peer_id
    if signer != subject:
        # A record or goodbye must be signed by the peer it is about; an accusation by its accuser.
        raise RemoteProtocolError("forged", f"signed by {signer[:16]}, claims {subject[:16]}")
    return Signed(env.domain, msg, env)
