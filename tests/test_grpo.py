"""GRPO maths on toy tensors: hand-computed loss, both clipping sides, KL, entropy, packing, steps."""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from node.engines.model import TinyModelSpec, build_tiny_model, build_tokenizer
from node.rl.config import GRPOConfig
from node.rl.grpo import (
    IGNORE,
    NonFiniteStep,
    accumulate,
    TrainSample,
    batch_loss,
    grpo_loss,
    make_optimizer,
    pack,
    split_minibatches,
    token_logprobs,
    train_step,
)
from node.rl.spec import filter_groups, group_advantages, has_signal

CFG = GRPOConfig(epsilon=0.2, delta=4.0, kl_coef=0.0, entropy_coef=0.0)
SMALL = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1)


def one(x):
    return torch.tensor([x], dtype=torch.float64)


def loss_of(ratio, adv, cfg=CFG):
    """Per-token loss for one token with the given ratio (old logp 0, new logp log ratio)."""
    logp = torch.log(one(ratio)).requires_grad_(True)
    parts = grpo_loss(logp, one(0.0), one(adv), one(1.0), cfg)
    parts.loss.backward()
    return parts.loss.item(), logp.grad.item(), parts


# -- advantages and filtering ------------------------------------------------------------------


def test_group_advantages_by_hand():
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5 -> +-1 (up to the 1e-6)
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    a = 0.5 / (0.5 + 1e-6)
    assert adv == pytest.approx([a, -a, -a, a], rel=1e-12)
    adv = group_advantages([3.0, 1.0, 2.0])
    std = math.sqrt(2 / 3)
    assert adv == pytest.approx([1 / (std + 1e-6), -1 / (std + 1e-6), 0.0])
    assert group_advantages([0.7] * 5) == [0.0] * 5


def test_zero_advantage_groups_are_filtered():
    groups = [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.2, 0.2], [0.0, 0.0, 0.5]]
    assert filter_groups(groups) == [1, 3]
    assert not has_signal([0.3]) and not has_signal([])


# -- the loss by hand --------------------------------------------------------------------------


def test_loss_inside_the_clip_range_is_minus_ratio_times_advantage():
    loss, grad, parts = loss_of(1.1, 2.0)
    assert loss == pytest.approx(-1.1 * 2.0)
    assert grad == pytest.approx(-1.1 * 2.0)  # d(-r A)/d logp = -r A
    assert parts.clip_frac == 0.0


def test_positive_advantage_is_clipped_above_one_plus_epsilon():
    loss, grad, parts = loss_of(1.5, 1.0)
    assert loss == pytest.approx(-1.2)  # min(1.5, 1.2) * 1
    assert grad == 0.0  # no push beyond the trust region
    assert parts.clip_frac == 1.0
    # below 1 - eps the unclipped term is the min: gradient flows (PPO's pessimistic bound)
    loss, grad, _ = loss_of(0.5, 1.0)
    assert loss == pytest.approx(-0.5) and grad == pytest.approx(-0.5)


def test_negative_advantage_is_clipped_below_one_minus_epsilon():
    loss, grad, _ = loss_of(0.5, -1.0)
    assert loss == pytest.approx(0.8)  # -min(0.5 * -1, 0.8 * -1) = 0.8
    assert grad == 0.0


def test_negative_advantage_ratio_is_bounded_above_by_delta():
    # between 1 + eps and delta: plain PPO (unclipped term, gradient flows)
    loss, grad, parts = loss_of(3.0, -1.0)
    assert loss == pytest.approx(3.0) and grad == pytest.approx(3.0)
    assert parts.delta_frac == 0.0
    # beyond delta: the loss is capped at delta * |A| and the gradient vanishes
    loss, grad, parts = loss_of(10.0, -1.0)
    assert loss == pytest.approx(4.0) and grad == 0.0
    assert parts.delta_frac == 1.0
    # plain PPO would have kept growing with the ratio
    ppo = -min(10.0 * -1.0, 1.2 * -1.0)
    assert ppo == 10.0


def test_loss_is_a_token_level_mean():
    logp = torch.log(torch.tensor([[1.0, 1.1, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    parts = grpo_loss(logp, torch.zeros_like(logp), adv, mask, CFG)
    # five scored tokens: -(1 + 1.1 - 2 - 2 - 2) / 5
    assert parts.loss.item() == pytest.approx(-(1.0 + 1.1 - 6.0) / 5)


def test_kl_term_uses_the_k3_estimator():
    cfg = GRPOConfig(kl_coef=0.5, entropy_coef=0.0)
    logp, ref = torch.tensor([-1.0], dtype=torch.float64), torch.tensor([-1.5], dtype=torch.float64)
    parts = grpo_loss(logp, logp.clone(), torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64),
                      cfg, ref_logp=ref)
    d = -0.5
    assert parts.kl == pytest.approx(math.exp(d) - d - 1)
    assert parts.loss.item() == pytest.approx(0.5 * (math.exp(d) - d - 1))
    same = grpo_loss(logp, logp.clone(), torch.zeros(1), torch.ones(1), cfg, ref_logp=logp.clone())
    assert same.kl == pytest.approx(0.0)


def test_entropy_bonus_lowers_the_loss():
    cfg = GRPOConfig(kl_coef=0.0, entropy_coef=0.1)
    logp = torch.zeros(2, dtype=torch.float64)
    ent = torch.tensor([2.0, 4.0], dtype=torch.float64)
    parts = grpo_loss(logp, logp.clone(), torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64),
                      cfg, entropy=ent)
    assert parts.entropy == pytest.approx(3.0)
    assert parts.loss.item() == pytest.approx(-0.3)


# -- packing -----------------------------------------------------------------------------------


def _samples(n=7, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(3, 90) for _ in range(rng.randint(1, 8))]
        c = [rng.randrange(3, 90) for _ in range(rng.randint(1, 7))]
        out.append(TrainSample(p, c, [rng.uniform(-5, -0.1) for _ in c], rng.uniform(-2, 2)))
    return out


@pytest.fixture(scope="module")
def model():
    tok = build_tokenizer()
    return build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, SMALL, seed=0).double()


def test_pack_layout_positions_and_targets():
    s1 = TrainSample([10, 11], [12, 13], [-1.0, -2.0], 0.5)
    s2 = TrainSample([20], [21, 22, 23], [-3.0, -4.0, -5.0], -1.0)
    b = pack([s1, s2], 10)
    assert b.input_ids.shape == (1, 10)
    # longest first: s2 (4 tokens) then s1 (4 tokens): stable order of equal lengths keeps s1 first
    assert b.input_ids[0, :8].tolist() == [10, 11, 12, 13, 20, 21, 22, 23]
    assert b.position_ids[0, :8].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert b.segment_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, -1, -1]
    assert b.targets[0].tolist() == [IGNORE, 12, 13, IGNORE, 21, 22, 23, IGNORE, IGNORE, IGNORE]
    assert b.old_logprobs[0, :8].tolist() == [0.0, -1.0, -2.0, 0.0, -3.0, -4.0, -5.0, 0.0]
    assert b.advantages[0, :8].tolist() == [0.0, 0.5, 0.5, 0.0, -1.0, -1.0, -1.0, 0.0]
    assert b.num_tokens == 5
    m = b.attention_mask()[0, 0]
    assert m[5, 4] == 0 and m[5, 3] < -1e30 and m[1, 2] < -1e30  # no cross-sample, causal


def test_pack_rejects_an_oversized_sample():
    with pytest.raises(ValueError):
        pack([TrainSample([1] * 6, [2] * 6, [0.0] * 6, 1.0)], 8)


def test_packed_loss_and_gradients_equal_the_unpacked_ones(model):
    samples = _samples()
    cfg = GRPOConfig(kl_coef=0.0, entropy_coef=1e-2)
    packed, unpacked = pack(samples, 24), pack(samples, 24, one_per_row=True)
    assert packed.input_ids.shape[0] < unpacked.input_ids.shape[0]
    grads = []
    losses = []
    for b in (packed, unpacked):
        model.zero_grad()
        parts = batch_loss(model, b, cfg)
        parts.loss.backward()
        losses.append(parts.loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-9, abs=1e-12)
    assert torch.allclose(grads[0], grads[1], atol=1e-10)


def test_packed_logprobs_equal_a_forward_of_each_sample_alone(model):
    samples = _samples(4, seed=3)
    b = pack(samples, 40)
    logp, _ = token_logprobs(model, b, temperature=0.7)
    got = sorted(round(x, 9) for x in logp[b.targets != IGNORE].tolist())
    want = []
    for s in samples:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([s.prompt_ids + s.completion_ids])).logits[0] / 0.7
        lp = torch.log_softmax(out, -1)
        p = len(s.prompt_ids)
        want += [round(lp[p - 1 + t, c].item(), 9) for t, c in enumerate(s.completion_ids)]
    assert got == pytest.approx(sorted(want), abs=1e-8)


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_micro_batches_add_up_to_the_whole_mini_batch(model):
    """Gradient accumulation: a mini-batch run one packed row per pass gives the gradient and the
    figures of one pass over all its rows (memory then grows with a pass, not the step)."""
    samples = _samples(12, seed=5)
    for s, v in zip(samples, range(12)):
        s.version = v % 2
    cfg = GRPOConfig(kl_coef=0.0, entropy_coef=1e-2, pack_length=24, micro_batch_tokens=24)
    b = pack(samples, 24)
    assert b.input_ids.shape[0] >= 3
    model.zero_grad()
    whole = accumulate(model, b, cfg, version=1, rows=b.input_ids.shape[0])
    g_whole = _grads(model).clone()
    model.zero_grad()
    passes = []
    hook = model.get_decoder().register_forward_hook(lambda m, i, o: passes.append(o.last_hidden_state.shape[0]))
    try:
        split = accumulate(model, b, cfg, version=1)  # rows_per_pass(cfg) = 1
    finally:
        hook.remove()
    assert passes == [1] * b.input_ids.shape[0]
    assert torch.allclose(_grads(model), g_whole, atol=1e-10)
    for name in ("policy", "entropy", "clip_frac", "mean_ratio", "masked_frac", "mismatch_kl"):
        assert getattr(split, name) == pytest.approx(getattr(whole, name), rel=1e-9, abs=1e-12), name
    assert split.loss.item() == pytest.approx(whole.loss.item(), rel=1e-9, abs=1e-12)
    assert split.same_version_kl[1] == whole.same_version_kl[1] > 0
    assert split.same_version_kl[0] == pytest.approx(whole.same_version_kl[0], rel=1e-9, abs=1e-12)


def test_train_step_is_the_same_in_micro_batches():
    tok = build_tokenizer()
    samples = _samples(10, seed=6)
    after = []
    for tokens in (10_000, 24):
        m = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, SMALL, seed=3).double()
        cfg = GRPOConfig(lr=1e-2, warmup_steps=0, optimizer_steps=2, kl_coef=0.0, pack_length=24,
                         micro_batch_tokens=tokens)
        opt, sched = make_optimizer(m, cfg)
        st = train_step(m, opt, sched, samples, cfg, pad_id=tok.pad_token_id)
        assert st.optimizer_steps == 2 and st.samples == 10
        after.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert torch.allclose(after[0], after[1], atol=1e-9)


# -- steps -------------------------------------------------------------------------------------


def test_split_minibatches():
    assert [len(m) for m in split_minibatches(list(range(10)), 4)] == [3, 3, 3, 1]
    assert [len(m) for m in split_minibatches(list(range(2)), 4)] == [1, 1]


def test_train_step_warms_up_the_lr_and_moves_the_policy(model):
    tok = build_tokenizer()
    m = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, SMALL, seed=1)
    cfg = GRPOConfig(lr=1e-2, warmup_steps=4, optimizer_steps=2, kl_coef=0.0, max_grad_norm=1.0)
    opt, sched = make_optimizer(m, cfg)
    # one prompt, a good and a bad completion; the good one must become more likely
    good, bad = [30, 31], [40, 41]
    with torch.no_grad():
        lp = torch.log_softmax(m(input_ids=torch.tensor([[5, 6] + good])).logits[0], -1)
    before = lp[1, good[0]].item() + lp[2, good[1]].item()
    lrs = []
    for _ in range(3):
        batch = []
        for c, a in ((good, 1.0), (bad, -1.0)):
            with torch.no_grad():
                lq = torch.log_softmax(m(input_ids=torch.tensor([[5, 6] + c])).logits[0], -1)
            batch.append(TrainSample([5, 6], c, [lq[1, c[0]].item(), lq[2, c[1]].item()], a))
        st = train_step(m, opt, sched, batch * 2, cfg, pad_id=tok.pad_token_id)
        assert st.optimizer_steps == 2 and st.samples == 4
        lrs.append(st.lr)
    assert lrs[0] < lrs[1] < lrs[2] <= cfg.lr  # warming up
    with torch.no_grad():
        lp = torch.log_softmax(m(input_ids=torch.tensor([[5, 6] + good])).logits[0], -1)
    assert lp[1, good[0]].item() + lp[2, good[1]].item() > before


def test_grad_norm_is_clipped():
    tok = build_tokenizer()
    m = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, SMALL, seed=2)
    cfg = GRPOConfig(lr=1e-3, max_grad_norm=1e-3, optimizer_steps=1, kl_coef=0.0, warmup_steps=0)
    opt, sched = make_optimizer(m, cfg)
    with torch.no_grad():
        lp = torch.log_softmax(m(input_ids=torch.tensor([[5, 6, 7]])).logits[0], -1)
    old = [lp[0, 6].item(), lp[1, 7].item()]  # ratio 1: inside the clip range, the gradient flows
    st = train_step(m, opt, sched, [TrainSample([5], [6, 7], old, 3.0)], cfg)
    assert st.grad_norm > cfg.max_grad_norm  # reported norm is the pre-clip norm
    total = torch.sqrt(sum((p.grad.detach() ** 2).sum() for p in m.parameters() if p.grad is not None))
    assert total.item() == pytest.approx(cfg.max_grad_norm, rel=1e-3)


def test_an_absurd_old_logprob_does_not_poison_the_weights():
    """The attack of issue 14: one claimed log-prob far below the model's own (the schema's floor,
    -1000; -1e30 before it had one) made exp(logp - old_logp) inf and every weight NaN."""
    tok = build_tokenizer()
    m = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, SMALL, seed=2)
    cfg = GRPOConfig(lr=1e-3, optimizer_steps=1, kl_coef=0.0, warmup_steps=0)
    opt, sched = make_optimizer(m, cfg)
    for adv in (1.0, -1.0, 0.0):
        st = train_step(m, opt, sched, [TrainSample([5], [6, 7], [-1000.0, -0.5], adv)], cfg)
        assert math.isfinite(st.loss) and math.isfinite(st.grad_norm)
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_a_non_finite_loss_never_reaches_the_optimizer():
    tok = build_tokenizer()
    m = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, SMALL, seed=2)
    cfg = GRPOConfig(lr=1e-3, optimizer_steps=1, kl_coef=0.0, warmup_steps=0)
    opt, sched = make_optimizer(m, cfg)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(NonFiniteStep):  # an advantage past every bound (the schema refuses it on the wire)
        train_step(m, opt, sched, [TrainSample([5], [6, 7], [-0.5, -0.5], float("inf"))], cfg)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_config_validation():
    with pytest.raises(ValueError):
        GRPOConfig(delta=1.1).validate()
    with pytest.raises(ValueError):
        GRPOConfig(epsilon=0).validate()
    GRPOConfig().validate()


# -- GPU bits, their CPU side: the choices are made by pure functions tested here ---------------


def test_packed_rows_use_position_resets_alone_under_a_varlen_flash_kernel_and_the_mask_otherwise():
    from node.rl.grpo import TrainSample, pack, packed_attention

    batch = pack([TrainSample([1, 2], [3], [-1.0], 1.0), TrainSample([4], [5, 6], [-1.0, -1.0], -1.0)], 8)
    assert batch.position_ids[0].tolist()[:5] == [0, 1, 2, 0, 1]  # restarts per sample
    flash = packed_attention(batch, "flash_attention_2", torch.bfloat16)
    assert flash["attention_mask"] is None and torch.equal(flash["position_ids"], batch.position_ids)
    for impl in ("sdpa", "eager", None):
        sdpa = packed_attention(batch, impl, torch.float32)
        assert sdpa["attention_mask"].shape == (1, 1, 8, 8)
        assert torch.equal(sdpa["attention_mask"], batch.attention_mask(torch.float32))


def test_adamw_is_fused_only_when_every_parameter_is_on_cuda():
    from node.rl.grpo import adamw_kwargs, make_optimizer

    assert adamw_kwargs({"cuda:0"}) == {"fused": True}
    assert adamw_kwargs({"cpu"}) == {} and adamw_kwargs({"cuda:0", "cpu"}) == {} and adamw_kwargs(set()) == {}
    opt, _ = make_optimizer(torch.nn.Linear(2, 2), GRPOConfig())
    assert not opt.param_groups[0].get("fused")  # the CPU path is torch's default AdamW, as before
