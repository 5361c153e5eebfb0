"""Pure pieces of the inference role: draw inputs, proof packing, size cap, step file, advertising;
and one step of the generator, honest and with each cheating mode (no network)."""

from __future__ import annotations

import pytest
from test_inference_role import RL, check_batch

from node.adversary.generator import make_generator
from node.identity import Identity
from node.engines.model import create_tiny_model, load_model, load_tokenizer
from node.proofs.config import ProofsConfig
from node.rl.config import InferenceConfig, RLConfig
from node.inference.service import advertise_due, read_step, write_step
from node.rl.spec import sampling_seed, step_key, thinking_budget
from node.rollouts.assemble import (
    chunk_proof_sizes,
    join_proofs,
    seal_within,
    split_proofs,
)
from node.rollouts.config import WorkerConfig
from node.rollouts.schema import RolloutBatch, RolloutSample, open_batch
from node.validator.pipeline import BatchReason, check_groups


def _key(run="run", peer="peer", step=3, root=b"r" * 32):
    return step_key(run, peer, root, step)


def test_seed_and_budget_depend_on_every_input_and_nothing_else():
    s = sampling_seed(_key())
    assert s == sampling_seed(_key()) and 0 <= s < 2**63
    assert len({s, sampling_seed(_key(step=4)), sampling_seed(_key(peer="other")), sampling_seed(_key(run="x")),
                sampling_seed(_key(root=b"s" * 32))}) == 5
    budgets = [64, 128, 256]
    drawn = {thinking_budget(budgets, _key(step=step), i) for step in range(20) for i in range(4)}
    assert drawn == set(budgets)  # every budget is reachable
    assert thinking_budget(budgets, _key(step=5), 1) == thinking_budget(budgets, _key(step=5), 1)
    with pytest.raises(ValueError):
        _key(step=-1)


@pytest.mark.parametrize("tokens,hidden,chunk,topk", [(1, 64, 32, 128), (33, 64, 32, 128), (64, 2, 32, 128), (70, 8, 16, 16)])
def test_proofs_split_back_exactly(tokens, hidden, chunk, topk):
    sizes = chunk_proof_sizes(tokens, hidden, chunk, topk)
    chunks = [bytes([i]) * n for i, n in enumerate(sizes)]
    assert split_proofs(join_proofs(chunks), tokens, hidden, chunk, topk) == chunks
    assert split_proofs(join_proofs(chunks)[:-1], tokens, hidden, chunk, topk) is None
    assert split_proofs(join_proofs(chunks) + b"\0", tokens, hidden, chunk, topk) is None


def _batch(groups: int, tokens: int, worker: str = "w") -> RolloutBatch:
    samples = [RolloutSample(prompt_index=g, sample_index=j, task_id=f"t{g}", prompt_ids=[1, 2], completion_ids=[3] * tokens,
                             logprobs=[-1.0] * tokens, finish_reason="length", reward=0.0, task_reward=0.0,
                             advantage=0.0, proof=b"") for g in range(groups) for j in range(2)]
    return RolloutBatch(run="r", worker=worker, step=0, policy_version=0, taskset="s", seed=1, temperature=1.0, top_p=1.0,
                        max_new_tokens=tokens, group_size=2, created_ms=0, samples=samples)


def test_size_cap_never_trims_a_step():
    """A batch holds every drawn prompt (validators reject partial ones): too big is not sent at all."""
    ident = Identity.generate()
    batch = _batch(8, 500, ident.peer_id)
    whole = seal_within(ident, batch, 10**9)
    assert open_batch(whole.envelope, "r").batch_id == whole.batch_id and whole.batch == batch
    assert seal_within(ident, batch, len(whole.envelope) - 1) is None
    assert seal_within(ident, batch, len(whole.envelope)).batch == batch


def test_step_file_round_trip_and_garbage(tmp_path):
    p = tmp_path / "step"
    assert read_step(p) == 0
    write_step(p, 41)
    assert read_step(p) == 41
    p.write_text("garbage")
    assert read_step(p) == 0


def test_advertise_only_on_noticeable_change_and_rate_limited():
    assert advertise_due((0.0, 0.0), (100.0, 0.0), 0.0)  # first figure at once
    assert not advertise_due((100.0, 0.0), (110.0, 0.0), 60.0)  # jitter
    assert advertise_due((100.0, 0.0), (130.0, 0.0), 60.0)
    assert advertise_due((100.0, 0.0), (100.0, 1.0), 60.0)
    assert not advertise_due((100.0, 0.0), (300.0, 5.0), 1.0)  # too soon after the last one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = create_tiny_model(tmp_path_factory.mktemp("m") / "m0", seed=0)
    return path, load_model(path), load_tokenizer(path)


def _generate(path, cheat: str, ident: Identity, rl: RLConfig | None = None):
    gen = make_generator(identity=ident, run_name="test", rl=rl or RLConfig(**RL), proofs=ProofsConfig(),
                         inference=InferenceConfig(engine="torch", device="cpu"), worker=WorkerConfig(cheat=cheat))
    gen.follow(path)
    result = gen.run_step(7, 0, 0)
    return open_batch(result.sealed.envelope, "test"), result


@pytest.mark.parametrize("cheat,caught", [
    ("", None),
    ("perturbed-model", "proof"),
    ("fake-rewards", "reward"),
    ("cherry-pick", "task"),
    ("early-exit", "reward"),
])
def test_generator_step_honest_and_cheating(tiny, cheat, caught):
    path, model, tok = tiny
    ident = Identity.generate()
    sb, result = _generate(path, cheat, ident)
    assert sb.batch.step == 7 and len(sb.batch.samples) == RL["prompts_per_batch"] * RL["group_size"]
    assert result.completion_tokens == sum(len(s.completion_ids) for s in sb.batch.samples)
    failures = check_batch(sb, model, tok, ident.peer_id, 0)
    if caught is None:
        assert failures == []
    else:
        assert any(f.startswith(caught) for f in failures), failures
        if cheat != "perturbed-model":  # only a changed model changes the activations
            assert not any(f.startswith(("proof", "logprobs")) for f in failures), failures
    if cheat == "fake-rewards":
        assert result.mean_reward > result.mean_true_reward


def test_generator_drop_groups_cheat_is_an_incomplete_batch(tiny):
    path, _, _ = tiny
    sb, _ = _generate(path, "drop-groups", Identity.generate())
    prompts = {s.prompt_index for s in sb.batch.samples}
    assert len(prompts) == RL["prompts_per_batch"] - 1
    check = check_groups(sb.batch.samples, RL["group_size"], RL["prompts_per_batch"])
    assert not check and check.reason == BatchReason.BAD_GROUPS


def test_early_exit_cheat_on_code_tasks_is_a_reward_mismatch_and_nothing_else(tiny):
    """The exit program really is what the cheat sends, with proofs and log-probs that hold: only the
    verifier (node/rl/harness.py), which no longer reads exit status, can refuse it."""
    path, model, tok = tiny
    ident = Identity.generate()
    rl = RLConfig(group_size=2, prompts_per_batch=1, max_new_tokens=20, taskset="code")
    sb, result = _generate(path, "early-exit", ident, rl)
    exits = [s for s in sb.batch.samples if tok.decode(s.completion_ids, skip_special_tokens=True) == "raise SystemExit"]
    assert exits and all(s.task_reward == 1.0 and s.finish_reason == "stop" for s in exits)
    failures = check_batch(sb, model, tok, ident.peer_id, 0, rl)
    assert failures and all(f.startswith("reward") for f in failures), failures
    assert result.mean_reward > result.mean_true_reward


def test_free_sandbox_cheat_is_refused_on_its_proofs_before_any_sandbox_runs(tiny, monkeypatch):
    """Issue 42: endless loops with proofs of nothing; the validator's pipeline refuses them on the
    proofs, and the code sandbox never runs (each sample would hold it for its whole time limit)."""
    import node.rl.verifiers as verifiers
    from node.adversary.generator import ENDLESS_PROGRAM
    from node.validator.pipeline import BatchRules, CheckModel, judge_batch
    from node.validator.tasks import RunTasks

    path, model, tok = tiny
    ident = Identity.generate()
    rl = RLConfig(group_size=2, prompts_per_batch=1, max_new_tokens=20, taskset="code")
    sb, _ = _generate(path, "free-sandbox", ident, rl)
    assert all(tok.decode(s.completion_ids, skip_special_tokens=True) == ENDLESS_PROGRAM for s in sb.batch.samples)
    runs = []
    monkeypatch.setattr(verifiers, "run_python", lambda program, limits: runs.append(program))
    rules = BatchRules(run="test", taskset="code", temperature=rl.temperature, top_p=rl.top_p,
                       max_new_tokens=rl.max_new_tokens, group_size=rl.group_size,
                       prompts_per_batch=rl.prompts_per_batch, async_level=2)
    j = judge_batch(sb.batch, rules, current_version=0, tasks=RunTasks(rl), model=CheckModel(model, tok, 0))
    assert not j.accepted and all(r.startswith("proof") for r in j.reasons), j.reasons
    assert runs == []


def test_pasted_answers_cheat_is_refused_by_the_replay_whatever_engine_it_names(tiny):
    """Issue 42 hole 1: right answers written in, re-proved so proofs and log-probs hold, truly scored
    and stated as vLLM's batch (where the run accepts vLLM, else as torch's): only the sampling replay
    can refuse them, and it does for both engines; a run that did not replay vLLM paid for them."""
    from dataclasses import replace

    from node.validator.pipeline import BatchRules, CheckModel, judge_batch
    from node.validator.tasks import RunTasks

    path, model, tok = tiny
    ident = Identity.generate()
    rl = RLConfig(group_size=4, prompts_per_batch=2, max_new_tokens=12)
    judged = {}
    for engines in (("torch", "vllm"), ("torch",)):
        gen = make_generator(identity=ident, run_name="test", rl=rl, proofs=ProofsConfig(),
                             inference=InferenceConfig(engine="torch", device="cpu", engines=list(engines)),
                             worker=WorkerConfig(cheat="pasted-answers"))
        gen.follow(path)
        batch = open_batch(gen.run_step(7, 0, 0).sealed.envelope, "test").batch
        assert batch.engine == engines[-1]
        pasted = [s for s in batch.samples if s.sample_index < 2]
        assert all(s.task_reward == 1.0 for s in pasted)  # every pasted answer is right
        rules = BatchRules(run="test", taskset=rl.taskset, temperature=rl.temperature, top_p=rl.top_p,
                           max_new_tokens=rl.max_new_tokens, group_size=rl.group_size,
                           prompts_per_batch=rl.prompts_per_batch, async_level=2, engines=engines)
        j = judge_batch(batch, rules, current_version=0, tasks=RunTasks(rl), model=CheckModel(model, tok, 0))
        assert {r for r in j.reasons if r != "ok"} == {BatchReason.SAMPLING_MISMATCH.value}, j.reasons
        assert all(j.reasons[i] == "ok" for i, s in enumerate(batch.samples) if s.sample_index >= 2)
        judged[batch.engine] = batch, rules
    batch, rules = judged["vllm"]
    unreplayed = replace(rules, replay_engines=("torch",))
    assert judge_batch(batch, unreplayed, current_version=0, tasks=RunTasks(rl), model=CheckModel(model, tok, 0)).accepted


def test_generator_step_with_length_reward(tiny):
    """Thinking budgets drawn per prompt, stated in the prompt, and the length penalty in the reward."""
    path, model, tok = tiny
    ident = Identity.generate()
    rl = RLConfig(**RL, length_reward=True, thinking_budgets=[2, 5], length_alpha=0.5)
    sb, _ = _generate(path, "", ident, rl)
    assert {s.target_length for s in sb.batch.samples} <= {2, 5}
    assert any(s.length_penalty > 0 for s in sb.batch.samples)
    assert check_batch(sb, model, tok, ident.peer_id, 0, rl) == []


def _cli(*argv: str) -> int:
    import argparse

    from node.app.commands.rollout import add_commands

    parser = argparse.ArgumentParser(prog="swarm-node")
    add_commands(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_rollout_cli_runs_steps_offline(tiny, capsys):
    import json

    assert _cli("rollout", "--model", str(tiny[0]), "--steps", "2", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["samples"] == 64 and r["tokens"] > 0 and r["batch_bytes"] > 0 for r in rows)  # [rl] defaults: 4 x 16


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps"),
    (["--model", "."], "not a model folder"),
    (["--run", "RUN"], "group_size"),
])
def test_rollout_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    run = tmp_path / "run.toml"
    run.write_text("[rl]\ngroup_size = 1\n")
    assert _cli("rollout", *[str(run) if a == "RUN" else a for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_generator_step_on_code_tasks(tiny):
    """Code tasks are scored in the sandbox, several at once; the batch stays valid for a validator."""
    path, model, tok = tiny
    ident = Identity.generate()
    rl = RLConfig(taskset="code", group_size=2, prompts_per_batch=2, max_new_tokens=4)
    sb, _ = _generate(path, "", ident, rl)
    assert len(sb.batch.samples) == 4 and sb.batch.taskset == "code"
    assert check_batch(sb, model, tok, ident.peer_id, 0, rl) == []  # rewards recomputed one by one


def test_sybil_flood_cheat_signs_each_batch_with_a_fresh_key_and_is_refused_on_its_proofs(tiny):
    """Issue 42: the flood of the fresh-identity pool. Each batch comes from a key nobody has seen
    (not the node's), so each draws on the trainers' pool of new identities; the junk inside is
    refused on its proofs (tests/test_sybil.py: the pool still gives an honest newcomer its share)."""
    from node.validator.pipeline import BatchRules, CheckModel, judge_batch
    from node.validator.tasks import RunTasks

    path, model, tok = tiny
    node_key = Identity.generate()
    rl = RLConfig(**RL)
    gen = make_generator(identity=node_key, run_name="test", rl=rl, proofs=ProofsConfig(),
                         inference=InferenceConfig(engine="torch", device="cpu"), worker=WorkerConfig(cheat="sybil-flood"))
    gen.follow(path)
    batches = [open_batch(gen.run_step(step, 0, 0).sealed.envelope, "test").batch for step in (7, 8, 9)]
    signers = {b.worker for b in batches}
    assert len(signers) == 3 and node_key.peer_id not in signers
    rules = BatchRules(run="test", taskset=rl.taskset, temperature=rl.temperature, top_p=rl.top_p,
                       max_new_tokens=rl.max_new_tokens, group_size=rl.group_size,
                       prompts_per_batch=rl.prompts_per_batch, async_level=2)
    for b in batches:
        j = judge_batch(b, rules, current_version=0, tasks=RunTasks(rl), model=CheckModel(model, tok, 0))
        assert not j.accepted and all(r.startswith("proof") for r in j.reasons), j.reasons
