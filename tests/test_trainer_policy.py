"""Policy state: creation of version 0, online filtering, and a resume that equals never stopping."""

from __future__ import annotations

import torch

from node.identity import Identity
from node.engines.model import is_model_folder
from node.rl.config import GRPOConfig
from node.trainer import checkpoints
from node.trainer.config import TrainerConfig
from node.trainer.policy import Policy, training_samples
from node.trainer.testing import reversal_batch

CFG = GRPOConfig(optimizer_steps=2, pack_length=64, kl_coef=0.0, lr=1e-3, warmup_steps=3)
TCFG = TrainerConfig(keep_checkpoints=2, init_warmup_steps=0)  # random init: fast
WORKER = Identity.from_seed(b"p" * 32)


def samples_for(policy: Policy, seed: int):
    b = reversal_batch(WORKER, "t", step=seed, policy_version=policy.step, tokenizer=policy.tokenizer,
                       model=policy.model, prompts=2, group_size=4, seed=seed)
    return training_samples(b)[0]


def test_zero_signal_groups_are_dropped():
    from node.engines.model import build_tokenizer

    tok = build_tokenizer()
    b = reversal_batch(WORKER, "t", step=0, policy_version=0, tokenizer=tok, prompts=3, group_size=3,
                       completions=[["1", "2", "3"], ["x", "x", "x"], ["9", "9", "9"]])
    got, dropped = training_samples(b)
    # group 0 may have signal or not depending on the answer; groups 1 and 2 are flat by construction
    rewards = [s.reward for s in b.samples if s.prompt_index == 0]
    flat0 = max(rewards) == min(rewards)
    assert dropped == 2 + flat0 and len(got) == (0 if flat0 else 3)


def test_version_0_is_created_once_and_resumed(tmp_path):
    policy, created = Policy.open(tmp_path, "", CFG, TCFG)
    assert created and policy.step == 0 and is_model_folder(policy.folder(0))
    again, created = Policy.open(tmp_path, "", CFG, TCFG)
    assert not created and again.step == 0


def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path):
    straight, _ = Policy.open(tmp_path / "a", "", CFG, TCFG)
    batches = [samples_for(straight, seed) for seed in (1, 2, 3)]  # fixed data (log-probs of v0)
    for b in batches:
        straight.train(b)
        straight.save()

    p, _ = Policy.open(tmp_path / "b", "", CFG, TCFG)
    p.train(batches[0])
    p.save()
    p.train(batches[1])  # trained but never saved: lost in the "crash"
    del p
    resumed, created = Policy.open(tmp_path / "b", "", CFG, TCFG)
    assert not created and resumed.step == 1
    for b in batches[1:]:
        resumed.train(b)
        resumed.save()
    assert resumed.step == straight.step == 3
    for (k, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k
    # only the last K folders are kept
    assert checkpoints.versions_on_disk(tmp_path / "b") == [2, 3]


def test_a_torn_state_write_leaves_the_old_state(tmp_path):
    policy, _ = Policy.open(tmp_path, "", CFG, TCFG)
    (tmp_path / (checkpoints.STATE + ".tmp")).write_bytes(b"half a pickle")  # crash mid-write
    assert Policy.open(tmp_path, "", CFG, TCFG)[0].step == 0


def test_bfloat16_publishing_keeps_the_float32_master_across_a_restart(tmp_path):
    """[trainer] publish_dtype = "bfloat16": the folders nodes fetch hold bfloat16 weights (half
    the bytes) and say so, while the trainer goes on from its float32 weights, restart included."""
    from dataclasses import replace

    from node.engines.model import load_model

    tcfg = replace(TCFG, publish_dtype="bfloat16")
    straight, _ = Policy.open(tmp_path / "a", "", CFG, TCFG)
    data = [samples_for(straight, seed) for seed in (1, 2)]
    for b in data:
        straight.train(b)

    p, _ = Policy.open(tmp_path / "b", "", CFG, tcfg)
    p.train(data[0])
    p.save()
    del p
    resumed, _ = Policy.open(tmp_path / "b", "", CFG, tcfg)
    resumed.train(data[1])
    folder = resumed.save()
    published = load_model(folder)  # dtype "auto": what a worker's engine loads
    assert {t.dtype for t in published.state_dict().values() if t.is_floating_point()} == {torch.bfloat16}
    for (k, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert a.dtype == torch.float32 and torch.equal(a, b), k
        assert torch.equal(published.state_dict()[k], a.to(torch.bfloat16)), k


def test_publish_dtype_is_checked():
    import pytest

    with pytest.raises(ValueError, match="publish_dtype"):
        TrainerConfig(publish_dtype="int8").validate()
