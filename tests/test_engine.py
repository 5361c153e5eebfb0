"""Torch engine and seeded sampling: determinism, log-probs, hidden-state capture, weight swaps."""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from node.engines.base import FINISH_LENGTH, FINISH_STOP, Engine
from node.engines.sampling import (
    sample_tokens,
    sequence_seed,
    top_p_mask,
    uniform_noise,
)
from node.engines.torch_engine import TorchEngine
from node.engines.model import TinyModelSpec, create_tiny_model
from node.proofs.capture import recompute_decode_states

SMALL = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("eng")
    return create_tiny_model(root / "a", seed=0, spec=SMALL), create_tiny_model(root / "b", seed=1, spec=SMALL)


@pytest.fixture(scope="module")
def engine(folders):
    e = TorchEngine("cpu")
    e.load(folders[0])
    return e


def enc(engine, text):
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


# -- sampling maths -----------------------------------------------------------------------------


def _splitmix_reference(x: int) -> int:
    m = (1 << 64) - 1
    x &= m
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_uniform_noise_matches_a_pure_python_splitmix64():
    seeds = [0, 1, 2**62 + 12345, 987654321]
    step, vocab = 7, 5
    got = uniform_noise(torch.tensor(seeds), step, vocab)
    m = (1 << 64) - 1
    for r, s in enumerate(seeds):
        base = _splitmix_reference((s * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) & m)
        for v in range(vocab):
            x = _splitmix_reference(base ^ ((v * 0x9E3779B97F4A7C15) & m))
            want = ((x >> 11) + 0.5) / 2**53
            assert got[r, v].item() == pytest.approx(want, rel=0, abs=1e-15)
    assert 0 < got.min() and got.max() < 1


def test_gumbel_max_samples_follow_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64)
    toks, logp = sample_tokens(logits.expand(n, -1), seeds, 0, temperature=0.7, top_p=1.0)
    probs = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(toks, minlength=4).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.015)
    assert torch.allclose(logp, probs.log()[toks], atol=1e-6)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert top_p_mask(logits, 0.5).tolist() == [[True, False, False, False]]
    assert top_p_mask(logits, 0.7).tolist() == [[True, True, False, False]]
    assert top_p_mask(logits, 0.81).tolist() == [[True, True, True, False]]
    toks, _ = sample_tokens(logits.expand(500, -1), torch.arange(500), 0, 1.0, 0.7)
    assert set(toks.tolist()) <= {0, 1}


def test_temperature_zero_is_greedy():
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    toks, _ = sample_tokens(logits, torch.arange(6), 3, 0.0, 1.0)
    assert torch.equal(toks, logits.argmax(-1))


def test_sequence_seeds_are_distinct_and_stable():
    seeds = {sequence_seed(5, i, j) for i in range(20) for j in range(20)}
    assert len(seeds) == 400
    assert sequence_seed(5, 1, 2) == sequence_seed(5, 1, 2) < 2**63


# -- engine -------------------------------------------------------------------------------------


def test_torch_engine_implements_the_protocol(engine):
    assert isinstance(engine, Engine)


def test_fixed_seed_gives_identical_samples_and_other_seeds_differ(engine):
    prompts = [enc(engine, "rev 123="), enc(engine, "rev 98765=")]
    a = engine.generate(prompts, 3, 1.0, 1.0, 8, seed=11)
    b = engine.generate(prompts, 3, 1.0, 1.0, 8, seed=11)
    c = engine.generate(prompts, 3, 1.0, 1.0, 8, seed=12)
    ids = lambda g: [s.completion_ids for grp in g for s in grp]
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    assert [s.logprobs for grp in a for s in grp] == [s.logprobs for grp in b for s in grp]


def test_a_sequence_does_not_depend_on_its_batch_mates(engine):
    p0 = enc(engine, "rev 4021=")
    alone = engine.generate([p0], 2, 1.0, 1.0, 8, seed=3)[0]
    # same prompt index 0, different (longer) companion prompt -> different left padding
    with_mate = engine.generate([p0, enc(engine, "rev 123456789=")], 2, 1.0, 1.0, 8, seed=3)[0]
    assert [s.completion_ids for s in alone] == [s.completion_ids for s in with_mate]
    for x, y in zip(alone, with_mate):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_logprobs_equal_a_plain_forward_pass(engine):
    temp = 0.8
    grp = engine.generate([enc(engine, "rev 55=")], 2, temp, 1.0, 6, seed=1)[0]
    for s in grp:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            lp = torch.log_softmax(engine.model(input_ids=ids).logits[0].float() / temp, -1)
        L = len(s.prompt_ids)
        want = [lp[L - 1 + i, t].item() for i, t in enumerate(s.completion_ids)]
        assert s.logprobs == pytest.approx(want, abs=1e-4)


def test_hidden_state_capture_matches_a_prefill(engine):
    groups = engine.generate([enc(engine, "rev 1="), enc(engine, "rev 31415=")], 2, 1.0, 1.0, 7, seed=2)
    flat = [s for g in groups for s in g]
    ref = recompute_decode_states(engine.model, [s.prompt_ids for s in flat], [s.completion_ids for s in flat])
    for s, r in zip(flat, ref):
        assert s.hidden.shape == (len(s.completion_ids), SMALL.hidden_size)
        assert torch.allclose(s.hidden, r.float(), atol=1e-4)


def test_termination_is_consistent(engine):
    eos = engine.tokenizer.eos_token_id
    for g in engine.generate([enc(engine, "rev 12=")], 16, 1.5, 1.0, 5, seed=9):
        for s in g:
            assert 1 <= len(s.completion_ids) <= 5
            assert eos not in s.completion_ids[:-1]  # nothing after eos
            if s.finish_reason == FINISH_STOP:
                assert s.completion_ids[-1] == eos
            else:
                assert s.finish_reason == FINISH_LENGTH and len(s.completion_ids) == 5


def test_forced_eos_stops_the_sequence(folders):
    eng = TorchEngine("cpu")
    eng.load(folders[0])
    eos = eng.tokenizer.eos_token_id

    def push_eos(_module, _args, logits):
        logits = logits.clone()
        logits[..., eos] += 1e4
        return logits

    handle = eng.model.lm_head.register_forward_hook(push_eos)
    try:
        s = eng.generate([enc(eng, "rev 9=")], 1, 1.0, 1.0, 6, seed=0)[0][0]
    finally:
        handle.remove()
    assert s.completion_ids == [eos] and s.finish_reason == FINISH_STOP and s.text == ""
    assert s.hidden.shape == (1, SMALL.hidden_size)


def test_swap_weights_in_place_equals_a_fresh_load(folders):
    a, b = folders
    eng = TorchEngine("cpu")
    eng.load(a)
    model_obj = eng.model
    prompt = [enc(eng, "rev 777=")]
    before = eng.generate(prompt, 2, 1.0, 1.0, 6, seed=4, capture_hidden=False)[0]
    eng.swap_weights(b)
    assert eng.model is model_obj  # no new model object: weights copied in place
    swapped = eng.generate(prompt, 2, 1.0, 1.0, 6, seed=4, capture_hidden=False)[0]
    fresh = TorchEngine("cpu")
    fresh.load(b)
    want = fresh.generate(prompt, 2, 1.0, 1.0, 6, seed=4, capture_hidden=False)[0]
    assert [s.completion_ids for s in swapped] == [s.completion_ids for s in want]
    assert [s.logprobs for s in swapped] != [s.logprobs for s in before]


def test_swap_weights_refuses_another_architecture(folders, tmp_path):
    other = create_tiny_model(tmp_path / "wide", spec=TinyModelSpec(hidden_size=48, intermediate_size=64,
                                                                    num_hidden_layers=2, num_attention_heads=2,
                                                                    num_key_value_heads=1))
    eng = TorchEngine("cpu")
    eng.load(folders[0])
    with pytest.raises(ValueError):
        eng.swap_weights(other)
    with pytest.raises(ValueError):
        eng.swap_weights(tmp_path)  # no safetensors at all


def test_generate_rejects_bad_arguments(engine):
    with pytest.raises(ValueError):
        engine.generate([], 1, 1.0, 1.0, 4, seed=0)
    with pytest.raises(ValueError):
        engine.generate([[]], 1, 1.0, 1.0, 4, seed=0)
    with pytest.raises(ValueError):
        engine.generate([[5]], 0, 1.0, 1.0, 4, seed=0)


def test_vllm_engine_module_imports_without_vllm():
    import importlib

    mod = importlib.import_module("node.engines.vllm_engine")
    assert hasattr(mod, "VLLMEngine")


def test_gumbel_sampling_is_unbiased_over_seeds_for_a_random_distribution():
    rng = random.Random(0)
    logits = torch.tensor([[rng.gauss(0, 1) for _ in range(6)]])
    n = 12000
    toks, _ = sample_tokens(logits.expand(n, -1), torch.arange(10**6, 10**6 + n), 5, 1.0, 1.0)
    probs = torch.softmax(logits[0], -1)
    freq = torch.bincount(toks, minlength=6).double() / n
    # chi-square with 5 degrees of freedom; 20.5 is the 0.999 quantile
    chi2 = float(((freq - probs.double()) ** 2 / probs.double()).sum() * n)
    assert chi2 < 20.5, chi2
    assert math.isfinite(chi2)


def test_vllm_hook_maps_recorded_states_back_to_completions():
    """The vLLM engine's pre-hook bookkeeping, driven with stand-ins for vLLM's sampling metadata."""
    from types import SimpleNamespace as NS

    from node.engines.vllm_engine import _states_by_prompt, _StepRecorder, _take_states

    rec = _StepRecorder()
    prompt = (5, 6)
    # two sequences of one prompt; step 0 (prefill, 2 positions each, last one selected), then one decode step
    data = {1: NS(prompt_token_ids=prompt, output_token_ids=()), 2: NS(prompt_token_ids=prompt, output_token_ids=())}
    meta0 = NS(selected_token_indices=torch.tensor([1, 3]), seq_groups=[NS(seq_ids=[1], seq_data=data), NS(seq_ids=[2], seq_data=data)])
    rec(None, (None, torch.arange(4.0)[:, None].expand(4, 3), meta0))
    data[1].output_token_ids, data[2].output_token_ids = (7,), (8,)
    meta1 = NS(selected_token_indices=torch.tensor([0, 1]), seq_groups=[NS(seq_ids=[2], seq_data=data), NS(seq_ids=[1], seq_data=data)])
    rec(None, (None, torch.tensor([[20.0] * 3, [10.0] * 3]), meta1))
    by_key = _states_by_prompt(rec)
    s1 = _take_states(by_key, prompt, [7, 9])  # sequence 1 produced 7 then 9
    s2 = _take_states(by_key, prompt, [8, 1])
    assert s1[:, 0].tolist() == [1.0, 10.0] and s2[:, 0].tolist() == [3.0, 20.0]
    assert _take_states(by_key, prompt, [7, 9]) is None  # each recording is used once


# -- which engine runs: "auto" never picks one the run does not accept ----------------------------


def test_auto_picks_only_an_engine_the_run_accepts():
    from node.rollouts.generate import pick_engine

    assert pick_engine("auto", ("torch",), vllm_ok=True) == "torch"  # vLLM usable, but the run refuses it
    assert pick_engine("auto", ("torch", "vllm"), vllm_ok=True) == "vllm"
    assert pick_engine("auto", ("torch", "vllm"), vllm_ok=False) == "torch"
    with pytest.raises(ValueError, match="no usable engine"):
        pick_engine("auto", ("vllm",), vllm_ok=False)
    with pytest.raises(ValueError, match="not in this run's engines"):
        pick_engine("vllm", ("torch",), vllm_ok=True)


def test_the_run_file_names_known_engines_and_an_accepted_one():
    from node.rl.config import InferenceConfig

    InferenceConfig(engines=["torch", "vllm"], engine="vllm").validate()
    for bad in (InferenceConfig(engines=["tensorrt"]), InferenceConfig(replay_engines=["sglang"]),
                InferenceConfig(engines=[]), InferenceConfig(engine="vllm")):
        with pytest.raises(ValueError):
            bad.validate()


def test_the_torch_engine_states_its_dtype(engine):
    assert engine.name == "torch" and engine.dtype_name == "float32"
