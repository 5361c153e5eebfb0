"""The cheating suite: honest batches pass, each named cheat is rejected with the right reason.

Batches are made with the embedded tiny model and the torch engine exactly as the contract says
(node/validator/testing.py), then tampered with, then judged by the pure pipeline in-process.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from node.engines.torch_engine import TorchEngine
from node.identity import Identity
from node.engines.model import create_tiny_model
from node.proofs.margins import ProofMargins
from node.proofs.reasons import Reason
from node.rl.config import RLConfig
from node.rl.spec import step_key
from node.validator import testing as T
from node.validator.pipeline import (
    BatchReason,
    BatchRules,
    CheckModel,
    Judgement,
    judge_batch,
    parse_batch,
)
from node.validator.config import ValidatorConfig
from node.validator.policy import PenaltyBook
from node.validator.store import ValidatorStore
from node.validator.tasks import RunTasks

RUN = "demo"
VERSION = 3  # the checkpoint version the honest batches claim (the model is the same file)
RULES = BatchRules(run=RUN, taskset="synthetic", temperature=1.0, top_p=1.0, max_new_tokens=8,
                   group_size=4, prompts_per_batch=2, async_level=2)
HONEST_BATCHES = 6


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    folder = create_tiny_model(Path(tmp_path_factory.mktemp("model")))
    engine = TorchEngine("cpu")
    engine.load(folder)
    tasks = RunTasks(RLConfig(group_size=RULES.group_size, prompts_per_batch=RULES.prompts_per_batch,
                              max_new_tokens=RULES.max_new_tokens))
    worker = Identity.from_seed(bytes(range(32)))  # fixed: the same draws, seeds and tokens every run
    honest = [T.make_batch(engine, worker, RULES, tasks, step=s, policy_version=VERSION) for s in range(HONEST_BATCHES)]
    return engine, tasks, worker, honest, CheckModel(engine.model, engine.tokenizer, VERSION)


def judge(world, signed, current=VERSION, replayed=lambda p: False) -> Judgement:
    _, tasks, _, _, model = world
    return judge_batch(signed.batch, RULES, current_version=current, tasks=tasks, model=model, replayed=replayed,
                       policy_root=T.ROOT)


def assert_rejected(j: Judgement, expected: frozenset[str]) -> None:
    assert not j.accepted
    bad = {r for r in j.reasons if r != "ok"}
    assert bad and bad <= expected, (bad, expected, j.details)


def test_honest_batches_pass_zero_false_rejections(world):
    judgements = [judge(world, b) for b in world[3]]
    false_rejections = [(j.reasons, j.details) for j in judgements if not j.accepted]
    assert false_rejections == []
    assert sum(len(j.reasons) for j in judgements) == HONEST_BATCHES * RULES.prompts_per_batch * RULES.group_size


def test_honest_batch_parses_and_a_stale_one_is_still_judged_ok_within_the_async_level(world):
    b = world[3][0]
    assert parse_batch(b.envelope, RUN).batch_id == b.batch_id
    assert judge(world, b, current=VERSION + RULES.async_level).accepted


def test_fault_wrong_model_weights(world):
    engine, tasks, worker, _, _ = world
    # 10% of each tensor's std. At 3% this tiny random-init model's proofs, log-probs and sampling
    # replay all still pass (measured): its final states barely depend on the weights' details.
    cheat = TorchEngine("cpu")
    cheat.model, cheat._tokenizer = T.perturbed_model(engine.model, 0.1), engine.tokenizer
    signed = T.make_batch(cheat, worker, RULES, tasks, step=1, policy_version=VERSION)
    assert_rejected(judge(world, signed), T.FAULTS["wrong_model_weights"].expected)


@pytest.mark.parametrize("scale", [0.01, 0.03])
def test_small_weight_changes_fail_thresholds_fitted_to_honest_work(world, scale):
    """The paper's thresholds let 1-3% through on this model; those a validator fits to the honest
    batches it accepted (node/proofs/margins.py, shown in its status) do not, and still pass honest ones.
    (In this float32 run the log-prob check refuses them too, tests/test_cheap_model.py: the proofs
    are judged here with one log-prob tolerance for every dtype, the bf16-sized one.)"""
    engine, tasks, worker, honest, _ = world
    proofs = replace(RULES.proofs, logprob_tolerance_mean_fp32=RULES.proofs.logprob_tolerance_mean,
                     logprob_tolerance_max_fp32=RULES.proofs.logprob_tolerance_max)
    rules = replace(RULES, proofs=proofs)
    margins = ProofMargins()
    for j in (judge(world, b) for b in honest):
        for chunks in j.proofs:
            margins.add(chunks, RULES.proofs.topk)
    fitted = replace(rules, proofs=margins.recommended(proofs, min_rollouts=margins.rollouts))
    assert fitted.proofs.max_mantissa_mean < RULES.proofs.max_mantissa_mean
    later = [T.make_batch(engine, worker, RULES, tasks, step=s, policy_version=VERSION) for s in range(20, 23)]
    assert all(judge_batch(b.batch, fitted, current_version=VERSION, tasks=tasks, model=world[4]).accepted for b in later)
    cheat = TorchEngine("cpu")
    cheat.model, cheat._tokenizer = T.perturbed_model(engine.model, scale), engine.tokenizer
    signed = T.make_batch(cheat, worker, RULES, tasks, step=1, policy_version=VERSION)
    assert judge_batch(signed.batch, rules, current_version=VERSION, tasks=tasks, model=world[4]).accepted  # the paper's
    assert not judge(world, signed).accepted  # the run's float32 log-prob tolerance
    j = judge_batch(signed.batch, fitted, current_version=VERSION, tasks=tasks, model=world[4])
    assert_rejected(j, T.FAULTS["wrong_model_weights"].expected)


def test_fault_altered_completion(world):
    engine, tasks, worker, honest_batches, _ = world
    honest = honest_batches[1]
    eos = engine.tokenizer.eos_token_id

    def edit(i, s):  # a careful cheat: rewrite the first token, then re-score and keep the rest consistent
        if s.completion_ids[0] == eos:
            return s
        ids = [20 + (s.completion_ids[0] + 1) % 60] + list(s.completion_ids[1:])
        task = tasks.draw(step_key(RUN, worker.peer_id, T.ROOT, honest.batch.step), s.prompt_index)
        sc = tasks.score(task, engine.tokenizer.decode(ids, skip_special_tokens=True), len(ids))
        return replace(s, completion_ids=ids, reward=sc.reward, task_reward=sc.task_reward, length_penalty=sc.length_penalty)

    edited = [edit(i, s) for i, s in enumerate(honest.batch.samples)]
    changed = [i for i, (a, b) in enumerate(zip(edited, honest.batch.samples)) if a is not b]
    assert changed
    signed = T.sign_batch(worker, replace(honest.batch, samples=T.regroup_advantages(edited)))
    j = judge(world, signed)
    assert_rejected(j, T.FAULTS["altered_completion"].expected)
    assert all(j.reasons[i] != "ok" for i in changed)  # every edited sample is caught


def test_fault_altered_last_token_is_caught_by_the_sampling_checks(world):
    honest, worker = world[3][1], world[2]

    def edit(i, s):
        ids = list(s.completion_ids)
        ids[-1] = 20 + (ids[-1] + 7) % 60
        return replace(s, completion_ids=ids, finish_reason="length")

    j = judge(world, T.with_samples(honest, worker, edit))
    assert_rejected(j, T.FAULTS["altered_last_token"].expected | {Reason.NOT_TERMINATED.value})
    assert BatchReason.SAMPLING_MISMATCH.value in j.reasons or Reason.LOGPROB_MISMATCH.value in j.reasons


def test_fault_copied_proofs(world):
    honest, worker = world[3][2], world[2]
    samples = honest.batch.samples
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_len.setdefault(len(s.completion_ids), []).append(i)
    rotate = {}
    for members in by_len.values():
        for a, b in zip(members, members[1:] + members[:1]):
            if a != b:
                rotate[a] = samples[b].proof
    assert rotate, "need two completions of equal length"
    signed = T.with_samples(honest, worker, lambda i, s: replace(s, proof=rotate.get(i, s.proof)))
    j = judge(world, signed)
    assert_rejected(j, T.FAULTS["copied_proofs"].expected)
    assert all(j.reasons[i] != "ok" for i in rotate)


def test_fault_reward_inflation(world):
    honest, worker = world[3][3], world[2]
    inflated = [replace(s, reward=1.0, task_reward=1.0) for s in honest.batch.samples]
    signed = T.sign_batch(worker, replace(honest.batch, samples=T.regroup_advantages(inflated)))
    assert_rejected(judge(world, signed), T.FAULTS["reward_inflation"].expected)


def test_fault_stale_policy_version(world):
    honest = world[3][0]
    j = judge(world, honest, current=VERSION + RULES.async_level + 1)
    assert_rejected(j, T.FAULTS["stale_policy"].expected)
    assert_rejected(judge(world, honest, current=VERSION - 1), frozenset({Reason.FUTURE_POLICY.value}))


def test_fault_replayed_batch(world, tmp_path):
    honest, worker = world[3][4], world[2]
    store = ValidatorStore(tmp_path / "v.sqlite")
    prompts = [s.prompt_index for s in honest.batch.samples]
    store.record(honest.batch_id, worker.peer_id, honest.batch.step, prompts, True, ["ok"], "t", b"v", 1)
    again = T.sign_batch(worker, replace(honest.batch, created_ms=honest.batch.created_ms + 1))
    assert again.batch_id != honest.batch_id
    slots = store.replayed_slots(worker.peer_id, again.batch.step, prompts, again.batch_id)
    assert_rejected(judge(world, again, replayed=slots.__contains__), T.FAULTS["replayed_batch"].expected)
    # The original batch sent again is not a replay: it gets its stored verdict back.
    assert store.replayed_slots(worker.peer_id, honest.batch.step, prompts, honest.batch_id) == set()
    assert store.verdict_of(honest.batch_id) == ("t", b"v")


def test_fault_cherry_picked_tasks(world):
    engine, tasks, worker, _, _ = world
    # Solve the tasks drawn at another step (say, the easy ones found by looking ahead).
    signed = T.make_batch(engine, worker, RULES, tasks, step=2, draw_step=7, policy_version=VERSION)
    assert_rejected(judge(world, signed), T.FAULTS["cherry_picked_tasks"].expected)


CODE_RULES = replace(RULES, taskset="code", max_new_tokens=24)  # room for the exit program and its eos


def test_fault_early_exit(world):
    engine, _, worker, _, model = world
    tasks = code_tasks()
    honest = T.make_batch(engine, worker, CODE_RULES, tasks, step=4, policy_version=VERSION)
    assert judge_batch(honest.batch, CODE_RULES, current_version=VERSION, tasks=tasks, model=model).accepted
    signed = T.early_exit(honest, worker, engine, CODE_RULES)
    j = judge_batch(signed.batch, CODE_RULES, current_version=VERSION, tasks=tasks, model=model)
    assert_rejected(j, T.FAULTS["early_exit"].expected)
    # The replay refuses the pasted tokens before they are scored; without it (an engine the run does
    # not replay) the verifier is what refuses them.
    j = judge_batch(signed.batch, replace(CODE_RULES, check_sampling=False), current_version=VERSION, tasks=tasks,
                    model=model)
    exits = [i for i, s in enumerate(signed.batch.samples) if s.task_reward == 1.0]
    assert exits and all(j.reasons[i] == Reason.REWARD_MISMATCH.value for i in exits)


BOTH_ENGINES = replace(RULES, engines=("torch", "vllm"))  # replay_engines left at its default


def test_fault_pasted_completion(world):
    """Issue 42 hole 1: text the model never sampled (the right answers, an injected URL), re-proved
    with the checkpoint so its proofs and log-probs hold, truly scored, is refused by the sampling
    replay whatever engine the batch names. Once a vLLM batch skipped the replay on its say-so."""
    engine, tasks, worker, honest, model = world
    assert BOTH_ENGINES.replays("vllm") and BOTH_ENGINES.replays("torch")

    def judged(signed, rules=BOTH_ENGINES):
        return judge_batch(signed.batch, rules, current_version=VERSION, tasks=tasks, model=model, policy_root=T.ROOT)

    answers = T.pasted_completions(honest[1], worker, engine, BOTH_ENGINES, tasks, lambda d: d.data.answer)
    assert all(s.task_reward == 1.0 for s in answers.batch.samples)  # every pasted answer is right
    for text_of in (lambda d: d.data.answer, lambda d: "http://x.io"):
        for claim in ("vllm", "torch"):
            signed = T.pasted_completions(honest[1], worker, engine, BOTH_ENGINES, tasks, text_of, claim=claim)
            assert_rejected(judged(signed), T.FAULTS["pasted_completion"].expected)
    # the attack as it was: a run that does not replay vLLM batches pays for the pasted answers
    assert judged(answers, replace(BOTH_ENGINES, replay_engines=("torch",))).accepted
    assert judged(T.sign_batch(worker, replace(honest[1].batch, engine="vllm"))).accepted  # honest stays honest


def code_tasks(**kw) -> RunTasks:
    return RunTasks(RLConfig(taskset="code", group_size=CODE_RULES.group_size,
                             prompts_per_batch=CODE_RULES.prompts_per_batch, max_new_tokens=CODE_RULES.max_new_tokens), **kw)


def test_fault_free_sandbox(world, monkeypatch):
    """Issue 42 hole 2: endless loops with garbage proofs are refused on their proofs, and no
    sample reaches the code sandbox (each would hold it for its whole time limit)."""
    import node.rl.verifiers as verifiers
    from node.rl.sandbox import SandboxResult

    engine, _, worker, _, model = world
    tasks = code_tasks()
    signed = T.free_sandbox(T.make_batch(engine, worker, CODE_RULES, tasks, step=5, policy_version=VERSION), worker, engine)
    runs = []
    monkeypatch.setattr(verifiers, "run_python", lambda program, limits: runs.append(program) or SandboxResult(
        returncode=None, stdout="", stderr="", timed_out=True, wall_s=5.0, isolation="test"))
    j = judge_batch(signed.batch, CODE_RULES, current_version=VERSION, tasks=tasks, model=model)
    assert_rejected(j, T.FAULTS["free_sandbox"].expected)
    assert len(runs) == 0, f"{len(runs)} sandbox runs for a batch whose proofs are garbage"


def test_scoring_past_the_batch_budget_rejects_the_batch(world):
    """Scoring has a time budget per batch: the samples not scored within it are rejected with
    ``score_budget`` (a reason that costs the worker points), the others keep their verdict."""
    engine, _, worker, _, model = world
    readings = iter(range(1000))  # a clock one second later at each reading: 2 samples fit in 2.5 s
    tasks = code_tasks(clock=lambda: float(next(readings)))
    signed = T.make_batch(engine, worker, CODE_RULES, code_tasks(), step=6, policy_version=VERSION)
    j = judge_batch(signed.batch, replace(CODE_RULES, score_budget_s=2.5), current_version=VERSION, tasks=tasks,
                    model=model)
    assert not j.accepted
    n = CODE_RULES.prompts_per_batch * CODE_RULES.group_size
    assert sorted(j.reasons) == ["ok"] * 2 + [BatchReason.SCORE_BUDGET.value] * (n - 2), j.details
    struck = PenaltyBook(ValidatorConfig()).on_verdict(worker.peer_id, j.reasons, now=0.0)
    assert struck is not None and struck.reason == BatchReason.SCORE_BUDGET.value


def test_fault_forged_signature(world):
    honest = world[3][5]
    forger = Identity.generate()
    forged = T.sign_batch(forger, honest.batch)  # names the honest worker, signed by someone else
    got = parse_batch(forged.envelope, RUN)
    assert not isinstance(got, type(honest)) and got.reason.value in T.FAULTS["forged_signature"].expected


def test_fault_chosen_seed(world):
    engine, tasks, worker, _, _ = world
    signed = T.make_batch(engine, worker, RULES, tasks, step=3, seed=12345, policy_version=VERSION)
    assert_rejected(judge(world, signed), T.FAULTS["chosen_seed"].expected)


def test_fault_dropped_group(world):
    """A worker drops the prompt it failed (a whole group): every remaining group is complete, so a
    per-group check passes it; a batch must hold every prompt drawn for its step."""
    honest, worker = world[3][4], world[2]
    kept = [s for s in honest.batch.samples if s.prompt_index != 0]
    assert kept and len(kept) < len(honest.batch.samples)
    signed = T.sign_batch(worker, replace(honest.batch, samples=kept))
    assert_rejected(judge(world, signed), T.FAULTS["dropped_group"].expected)


def test_fault_draw_of_another_version(world):
    """A batch made with v3's weights whose tasks and seed are the draw of another manifest root (one
    the worker could compute ahead, or the easier of two versions' draws): the root is not v3's."""
    engine, tasks, worker, _, _ = world
    signed = T.make_batch(engine, worker, RULES, tasks, step=4, policy_version=VERSION, policy_root=b"\x22" * 32)
    assert_rejected(judge(world, signed), T.FAULTS["draw_of_another_version"].expected)


def test_wrong_parameters_and_incomplete_groups(world):
    honest, worker = world[3][0], world[2]
    hot = T.sign_batch(worker, replace(honest.batch, temperature=2.0))
    assert_rejected(judge(world, hot), frozenset({Reason.WRONG_TEMPERATURE.value}))
    longer = T.sign_batch(worker, replace(honest.batch, max_new_tokens=9))
    assert_rejected(judge(world, longer), frozenset({BatchReason.WRONG_PARAMS.value}))
    partial = T.sign_batch(worker, replace(honest.batch, samples=honest.batch.samples[1:]))
    assert_rejected(judge(world, partial), frozenset({BatchReason.BAD_GROUPS.value}))


def test_token_ids_outside_the_vocabulary_are_a_reason_not_a_crash(world):
    honest, worker = world[3][2], world[2]
    huge = T.with_samples(honest, worker, lambda i, s: replace(s, completion_ids=[10**9] + list(s.completion_ids[1:])))
    assert_rejected(judge(world, huge), frozenset({Reason.OUT_OF_BOUNDS.value}))


def test_garbage_bytes_are_a_reason_not_a_crash():
    for data in (b"", b"\x00" * 10, b"\x92\x01\x02", bytes(range(256))):
        got = parse_batch(data, RUN)
        assert got.reason.value in (BatchReason.MALFORMED.value, BatchReason.FORGED.value)


def test_every_named_fault_has_a_test():
    tested = {name[len("test_fault_"):] for name in globals() if name.startswith("test_fault_")}
    assert set(T.FAULTS) <= tested | {"stale_policy", "replayed_batch", "altered_last_token", "ground_step"}


def test_length_reward_runs_check_budgets_and_penalties(world):
    engine, _, worker, _, model = world
    rl = RLConfig(group_size=RULES.group_size, prompts_per_batch=RULES.prompts_per_batch,
                  max_new_tokens=RULES.max_new_tokens, length_reward=True, thinking_budgets=[3, 6])
    tasks = RunTasks(rl)
    signed = T.make_batch(engine, worker, RULES, tasks, step=11, policy_version=VERSION)
    assert {s.target_length for s in signed.batch.samples} <= {3, 6}
    assert any(s.length_penalty > 0 for s in signed.batch.samples)
    ok = judge_batch(signed.batch, RULES, current_version=VERSION, tasks=tasks, model=model)
    assert ok.accepted, ok.details
    # Claiming no length penalty (a higher reward) is a reward mismatch.
    unpenalised = [replace(s, length_penalty=0.0, reward=s.task_reward) for s in signed.batch.samples]
    cheat = T.sign_batch(worker, replace(signed.batch, samples=T.regroup_advantages(unpenalised)))
    j = judge_batch(cheat.batch, RULES, current_version=VERSION, tasks=tasks, model=model)
    assert_rejected(j, frozenset({Reason.REWARD_MISMATCH.value}))


# --------------------------------------------------------------------------------------------
# Engine-aware checks: a batch states its engine; the run says which it accepts and which replay


class OtherSamplerEngine:
    """A vLLM-style engine: honest log-probs and final hidden states, tokens drawn by a sampler the
    validator cannot replay (here: our sampler under seeds the batch does not state)."""

    name = "vllm"

    def __init__(self, inner: TorchEngine) -> None:
        self.inner = inner

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    @property
    def dtype_name(self) -> str:
        return self.inner.dtype_name

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, seed, capture_hidden=True):
        return self.inner.generate(prompts, n, temperature, top_p, max_new_tokens, seed ^ 0x5EED, capture_hidden)


# A run that opts out of replaying vLLM batches (replay_engines = ["torch"]); by default both are replayed.
VLLM_RUN = replace(RULES, engines=("torch", "vllm"), replay_engines=("torch",))


@pytest.fixture(scope="module")
def vllm_batch(world):
    engine, tasks, worker, _, _ = world
    return T.make_batch(OtherSamplerEngine(engine), worker, VLLM_RUN, tasks, step=7, policy_version=VERSION)


def test_batches_state_their_engine_and_dtype_under_the_signature(world, vllm_batch):
    honest = world[3][0]
    assert (honest.batch.engine, honest.batch.dtype) == ("torch", "float32")
    assert (vllm_batch.batch.engine, vllm_batch.batch.dtype) == ("vllm", "float32")
    claimed = T.sign_batch(world[2], replace(honest.batch, engine="vllm"))
    assert claimed.batch_id != honest.batch_id  # the engine is part of what is signed


def test_a_batch_claiming_an_engine_the_run_refuses_is_rejected_with_the_reason(world, vllm_batch):
    _, tasks, _, _, model = world
    j = judge_batch(vllm_batch.batch, RULES, current_version=VERSION, tasks=tasks, model=model, policy_root=T.ROOT)
    assert set(j.reasons) == {BatchReason.ENGINE_REFUSED.value}
    assert "'vllm' is not one this run accepts (torch)" in j.details[0]
    # a cheat that relabels an honest torch batch as vllm (to skip the replay) is refused the same way
    relabelled = T.sign_batch(world[2], replace(world[3][0].batch, engine="vllm"))
    assert set(judge(world, relabelled).reasons) == {BatchReason.ENGINE_REFUSED.value}


def test_a_vllm_style_batch_passes_a_run_that_accepts_it_and_fails_one_that_requires_replay(world, vllm_batch):
    _, tasks, _, _, model = world

    def judged(rules):
        return judge_batch(vllm_batch.batch, rules, current_version=VERSION, tasks=tasks, model=model, policy_root=T.ROOT)

    ok = judged(VLLM_RUN)
    assert ok.accepted, (ok.reasons, ok.details)
    strict = judged(replace(VLLM_RUN, replay_engines=("torch", "vllm")))
    assert not strict.accepted
    assert {r for r in strict.reasons if r != "ok"} == {BatchReason.SAMPLING_MISMATCH.value}
    # the same tokens stated as torch's are replayed, and fail: the replay is what tells the engines apart
    as_torch = T.sign_batch(world[2], replace(vllm_batch.batch, engine="torch"))
    j = judge_batch(as_torch.batch, VLLM_RUN, current_version=VERSION, tasks=tasks, model=model, policy_root=T.ROOT)
    assert BatchReason.SAMPLING_MISMATCH.value in j.reasons


def test_log_prob_and_proof_checks_still_apply_to_engines_without_replay(world, vllm_batch):
    _, tasks, worker, _, model = world
    lied = T.with_samples(vllm_batch, worker, lambda i, s: replace(s, logprobs=[x - 1.0 for x in s.logprobs]))
    j = judge_batch(lied.batch, VLLM_RUN, current_version=VERSION, tasks=tasks, model=model, policy_root=T.ROOT)
    assert set(j.reasons) == {Reason.LOGPROB_MISMATCH.value}
    unproved = T.with_samples(vllm_batch, worker, lambda i, s: replace(s, proof=bytes(len(s.proof))))
    j = judge_batch(unproved.batch, VLLM_RUN, current_version=VERSION, tasks=tasks, model=model, policy_root=T.ROOT)
    assert not j.accepted and Reason.LOGPROB_MISMATCH.value not in j.reasons


def test_a_run_that_fixes_the_dtype_refuses_batches_stating_another(world):
    j = judge_batch(world[3][0].batch, replace(RULES, dtype="bfloat16"), current_version=VERSION, tasks=world[1],
                    model=world[4], policy_root=T.ROOT)
    assert set(j.reasons) == {BatchReason.WRONG_PARAMS.value} and "dtype" in j.details[0]


def test_a_batch_stating_an_unknown_dtype_or_a_garbage_engine_is_malformed(world):
    from node.wire import encode, pack, seal

    for bad in ({"dtype": "int4"}, {"engine": "to rch"}, {"engine": ""}):
        wire = {**world[3][0].batch.to_wire(), **bad}  # raw bytes: a hostile encoder skips our checks
        data = encode(seal(world[2], "rollout-batch", pack(wire)))
        check = parse_batch(data, RUN)
        assert check.reason == BatchReason.MALFORMED, bad
