"""Torch's thread default for node processes sharing a machine (issue 39), pure."""

from __future__ import annotations

from node.roles.core import default_torch_threads, set_torch_threads


def test_half_the_cpus_at_least_one():
    """Four torch processes with one thread per core each spun against each other on two cores."""
    assert [default_torch_threads(n) for n in (None, 1, 2, 4, 16)] == [1, 1, 1, 2, 8]


def test_the_environment_decides_when_it_sets_threads():
    import torch

    before = torch.get_num_threads()
    set_torch_threads("trainer", environ={"OMP_NUM_THREADS": "3"})
    set_torch_threads("relay", environ={})
    assert torch.get_num_threads() == before
