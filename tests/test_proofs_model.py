"""TOPLOC end to end with a small real model: honest rollouts pass, each kind of tampering fails.

The model is a random-init Llama (hidden 256, 4 layers, vocab 256) in bf16, built locally. Its
``initializer_range`` is 0.2 rather than the default 0.02: with 0.02 the random blocks barely touch
the residual stream, every final state is nearly its own token's embedding, and no proof can see
the context (then a changed prompt token or a 3% weight perturbation passes; measured, see the
report of issue 4). 0.2 gives context-dependent states, as a trained model has. Chunks are
32 tokens x 256 = 8192 values, so k = 128 is the top 1.6%, as for real models (paper: k=128 of
32 x 4096+).

Numbers measured here are printed (``pytest -s``) so a change of margin is visible.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from node.proofs.capture import (
    capture_final_hidden,
    completion_lengths,
    logits_from_hidden,
    prefill_hidden_states,
    recompute_decode_states,
)
from node.proofs.checks import check_logprobs, check_termination
from node.proofs.config import ProofsConfig
from node.proofs.reasons import Reason
from node.proofs.margins import Worst, recommend
from node.proofs.toploc import build_proofs_many, judge, summarize, verify_proofs
from node.rl.spec import token_logprobs

CFG = ProofsConfig()
EOS, PAD = 2, 0
VOCAB = 256
MAX_NEW = 70  # two full chunks and a 6-token tail
TEMPERATURE = 1.0
HONEST_SEEDS = 30  # x 4 rollouts, in the slow test


def make_model(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.fixture(scope="module")
def model():
    return make_model()


def random_prompts(seed: int, n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 16, (n,), generator=g)
    return [torch.randint(3, VOCAB, (int(n_),), generator=g).tolist() for n_ in lengths]


def generate(model, prompts: list[list[int]], seed: int, max_new: int = MAX_NEW, min_new: int = 0):
    """An honest inference node: left-padded batch, sampled, final states captured -> rollouts."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    with capture_final_hidden(model) as cap, torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=TEMPERATURE,
            top_k=0,
            max_new_tokens=max_new,
            min_new_tokens=min_new,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )
    new = out[:, width:]
    assert cap.num_steps == new.shape[1]  # one captured state per generated column
    lengths = completion_lengths(new, [EOS])
    states = cap.per_sequence(lengths)
    completions = [new[b, :n].tolist() for b, n in enumerate(lengths)]
    logprobs = [
        token_logprobs(logits_from_hidden(model, s), torch.tensor(c), TEMPERATURE).tolist()
        for s, c in zip(states, completions)
    ]
    return completions, build_proofs_many(states, CFG.chunk_tokens, CFG.topk), logprobs, states


def validate(model, prompts, completions, proofs, logprobs=None):
    """A validator: one prefill -> proof verdicts (and log-prob checks when claimed log-probs are given)."""
    states = recompute_decode_states(model, prompts, completions, PAD)
    verdicts = [verify_proofs(s, p, CFG) for s, p in zip(states, proofs)]
    lp_checks = []
    if logprobs is not None:
        for s, c, lp in zip(states, completions, logprobs):
            mine = token_logprobs(logits_from_hidden(model, s), torch.tensor(c), TEMPERATURE)
            lp_checks.append(
                check_logprobs(lp, mine, tolerance_mean=CFG.logprob_tolerance_mean, tolerance_max=CFG.logprob_tolerance_max)
            )
    return verdicts, lp_checks


def test_capture_matches_a_plain_forward(model):
    prompts = random_prompts(1, n=1)
    completions, _, _, states = generate(model, prompts, seed=1, max_new=20, min_new=20)
    full = torch.tensor([prompts[0] + completions[0]])
    ref = prefill_hidden_states(model, full)[0, len(prompts[0]) - 1 : -1]  # decode positions
    assert states[0].shape == ref.shape == (20, 256)
    # KV-cache decode and one prefill differ only by bf16 rounding noise.
    assert torch.allclose(states[0].float(), ref.float(), atol=0.1, rtol=0.05)


def honest_rejections(model, seeds: range) -> list:
    verdicts, lp_checks, total = [], [], 0
    for seed in seeds:
        prompts = random_prompts(100 + seed)
        completions, proofs, logprobs, _ = generate(model, prompts, seed)
        assert all(check_termination(c, [EOS], MAX_NEW).ok for c in completions)
        v, lp = validate(model, prompts, completions, proofs, logprobs)
        verdicts += v
        lp_checks += lp
        total += sum(len(c) for c in completions)
    rejections = [v.check for v in verdicts if not v.ok] + [c for c in lp_checks if not c.ok]
    print(f"\nhonest: {len(verdicts)} rollouts, {total} tokens, {summarize(verdicts)}, rejections {len(rejections)}")
    assert summarize(verdicts)["chunks"] >= 2 * len(seeds) * 4
    return rejections


def test_honest_rollouts_pass(model):
    assert honest_rejections(model, range(2)) == []


@pytest.mark.slow
def test_no_false_positives_over_many_seeds(model):
    assert honest_rejections(model, range(2, 2 + HONEST_SEEDS)) == []


@pytest.fixture(scope="module")
def honest(model):
    prompts = random_prompts(7)
    completions, proofs, logprobs, _ = generate(model, prompts, seed=7, min_new=MAX_NEW)
    return prompts, completions, proofs, logprobs


def assert_all_rejected(verdicts, label):
    print(f"\n{label}: {[v.reason.value for v in verdicts]} {summarize(verdicts)}")
    assert all(not v.ok for v in verdicts), label


def perturbed(model, scale: float, seed: int = 1):
    """The run's weights plus Gaussian noise of ``scale`` x each tensor's std (a fine-tuned or wrong model)."""
    other = copy.deepcopy(model).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return other.to(torch.bfloat16)


@pytest.mark.parametrize("scale", [0.03])  # 3% of each tensor's std; larger ones fail harder
def test_perturbed_weights_are_detected(model, honest, scale):
    prompts = honest[0]
    completions, proofs, _, _ = generate(perturbed(model, scale), prompts, seed=7, min_new=MAX_NEW)
    verdicts, _ = validate(model, prompts, completions, proofs)
    assert_all_rejected(verdicts, f"weights perturbed by {scale}")


def test_different_prompt_is_detected(model, honest):
    _, completions, proofs, _ = honest
    claimed = random_prompts(8)  # the node generated for other prompts than it claims
    verdicts, _ = validate(model, claimed, completions, proofs)
    assert_all_rejected(verdicts, "different prompt")


def test_changed_prompt_token_is_detected(model, honest):
    prompts, completions, proofs, _ = honest
    claimed = [[p[0]] + [(p[1] + 1) % VOCAB or 3] + p[2:] for p in prompts]
    verdicts, _ = validate(model, claimed, completions, proofs)
    assert_all_rejected(verdicts, "one prompt token changed")


def test_changed_completion_token_is_detected(model, honest):
    prompts, completions, proofs, logprobs = honest
    changed = [c[:20] + [(c[20] + 1) % VOCAB or 3] + c[21:] for c in completions]
    verdicts, lp = validate(model, prompts, changed, proofs, logprobs)
    assert_all_rejected(verdicts, "completion token 20 changed")
    assert all(not c.ok and c.reason is Reason.LOGPROB_MISMATCH for c in lp)


def test_changed_last_token_is_caught_by_logprobs_not_by_the_proof(model, honest):
    # No proven state depends on the last token (it was never fed back), so only the sampling
    # check can see it: the claimed log-prob belongs to the original token. The cheat swaps in
    # the token the model finds least likely; a swap to a token about as likely as the sampled one
    # moves its log-prob by less than the tolerance and is invisible to both checks (TOPLOC2's
    # replayable seeded sampling closes that gap).
    prompts, completions, proofs, logprobs = honest
    states = recompute_decode_states(model, prompts, completions, PAD)
    unlikely = [int(logits_from_hidden(model, s[-1]).argmin()) for s in states]
    changed = [c[:-1] + [u] for c, u in zip(completions, unlikely)]
    verdicts, lp = validate(model, prompts, changed, proofs, logprobs)
    assert all(v.ok for v in verdicts)
    assert all(c.reason is Reason.LOGPROB_MISMATCH for c in lp), lp


EDITS = [
    (lambda c: c[:-5], "truncated by 5"),
    (lambda c: c[:-40], "truncated by 40"),
    (lambda c: c + [5, 6, 7], "padded by 3"),
    (lambda c: c + [PAD] * 30, "padded by 30"),
]


@pytest.mark.parametrize("edit, label", EDITS)
def test_truncated_or_padded_completion_is_caught_by_exact_rules(model, honest, edit, label):
    """A completion cut short or extended breaks facts that need no numeric tolerance: where
    generation stopped (termination) and one claimed log-prob per token. Whether the proof also
    notices a few extra tokens inside the last chunk depends on the numbers, so no rule leans on it."""
    prompts, completions, _, logprobs = honest
    edited = [edit(c) for c in completions]
    termination = [check_termination(c, [EOS], MAX_NEW) for c in edited]
    print(f"\n{label}: {[t.reason.value for t in termination]}")
    assert all(not t.ok for t in termination), label
    assert {t.reason for t in termination} <= {Reason.NOT_TERMINATED, Reason.TOKENS_AFTER_EOS, Reason.TOO_LONG}
    states = recompute_decode_states(model, prompts, edited, PAD)
    for s, c, lp in zip(states, edited, logprobs):
        mine = token_logprobs(logits_from_hidden(model, s), torch.tensor(c), TEMPERATURE)
        assert check_logprobs(lp, mine, tolerance_mean=1.0, tolerance_max=1.0).reason is Reason.LOGPROB_SHAPE


def test_proofs_for_a_different_number_of_chunks_are_refused(model, honest):
    """Cutting 40 tokens off drops at least one 32-token chunk: the proof count no longer fits,
    whatever the states say."""
    prompts, completions, proofs, _ = honest
    verdicts, _ = validate(model, prompts, [c[:-40] for c in completions], proofs)
    assert [v.reason for v in verdicts] == [Reason.PROOF_COUNT] * len(verdicts)


def test_proofs_shuffled_between_sequences_are_detected(model, honest):
    prompts, completions, proofs, _ = honest
    verdicts, _ = validate(model, prompts, completions, proofs[1:] + proofs[:1])
    assert_all_rejected(verdicts, "proofs shuffled")


@pytest.fixture(scope="module")
def fp32_verdicts(model, honest):
    """A node that computes in fp32 (its states rounded to bf16 for the proof); the validator runs bf16."""
    prompts = honest[0]
    completions, proofs, _, _ = generate(make_model(torch.float32), prompts, seed=7, min_new=MAX_NEW)
    return validate(model, prompts, completions, proofs)[0]


def test_fp32_computation_moves_the_measurements(model, honest, fp32_verdicts):
    fp32 = summarize(fp32_verdicts)
    ref = summarize(validate(model, *honest[:3])[0])
    print(f"\nfp32 vs bf16: fp32 {fp32}\nbf16 {ref}")
    assert fp32["median_mant_err_mean"] > 2 * ref["median_mant_err_mean"]


@pytest.mark.xfail(
    strict=True,
    reason="at this model size fp32 vs bf16 stays inside the paper's thresholds (errors grow with depth; "
    "measured in the issue 4 report): see the next test for the run's own thresholds",
)
def test_fp32_computation_is_rejected_with_the_papers_thresholds(fp32_verdicts):
    assert_all_rejected(fp32_verdicts, "fp32 instead of bf16")


def honest_verdicts(model, seeds: range) -> list:
    out = []
    for seed in seeds:
        prompts = random_prompts(100 + seed)
        completions, proofs, _, _ = generate(model, prompts, seed)
        out += validate(model, prompts, completions, proofs)[0]
    return out


def test_fp32_computation_is_rejected_with_thresholds_fitted_to_honest_work(model, fp32_verdicts):
    """What a validator's status recommends (node/proofs/margins.py) after watching honest rollouts."""
    seen = honest_verdicts(model, range(200, 208))
    assert all(v.ok for v in seen)
    fitted = recommend(Worst.over([Worst.of(v.chunks, CFG.topk) for v in seen]), CFG)
    print(f"\nfitted: exp {fitted.max_exp_mismatches}, mean {fitted.max_mantissa_mean}, median {fitted.max_mantissa_median}")
    assert fitted.max_mantissa_mean < CFG.max_mantissa_mean  # tighter than the paper's on this model

    def passes(v) -> bool:
        return all(judge(c, fitted).ok for c in v.chunks)

    later = honest_verdicts(model, range(300, 308))  # honest rollouts the fit never saw
    assert sum(passes(v) for v in later) == len(later)
    assert not any(passes(v) for v in fp32_verdicts), "fp32 instead of bf16 passed the fitted thresholds"
