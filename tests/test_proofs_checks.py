"""Termination, sampling and data checks: pure functions on toy values."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from node.config import ConfigError, build
from node.proofs.checks import (
    check_bounds,
    check_logprobs,
    check_policy_version,
    check_rewards,
    check_sampling_params,
    check_termination,
    first_failure,
)
from node.proofs.config import ProofsConfig
from node.proofs.reasons import PASS, Reason
from node.rl.spec import token_logprobs

EOS = 2


@pytest.mark.parametrize(
    "tokens, reason",
    [
        ([5, 6, EOS], Reason.OK),
        ([5, 6, 7, 8], Reason.OK),  # ran to max_new_tokens = 4
        ([5, 6, 7, EOS], Reason.OK),  # EOS exactly at the limit
        ([EOS], Reason.OK),
        ([], Reason.EMPTY_COMPLETION),
        ([5, EOS, 6], Reason.TOKENS_AFTER_EOS),
        ([EOS, EOS], Reason.TOKENS_AFTER_EOS),
        ([5, 6], Reason.NOT_TERMINATED),  # stopped early without EOS
        ([5, 6, 7, 8, 9], Reason.TOO_LONG),
    ],
)
def test_termination(tokens, reason):
    assert check_termination(tokens, [EOS], max_new_tokens=4).reason is reason


def test_termination_with_several_eos_ids():
    assert check_termination([5, 9], [EOS, 9], 10).ok
    assert check_termination([9, 5], [EOS, 9], 10).reason is Reason.TOKENS_AFTER_EOS


def test_token_logprobs_is_log_softmax_of_scaled_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    lp = token_logprobs(logits, torch.tensor([2, 1]), temperature=0.5)
    expected0 = 6.0 - math.log(math.exp(2) + math.exp(4) + math.exp(6))
    assert lp.tolist() == pytest.approx([expected0, -math.log(3)], rel=1e-6)
    with pytest.raises(ValueError):
        token_logprobs(logits, torch.tensor([0, 0]), temperature=0.0)


def test_logprob_check():
    mine = torch.tensor([-0.5, -1.0, -2.0])
    tol = {"tolerance_mean": 0.1, "tolerance_max": 1.0}
    assert check_logprobs([-0.52, -0.98, -2.01], mine, **tol).ok
    assert check_logprobs([-0.5, -1.0, -4.0], mine, **tol).reason is Reason.LOGPROB_MISMATCH  # one forced token
    assert check_logprobs([-0.7, -1.2, -2.2], mine, **tol).reason is Reason.LOGPROB_MISMATCH  # systematic
    assert check_logprobs([-0.5, -1.0], mine, **tol).reason is Reason.LOGPROB_SHAPE
    assert check_logprobs(["a", None, 1], mine, **tol).reason is Reason.LOGPROB_SHAPE
    assert check_logprobs([-0.5, float("nan"), -2.0], mine, **tol).reason is Reason.LOGPROB_MISMATCH
    assert check_logprobs([-0.5, 0.5, -2.0], mine, **tol).reason is Reason.LOGPROB_MISMATCH  # log p > 0
    assert check_logprobs([], torch.tensor([]), **tol).ok


def test_sampling_params():
    assert check_sampling_params(1.0, 7, run_temperature=1.0, expected_seed=7).ok
    assert check_sampling_params(float(np.float32(0.7)), 7, run_temperature=0.7, expected_seed=7).ok
    assert check_sampling_params(0.5, 7, run_temperature=1.0, expected_seed=7).reason is Reason.WRONG_TEMPERATURE
    assert check_sampling_params(float("nan"), 7, run_temperature=1.0, expected_seed=7).reason is Reason.WRONG_TEMPERATURE
    assert check_sampling_params("1.0", 7, run_temperature=1.0, expected_seed=7).reason is Reason.WRONG_TEMPERATURE
    assert check_sampling_params(1.0, 8, run_temperature=1.0, expected_seed=7).reason is Reason.WRONG_SEED
    assert check_sampling_params(1.0, 8, run_temperature=1.0, expected_seed=None).ok


def test_rewards():
    assert check_rewards([1.0, 0.0], [1.0, 0.0], tolerance=1e-6).ok
    r = check_rewards([1.0, 1.0], [1.0, 0.0], tolerance=1e-6)
    assert r.reason is Reason.REWARD_MISMATCH and "sample 1" in r.detail
    assert check_rewards([1.0], [1.0, 0.0], tolerance=1e-6).reason is Reason.REWARD_MISMATCH
    assert check_rewards([float("inf")], [1.0], tolerance=1e-6).reason is Reason.REWARD_MISMATCH
    assert check_rewards("xx", [1.0], tolerance=1e-6).reason is Reason.REWARD_MISMATCH
    assert check_rewards(7, [1.0], tolerance=1e-6).reason is Reason.REWARD_MISMATCH


def test_bounds():
    bounds = {"reward": (-1.0, 1.0), "temperature": (1e-3, 2.0)}
    assert check_bounds({"reward": 1.0, "temperature": 0.7, "extra": 99}, bounds).ok
    for values in (
        {"reward": 1.5, "temperature": 0.7},
        {"reward": float("nan"), "temperature": 0.7},
        {"reward": True, "temperature": 0.7},
        {"reward": "1", "temperature": 0.7},
        {"temperature": 0.7},
    ):
        assert check_bounds(values, bounds).reason is Reason.OUT_OF_BOUNDS, values


def test_policy_version_staleness():
    assert check_policy_version(10, current_step=10, async_level=2).ok
    assert check_policy_version(8, current_step=10, async_level=2).ok
    assert check_policy_version(7, current_step=10, async_level=2).reason is Reason.STALE_POLICY
    assert check_policy_version(11, current_step=10, async_level=2).reason is Reason.FUTURE_POLICY
    assert check_policy_version("9", current_step=10, async_level=2).reason is Reason.OUT_OF_BOUNDS
    assert check_policy_version(0, current_step=0, async_level=0).ok


def test_first_failure_picks_the_first_reason():
    stale = check_policy_version(1, current_step=10, async_level=2)
    assert first_failure([PASS, stale, check_termination([], [EOS], 4)]) == stale
    assert first_failure([PASS, PASS]).ok


def test_config_defaults_and_validation():
    cfg = build(ProofsConfig, {}, "run.proofs")
    assert (cfg.chunk_tokens, cfg.topk, cfg.max_exp_mismatches) == (32, 128, 38)
    assert (cfg.max_mantissa_mean, cfg.max_mantissa_median) == (10.0, 8.0)
    assert build(ProofsConfig, {"topk": 64, "max_exp_mismatches": 19}, "run.proofs").topk == 64
    for bad in ({"topk": 0}, {"chunk_tokens": 0}, {"max_exp_mismatches": 200}, {"max_mantissa_mean": -1.0},
                {"topk": 100000}, {"typo": 1}):
        with pytest.raises(ConfigError):
            build(ProofsConfig, bad, "run.proofs")


def test_proofs_package_imports_without_the_network_stack():
    code = (
        "import sys\n"
        "for m in ('libp2p', 'trio', 'msgpack'): sys.modules[m] = None\n"
        "import node.proofs.toploc, node.proofs.capture, node.proofs.checks, node.proofs.config\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    light = "import sys, node.proofs.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", light], check=True, timeout=60)
