"""A cheaper model than the run's checkpoint (issue 42, hole 7): what the validator's checks catch.

A worker saving compute generates and proves with changed weights (node/adversary/cheap.py) and
claims the checkpoint. In a float32 run the validator's prefill reproduces an honest worker's
log-probs to < 1e-6 (bench/cheap_model.py), so the log-prob check tolerates 1e-3 mean / 1e-2 max
there instead of the bf16-sized 0.1 / 1.0 that let an 8-bit model through every time.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest

from node.adversary.cheap import quantise_rows
from node.engines.model import create_tiny_model
from node.engines.torch_engine import TorchEngine
from node.identity import Identity
from node.proofs import checks
from node.proofs.config import ProofsConfig
from node.rl.config import RLConfig
from node.validator import testing as T
from node.validator.pipeline import BatchRules, CheckModel, judge_batch
from node.validator.tasks import RunTasks

RUN = "cheap"
VERSION = 1
RL = RLConfig(group_size=4, prompts_per_batch=4, max_new_tokens=16)  # 16 completions a batch
RULES = BatchRules(run=RUN, taskset=RL.taskset, temperature=RL.temperature, top_p=RL.top_p,
                   max_new_tokens=RL.max_new_tokens, group_size=RL.group_size,
                   prompts_per_batch=RL.prompts_per_batch, async_level=2)
BATCHES = 4


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    engine = TorchEngine("cpu")
    engine.load(create_tiny_model(Path(tmp_path_factory.mktemp("model"))))
    assert engine.dtype_name == "float32"  # the embedded model's checkpoint
    return engine, RunTasks(RL), Identity.from_seed(b"c" * 32), CheckModel(engine.model, engine.tokenizer, VERSION)


def batches(engine, world, steps=range(BATCHES)):
    _, tasks, worker, _ = world
    return [T.make_batch(engine, worker, RULES, tasks, step=s, policy_version=VERSION) for s in steps]


def judge(world, signed, rules=RULES):
    return judge_batch(signed.batch, rules, current_version=VERSION, tasks=world[1], model=world[3], policy_root=T.ROOT)


def test_an_8_bit_copy_of_a_float32_checkpoint_is_refused_on_its_logprobs(world):
    engine = world[0]
    cheat = TorchEngine("cpu")
    cheat.model, cheat._tokenizer = quantise_rows(copy.deepcopy(engine.model), 8), engine.tokenizer
    for signed in batches(cheat, world):
        j = judge(world, signed)
        assert not j.accepted, "an 8-bit model passed"  # it passed every time with 0.1 / 1.0
        assert "logprob_mismatch" in j.reasons, j.details
    for signed in batches(engine, world, range(10, 10 + BATCHES)):  # honest batches still pass
        assert judge(world, signed).accepted


def test_a_bfloat16_batch_keeps_the_runs_tolerance(world):
    """The float32 tolerance needs float32 on both sides; bf16 decoding moves log-probs by ~0.06."""
    signed = batches(world[0], world, [20])[0]
    moved = T.with_samples(signed, world[2], lambda i, s: replace(s, logprobs=[min(0.0, x + 0.02) for x in s.logprobs]))
    assert not judge(world, moved).accepted  # stated float32: 0.02 is far beyond float32 noise
    as_bf16 = T.sign_batch(world[2], replace(moved.batch, dtype="bfloat16"))
    assert judge(world, as_bf16).accepted


@pytest.mark.parametrize("dtypes, expected", [
    (("float32", "float32"), (1e-3, 1e-2)),
    (("float32", "bfloat16"), (0.1, 1.0)),
    (("float16", "float32"), (0.1, 1.0)),
    (("bfloat16", "bfloat16"), (0.1, 1.0)),
])
def test_logprob_tolerances_by_dtype(dtypes, expected):
    assert checks.logprob_tolerances(ProofsConfig(), *dtypes) == expected


def test_a_run_can_loosen_the_float32_tolerance():
    cfg = ProofsConfig(logprob_tolerance_mean_fp32=0.05, logprob_tolerance_max_fp32=0.5)
    cfg.validate()
    assert checks.logprob_tolerances(cfg, "float32", "float32") == (0.05, 0.5)
    with pytest.raises(ValueError, match="logprob_tolerance_mean_fp32"):
        ProofsConfig(logprob_tolerance_mean_fp32=-1.0).validate()
