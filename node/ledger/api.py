"""What other services may ask of the ledger (:class:`node.ledger.service.LedgerService` is the real one),
and the error it answers a refused request with.

A ``typing.Protocol`` so unit tests can hand a service a small fake instead of a running ledger.
"""

from __future__ import annotations

from typing import Any, Protocol


class LedgerError(Exception):
    """A local caller asked for something the ledger refuses (e.g. a kind this node may not author)."""


class LedgerAPI(Protocol):
    async def append(self, body: Any) -> Any:
        """Sign, store, apply and publish an entry of ours (``LedgerError`` when refused)."""

    def ban_of(self, peer: str) -> Any | None:
        """The active ban on ``peer`` from a penalty entry, or None."""

    def accepted_samples(self, peer: str) -> int:
        """Samples of ``peer``'s rollouts that trainers recorded as trained (its accepted history)."""

    def note_received(self, peer: str, manifest_id: bytes, nbytes: int, pieces: int = 1) -> None:
        """``peer`` sent us ``nbytes`` of verified checkpoint data (batched into signed receipts)."""
