"""The policy terms GRPO can train with, one small pure function each: ``[grpo] loss`` picks one.

Every function takes per-token tensors of one shape — the trainer's log-probs ``logp`` (with
gradient), the inference engine's ``old_logp`` (the log-probs the sample was drawn with, at the
version that generated it), the advantages — and returns a :class:`PolicyTerms`: the per-token
loss (to be averaged over the completion tokens by :func:`node.rl.grpo.grpo_loss`) and which tokens
the loss gave no policy gradient (clipped or masked), for the ``masked_frac`` figure. ``r`` is the
importance ratio exp(logp - old_logp), bounded in log space by the caller.

* ``intellect2`` — PPO's clipped surrogate with INTELLECT-2's two-sided clip (Prime Intellect 2025,
  §3.3; "dual-clip PPO", Ye et al. 2020): ``-min(r A, clip(r, 1-eps, 1+eps) A)``, and for A < 0 at
  least ``-delta A``.
* ``dppo-tv`` — prime-rl's default since Aug 2026 (src/prime_rl/trainer/rl/loss.py): the trust region
  is on the probabilities, not the ratio ("DPPO-binary TV", arXiv 2602.04879). A token is masked when
  the trainer's probability moved more than ``tv`` from the engine's in the direction the advantage
  pushes (A > 0: p - p_old > tv; A < 0: p - p_old < -tv); kept tokens give ``-r A``; every token adds
  ``tau log(r)^2`` (Kimi K2.5, arXiv 2602.02276), which pulls the policy back towards the samples'.
* ``tis`` — truncated importance sampling (IMPALA's rho-bar, Espeholt et al. 2018; applied to the
  trainer/inference mismatch by Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"): the policy gradient ``A grad log p`` weighted by ``min(r, cap)`` with the
  weight held constant (stop-gradient), so every token keeps a gradient and a stale token's weight is
  bounded. The masked/clipped figure counts the tokens whose weight was truncated.

No I/O, no model: tensors in, tensors out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import LOSSES


@dataclass
class PolicyTerms:
    per_token: torch.Tensor  # policy loss per token (same shape as logp)
    cut: torch.Tensor  # bool, tokens the loss gave no (intellect2, dppo-tv) or a truncated (tis) gradient


def intellect2(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, *, epsilon: float,
               delta: float) -> PolicyTerms:
    """INTELLECT-2's two-sided clipped surrogate (module docstring)."""
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon)
    ppo = torch.min(ratio * adv, clipped * adv)
    neg = adv < 0
    bounded = torch.where(neg, torch.max(ppo, delta * adv), ppo)
    with torch.no_grad():
        # the clipped branch won (no gradient) or the delta bound did
        cut = ((adv > 0) & (ratio > 1 + epsilon)) | (neg & ((ratio < 1 - epsilon) | (ratio > delta)))
    return PolicyTerms(-bounded, cut)


def dppo_tv(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, *, tv: float,
            tau: float) -> PolicyTerms:
    """prime-rl's DPPO-binary-TV masking with the Kimi K2.5 log-ratio penalty (module docstring)."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        moved = torch.exp(logp) - torch.exp(old_logp)  # p_trainer - p_inference
        cut = ((adv > 0) & (moved > tv)) | ((adv < 0) & (moved < -tv))
    policy = torch.where(cut, torch.zeros_like(ratio), -ratio * adv)
    return PolicyTerms(policy + tau * log_ratio ** 2, cut)


def tis(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, *, cap: float) -> PolicyTerms:
    """Truncated-IS policy gradient: gradient ``min(r, cap) A grad logp`` (module docstring)."""
    with torch.no_grad():
        ratio = torch.exp(logp - old_logp)
        weight = ratio.clamp(max=cap)
        cut = ratio > cap
    return PolicyTerms(-weight * adv * logp, cut)


def policy_terms(name: str, cfg) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], PolicyTerms]:
    """The loss ``name`` with its ``[grpo]`` parameters from ``cfg`` bound: f(logp, old_logp, adv)."""
    if name == "intellect2":
        return lambda lp, old, a: intellect2(lp, old, a, epsilon=cfg.epsilon, delta=cfg.delta)
    if name == "dppo-tv":
        return lambda lp, old, a: dppo_tv(lp, old, a, tv=cfg.tv_bound, tau=cfg.tv_tau)
    if name == "tis":
        return lambda lp, old, a: tis(lp, old, a, cap=cfg.tis_cap)
    raise ValueError(f"loss: one of {', '.join(LOSSES)}, not {name!r}")  # GRPOConfig.validate said so first


def mismatch_kl(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(engine || trainer) from the engine's samples: r - log r - 1 with
    r = p_trainer / p_engine (Schulman's estimator; the ``mismatch_kl`` prime-rl reports)."""
    log_ratio = logp - old_logp
    return torch.exp(log_ratio) - log_ratio - 1


def off_policy_steps(versions: list[int], trained: int) -> list[int]:
    """Off-policy steps of each sample as the field counts them: the version trained minus the version
    that generated it (queueing included)."""
    return [trained - v for v in versions]
