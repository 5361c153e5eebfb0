"""Torch engine and seeded sampling: determinism, log-probs, hidden-state capture, weight swaps."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

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
from node.engines.vllm_engine import GUMBEL_PROCESSOR, V1_RUNNER_SWITCH
from node.engines.vllm_gumbel import parse_draw
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


# -- the static-cache decode path: same tokens, log-probs and proof states as the dynamic one ------


@pytest.fixture(scope="module")
def static_engine(folders):
    e = TorchEngine("cpu", decode="static")
    e.load(folders[0])
    return e


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.5, 1.0)])
def test_static_decode_matches_the_dynamic_path(engine, static_engine, temperature, top_p):
    assert engine.decode_mode() == "dynamic" and static_engine.decode_mode() == "static"
    prompts = [enc(engine, "rev 1="), enc(engine, "rev 31415926="), enc(engine, "rev 42=")]
    for seed in (2, 3):  # the second call reuses the (reset) static cache
        a = [s for g in engine.generate(prompts, 3, temperature, top_p, 12, seed=seed) for s in g]
        b = [s for g in static_engine.generate(prompts, 3, temperature, top_p, 12, seed=seed) for s in g]
        assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
        assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
        for x, y in zip(a, b):
            assert y.logprobs == pytest.approx(x.logprobs, abs=1e-5)
            assert y.hidden.shape == x.hidden.shape and y.hidden.dtype == x.hidden.dtype
            assert torch.allclose(x.hidden, y.hidden, atol=1e-5)


def test_static_decode_states_are_what_a_validator_prefill_proves(static_engine):
    from node.proofs.config import ProofsConfig
    from node.proofs.toploc import build_proofs_many, verify_proofs

    flat = [s for g in static_engine.generate([enc(static_engine, "rev 2718=")], 4, 1.0, 1.0, 40, seed=8) for s in g]
    ref = recompute_decode_states(static_engine.model, [s.prompt_ids for s in flat], [s.completion_ids for s in flat])
    proofs = build_proofs_many([s.hidden for s in flat], 32, 128)
    for s, r, p in zip(flat, ref, proofs):
        assert torch.allclose(s.hidden, r.float(), atol=1e-4)
        assert verify_proofs(r, p, ProofsConfig()).ok


def test_decode_modes_resolve_by_device_and_model(engine, folders):
    assert TorchEngine("cpu").decode_mode() == "dynamic" or TorchEngine("cpu").model is None
    compiled_on_cpu = TorchEngine("cpu", decode="compiled")
    compiled_on_cpu.load(folders[0])
    assert compiled_on_cpu.decode_mode() == "static"  # CUDA graphs are GPU-only
    with pytest.raises(ValueError):
        TorchEngine("cpu", decode="fast")


# -- the vLLM engine against a stand-in of vLLM's public API, fast and in every run (the real vLLM,
#    its CPU build, runs in tests/vllm_real/: `make vllm-test`) ----------------------------------


class _FakeLLM:
    """vllm.LLM as the engine uses it: generate(TokensPrompt list, SamplingParams list) -> RequestOutputs.

    Decodes as vLLM's V1 sampler does with the engine's logits processor (node/engines/vllm_gumbel.py):
    per step the model's logits, the processor's rewrite, a greedy argmax (the requests are at
    temperature 0), and the raw log-probs (log softmax of the logits before the processor) that
    logprobs_mode = "raw_logprobs" returns."""

    def __init__(self, inner, **kwargs):
        self.inner, self.kwargs, self.rpcs, self.resets = inner, kwargs, [], 0

    def generate(self, prompts, sampling_params, use_tqdm=True):
        from types import SimpleNamespace as NS

        from node.engines.vllm_gumbel import GumbelDraws

        outs = []
        for p, sp in zip(prompts, sampling_params):
            assert sp.temperature == 0.0  # vLLM only takes the processor's choice
            ids, lps, draws = [], [], GumbelDraws()
            draws.update([], [(0, sp, p["prompt_token_ids"], ids)], [])
            with torch.no_grad():
                while len(ids) < sp.max_tokens and (not ids or ids[-1] not in sp.stop_token_ids):
                    logits = self.inner.model(torch.tensor([p["prompt_token_ids"] + ids])).logits[:, -1].float()
                    raw = torch.log_softmax(logits, -1)
                    tok = int(draws.apply(logits).argmax())
                    lps.append({tok: NS(logprob=float(raw[0, tok]))})
                    ids.append(tok)
            outs.append(NS(outputs=[NS(token_ids=tuple(ids), logprobs=lps, text="", finish_reason="")]))
        return outs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append((method, kwargs))
        self.inner.swap_weights(Path(kwargs["weights_path"]))
        return [None]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.resets += 1
        return True


@pytest.fixture
def fake_vllm(monkeypatch, folders):
    import sys
    import types
    from dataclasses import dataclass

    inner = TorchEngine("cpu")
    inner.load(folders[0])

    @dataclass
    class SamplingParams:
        n: int = 1
        temperature: float = 1.0
        top_p: float = 1.0
        max_tokens: int = 16
        logprobs: int | None = None
        skip_special_tokens: bool = True
        stop_token_ids: list | None = None
        extra_args: dict | None = None

    vllm = types.ModuleType("vllm")
    vllm.LLM = lambda **kw: _FakeLLM(inner, **kw)
    vllm.SamplingParams = SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    vllm.inputs = inputs
    platforms = types.ModuleType("vllm.platforms")  # a GPU, as the engine was written for
    platforms.current_platform = types.SimpleNamespace(is_cuda=lambda: True, is_cpu=lambda: False)
    vllm.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the engine must switch it off (and this restores it)
    return inner


def test_vllm_engine_samples_per_request_seeds_and_proves_with_a_torch_prefill(fake_vllm, folders):
    from node.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine()
    eng.load(folders[0])
    assert eng.llm.kwargs["logprobs_mode"] == "raw_logprobs" and eng.llm.kwargs["generation_config"] == "vllm"
    assert eng.llm.kwargs["logits_processors"] == [GUMBEL_PROCESSOR] and os.environ[V1_RUNNER_SWITCH] == "0"
    assert eng.name == "vllm" and eng.dtype_name == "float32" and isinstance(eng, Engine)
    prompts = [enc(eng, "rev 12="), enc(eng, "rev 9876=")]
    rows, seeds, _, params = eng.requests(prompts, 3, 1.0, 1.0, 8, seed=5)
    assert [p.n for p in params] == [1] * 6 and [p.temperature for p in params] == [0.0] * 6
    assert [parse_draw(p.extra_args).seed for p in params] == seeds  # one request per sequence, our seed
    assert len(set(seeds)) == 6 and seeds[0] == sequence_seed(5, 0, 0)
    groups = eng.generate(prompts, 3, 1.0, 1.0, 8, seed=5)
    flat = [s for g in groups for s in g]
    # the processor's draws are the torch engine's: the same seed, the same tokens
    same = [s for g in fake_vllm.generate(prompts, 3, 1.0, 1.0, 8, seed=5, capture_hidden=False) for s in g]
    assert [s.completion_ids for s in flat] == [s.completion_ids for s in same]
    ref = recompute_decode_states(fake_vllm.model, [s.prompt_ids for s in flat], [s.completion_ids for s in flat])
    for s, r in zip(flat, ref):
        assert torch.allclose(s.hidden, r.float(), atol=1e-4)  # proofs come from the prefill
    # the claimed log-probs are vLLM's (top_p = 1) and equal the prefill's log softmax(logits / T)
    _, prefill_lp = eng.prove([s.prompt_ids for s in flat], [s.completion_ids for s in flat], 1.0)
    for s, lp in zip(flat, prefill_lp):
        assert s.logprobs == pytest.approx(lp, abs=1e-4)


def test_vllm_engine_takes_prefill_logprobs_under_top_p_and_swaps_weights_through_the_rpc(fake_vllm, folders):
    from node.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine()
    eng.load(folders[0])
    flat = [s for g in eng.generate([enc(eng, "rev 55=")], 2, 0.8, 0.9, 6, seed=1) for s in g]
    _, prefill_lp = eng.prove([s.prompt_ids for s in flat], [s.completion_ids for s in flat], 0.8)
    assert [s.logprobs for s in flat] == prefill_lp  # vLLM's raw ones are before the temperature
    eng.swap_weights(folders[1])
    [(method, kwargs)] = eng.llm.rpcs
    assert method == "swap_weights_in_place" and eng.llm.resets == 1
    view = Path(kwargs["weights_path"])  # vLLM reads a staged view of the checkpoint (stage_checkpoint)
    assert view == eng.view and view.parent == folders[1].parent and eng.path == folders[1]
    assert sorted(p.name for p in view.iterdir()) == sorted(p.name for p in folders[1].iterdir() if p.is_file())
    fresh = TorchEngine("cpu")
    fresh.load(folders[1])
    for a, b in zip(eng.prover.model.state_dict().values(), fresh.model.state_dict().values()):
        assert torch.equal(a, b)  # the prover follows the same checkpoint


def test_a_staged_checkpoint_outlives_the_deletion_of_its_folder(tmp_path):
    """The shards layer may delete an old version while vLLM still reads it (minutes for a first
    load on a CPU): the engine reads a view of hard links, which the deletion leaves whole."""
    import shutil

    from node.engines.vllm_engine import drop_view, stage_checkpoint

    folder = create_tiny_model(tmp_path / "7", seed=0, spec=SMALL)
    want = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    view = stage_checkpoint(folder)
    assert view.parent == folder.parent and not view.name.isdigit()  # a name the checkpoint store skips
    shutil.rmtree(folder)
    assert {p.name: p.read_bytes() for p in view.iterdir()} == want
    TorchEngine("cpu").load(view)
    drop_view(view)
    assert not view.exists()


def test_the_vllm_engine_uses_only_vllm_names_the_conformance_table_lists():
    """Every ``vllm`` import and every ``self.llm.<name>`` call in the engine is in VLLM_API, which
    ``make vllm-conformance`` checks against the pinned release."""
    import ast
    import inspect

    from node.engines import vllm_engine

    tree = ast.parse(inspect.getsource(vllm_engine))
    processor = ast.parse(Path(vllm_engine.__file__).with_name("vllm_processor.py").read_text())  # imports vllm
    assert GUMBEL_PROCESSOR == "node.engines.vllm_processor:GumbelMaxProcessor"
    used = set()
    for node in [*ast.walk(tree), *ast.walk(processor)]:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            used |= {f"{node.module}.{a.name}" for a in node.names}
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "llm" and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"):
            used.add(f"vllm.LLM.{node.attr}")
    assert used and used <= set(vllm_engine.VLLM_API), used - set(vllm_engine.VLLM_API)
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not attrs & {"llm_engine", "model_executor", "driver_worker"}  # no V0 internals
    # one environment switch, vLLM's model runner (it reads it nowhere else: V1_RUNNER_SWITCH)
    assert [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "environ"] == ["environ"]
    assert not any(a.startswith("_") and not a.startswith("__") for a in attrs - {"_dtype"})  # no private attribute


# -- which engine runs: "auto" never picks one the run does not accept ----------------------------


def test_auto_picks_only_an_engine_the_run_accepts():
    from node.inference.generate import pick_engine

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


def test_a_failing_compiled_decode_falls_back_to_the_static_cache_with_the_same_samples(folders, monkeypatch):
    eng = TorchEngine("cpu", decode="static")
    eng.load(folders[0])
    prompts = [enc(eng, "rev 12=")]
    want = eng.generate(prompts, 2, 1.0, 1.0, 6, seed=4)[0]
    monkeypatch.setattr(eng, "decode_mode", lambda: "compiled" if eng.decode == "static-compiled" else eng.decode)
    eng.decode = "static-compiled"  # stands for CUDA + compiled: this CPU has no graphs to fail
    real = eng._decode_static
    calls = []

    def broken_once(*args):
        calls.append(eng.decode)
        if len(calls) == 1:
            raise RuntimeError("inductor: no kernel for this GPU")
        return real(*args)

    monkeypatch.setattr(eng, "_decode_static", broken_once)
    got = eng.generate(prompts, 2, 1.0, 1.0, 6, seed=4)[0]
    assert calls == ["static-compiled", "static"] and eng.decode == "static"
    assert [s.completion_ids for s in got] == [s.completion_ids for s in want]
