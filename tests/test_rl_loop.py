"""The one-process RL loop (draw -> sample -> score -> GRPO) and the ML core's CLI commands."""

from __future__ import annotations

import argparse
import statistics

import pytest

torch = pytest.importorskip("torch")

from node.engines.torch_engine import TorchEngine
from node.engines.model import (
    TinyModelSpec,
    create_tiny_model,
    is_model_folder,
)
from node.rl.warmup import create_default_model
from node.app.commands.rl import add_commands
from node.rl.config import GRPOConfig, RLConfig
from node.rl.loop import run_local_loop
from node.rl.rollout import make_groups, train_samples
from node.rl.spec import OFFLINE_ROOT, step_key
from node.rl.tasks import draw_task, load_taskset

SMALL = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)


def run_cli(*argv) -> int:
    p = argparse.ArgumentParser()
    add_commands(p.add_subparsers())
    args = p.parse_args(list(argv))
    return args.func(args)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path, _ = create_default_model(tmp_path_factory.mktemp("loop") / "m", warmup_steps=5, spec=SMALL)
    e = TorchEngine("cpu")
    e.load(path)
    return e


def test_make_groups_draws_scores_and_normalises(engine):
    ts = load_taskset("synthetic")
    rl = RLConfig(group_size=4, prompts_per_batch=3, max_new_tokens=8)
    groups = make_groups(engine, ts, rl, "peerX", step=2, seed=9)
    assert [g.task.id for g in groups] == [draw_task(ts, step_key("", "peerX", OFFLINE_ROOT, 2), i).id for i in range(3)]
    for g in groups:
        assert len(g.samples) == len(g.rewards) == len(g.advantages) == 4
        assert all(0.0 <= r <= 1.0 for r in g.rewards)
        assert abs(sum(g.advantages)) < 1e-6
    kept = train_samples(groups, version=2)
    assert len(kept) == 4 * sum(g.has_signal for g in groups)
    assert all(s.version == 2 for s in kept)


def test_local_loop_runs_and_trains_in_place(engine):
    before = [p.detach().clone() for p in engine.model.parameters()]
    hist = run_local_loop(engine, load_taskset("synthetic"), RLConfig(group_size=4, prompts_per_batch=4, max_new_tokens=8),
                          GRPOConfig(optimizer_steps=2), steps=2, seed=1)
    assert [h.step for h in hist] == [0, 1]
    assert sum(h.samples_trained for h in hist) > 0  # graded rewards: groups with signal exist
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))


def test_an_async_level_samples_from_weights_that_lag_that_many_steps(tmp_path):
    path, _ = create_default_model(tmp_path / "m", warmup_steps=2, spec=SMALL)
    e = TorchEngine("cpu")
    e.load(path)
    first = {k: v.clone() for k, v in e.model.state_dict().items()}
    rl = RLConfig(group_size=4, prompts_per_batch=2, max_new_tokens=6)
    sampled = []

    def spy(engine_used):
        sampled.append({k: v.clone() for k, v in engine_used.model.state_dict().items()})

    import node.rl.loop as loop

    real = loop.make_groups
    loop.make_groups = lambda engine_used, *a, **kw: (spy(engine_used), real(engine_used, *a, **kw))[1]
    try:
        after = []  # the trainee's weights after each step: version step + 1
        hist = run_local_loop(e, load_taskset("synthetic"), rl, GRPOConfig(lr=1e-2, warmup_steps=0), 4, async_level=2,
                              on_step=lambda _: after.append({k: v.clone() for k, v in e.model.state_dict().items()}))
    finally:
        loop.make_groups = real
    assert [h.policy_version for h in hist] == [0, 0, 0, 1]
    assert all(torch.equal(sampled[i][k], first[k]) for i in range(3) for k in first)  # steps 0-2 sample from v0
    assert all(torch.equal(sampled[3][k], after[0][k]) for k in first)  # step 3 samples from v1


@pytest.mark.slow
def test_mean_reward_rises_on_the_synthetic_task(tmp_path):
    """The demo's promise, measured: the default model + defaults learn digit reversal on a CPU."""
    torch.set_num_threads(1)
    path, _ = create_default_model(tmp_path / "m")
    eng = TorchEngine("cpu")
    eng.load(path)
    hist = run_local_loop(eng, load_taskset("synthetic"), RLConfig(group_size=16, prompts_per_batch=8, max_new_tokens=10),
                          GRPOConfig(), steps=80, seed=0)
    first = statistics.fmean(h.mean_reward for h in hist[:10])
    last = statistics.fmean(h.mean_reward for h in hist[-10:])
    assert last > first + 0.08, (first, last)


# -- CLI -----------------------------------------------------------------------------------------


def test_init_model_writes_a_folder_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "model"
    assert run_cli("init-model", "--out", str(out), "--warmup-steps", "0") == 0
    assert is_model_folder(out)
    assert run_cli("init-model", "--out", str(out), "--warmup-steps", "0") == 2
    assert "exists" in capsys.readouterr().err
    assert run_cli("init-model", "--out", str(out), "--warmup-steps", "0", "--force") == 0
    assert run_cli("init-model", "--out", str(tmp_path / "x"), "--warmup-steps", "-1") == 2


def test_rl_local_rejects_bad_input_in_one_line(tmp_path, capsys):
    assert run_cli("rl-local", "--taskset", str(tmp_path / "missing.jsonl")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1
    assert run_cli("rl-local", "--model", str(tmp_path), "--steps", "1") == 2
    assert run_cli("rl-local", "--group-size", "1") == 2


def test_rl_local_runs_a_step_on_a_given_model(tmp_path, capsys):
    path = create_tiny_model(tmp_path / "m", spec=SMALL)
    csv = tmp_path / "r.csv"
    assert run_cli("rl-local", "--model", str(path), "--steps", "1", "--prompts", "2", "--group-size", "2",
                   "--max-new-tokens", "4", "--csv", str(csv)) == 0
    out = capsys.readouterr().out
    assert "mean reward" in out and "greedy reward" in out
    assert csv.read_text().startswith("step,mean_reward,seconds\n")
