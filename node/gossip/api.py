"""What other services may ask of membership (:class:`node.gossip.service.Membership` is the real one),
and what membership needs from the relay side: addresses to advertise, and dials of relayed ones.

``typing.Protocol`` s so unit tests can hand a service a small fake instead of a running node.
"""

from __future__ import annotations

from typing import Protocol


class MembershipAPI(Protocol):
    def members(self) -> dict[str, str]:
        """Alive peer id -> role."""

    def addrs_of(self, peer_id: str) -> list[str]:
        """The addresses a member advertises in its record ([] if unknown)."""

    def update(self, **fields) -> None:
        """Change our record (checkpoints held, load, capacity...); it is republished at once. Hand
        every checkpoint version held: the record keeps the newest that fit."""


class RelayAPI(Protocol):
    """The relay side of this node (client or HOP: :mod:`node.reach.relay`)."""

    def circuit_addrs(self) -> list[str]:
        """Relayed addresses others can dial us on ([] when we hold no reservation)."""

    async def connect_addr(self, addr: str) -> str:
        """Connect to a full multiaddr, direct or ``/p2p-circuit``; returns the remote peer id."""


class HeldVersions(Protocol):
    """The shards side of this node, as far as our record goes."""

    def versions_held(self) -> list[int]:
        """Complete checkpoint versions held here, oldest first."""

    def peers_in_use(self) -> set[str]:
        """The peers our running checkpoint downloads chose (their sessions, dials in flight):
        membership never prunes them. Never the peers downloading from us: they choose themselves,
        and protected, a crowd of them would leave only honest connections to prune."""
