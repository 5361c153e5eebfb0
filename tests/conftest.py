"""Shared fixtures, and the environment every test (and every process a test starts) runs in."""

from __future__ import annotations

import os

# Set before anything imports torch, and inherited by the node processes the tests start: one
# compute thread per process. The suite runs many processes on 2 shared cores; several OpenMP
# pools spinning against each other (or against another job on the machine) make run times swing
# by multiples, and nothing here needs intra-op parallelism to be correct.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run and machine (a red CI run is red again
# locally), with no example database carried between runs. HYPOTHESIS_PROFILE=explore searches
# fresh random examples instead: run it now and then, and pin what it finds with @example.
settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", database=None, print_blob=True, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture
def fast_membership():
    """Membership timers for tests: short probe period and suspicion."""
    return {"probe_period": 0.5, "probe_timeout": 0.4, "indirect_timeout": 0.8, "suspicion_mult": 3.0, "min_sync": 5.0}
