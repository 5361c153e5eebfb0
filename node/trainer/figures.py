"""The trainer's figures: what status and the metrics show of its intake, verdicts, steps and the
life of the samples it trains (pure: the times come in as arguments).

How this works
--------------
* :class:`TrainerFigures` is a plain record the service updates as things happen (as the inference
  service's ``Stats``): counters of batches judged at intake and of verdicts, samples by what became
  of their batch, the time waited and the time stepped, the last step's figures and the reward curve.
  It decides nothing: no figure feeds back into what the trainer does.
* The life of a batch (generated -> acknowledged -> verified -> trained) is kept per batch from its
  acknowledgement until it is trained or leaves the queue, for at most :data:`MAX_LIFE_TRACKED`
  batches; the stages of trained batches are summed, and status shows their means.
* :class:`TrainerGauges` holds the Prometheus series of the trainer (node/metrics.py builds them)
  and sets them from a step's figures in one place.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MAX_LIFE_TRACKED = 4096  # batches whose generated/acked/verified times are remembered until trained


@dataclass
class TrainerFigures:
    """Counters and figures of one trainer process, since it started (the reward curve: the run's)."""

    reward_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, mean reward), every step of the run
    intake: Counter = field(default_factory=Counter)  # "accepted" or refusal reason -> batches
    verdicts: Counter = field(default_factory=Counter)  # verdict outcomes
    sample_outcomes: Counter = field(default_factory=Counter)  # samples by what became of their batch: trained, <reason>
    idle_s: float = 0.0  # time the loop waited for rollouts since the first batch of this run arrived
    busy_s: float = 0.0  # time spent in steps (train + save + publish)
    step_batches: int = 0  # rollout batches the steps timed in phases took
    no_signal_batches: int = 0  # batches consumed with every group flat (nothing to learn from)
    dropped_steps: int = 0  # steps whose loss or gradients were not finite
    samples_in_hand: int = 0  # samples with signal the last pick found (a step needs min_batch_samples)
    last_step: dict = field(default_factory=dict)
    publish_error: str = ""  # why the last publication failed ("" once one succeeds)
    life: dict[bytes, tuple[float, float, float | None]] = field(default_factory=dict)  # batch -> (generated, acked, verified) wall s
    life_s: Counter = field(default_factory=Counter)  # summed seconds per stage of trained batches
    life_n: int = 0  # trained batches in those sums

    def on_acked(self, batch_id: bytes, generated: float, acked: float) -> None:
        """An accepted batch, stamped by its worker at ``generated`` (wall seconds)."""
        if len(self.life) < MAX_LIFE_TRACKED:
            self.life[batch_id] = (generated, acked, None)

    def on_verified(self, batch_id: bytes, now: float) -> None:
        life = self.life.get(batch_id)
        if life is not None:
            self.life[batch_id] = (life[0], life[1], now)

    def on_gone(self, batch_ids: list[bytes], samples: int, reason: str) -> None:
        """Acknowledged batches that left the queue untrained (``reason``: expired, a failed verdict)."""
        self.sample_outcomes[reason] += samples
        for bid in batch_ids:
            self.life.pop(bid, None)

    def on_trained(self, batch_id: bytes, samples: int | None, now: float) -> None:
        """A batch consumed by the coming step (``samples``: None when its row is gone)."""
        if samples is not None:
            self.sample_outcomes["trained"] += samples
        life = self.life.pop(batch_id, None)
        if life is None:
            return
        generated, acked, verified = life
        verified = acked if verified is None else verified  # no validators: ready at once
        self.life_s["generated_to_acked"] += max(0.0, acked - generated)
        self.life_s["acked_to_verified"] += verified - acked
        self.life_s["verified_to_trained"] += now - verified
        self.life_n += 1

    def sample_life(self) -> dict[str, float]:
        """Mean seconds per stage of the trained batches."""
        return {k: round(v / self.life_n, 3) for k, v in self.life_s.items()} if self.life_n else {}


def off_policy_figures(stats) -> dict:
    """A step's off-policy figures for status (``StepStats``: node/rl/grpo.py)."""
    same = stats.mismatch_kl_same_version
    return {"masked_frac": round(stats.masked_frac, 4), "mismatch_kl": round(stats.mismatch_kl, 6),
            "mismatch_kl_same_version": None if same is None else round(same, 6),
            "off_policy_steps": {"mean": round(stats.off_policy_mean, 3), "max": stats.off_policy_max}}


def step_figures(version: int, samples: int, batches: int, stats, seconds: float, by_engine: dict) -> dict:
    """The last step as status shows it (``stats``: node/rl/grpo.py ``StepStats``; ``by_engine``:
    node/rl/mismatch.py's figures per engine)."""
    return {"step": version, "samples": samples, "batches": batches, "tokens": stats.tokens,
            "loss": round(stats.loss, 5), "entropy": round(stats.entropy, 4),
            "clip_frac": round(stats.clip_frac, 4), "grad_norm": round(stats.grad_norm, 4),
            "lr": stats.lr, "seconds": round(seconds, 3),
            "tokens_per_s": round(stats.tokens / seconds, 1) if seconds > 0 else None,
            **off_policy_figures(stats),
            "mismatch_by_engine": {name: f.figures() for name, f in by_engine.items()}}


def reward_points(curve: list[tuple[int, float]], most: int) -> list[list]:
    """``[step, mean reward]`` for every step, or, past ``most`` steps, ``most`` consecutive buckets
    (``[last step of the bucket, mean of its rewards]``) so the whole run fits in status."""
    if len(curve) <= most:
        return [[s, round(r, 4)] for s, r in curve]
    size = -(-len(curve) // most)
    out = []
    for i in range(0, len(curve), size):
        part = curve[i:i + size]
        out.append([part[-1][0], round(sum(r for _, r in part) / len(part), 4)])
    return out


class TrainerGauges:
    """The trainer's Prometheus series, made on ``metrics`` (node/metrics.py ``Metrics``)."""

    def __init__(self, metrics, step: int) -> None:
        m = metrics
        self.batches = m.counter("trainer_batches_total", "Rollout batches judged at intake", ["outcome"])
        self.step = m.gauge("trainer_step", "Policy version of the trainer")
        self.tokens = m.counter("trainer_tokens_total", "Completion tokens trained on")
        self.step.set(step)
        self.reward = m.gauge("trainer_reward", "Mean task reward of the samples in the last step")
        self.loss = m.gauge("trainer_loss", "GRPO loss of the last step")
        self.step_seconds = m.histogram("trainer_step_seconds", "Time of one optimizer step (training only)",
                                        buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.eval = m.gauge("trainer_eval_score", "Held-out greedy score of the last version evaluated")
        self.eval_version = m.gauge("trainer_eval_version", "Policy version of the last held-out evaluation")
        # The off-policy figures of the last step (node/rl/losses.py; prime-rl's names where it has one).
        self.masked = m.gauge("trainer_masked_token_fraction", "Tokens the [grpo] loss clipped or masked, last step")
        self.mismatch = m.gauge("trainer_mismatch_kl", "k3 KL between the engines' and the trainer's log-probs "
                                "at the weights trained, last step")
        self.mismatch_same = m.gauge("trainer_mismatch_kl_same_version", "The same KL over tokens generated by "
                                     "the version the trainer held, before its update (last step that had any)")
        # Each engine's log-prob mismatch at the weights that generated the samples (node/rl/mismatch.py).
        self.engine_kl = m.gauge("trainer_mismatch_kl_by_engine", "k3 KL between an engine's log-probs and the "
                                 "trainer's at the version that generated them, last step", ["engine"])
        self.engine_beyond = m.gauge("trainer_logprob_beyond_tolerance_fraction", "Tokens of an engine whose "
                                     "|log-prob - trainer's| exceeds the validator's per-token tolerance for its dtype, last step",
                                     ["engine"])
        self.off_policy = m.gauge("trainer_off_policy_steps", "Version trained minus version that generated "
                                  "each sample, last step", ["stat"])

    def on_step(self, version: int, stats, mean_reward: float, seconds: float, by_engine: dict) -> None:
        for name, f in by_engine.items():
            self.engine_kl.labels(engine=name).set(f.kl)
            self.engine_beyond.labels(engine=name).set(f.beyond)
        self.step.set(version)
        self.tokens.inc(stats.tokens)
        self.reward.set(mean_reward)
        self.loss.set(stats.loss)
        self.step_seconds.observe(seconds)
        self.masked.set(stats.masked_frac)
        self.mismatch.set(stats.mismatch_kl)
        if stats.mismatch_kl_same_version is not None:
            self.mismatch_same.set(stats.mismatch_kl_same_version)
        self.off_policy.labels(stat="mean").set(stats.off_policy_mean)
        self.off_policy.labels(stat="max").set(stats.off_policy_max)

    def on_eval(self, version: int, score: float) -> None:
        self.eval.set(score)
        self.eval_version.set(version)
