"""What a fresh identity may submit: the intake quota of trainers and validators. Pure (no I/O, no clock).

The attack it bounds (issue 13, "Sybil identities"): a key is free, so a worker that is banned, or
that wants to push many batches before its first verdict lands, makes a new one. Bans and strikes
are per identity; without a quota each new key could fill the trainer's queue (``max_pending_batches``)
and the validators' queues with batches of its choosing, and in a run without validators every one of
them would train. Proof of work or stake are not available to this swarm; what is available is
*history*: batches of this worker that a trainer of the run trained (after a passing verdict when
the run has validators), as the ledger's signed ``rollouts`` entries record them
(:meth:`node.ledger.chain.Ledger.accepted_samples`). So the rule is:

* time is cut into fixed intervals of ``interval_s`` (interval ``k`` is ``[k * interval_s, (k+1) * interval_s)``);
* in one interval a worker with ``a`` accepted batches may have ``new_batches + a`` batches taken at
  intake: a fresh identity ``new_batches``; an honest worker whose batches all train doubles its
  allowance every interval it uses it fully (``new_batches`` the first, ``2 * new_batches`` the next,
  ...), and from ``trusted_after`` accepted batches on it has no quota at all;
* all workers with *no* accepted batch together may have ``new_total`` batches taken per interval:
  however many keys a cheater makes, the unproven ones share one small pool;
* a refusal says ``quota`` (this worker's allowance) or ``quota-new`` (the shared pool) and when the
  next interval starts (:attr:`QuotaRefusal.retry_after_s`). Both are "not now", never a strike:
  the worker keeps the batch and retries (node/rollouts/submit.py).

Batches are counted when taken (spooled at a trainer, queued at a validator), not when refused for
another reason, so a quota refusal never uses up a worker's step either. The accepted count is the
ledger's, so it is the same at every trainer and validator once the entries have travelled; a node
whose replica lags sees a smaller history and may refuse a little early, never admit more than
the rule says. The counts of the current interval live in memory: a restart starts the interval
afresh (at most one extra interval's allowance per restart, and restarts are the operator's).

Validators apply the same rule scaled by :func:`validator_scale` (every trainer of the run hands on
up to one allowance per worker, and batches taken late in one interval may reach a validator early
in the next): a validator's quota is a backstop against a trainer that lets too much through, not
the first line.

Sized for the demo (node/app/demo.py: two or three fresh inference nodes of 32-sample batches, the
one CPU validator the bottleneck at about 25 batches a minute for all of them, the trainer holding
at most 12 batches in its queue, some judged stale): a new worker's first interval needs its share
of the queue plus what is judged meanwhile, well under 16, and after that its history grows as fast
as its batches train. tests/test_sybil.py models that pipeline and checks that no batch meets the
quota. The pool (``new_total``) is what bounds Sybil keys together: size it to a fraction of what
the run's validators can check per interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class QuotaConfig:
    """``[quota]`` table: intake quota of identities without accepted history (trainers and validators)."""

    interval_s: float = 60.0  # length of one quota interval in seconds (fixed intervals from time 0)
    new_batches: int = 16  # batches a worker with no accepted batch may have taken per interval; 0 = no quota at all
    new_total: int = 64  # batches all workers with no accepted batch together may have taken per interval
    trusted_after: int = 256  # trained batches from which a worker has no quota (below: new_batches + trained per interval)

    def validate(self) -> None:
        if not 1.0 <= self.interval_s <= 86400.0:
            raise ValueError(f"interval_s: 1..86400 seconds, got {self.interval_s}")
        if not 0 <= self.new_batches <= 1_000_000:
            raise ValueError(f"new_batches: 0..1000000, got {self.new_batches}")
        if self.new_batches and not self.new_batches <= self.new_total <= 1_000_000:
            raise ValueError(f"new_total: new_batches ({self.new_batches})..1000000, got {self.new_total}")
        if not 0 <= self.trusted_after <= 2**40:
            raise ValueError(f"trusted_after: 0..2**40, got {self.trusted_after}")


@dataclass(frozen=True)
class QuotaRefusal:
    """Why a batch is not taken now, and in how many seconds the next interval starts."""

    reason: str  # "quota" (this worker's allowance) or "quota-new" (the pool of workers without history)
    retry_after_s: float
    detail: str


QUOTA_REASONS = frozenset({"quota", "quota-new"})


def allowance(accepted: int, cfg: QuotaConfig, scale: int = 1) -> int | None:
    """Batches per interval for a worker with ``accepted`` accepted batches; None = no quota."""
    if cfg.new_batches == 0 or accepted >= cfg.trusted_after:
        return None
    return scale * (cfg.new_batches + max(0, accepted))


def validator_scale(trainers: int) -> int:
    """A validator's quota is this many times a trainer's (see the module docstring)."""
    return 2 * max(1, trainers)


def fresh_gain_per_hour(cfg: QuotaConfig, samples_per_batch: int) -> dict[str, int]:
    """The most batches (and samples) intake takes per hour from one identity that never gets a batch
    accepted, and from all such identities together (docs/security.md's table)."""
    per_hour = math.floor(3600 / cfg.interval_s)
    one = cfg.new_batches * per_hour
    everyone = cfg.new_total * per_hour
    return {"batches": one, "samples": one * samples_per_batch,
            "all_new_batches": everyone, "all_new_samples": everyone * samples_per_batch}


class QuotaBook:
    """The current interval's counts per worker and for the pool of workers without history.

    Bounded: only the current interval is kept (an older one is dropped as soon as time moves on),
    and a worker appears in it only after a batch of its was taken, so it holds at most
    ``new_total`` workers without history plus the workers with history that sent in this interval.
    """

    def __init__(self, cfg: QuotaConfig, scale: int = 1) -> None:
        self.cfg = cfg
        self.scale = scale
        self._interval = -1
        self._taken: dict[str, int] = {}
        self._new_taken = 0
        self.refused = 0  # batches refused by the quota since start (status)

    def _roll(self, now: float) -> int:
        k = math.floor(now / self.cfg.interval_s)
        if k != self._interval:
            self._interval, self._taken, self._new_taken = k, {}, 0
        return k

    def check(self, worker: str, accepted: int, now: float) -> QuotaRefusal | None:
        """None if a batch of ``worker`` (with ``accepted`` accepted batches) may be taken at ``now``."""
        limit = allowance(accepted, self.cfg, self.scale)
        if limit is None:
            return None
        k = self._roll(now)
        retry = (k + 1) * self.cfg.interval_s - now
        taken = self._taken.get(worker, 0)
        if taken >= limit:
            self.refused += 1
            return QuotaRefusal("quota", retry, f"{taken} of {limit} batches this interval ({accepted} accepted so far)")
        if accepted <= 0 and self._new_taken >= self.scale * self.cfg.new_total:
            self.refused += 1
            return QuotaRefusal("quota-new", retry, f"workers without accepted batches used all {self._new_taken}")
        return None

    def take(self, worker: str, accepted: int, now: float) -> None:
        """A batch of ``worker`` was taken (after :meth:`check` allowed it)."""
        if allowance(accepted, self.cfg, self.scale) is None:
            return
        self._roll(now)
        self._taken[worker] = self._taken.get(worker, 0) + 1
        if accepted <= 0:
            self._new_taken += 1

    def status(self) -> dict:
        return {"interval_s": self.cfg.interval_s, "workers_this_interval": len(self._taken),
                "new_taken": self._new_taken, "refused": self.refused}


def accepted_batches(accepted_samples: int, samples_per_batch: int) -> int:
    """Accepted batches from the ledger's accepted samples (every batch of a run has the same size:
    ``prompts_per_batch * group_size``; node/rollouts/assemble.py refuses partial ones)."""
    return accepted_samples // max(1, samples_per_batch)
