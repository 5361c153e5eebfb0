"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture
def fast_membership():
    """Membership timers for tests: short probe period and suspicion."""
    return {"probe_period": 0.5, "probe_timeout": 0.4, "indirect_timeout": 0.8, "suspicion_mult": 3.0, "min_sync": 5.0}
