"""The [grpo] loss choices on toy tensors, against values worked out by hand; the off-policy figures."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from node.config import ConfigError, RunConfig  # noqa: E402
from node.engines.model import TinyModelSpec, build_tiny_model, build_tokenizer  # noqa: E402
from node.rl.config import LOSSES, GRPOConfig  # noqa: E402
from node.rl.grpo import TrainSample, grpo_loss, make_optimizer, train_step  # noqa: E402
from node.rl.losses import dppo_tv, intellect2, mismatch_kl, off_policy_steps, tis  # noqa: E402

SMALL = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def grads(fn, p_new, p_old, adv):
    """(per-token loss, d loss / d logp, cut) of ``fn`` at the given probabilities."""
    logp = torch.log(t(*p_new)).requires_grad_(True)
    terms = fn(logp, torch.log(t(*p_old)), t(*adv))
    terms.per_token.sum().backward()
    return terms.per_token.detach().tolist(), logp.grad.tolist(), terms.cut.tolist()


def close(a, b, tol=1e-9):
    return all(math.isclose(x, y, rel_tol=tol, abs_tol=tol) for x, y in zip(a, b, strict=True))


# -- intellect2 ---------------------------------------------------------------------------------


def test_intellect2_by_hand():
    f = lambda lp, old, a: intellect2(lp, old, a, epsilon=0.2, delta=4.0)  # noqa: E731
    # ratios 1.1 (inside), 1.5 with A > 0 (clipped at 1.2), 0.5 with A < 0 (clipped at 0.8),
    # 2.0 with A < 0 (unclipped: -rA), 5.0 with A < 0 (delta bound: -4A)
    loss, grad, cut = grads(f, [0.55, 0.75, 0.25, 0.4, 0.5], [0.5, 0.5, 0.5, 0.2, 0.1], [1.0, 2.0, -1.0, -1.0, -1.0])
    assert close(loss, [-1.1, -2.4, 0.8, 2.0, 4.0])
    # d(-rA)/dlogp = -rA where the ratio branch is live, 0 where a clip or the bound wins
    assert close(grad, [-1.1, 0.0, 0.0, 2.0, 0.0])
    assert cut == [False, True, True, False, True]


# -- dppo-tv ------------------------------------------------------------------------------------


def test_dppo_tv_masks_by_probability_difference_in_the_advantages_direction():
    f = lambda lp, old, a: dppo_tv(lp, old, a, tv=0.2, tau=0.0)  # noqa: E731
    # token 0: p 0.5 -> 0.8 (+0.3) with A > 0: masked. token 1: same move with A < 0: kept (-rA = 1.6).
    # token 2: p 0.5 -> 0.2 (-0.3) with A < 0: masked. token 3: 0.01 -> 0.1, ratio 10 but +0.09: kept.
    loss, grad, cut = grads(f, [0.8, 0.8, 0.2, 0.1], [0.5, 0.5, 0.5, 0.01], [1.0, -1.0, -1.0, 1.0])
    assert cut == [True, False, True, False]
    assert close(loss, [0.0, 1.6, 0.0, -10.0])
    assert close(grad, [0.0, 1.6, 0.0, -10.0])  # d(-rA)/dlogp = -rA


def test_dppo_tv_log_ratio_penalty_is_on_every_token():
    f = lambda lp, old, a: dppo_tv(lp, old, a, tv=0.2, tau=0.5)  # noqa: E731
    lr = math.log(0.8 / 0.5)
    loss, grad, _ = grads(f, [0.8, 0.8], [0.5, 0.5], [1.0, -1.0])
    # masked token: tau log(r)^2 alone; kept one: -rA + tau log(r)^2; grad adds 2 tau log(r)
    assert close(loss, [0.5 * lr ** 2, 1.6 + 0.5 * lr ** 2])
    assert close(grad, [lr, 1.6 + lr])


# -- tis ----------------------------------------------------------------------------------------


def test_truncated_is_weights_the_policy_gradient_by_the_capped_ratio():
    f = lambda lp, old, a: tis(lp, old, a, cap=2.0)  # noqa: E731
    # ratios 0.5, 1.5 and 4 (truncated to 2); the weight carries no gradient: d/dlogp = -w A
    _, grad, cut = grads(f, [0.25, 0.75, 0.8], [0.5, 0.5, 0.2], [1.0, -2.0, 1.0])
    assert close(grad, [-0.5, 3.0, -2.0])
    assert cut == [False, False, True]


def test_on_policy_every_loss_gives_the_plain_policy_gradient():
    """At ratio 1 (nothing stale, no mismatch) all three are -A grad log p (+0 from the penalty)."""
    p, adv = [0.3, 0.6], [0.7, -1.3]
    for fn in (lambda lp, old, a: intellect2(lp, old, a, epsilon=0.2, delta=4.0),
               lambda lp, old, a: dppo_tv(lp, old, a, tv=0.2, tau=1e-3),
               lambda lp, old, a: tis(lp, old, a, cap=2.0)):
        _, grad, cut = grads(fn, p, p, adv)
        assert close(grad, [-0.7, 1.3])
        assert cut == [False, False]


# -- through grpo_loss --------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOSSES)
def test_grpo_loss_is_the_token_mean_of_the_chosen_term_and_counts_the_cut_tokens(name):
    cfg = GRPOConfig(loss=name, kl_coef=0.0, entropy_coef=0.0, tv_tau=0.0)
    logp = torch.log(t(0.8, 0.55, 0.3))
    old = torch.log(t(0.5, 0.5, 0.3))
    adv, mask = t(1.0, 1.0, 1.0), t(1.0, 1.0, 0.0)  # the third token carries no loss
    parts = grpo_loss(logp, old, adv, mask, cfg)
    # token 0 (r 1.6, +0.3 in p) is cut by every loss: clipped (intellect2), masked (dppo-tv), 1.6 < cap (tis: no)
    expected_cut = {"intellect2": 0.5, "dppo-tv": 0.5, "tis": 0.0}[name]
    assert parts.masked_frac == pytest.approx(expected_cut)
    expected_policy = {"intellect2": (-1.2 - 1.1) / 2, "dppo-tv": (0.0 - 1.1) / 2,
                       "tis": (-1.6 * math.log(0.8) - 1.1 * math.log(0.55)) / 2}[name]
    assert parts.policy == pytest.approx(expected_policy)
    k3 = [r - math.log(r) - 1 for r in (1.6, 1.1)]
    assert parts.mismatch_kl == pytest.approx(sum(k3) / 2)


def test_mismatch_kl_is_k3_and_zero_when_the_engines_agree():
    assert close(mismatch_kl(t(0.0, math.log(2)), t(0.0, 0.0)).tolist(), [0.0, 2 - math.log(2) - 1])


def test_same_version_mismatch_counts_only_the_tokens_of_the_version_held():
    cfg = GRPOConfig(kl_coef=0.0, entropy_coef=0.0)
    logp, old = torch.log(t(0.6, 0.5)), torch.log(t(0.5, 0.5))
    parts = grpo_loss(logp, old, t(1.0, 1.0), t(1.0, 1.0), cfg, same_version=torch.tensor([False, True]))
    assert parts.same_version_kl == (0.0, 1)


# -- a step's figures ---------------------------------------------------------------------------


def test_off_policy_steps_are_version_trained_minus_version_generated():
    assert off_policy_steps([5, 3, 5], 5) == [0, 2, 0]


@pytest.mark.parametrize("name", LOSSES)
def test_train_step_reports_the_off_policy_figures(name):
    tok = build_tokenizer()
    m = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, SMALL, seed=3)
    cfg = GRPOConfig(loss=name, lr=1e-3, optimizer_steps=2, kl_coef=0.0, warmup_steps=0)
    opt, sched = make_optimizer(m, cfg)
    samples = [TrainSample([5], [6, 7], [-0.5, -0.5], 1.0, version=7),
               TrainSample([5], [6, 8], [-0.5, -0.5], -1.0, version=4)]
    stats = train_step(m, opt, sched, samples, cfg, version=7)
    assert (stats.off_policy_mean, stats.off_policy_max) == (1.5, 3)
    assert stats.mismatch_kl > 0  # the toy log-probs are not the model's
    assert stats.mismatch_kl_same_version is not None  # the first mini-batch holds the version-7 sample
    assert 0.0 <= stats.masked_frac <= 1.0
    assert train_step(m, opt, sched, samples[1:], cfg, version=7).mismatch_kl_same_version is None


# -- the run file -------------------------------------------------------------------------------


def test_the_loss_is_a_run_file_setting_every_role_reads_alike():
    run = RunConfig(tables={"grpo": {"loss": "dppo-tv", "max_off_policy_steps": 6}})
    grpo = run.section("grpo", GRPOConfig)
    assert (grpo.loss, grpo.max_off_policy_steps) == ("dppo-tv", 6)
    with pytest.raises(ConfigError, match="loss: one of intellect2, dppo-tv, tis"):
        RunConfig(tables={"grpo": {"loss": "ppo"}}).section("grpo", GRPOConfig)


def test_max_off_policy_steps_bounds_the_grace_and_must_cover_async_level():
    cfg = GRPOConfig(async_level=2, verify_grace_steps=4, max_off_policy_steps=4)
    assert (cfg.grace_steps(), cfg.off_policy_bound()) == (2, 4)
    assert GRPOConfig(async_level=2, verify_grace_steps=2).off_policy_bound() == 4  # the default: within 8
    with pytest.raises(ValueError, match="max_off_policy_steps"):
        GRPOConfig(async_level=4, max_off_policy_steps=3).validate()


def test_the_trainer_and_the_validator_stop_at_the_same_bound():
    """A batch acknowledged at the edge of async_level is trained at most max_off_policy_steps behind,
    and a validator refuses as stale exactly the versions the trainer can no longer train."""
    from node.trainer.intake import expired
    from node.roles.sections import RunSections
    from node.validator.config import ValidatorSections
    from node.validator.service import batch_rules

    run = RunConfig(tables={"grpo": {"async_level": 2, "verify_grace_steps": 4, "max_off_policy_steps": 4}})
    cfg = run.section("grpo", GRPOConfig)
    # version 0, acknowledged at step 2: trainable at step 4 (4 behind), not at 5 (grace alone said 6)
    assert not expired(0, 2, 4, cfg.async_level, cfg.grace_steps())
    assert expired(0, 2, 5, cfg.async_level, cfg.grace_steps())
    assert batch_rules(run.name, RunSections.of(run).pick(ValidatorSections)).async_level == 4
