"""GRPO as INTELLECT-2 ran it: token-level loss with two-sided clipping, KL, entropy, packing.

How this works:

1. Each training sample is prompt + completion tokens, the log-probs the inference node sampled
   them with (``old_logprobs``, under logits / T of policy version v), and its group-relative
   advantage (``node.rl.spec.group_advantages``).
2. :func:`pack` lays samples end to end into rows of ``pack_length`` tokens. Position ids restart at
   0 for every sample and the attention mask is block-diagonal causal, so a packed row computes the
   same log-probs as each sample alone (tested); padding wastes nothing but the row's tail.
3. :func:`token_logprobs` runs the policy once per row: log softmax(logits / T) at each next token
   and the entropy of that distribution (logits only at the scored positions).
4. :func:`grpo_loss` is the token-level objective (every completion token weighs the same, as in
   INTELLECT-2 / DAPO, rather than a mean per sequence):

       loss = mean(l) + kl_coef * mean(k3(ref, logp)) - entropy_coef * mean(H)

   where ``l`` is the per-token policy term ``[grpo] loss`` picks (node/rl/losses.py): INTELLECT-2's
   two-sided clipped surrogate (the default; r = exp(logp - old_logp)),

       A >= 0: l = -min(r A, clip(r, 1-eps, 1+eps) A)
       A <  0: l = -max(min(r A, clip(r, 1-eps, 1+eps) A), delta A)   # ratio bounded above by delta

   prime-rl's DPPO-TV masking, or a truncated-IS policy gradient. The delta bound is INTELLECT-2's
   two-sided clipping (also "dual-clip PPO", Ye et al. 2020): with a negative advantage and a huge
   ratio the plain PPO objective is unbounded; capping it at delta A zeroes the gradient there and
   keeps off-policy tokens from blowing up the update. k3 is Schulman's unbiased low-variance KL
   estimator exp(q - p) - (q - p) - 1. Each step also measures the mismatch KL between the engine's
   log-probs and the trainer's (prime-rl's ``mismatch_kl``), the tokens the loss clipped or masked
   and how many versions behind its samples were (``StepStats``).
5. :func:`train_step` splits one rollout step's samples into ``optimizer_steps`` mini-batches and
   does one AdamW step (grad-norm clipped, linear warm-up) on each; a mini-batch of more than
   ``micro_batch_tokens`` is run in several forward/backward passes whose gradients add up to its
   own (:func:`accumulate`), so memory does not grow with the step's samples.

Everything here is pure tensor maths plus the model's forward; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .config import GRPOConfig
from .losses import mismatch_kl, off_policy_steps, policy_terms

IGNORE = -100  # target id of positions that carry no loss
MAX_LOG_RATIO = 20.0  # |log(pi / pi_old)| bound inside the loss (see grpo_loss)


class NonFiniteStep(ArithmeticError):
    """The loss or the gradient norm of a mini-batch was not finite; the optimizer did not step on it."""


@dataclass
class TrainSample:
    """One completion to learn from."""

    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]  # one per completion token, from the sampling policy
    advantage: float
    version: int = 0  # policy version that generated it (staleness bookkeeping)
    engine: str = "torch"  # inference engine that generated it (its batch's; node/rl/mismatch.py)
    dtype: str = "float32"  # the dtype that engine ran the model in (its batch's; sets the validator's tolerance)

    def __post_init__(self):
        if len(self.old_logprobs) != len(self.completion_ids):
            raise ValueError("old_logprobs must have one entry per completion token")
        if not self.prompt_ids or not self.completion_ids:
            raise ValueError("prompt and completion must be non-empty")

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class PackedBatch:
    """Rows of packed samples; every (R, S) tensor is aligned on input positions."""

    input_ids: torch.Tensor  # (R, S) long
    position_ids: torch.Tensor  # (R, S) long, restart at 0 per sample
    segment_ids: torch.Tensor  # (R, S) long, sample index in the row (-1 = padding)
    targets: torch.Tensor  # (R, S) long, next token to score at this position or IGNORE
    old_logprobs: torch.Tensor  # (R, S) float, aligned with targets (0 where IGNORE)
    advantages: torch.Tensor  # (R, S) float, aligned with targets (0 where IGNORE)
    loss_mask: torch.Tensor  # (R, S) float, 1 where a completion token is scored
    num_samples: int = 0
    versions: torch.Tensor | None = None  # (R, S) long, policy version that generated the token (-1 = none)

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def rows(self, lo: int, hi: int) -> PackedBatch:
        """Rows ``lo:hi`` as a batch of their own (a micro-batch: no row holds part of a sample)."""
        return PackedBatch(self.input_ids[lo:hi], self.position_ids[lo:hi], self.segment_ids[lo:hi],
                           self.targets[lo:hi], self.old_logprobs[lo:hi], self.advantages[lo:hi],
                           self.loss_mask[lo:hi], num_samples=0,
                           versions=None if self.versions is None else self.versions[lo:hi])

    def passes(self, per: int) -> list[PackedBatch]:
        """The batch in micro-batches of ``per`` rows (itself when it fits one)."""
        R = self.input_ids.shape[0]
        return [self] if R <= per else [self.rows(lo, lo + per) for lo in range(0, R, per)]

    def attention_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(R, 1, S, S) additive mask: 0 where query i may see key j (same sample, j <= i), else -inf.

        The 4-D form is what transformers accepts as a ready-made mask; keys of another sample (or
        padding) are masked, so attention never crosses samples.
        """
        S = self.input_ids.shape[1]
        seg = self.segment_ids
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)  # (R, S, S)
        causal = torch.ones(S, S, dtype=torch.bool, device=seg.device).tril()
        allowed = same & causal
        # padding queries attend to themselves only, so no row of the softmax is empty (NaN)
        allowed |= torch.eye(S, dtype=torch.bool, device=seg.device)[None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=seg.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[:, None]


def pack(samples: Sequence[TrainSample], pack_length: int, pad_id: int = 0, one_per_row: bool = False) -> PackedBatch:
    """First-fit-decreasing packing of samples into rows of ``pack_length`` tokens.

    ``one_per_row=True`` gives the unpacked baseline (one right-padded sample per row). A sample
    longer than ``pack_length`` raises ValueError (the caller caps prompt + max_new_tokens).
    """
    order = sorted(range(len(samples)), key=lambda k: -samples[k].length)
    rows: list[list[int]] = []
    used: list[int] = []
    for k in order:
        n = samples[k].length
        if n > pack_length:
            raise ValueError(f"sample of {n} tokens exceeds pack_length {pack_length}")
        for r in range(len(rows)):
            if not one_per_row and used[r] + n <= pack_length:
                rows[r].append(k)
                used[r] += n
                break
        else:
            rows.append([k])
            used.append(n)
    R, S = len(rows), pack_length if not one_per_row else max(used, default=1)
    ids = torch.full((R, S), pad_id, dtype=torch.long)
    pos = torch.zeros((R, S), dtype=torch.long)
    seg = torch.full((R, S), -1, dtype=torch.long)
    tgt = torch.full((R, S), IGNORE, dtype=torch.long)
    old = torch.zeros((R, S), dtype=torch.float32)
    adv = torch.zeros((R, S), dtype=torch.float32)
    ver = torch.full((R, S), -1, dtype=torch.long)
    for r, members in enumerate(rows):
        off = 0
        for s_idx, k in enumerate(members):
            s = samples[k]
            seq = s.prompt_ids + s.completion_ids
            n, p = len(seq), len(s.prompt_ids)
            ids[r, off:off + n] = torch.tensor(seq)
            pos[r, off:off + n] = torch.arange(n)
            seg[r, off:off + n] = s_idx
            # position off+p-1+t predicts completion token t
            lo, hi = off + p - 1, off + n - 1
            tgt[r, lo:hi] = torch.tensor(s.completion_ids)
            old[r, lo:hi] = torch.tensor(s.old_logprobs, dtype=torch.float32)
            adv[r, lo:hi] = float(s.advantage)
            ver[r, lo:hi] = s.version
            off += n
    return PackedBatch(ids, pos, seg, tgt, old, adv, (tgt != IGNORE).float(), num_samples=len(samples), versions=ver)


# Attention implementations that read packed samples' boundaries from position ids that restart at
# 0 (transformers' varlen path), so a packed row needs no (R, 1, S, S) mask and keeps the flash kernel.
POSITION_PACKED_ATTENTION = frozenset({"flash_attention_2", "flash_attention_3"})


def packed_attention(batch: PackedBatch, attn_implementation: str | None, dtype: torch.dtype) -> dict:
    """The forward's attention arguments for a packed batch.

    With a varlen flash kernel the position-id resets alone delimit samples (no mask: the kernel
    never materialises S x S); otherwise (SDPA, eager) the block-diagonal causal 4-D mask, which
    SDPA honours. Both compute the per-sample causal attention :func:`pack` promises.
    """
    if attn_implementation in POSITION_PACKED_ATTENTION:
        return {"position_ids": batch.position_ids, "attention_mask": None}
    return {"position_ids": batch.position_ids, "attention_mask": batch.attention_mask(dtype)}


# Config fields of heads that scale or cap the logits after the linear layer: such a model keeps
# its own forward (all positions) rather than the decoder-then-head shortcut below.
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _sharded(model) -> bool:
    """Whether ``model`` is an FSDP2 module: called piecewise it would skip the root's unshard."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed
        return False
    return isinstance(model, FSDPModule)


def _decoder_and_head(model):
    """(decoder, linear head) when the causal LM is exactly ``head(decoder(...))`` (Llama/Qwen2-style,
    as the proofs assume: node/proofs/capture.py), else (None, None)."""
    if _sharded(model):  # FSDP2 unshards the root's own parameters (embeddings, head) in its forward
        return None, None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    config = getattr(model, "config", None)
    if not isinstance(head, torch.nn.Linear) or decoder is None or decoder is model:
        return None, None
    if any(getattr(config, name, None) not in (None, 0, 1, 1.0) for name in _HEAD_EXTRAS):
        return None, None
    return decoder, head


def token_logprobs(model, batch: PackedBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp (R, S), entropy (R, S)) of each target under softmax(logits / T); 0 where IGNORE.

    Logits are taken only where a token is scored: a (tokens, vocab) tensor and its backward are
    most of a step's memory, and RL rows are mostly prompt (SmolLM2's 49,152-entry vocabulary over
    ~110-token chat prompts with 8-token answers: 14x fewer rows of logits)."""
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    attn = {k: (v.to(dev) if v is not None else None) for k, v in packed_attention(batch, impl, dtype).items()}
    tgt = batch.targets.to(dev)
    keep = tgt != IGNORE
    decoder, head = _decoder_and_head(model)
    if decoder is not None:
        hidden = decoder(input_ids=batch.input_ids.to(dev), use_cache=False, **attn).last_hidden_state
        logits = head(hidden[keep])  # (N, V)
    else:
        logits = model(input_ids=batch.input_ids.to(dev), use_cache=False, **attn).logits[keep]
    # at least float32 for the softmax (bf16 logits lose the small log-probs); float64 stays float64
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, tgt[keep][:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zeros = torch.zeros(keep.shape, dtype=lp.dtype, device=dev)
    return zeros.masked_scatter(keep, lp), zeros.masked_scatter(keep, ent)


@dataclass
class LossParts:
    loss: torch.Tensor
    policy: float
    kl: float
    entropy: float
    clip_frac: float  # fraction of tokens whose ratio left [1 - eps, 1 + eps]
    delta_frac: float  # fraction of negative-advantage tokens cut by the delta bound
    mean_ratio: float
    masked_frac: float = 0.0  # fraction of tokens the chosen loss clipped or masked (losses.py ``cut``)
    mismatch_kl: float = 0.0  # mean k3 KL(engine || trainer) over the tokens, at the weights trained
    same_version_kl: tuple[float, int] = (0.0, 0)  # (sum, tokens) of that KL over tokens of the version held


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    same_version: torch.Tensor | None = None,
) -> LossParts:
    """Token-level GRPO loss with ``cfg.loss``'s policy term (see module docstring); tensors share one
    shape. ``same_version``: bool, tokens generated at the very weights ``logp`` comes from (their
    mismatch KL is the engine-against-trainer figure alone, with no policy drift in it)."""
    mask = mask.to(logp.dtype)
    n = mask.sum().clamp(min=1.0)
    # |log r| bounded by MAX_LOG_RATIO: a ratio beyond e^20 is clipped, masked or truncated by every
    # loss anyway and one below e^-20 contributes less than e^-20 |A|, so no honest loss moves; but an
    # old log-prob far below the new one would overflow exp() to inf, and inf * 0 is NaN in every weight.
    held = logp.detach()
    old = torch.clamp(old_logp, min=held - MAX_LOG_RATIO, max=held + MAX_LOG_RATIO)
    terms = policy_terms(cfg.loss, cfg)(logp, old, advantages)
    policy = (terms.per_token * mask).sum() / n
    loss = policy
    kl_val = torch.zeros((), device=logp.device)
    if ref_logp is not None and cfg.kl_coef > 0:
        d = ref_logp - logp
        kl_val = ((torch.exp(d) - d - 1) * mask).sum() / n
        loss = loss + cfg.kl_coef * kl_val
    ent_val = torch.zeros((), device=logp.device)
    if entropy is not None:
        ent_val = (entropy * mask).sum() / n
        loss = loss - cfg.entropy_coef * ent_val
    with torch.no_grad():
        ratio = torch.exp(held - old)
        neg = advantages < 0
        out_of_clip = ((ratio < 1 - cfg.epsilon) | (ratio > 1 + cfg.epsilon)).float()
        cut = (neg & (ratio > cfg.delta)).float()
        n_neg = (neg.float() * mask).sum().clamp(min=1.0)
        mkl = mismatch_kl(held, old) * mask
        same = (0.0, 0)
        if same_version is not None:
            sv = same_version.to(mask.dtype) * mask
            same = (float((mkl * sv).sum()), int(sv.sum()))
        return LossParts(
            loss=loss,
            policy=float(policy.detach()),
            kl=float(kl_val.detach()),
            entropy=float(ent_val.detach()),
            clip_frac=float((out_of_clip * mask).sum() / n),
            delta_frac=float((cut * mask).sum() / n_neg),
            mean_ratio=float((ratio * mask).sum() / n),
            masked_frac=float((terms.cut.to(mask.dtype) * mask).sum() / n),
            mismatch_kl=float(mkl.sum() / n),
            same_version_kl=same,
        )


def batch_loss(model, batch: PackedBatch, cfg: GRPOConfig, ref_model=None, version: int | None = None) -> LossParts:
    """The GRPO loss of a packed batch under ``model`` (and ``ref_model`` for the KL term).

    ``version``: the policy version ``model`` holds exactly (the step's first mini-batch), so the
    tokens that version generated give the same-version mismatch KL; None once it has moved on."""
    dev = next(model.parameters()).device
    logp, ent = token_logprobs(model, batch, cfg.temperature)
    ref = None
    if ref_model is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            ref, _ = token_logprobs(ref_model, batch, cfg.temperature)
    same = None
    if version is not None and batch.versions is not None:
        same = (batch.versions == version).to(dev)
    return grpo_loss(logp, batch.old_logprobs.to(dev), batch.advantages.to(dev), batch.loss_mask.to(dev),
                     cfg, ref_logp=ref, entropy=ent, same_version=same)


def combine(parts: Sequence[LossParts], weights: Sequence[float]) -> LossParts:
    """One mini-batch's figures from its micro-batches' (``weights``: each one's share of the scored
    tokens). Exact for every token mean; ``delta_frac`` (a mean over negative-advantage tokens) is
    weighted by all tokens, close enough for a figure."""
    def mean(name: str) -> float:
        return sum(w * getattr(p, name) for p, w in zip(parts, weights))
    loss = sum(w * p.loss.detach() for p, w in zip(parts, weights))
    same = (sum(p.same_version_kl[0] for p in parts), sum(p.same_version_kl[1] for p in parts))
    return LossParts(loss=loss, **{name: mean(name) for name in _TOKEN_MEANS}, same_version_kl=same)


_TOKEN_MEANS = ("policy", "kl", "entropy", "clip_frac", "delta_frac", "mean_ratio", "masked_frac", "mismatch_kl")


def rows_per_pass(cfg: GRPOConfig) -> int:
    """Packed rows in one forward/backward pass: ``[grpo] micro_batch_tokens`` in whole rows."""
    return max(1, cfg.micro_batch_tokens // cfg.pack_length)


def accumulate(model, batch: PackedBatch, cfg: GRPOConfig, ref_model=None, version: int | None = None,
               scale: float = 1.0, rows: int | None = None) -> LossParts:
    """Backward of ``scale`` x the mini-batch's loss, ``rows`` packed rows per pass (default
    :func:`rows_per_pass`), gradients summed in ``.grad``; returns the mini-batch's figures.

    Every term of the loss is a sum over scored tokens divided by their count, so micro-batch ``i``
    with ``n_i`` of the mini-batch's ``N`` tokens contributes ``loss_i * n_i / N``: the summed
    gradient is the whole mini-batch's, while memory (the (rows, S, vocab) logits and their
    backward) grows with ``rows``, not with the step's samples. 128 SmolLM2 samples in one pass
    took 20 GB."""
    slices = batch.passes(rows or rows_per_pass(cfg))
    counts = [float(b.loss_mask.sum()) for b in slices]
    total = sum(counts) or 1.0
    parts = []
    for b, n in zip(slices, counts):
        p = batch_loss(model, b, cfg, ref_model, version=version)
        (p.loss * (scale * n / total)).backward()
        parts.append(p)
    return combine(parts, [n / total for n in counts]) if len(parts) > 1 else parts[0]


def adamw_kwargs(devices: set[str]) -> dict:
    """``fused=True`` (one kernel for the whole update, torch's fastest AdamW) when every parameter is
    on CUDA; the CPU path keeps torch's default implementation."""
    return {"fused": True} if devices and all(d.startswith("cuda") for d in devices) else {}


def make_optimizer(model, cfg: GRPOConfig):
    """AdamW with linear warm-up to ``cfg.lr`` over ``cfg.warmup_steps`` optimizer steps."""
    devices = {str(p.device) for p in model.parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99),
                            **adamw_kwargs(devices))
    warm = max(cfg.warmup_steps, 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warm + 1)) if warm else 1.0)
    return opt, sched


@dataclass
class StepStats:
    optimizer_steps: int = 0
    samples: int = 0
    tokens: int = 0
    loss: float = 0.0
    policy: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clip_frac: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    rows: int = 0
    masked_frac: float = 0.0  # tokens the loss clipped or masked (mean over mini-batches)
    mismatch_kl: float = 0.0  # k3 KL(engine || trainer) at the weights trained (mean over mini-batches)
    # the same KL over the tokens generated by the version the trainer held at the step's start,
    # measured before its first update: the engine-against-trainer figure alone (None: no such token)
    mismatch_kl_same_version: float | None = None
    off_policy_mean: float = 0.0  # version trained - version that generated it, over the step's samples
    off_policy_max: int = 0
    extra: dict = field(default_factory=dict)

    def add(self, parts: LossParts, grad_norm: float) -> None:
        """Fold one mini-batch's figures into the running means (call before counting its step)."""
        k = self.optimizer_steps
        for name, val in (("loss", float(parts.loss.detach())), ("policy", parts.policy), ("kl", parts.kl),
                          ("entropy", parts.entropy), ("clip_frac", parts.clip_frac), ("grad_norm", grad_norm),
                          ("masked_frac", parts.masked_frac), ("mismatch_kl", parts.mismatch_kl)):
            setattr(self, name, (getattr(self, name) * k + val) / (k + 1))
        total, tokens = parts.same_version_kl
        if tokens:
            self.mismatch_kl_same_version = total / tokens

    def off_policy(self, samples: Sequence[TrainSample], version: int | None) -> None:
        """Record how far behind ``version`` (the version being trained) the step's samples were."""
        if version is None or not samples:
            return
        steps = off_policy_steps([s.version for s in samples], version)
        self.off_policy_mean = sum(steps) / len(steps)
        self.off_policy_max = max(steps)


def split_minibatches(samples: Sequence[TrainSample], parts: int) -> list[list[TrainSample]]:
    """``parts`` contiguous, nearly equal mini-batches (fewer if there are fewer samples)."""
    parts = max(1, min(parts, len(samples)))
    size = math.ceil(len(samples) / parts)
    return [list(samples[i:i + size]) for i in range(0, len(samples), size)]


def train_step(model, optimizer, scheduler, samples: Sequence[TrainSample], cfg: GRPOConfig,
               ref_model=None, pad_id: int = 0, packed: bool = True, version: int | None = None) -> StepStats:
    """One rollout step: ``cfg.optimizer_steps`` AdamW steps over mini-batches of ``samples``.

    ``version``: the policy version ``model`` holds (the trainer's step), for the off-policy and
    same-version mismatch figures; None leaves them unset."""
    stats = StepStats()
    if not samples:
        return stats
    stats.off_policy(samples, version)
    model.train()
    for k, mb in enumerate(split_minibatches(samples, cfg.optimizer_steps)):
        batch = pack(mb, cfg.pack_length, pad_id=pad_id, one_per_row=not packed)
        optimizer.zero_grad(set_to_none=True)
        parts = accumulate(model, batch, cfg, ref_model, version=version if k == 0 else None)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        if not (torch.isfinite(parts.loss.detach()) and torch.isfinite(gn)):
            optimizer.zero_grad(set_to_none=True)
            model.eval()
            raise NonFiniteStep(f"mini-batch {stats.optimizer_steps}: loss {float(parts.loss.detach())}, grad norm {float(gn)}")
        stats.lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        stats.add(parts, float(gn))  # running means over the mini-batches of this rollout step
        stats.optimizer_steps += 1
        stats.samples += len(mb)
        stats.tokens += batch.num_tokens
        stats.rows += batch.input_ids.shape[0]
    model.eval()
    return stats
