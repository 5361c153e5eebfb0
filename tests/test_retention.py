"""Checkpoint retention covers every batch the trainer may still train (issue 39), pure."""

from __future__ import annotations

from node.rl.config import GRPOConfig
from node.shards.config import ShardsConfig, kept_versions
from node.trainer.intake import trainable_until


def _oldest_live_version(step: int, g: GRPOConfig) -> int:
    """The oldest policy version a batch the trainer at ``step`` may still train was made with: the
    one acknowledged last (at ``step - grace``) with the oldest version intake let through then."""
    v = step
    while trainable_until(v - 1, v - 1 + g.async_level, g.async_level, g.verify_grace_steps) >= step:
        v -= 1
    return v


def test_default_retention_keeps_every_version_a_live_batch_refers_to():
    """With the defaults a node kept 3 versions while batches 4 versions old were still trainable:
    the validator waited 120 s per batch for a checkpoint no peer held any more."""
    for g in (GRPOConfig(), GRPOConfig(async_level=0, verify_grace_steps=0), GRPOConfig(async_level=5, verify_grace_steps=3)):
        keep = kept_versions(ShardsConfig().keep_versions, g.async_level, g.verify_grace_steps)
        step = 100
        assert step - keep + 1 <= _oldest_live_version(step, g), g


def test_a_larger_keep_versions_is_kept():
    assert kept_versions(20, 2, 2) == 20
