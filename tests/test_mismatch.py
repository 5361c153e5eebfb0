"""Each engine's log-prob mismatch against the trainer (node/rl/mismatch.py): the figures on toy
tensors, the choice of samples, the window prime-rl's admission looks over, and a real trainer
node's status and metrics with torch and vLLM batches in one step."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import pytest
import torch
from swarmtest import node_config, open_nodes
from test_trainer_loop import make_run, submit
from waiting import wait_for

from node.engines.model import create_tiny_model, load_model, load_tokenizer
from node.identity import load_or_create_identity
from node.rl.config import GRPOConfig
from node.rl.grpo import TrainSample
from node.rl.mismatch import (
    ADMISSION_STEPS,
    PRIME_RL_ADMISSION_KL,
    EngineMismatch,
    MismatchWindow,
    engine_mismatch,
    pick,
    rescore,
)
from node.trainer.config import TrainerConfig
from node.trainer.policy import training_samples
from node.trainer.testing import model_logprobs, reversal_batch, sign_batch


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def k3(p, q):  # KL estimate of one token: r - log r - 1, log r = trainer - engine
    return math.exp(p - q) - (p - q) - 1


def test_figures_are_split_by_engine():
    trainer = [t(-1.0, -2.0), t(-0.5), t(-3.0, -1.0, -2.0)]
    engine = [t(-1.0, -3.5), t(-0.5), t(-3.2, -1.0, -2.0)]
    got = engine_mismatch(trainer, engine, ["vllm", "torch", "vllm"], [1.0] * 3)
    assert set(got) == {"torch", "vllm"}
    assert got["torch"] == EngineMismatch(samples=1, tokens=1, kl=0.0, beyond=0.0, max_abs=0.0, max_sample_mean=0.0)
    v = got["vllm"]
    assert (v.samples, v.tokens) == (2, 5)
    assert v.kl == pytest.approx((k3(-2.0, -3.5) + k3(-3.0, -3.2)) / 5)
    assert v.beyond == pytest.approx(1 / 5)  # only the 1.5 nat token is beyond 1.0
    assert v.max_abs == pytest.approx(1.5)
    assert v.max_sample_mean == pytest.approx(0.75)  # (0 + 1.5) / 2 beats (0.2 + 0 + 0) / 3


def test_an_engine_without_tokens_is_absent_and_lengths_must_agree():
    assert engine_mismatch([t()], [t()], ["vllm"], [1.0]) == {}
    with pytest.raises(ValueError):
        engine_mismatch([t(-1.0)], [], ["torch"], [1.0])
    with pytest.raises(ValueError):
        engine_mismatch([t(-1.0)], [t(-1.0)], ["torch"], [])


def test_each_sample_is_judged_by_its_own_tolerance():
    """A float32 batch gets the validator's tight tolerance, a bfloat16 one the loose: the same 0.05
    nat is beyond the first and within the second."""
    got = engine_mismatch([t(-1.0), t(-1.0)], [t(-1.05), t(-1.05)], ["vllm", "vllm"], [1e-2, 1.0])["vllm"]
    assert got.beyond == pytest.approx(0.5)


def sample(version, engine, n=1):
    return TrainSample([1, 2], [3] * n, [-1.0] * n, 1.0, version, engine)


def test_pick_takes_the_version_held_from_each_engine_in_turn_up_to_the_bound():
    samples = [sample(4, "torch"), sample(4, "torch"), sample(3, "vllm"), sample(4, "torch"), sample(4, "vllm")]
    chosen = pick(samples, version=4, most=3)
    assert [s.engine for s in chosen] == ["torch", "vllm", "torch"]
    assert chosen[0] is samples[0] and chosen[1] is samples[4] and chosen[2] is samples[1]
    assert pick(samples, version=4, most=0) == [] and pick(samples, version=5, most=8) == []
    assert len(pick(samples, version=4, most=99)) == 4


def test_rescore_gives_the_log_probs_the_model_sampled_with():
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(create_tiny_model(Path(tmp) / "m", seed=0)).eval()
    prompt, comps = [5, 6, 7], [[8, 9, 10, 11], [12, 13]]
    honest = [TrainSample(prompt, c, model_logprobs(model, prompt, c, 1.0), 0.5, 0, "torch") for c in comps]
    # packed in one row, or one per pass: each sample's tokens, in order
    for cfg in (GRPOConfig(pack_length=16), GRPOConfig(pack_length=8, micro_batch_tokens=8)):
        mine = rescore(model, honest, cfg)
        assert [m.shape[0] for m in mine] == [4, 2]
    got = engine_mismatch(mine, [torch.tensor(s.old_logprobs, dtype=torch.float64) for s in honest],
                          [s.engine for s in honest], [1.0] * 2)
    assert got["torch"].tokens == 6 and got["torch"].max_abs < 1e-4 and got["torch"].kl < 1e-8
    # the same tokens claimed at another temperature are measured as a mismatch
    hot = [dataclasses.replace(s, old_logprobs=model_logprobs(model, prompt, s.completion_ids, 2.0), engine="vllm")
           for s in honest]
    far = engine_mismatch(mine, [torch.tensor(s.old_logprobs, dtype=torch.float64) for s in hot], ["vllm"] * 2,
                          [1.0] * 2)
    assert far["vllm"].kl > 1e-3 and far["vllm"].max_abs > 0.1


def figures(kl, tokens=10, beyond=0.0, max_abs=0.1):
    return EngineMismatch(samples=1, tokens=tokens, kl=kl, beyond=beyond, max_abs=max_abs, max_sample_mean=max_abs)


def test_the_window_keeps_each_engines_last_steps_and_judges_admission_only_when_full():
    w = MismatchWindow()
    w.add({"vllm": figures(0.5, beyond=1.0, max_abs=3.0)})  # one bad step, pushed out later
    for _ in range(ADMISSION_STEPS - 1):
        w.add({"vllm": figures(0.001), "torch": figures(0.0, tokens=30)})
    s = w.status()
    assert s["vllm"]["steps"] == ADMISSION_STEPS and s["vllm"]["max_kl"] == 0.5 and s["vllm"]["max_abs"] == 3.0
    assert s["vllm"]["mean_kl"] == pytest.approx((0.5 + 0.001 * (ADMISSION_STEPS - 1)) / ADMISSION_STEPS, abs=1e-6)
    assert s["vllm"]["beyond"] == pytest.approx(10 / (10 * ADMISSION_STEPS))  # token-weighted
    assert s["vllm"]["admitted"] is False  # 0.5 / 20 > 0.015
    assert s["torch"]["steps"] == ADMISSION_STEPS - 1 and s["torch"]["admitted"] is None  # not enough steps yet
    w.add({"vllm": figures(0.001), "torch": figures(0.0, tokens=30)})
    s = w.status()
    assert s["vllm"]["steps"] == ADMISSION_STEPS and s["vllm"]["max_kl"] == 0.001 and s["vllm"]["admitted"] is True
    assert s["torch"]["admitted"] is True and s["torch"]["tokens"] == 30 * ADMISSION_STEPS
    assert PRIME_RL_ADMISSION_KL == 0.015


def test_mismatch_samples_is_validated():
    TrainerConfig(mismatch_samples=0).validate()
    for bad in (-1, TrainerConfig().max_step_samples + 1):
        with pytest.raises(ValueError, match="mismatch_samples"):
            TrainerConfig(mismatch_samples=bad).validate()


def test_training_samples_carry_their_batchs_engine():
    with tempfile.TemporaryDirectory() as tmp:
        tok = load_tokenizer(create_tiny_model(Path(tmp) / "m", seed=0))
        ident, _ = load_or_create_identity(Path(tmp) / "id")
    batch = reversal_batch(ident, "test", step=0, policy_version=2, tokenizer=tok, seed=1)
    for engine in ("torch", "vllm"):
        samples, _ = training_samples(dataclasses.replace(batch, engine=engine))
        assert samples and {(s.engine, s.version, s.dtype) for s in samples} == {(engine, 2, "float32")}
    samples, _ = training_samples(dataclasses.replace(batch, dtype="bfloat16"))
    assert {s.dtype for s in samples} == {"bfloat16"}


async def test_a_trainer_reports_each_engines_mismatch_in_status_and_metrics(tmp_path):
    run = make_run(tmp_path)
    run.tables["inference"] = {"engines": ["torch", "vllm"]}
    run.tables["trainer"]["mismatch_samples"] = 6
    cfgs = [node_config(tmp_path, "trainer", "trainer", run=run), node_config(tmp_path, "client", "relay", run=run)]
    async with open_nodes(cfgs) as (tnode, client):
        trainer = tnode.trainer
        policy = trainer.policy
        for step, engine, temperature in ((0, "torch", 1.0), (1, "vllm", 1.3)):
            # the "vllm" batch claims log-probs of another temperature: a mismatch the figures must show
            batch = reversal_batch(client.identity, "test", step=step, policy_version=0, tokenizer=policy.tokenizer,
                                   model=policy.model, prompts=2, group_size=4, seed=step + 1,
                                   policy_root=trainer.shards.announced[0][0])
            if engine == "vllm":
                batch = dataclasses.replace(batch, engine=engine, samples=[dataclasses.replace(
                    s, logprobs=[lp * temperature for lp in s.logprobs]) for s in batch.samples])
            ack = await submit(client, tnode.peer_id, sign_batch(client.identity, batch))
            assert ack.accepted, ack.reason
        await wait_for(lambda: trainer.published == 1, what="version 1")
        last = trainer.status()["last_step"]["mismatch_by_engine"]
        assert set(last) == {"torch", "vllm"} and last["torch"]["samples"] == last["vllm"]["samples"] == 3
        assert last["torch"]["kl"] < 1e-6 and last["torch"]["beyond"] == 0.0  # the trainer's own log-probs
        assert last["vllm"]["kl"] > 100 * max(last["torch"]["kl"], 1e-8) and last["vllm"]["max_abs"] > 0.01
        assert last["vllm"]["beyond"] > 0.5  # float32 batches: the validator's tight tolerance (1e-2)
        window = trainer.status()["mismatch_by_engine"]
        assert window["vllm"]["steps"] == 1 and window["vllm"]["admitted"] is None
        metrics = tnode.metrics.render().decode()
        assert 'swarm_trainer_mismatch_kl_by_engine{engine="vllm"}' in metrics
        assert 'swarm_trainer_logprob_beyond_tolerance_fraction{engine="torch"} 0.0' in metrics


def test_status_keeps_the_figures_of_engines_that_agree_to_a_millionth():
    """float32 engines differ by ~1e-6 in a log-prob and ~1e-12 in KL: status keeps significant digits."""
    w = MismatchWindow()
    w.add({"vllm": figures(3.14159e-12, max_abs=1.23456e-6)})
    s = w.status()["vllm"]
    assert s["mean_kl"] == pytest.approx(3.142e-12, rel=1e-9) and s["max_abs"] == pytest.approx(1.235e-6, rel=1e-9)
    assert figures(2.5e-9).figures()["kl"] == pytest.approx(2.5e-9)
