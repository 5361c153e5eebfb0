"""What the shards sessions see of the shards service, and what they tell it.

How this works
--------------
rust-libp2p splits a protocol into a *behaviour* (all peers) and a *handler* per connection; a
handler knows nothing of the behaviour but the events it reports to it. Here the behaviour is
:class:`node.shards.service.ShardsService`, which holds the versions, the announcements, the bans
and the set of serving sessions; the handlers are the download of one version (client.py), the
serving session of one peer (server.py) and the delta part (deltasync.py). They are handed the
service as a :class:`SessionOwner` (the download and the serving session) or a :class:`DeltaOwner`
(the delta part): a few things to read and ask, and the events they report (a piece verified,
bytes to credit, a peer to ban, a message refused, super-seeding reveals to route). None of them
imports service.py (tests/test_architecture.py holds that), so the package has no import circle
and a test drives a session with a small fake.

Other components use :mod:`node.shards.api` instead, the service's public API.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .api import MemberAddrs
from .config import ShardsConfig
from .manifest import SignedManifest
from .peering import DialBook
from .store import VersionStore

if TYPE_CHECKING:  # the host is an I/O object the sessions open streams on; named for readers
    from ..net.host import SwarmHost


class SessionOwner(Protocol):
    """The shards service as a transfer session (client.py, server.py) sees it."""

    @property
    def cfg(self) -> ShardsConfig:
        """The ``[shards]`` settings of the run."""

    @property
    def rng(self) -> random.Random:
        """The service's one source of random choices (seeded by tests)."""

    @property
    def host(self) -> SwarmHost:
        """The node's host: the peers to dial (``direct_peers``) and streams to them."""

    @property
    def announced(self) -> Mapping[int, tuple[bytes, str]]:
        """version -> (manifest root, announcer), the first announcement of each."""

    def is_banned(self, peer: str, now: float) -> bool:
        """Whether ``peer`` is banned from checkpoint transfers."""

    def banned_anywhere(self, peer: str, now: float) -> bool:
        """Whether any part of the node bans ``peer`` (a download dials no such member)."""

    def downloaders_of(self, root: bytes) -> set[str]:
        """The peers downloading the version (or delta) ``root`` from us."""

    @property
    def members(self) -> MemberAddrs | None:
        """Membership's view: the members and their records' addresses (None before membership runs)."""

    @property
    def dials(self) -> DialBook:
        """The node's dials of public members, shared by its downloads (node/shards/peering.py)."""

    # Events the sessions report.

    def on_piece_verified(self, vs: VersionStore, piece: int) -> None:
        """``piece`` of ``vs`` passed its hash: it is served, and told to the peers downloading ``vs``."""

    def credit(self, peer: str, root: bytes, nbytes: int) -> None:
        """``peer`` supplied ``nbytes`` of a piece of ``root`` that verified (the ledger credits it)."""

    def ban(self, peer: str, reason: str, now: float) -> None:
        """``peer`` was convicted of sending bad data (scored down, disconnected)."""

    def reject(self, reason: str) -> None:
        """A peer's message was refused for ``reason`` (counted, per reason)."""

    def route_reveals(self, root: bytes, reveals: list[tuple[str, int]]) -> None:
        """Super-seeding decided to show these (peer, piece) pairs of ``root``: tell their sessions."""


class DeltaOwner(SessionOwner, Protocol):
    """The shards service as its delta part (deltasync.py) sees it: a delta is downloaded like a
    version (a :class:`SessionOwner` for its download) and served like one."""

    def path_of(self, version: int) -> Path | None:
        """The folder of a complete version held (re-verified since start), else None."""

    def serve(self, vs: VersionStore) -> None:
        """Serve ``vs`` (a delta) from now on: each piece once it is verified."""

    def stop_serving(self, root: bytes) -> VersionStore | None:
        """Serve ``root`` no more; returns the store that was served, if any (the caller closes it)."""

    def add_superseeder(self, signed: SignedManifest) -> None:
        """Serve ``signed`` super-seeded: pieces revealed a few at a time."""
