"""The ``[shards]`` table of the run file: how checkpoints are cut, fetched, served and kept.

Kept free of libp2p and torch so ``node.config`` can build it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..net.budget import StreamsConfig
from ..rl.config import GRPOConfig

FETCH_POLICIES = ("auto", "all", "newest", "none")
DELTA_CODECS = ("lzma", "zlib")  # node/shards/delta.py CODECS


@dataclass
class ShardsConfig:
    # Piece size in bytes for manifests this node publishes; 0 = automatic (1 MiB, halved down to
    # 128 KiB while a checkpoint has fewer than 256 pieces, doubled until it has at most MAX_PIECES).
    # See node/shards/manifest.py for the measurements.
    piece_size: int = 0
    # Bytes asked for by one request (a block; a fast peer is asked for a new piece whole, up to 1 MiB). 256 KiB: see node/shards/manifest.py.
    block_size: int = 256 * 1024
    # Complete versions kept on disk; older ones are deleted. Never fewer than a live batch may still
    # refer to: [grpo] async_level + verify_grace_steps + 1 (kept_versions below; 5 by default).
    keep_versions: int = 3
    # Which announced versions to download: "all" (relays), "newest" (inference/validator),
    # "none" (trainer), or "auto" = by role.
    fetch: str = "auto"
    # Peers downloaded from at once, per version. Each one's queue holds 3 s of its measured rate, so
    # a few fill a downlink; each more costs a session each way and its Haves (16 peers: 7-25 % more
    # CPU per MiB at N=16-24 than 8 in bench/shards.py swarm).
    max_peers: int = 8
    # Requests served at once by this node over all peers (the rest wait in per-peer queues).
    max_serving: int = 16
    # Upload cap in bytes per second over all peers; 0 = unlimited.
    upload_rate: int = 0
    # A request not answered within this many seconds is re-issued to another peer.
    request_timeout: float = 10.0
    # Seconds a peer that sent bad pieces or malformed data is banned for.
    ban_seconds: float = 600.0
    # Malformed or out-of-protocol messages from one peer, within garbage_window seconds, that get it
    # banned (ban_seconds) by this node's shards service; a stream cut mid-frame does not count.
    garbage_strikes: int = 5
    # Seconds over which garbage_strikes add up.
    garbage_window: float = 600.0
    # Seconds between re-announcements of the newest version this node published (late joiners).
    announce_interval: float = 15.0
    # The publisher reveals pieces to each downloader a few at a time, least-spread first, so it
    # sends every piece about once and the downloaders pass them on (BitTorrent super-seeding, BEP 16).
    super_seed: bool = True
    # Show a progress bar for downloads when stderr is a terminal.
    progress: bool = True
    # Bytes per second re-hashed when the complete versions on disk are checked again at start (in the
    # background, in a worker thread; a piece is served once it passes, a version is loaded once all
    # of it passed); 0 = as fast as the disk allows.
    recheck_rate: int = 256 * 1024 * 1024
    # Publish each new version also as a delta against the previous one, and fetch a version as a
    # delta when the trainer offers one against a version this node holds (node/shards/deltasync.py).
    delta: bool = True
    # Codec of published deltas, both in the stdlib: "zlib" (bench/deltas.py, 59M-parameter bf16
    # step: 1.1 s to encode, 0.034 of the full size) or "lzma" (11.7 s, 0.031).
    delta_codec: str = "zlib"
    # A delta larger than this fraction of its full version is not published (receivers fetch full).
    delta_max_ratio: float = 0.5
    # Seconds a delta may go without a new verified piece (or its manifest unanswered) before the
    # node gives up on it and fetches full pieces.
    delta_stall_timeout: float = 30.0

    def validate(self) -> None:
        if self.piece_size and (self.piece_size < 16 * 1024 or self.piece_size > 64 * 1024 * 1024):
            raise ValueError(f"piece_size: 0 or 16 KiB..64 MiB, got {self.piece_size}")
        if self.piece_size & (self.piece_size - 1):
            raise ValueError(f"piece_size: must be a power of two, got {self.piece_size}")
        if not 16 * 1024 <= self.block_size <= 1024 * 1024 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: a power of two in 16 KiB..1 MiB, got {self.block_size}")
        if self.piece_size and self.block_size > self.piece_size:
            raise ValueError("block_size: must not exceed piece_size")
        if self.keep_versions < 1:
            raise ValueError(f"keep_versions: at least 1, got {self.keep_versions}")
        if self.fetch not in FETCH_POLICIES:
            raise ValueError(f"fetch: one of {', '.join(FETCH_POLICIES)}, got {self.fetch!r}")
        for name in ("max_peers", "max_serving"):
            if not 1 <= getattr(self, name) <= 1024:
                raise ValueError(f"{name}: 1..1024, got {getattr(self, name)}")
        for name in ("upload_rate", "recheck_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: >= 0, got {getattr(self, name)}")
        if not 1 <= self.garbage_strikes <= 1000:
            raise ValueError(f"garbage_strikes: 1..1000, got {self.garbage_strikes}")
        if self.delta_codec not in DELTA_CODECS:
            raise ValueError(f"delta_codec: one of {', '.join(DELTA_CODECS)}, got {self.delta_codec!r}")
        if not 0 < self.delta_max_ratio <= 1:
            raise ValueError(f"delta_max_ratio: in (0, 1], got {self.delta_max_ratio}")
        for name in ("request_timeout", "ban_seconds", "announce_interval", "garbage_window", "delta_stall_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ShardsSections:
    """The run's tables the shards service reads, handed in by the core (node/roles/core.py); each
    defaults to a run file without that table."""

    shards: ShardsConfig = field(default_factory=ShardsConfig)  # this table
    grpo: GRPOConfig = field(default_factory=GRPOConfig)  # the staleness bounds, which set the versions kept (kept_versions)
    streams: StreamsConfig = field(default_factory=StreamsConfig)  # per-peer stream budgets of its handler

    def kept(self) -> ShardsConfig:
        """The ``[shards]`` table with ``keep_versions`` raised to what the run's batches may refer to."""
        grpo = self.grpo
        return replace(self.shards, keep_versions=kept_versions(self.shards.keep_versions, grpo.async_level,
                                                                 grpo.verify_grace_steps))


def kept_versions(keep_versions: int, async_level: int, verify_grace_steps: int) -> int:
    """Complete versions a node keeps: ``[shards] keep_versions``, but never fewer than a batch the
    trainer may still train refers to. A batch of version ``v`` is trainable while the trainer is at
    most ``async_level + verify_grace_steps`` versions past ``v`` (node/trainer/intake.py
    ``trainable_until``), and a validator must fetch ``v`` to judge it: a trainer, relay or peer
    that pruned ``v`` earlier left the validator waiting for a download no one could serve (issue 39)."""
    return max(keep_versions, async_level + verify_grace_steps + 1)
