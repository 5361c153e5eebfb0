"""What other services may ask of the shards service (:class:`node.shards.service.ShardsService` is
the real one). A ``typing.Protocol`` so unit tests can hand a service a small fake.

New versions are delivered, not polled: :meth:`ShardsAPI.wait_newer` returns once a complete
version newer than the caller's is held, :meth:`ShardsAPI.wait_announced` once a trainer announced one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol


class ShardsAPI(Protocol):
    announced: Mapping[int, tuple[bytes, str]]  # version -> (manifest root, announcer)

    def latest(self) -> int | None:
        """The newest complete version held, or None."""

    def path_of(self, version: int) -> Path | None:
        """The model folder of a complete version, else None."""

    def versions_held(self) -> list[int]:
        """Complete versions held, oldest first."""

    async def wait_version(self, version: int) -> Path:
        """Wait until ``version`` is complete here; returns its folder."""

    async def wait_newer(self, version: int | None) -> int:
        """Wait until a complete version newer than ``version`` (any, if None) is held; returns the newest."""

    async def wait_announced(self, version: int) -> int:
        """Wait until a version newer than ``version`` is announced; returns the newest announced."""

    def want_version(self, version: int) -> None:
        """A version ``version`` or newer exists (a trainer said so): should no announcement of one
        arrive within a re-announcement period, ask a peer for its newest manifest."""

    def fetch(self, version: int, root: bytes, source: str) -> None:
        """Download ``version`` whatever the fetch policy (a validator needs old versions too)."""

    async def publish(self, folder: Path, version: int) -> Any:
        """Hash, store, seed and announce ``folder`` as ``version``; returns the signed manifest."""

    def peers_in_use(self) -> set[str]:
        """The peers our running downloads chose (their sessions, and their dials in flight):
        membership's connection manager does not prune them. Never the peers downloading from us,
        who chose themselves (protected, a crowd of them would crowd out every honest connection)."""


class MemberAddrs(Protocol):
    """What the shards service reads of membership (:class:`node.gossip.service.Membership` is the
    real one): the live members and the addresses their records advertise, so that a download short
    of direct peers dials public ones (node/shards/peering.py). Handed to a running service with
    :meth:`node.shards.service.ShardsService.use_members`: membership starts after shards, since
    its record lists the versions shards holds."""

    def members(self) -> dict[str, str]:
        """Alive peer id -> role."""

    def addrs_of(self, peer_id: str) -> list[str]:
        """The addresses a member advertises in its record ([] if unknown)."""

    def reachability_of(self, peer_id: str) -> str:
        """What a member's record says of it: ``public``, ``private`` (behind NAT) or ``unknown``."""
