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
* workers with *no* accepted batch draw from one pool besides (:class:`FreshPool`), shared **per
  origin**, not first come, first served. An origin is where the batch came from: the address group
  of the connection it arrived on (:func:`node.net.origins.address_group`; over a relay, the relay's
  connection), or the key itself where no address tells origins apart (loopback, or a validator,
  which hears batches from trainers). Issue 42: four free keys that fired at the exact start of
  every interval (the refusal's own ``retry_after`` names it) took the whole pool of fixed
  intervals within 0.3 s, and an honest newcomer got none of it for as long as they kept at it;
  shared per key, a node that made a new key for every attempt filled the pool's key table with
  keys that were only ever refused and emptied the welcome bucket. Now the pool accrues
  ``new_total`` batches per ``interval_s`` continuously (a token bucket, no boundary to race),
  divided equally among the origins that asked within the last interval: each origin's share
  accrues in its own bucket, which no other origin can take from, so a newcomer among ``n``
  flooding origins gets ``new_total / (n + 1)`` per interval however fast they poll and however
  many keys they make. An origin's first batches come from a shared welcome bucket (at most
  ``new_batches`` each; it holds ``new_total`` and refills ``new_batches`` per interval), so only
  new *addresses* draw on it; a key whose batch failed a verdict (:meth:`QuotaBook.fail`) is kept
  out of the pool for ``BAR_INTERVALS`` intervals. Within one origin the keys are served first
  come, first served (each within its own ``new_batches`` a interval): keys behind one address are
  one party as far as the pool can tell;
* a refusal says ``quota`` (this worker's allowance) or ``quota-new`` (the pool) and when to retry
  (:attr:`QuotaRefusal.retry_after_s`: the next interval, or when this origin's share holds a batch).
  Both are "not now", never a strike: the worker keeps the batch and retries (node/inference/outbox.py).

What sharing per origin cannot do: ``n`` addresses (or address groups) that keep asking hold ``n``
shares, and a newcomer's share is ``1 / (n + 1)`` of the pool (bench/sybil_pool.py measures it);
once ``MAX_ORIGINS`` origins are asking a new one waits for one of them to go quiet. On one machine
(loopback: the demo, the tests) every node has the same address, so there the pool is shared per
key, as before, and key-making is not bounded. Only a cost per origin (history, stake, work) bounds
``n`` further.

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

import heapq
import math
from dataclasses import dataclass


@dataclass
class QuotaConfig:
    """``[quota]`` table: intake quota of identities without accepted history (trainers and validators)."""

    interval_s: float = 60.0  # length of one quota interval in seconds (fixed intervals from time 0)
    new_batches: int = 16  # batches a worker with no accepted batch may have taken per interval; 0 = no quota at all
    new_total: int = 64  # batches per interval all workers with no accepted batch share (per address; FreshPool)
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
    everyone = (cfg.new_total + cfg.new_batches) * per_hour  # the pool's accrual + the welcome bucket's refill
    return {"batches": one, "samples": one * samples_per_batch,
            "all_new_batches": everyone, "all_new_samples": everyone * samples_per_batch}


MAX_ORIGINS = 4096  # origins sharing the pool at once (bounded memory; see the module docstring)
MAX_BARRED = 4 * MAX_ORIGINS  # keys kept out of the pool after a failed verdict (oldest forgotten first)
BAR_INTERVALS = 10  # intervals a key whose batch failed a verdict stays out of the pool
MIN_WAIT_S = 0.01  # shortest retry a quota-new refusal names (float rounding must not spin a retrying worker)
PRUNE_EVERY_S = 1.0  # how often origins quiet for an interval are dropped from the pool


class FreshPool:
    """The pool of workers without accepted history: ``total`` batches per ``interval_s``, accruing
    continuously and shared equally by the origins that asked within the last interval (module docstring).

    Each origin holds ``[tokens, last accrual, last asked]``; its tokens accrue at ``rate / n`` up to
    ``max(1, total / n)`` for ``n`` origins asking, so all origins together accrue at most ``rate``.
    Bars are per key: a failed verdict is the key's, not its address's (an honest worker may share
    an address with a cheat).
    """

    def __init__(self, total: float, welcome: float, interval_s: float) -> None:
        self.total, self.welcome, self.interval_s = total, welcome, interval_s
        self.rate = total / interval_s  # batches per second, all origins together
        self._origins: dict[str, list[float]] = {}
        self._barred: dict[str, float] = {}  # key -> until when
        self._lobby = total  # the welcome bucket: first batches of origins new to the pool
        self._lobby_at: float | None = None
        self._pruned = -math.inf

    def _prune(self, now: float) -> None:
        if now - self._pruned < PRUNE_EVERY_S:
            return
        self._pruned = now
        quiet = [o for o, (_, _, seen) in self._origins.items() if now - seen > self.interval_s]
        for o in quiet:
            del self._origins[o]
        for k in [k for k, until in self._barred.items() if until <= now]:
            del self._barred[k]

    def _bucket(self, origin: str, now: float) -> list[float] | None:
        """``origin``'s bucket accrued to ``now`` (a new origin joins with its welcome); None if it may not join."""
        bucket = self._origins.get(origin)
        if bucket is None:
            if len(self._origins) >= MAX_ORIGINS:
                return None
            if self._lobby_at is not None:
                self._lobby = min(self.total, self._lobby + (now - self._lobby_at) * self.welcome / self.interval_s)
            self._lobby_at = now
            grant = min(self.welcome, self._lobby)
            self._lobby -= grant
            bucket = self._origins[origin] = [grant, now, now]
            return bucket
        n = len(self._origins)
        bucket[0] = max(bucket[0], min(max(1.0, self.total / n), bucket[0] + (now - bucket[1]) * self.rate / n))
        bucket[1] = bucket[2] = now
        return bucket

    def wait(self, worker: str, now: float, origin: str | None = None) -> float:
        """0 if a batch of ``worker`` (arriving from ``origin``; None: the key is its own origin) may
        be taken from the pool at ``now``, else seconds until it may."""
        self._prune(now)
        until = self._barred.get(worker)
        if until is not None:
            if until > now:
                return until - now
            del self._barred[worker]  # served its bar since the last prune
        bucket = self._bucket(origin or worker, now)
        if bucket is None:
            return self.interval_s
        if bucket[0] >= 1.0 - 1e-9:
            return 0.0
        return max(MIN_WAIT_S, (1.0 - bucket[0]) * len(self._origins) / self.rate)

    def take(self, worker: str, now: float, origin: str | None = None) -> None:
        bucket = self._origins.get(origin or worker)
        if bucket is not None:
            bucket[0] = max(0.0, bucket[0] - 1.0)

    def fail(self, worker: str, now: float) -> None:
        """A batch of ``worker`` failed a verdict: the key stays out of the pool for ``BAR_INTERVALS``
        intervals; where it is its own origin, that origin's share goes with it."""
        self._origins.pop(worker, None)
        self._barred.pop(worker, None)
        self._barred[worker] = now + BAR_INTERVALS * self.interval_s
        while len(self._barred) > MAX_BARRED:
            del self._barred[next(iter(self._barred))]

    def status(self) -> dict:
        return {"fresh_origins": len(self._origins), "barred": len(self._barred)}


class QuotaBook:
    """The current interval's counts per worker, and the pool of workers without history (:class:`FreshPool`).

    Bounded: only the current interval's counts are kept (an older one is dropped as soon as time
    moves on), and a worker appears in them only after a batch of its was taken; the pool holds at
    most ``MAX_ORIGINS`` origins and ``MAX_BARRED`` barred keys.
    """

    def __init__(self, cfg: QuotaConfig, scale: int = 1) -> None:
        self.cfg = cfg
        self.scale = scale
        self.pool = FreshPool(scale * cfg.new_total, scale * cfg.new_batches, cfg.interval_s)
        self._interval = -1
        self._taken: dict[str, int] = {}
        self._new_taken = 0
        self.refused = 0  # batches refused by the quota since start (status)

    def _roll(self, now: float) -> int:
        k = math.floor(now / self.cfg.interval_s)
        if k != self._interval:
            self._interval, self._taken, self._new_taken = k, {}, 0
        return k

    def check(self, worker: str, accepted: int, now: float, origin: str | None = None) -> QuotaRefusal | None:
        """None if a batch of ``worker`` (with ``accepted`` accepted batches, arriving from ``origin``;
        None: the key is its own origin) may be taken at ``now``."""
        limit = allowance(accepted, self.cfg, self.scale)
        if limit is None:
            return None
        k = self._roll(now)
        taken = self._taken.get(worker, 0)
        if taken >= limit:
            self.refused += 1
            return QuotaRefusal("quota", (k + 1) * self.cfg.interval_s - now,
                                f"{taken} of {limit} batches this interval ({accepted} accepted so far)")
        if accepted <= 0 and (wait := self.pool.wait(worker, now, origin)) > 0:
            self.refused += 1
            return QuotaRefusal("quota-new", wait, f"its origin's share of the pool of workers without accepted "
                                                   f"batches ({self.pool.status()['fresh_origins']} origins share it) is used")
        return None

    def take(self, worker: str, accepted: int, now: float, origin: str | None = None) -> None:
        """A batch of ``worker`` was taken (after :meth:`check` allowed it)."""
        if allowance(accepted, self.cfg, self.scale) is None:
            return
        self._roll(now)
        self._taken[worker] = self._taken.get(worker, 0) + 1
        if accepted <= 0:
            self._new_taken += 1
            self.pool.take(worker, now, origin)

    def fail(self, worker: str, now: float) -> None:
        """A batch of ``worker`` failed its verdict: if it has no history it loses its share of the pool."""
        self.pool.fail(worker, now)

    def status(self) -> dict:
        return {"interval_s": self.cfg.interval_s, "workers_this_interval": len(self._taken),
                "new_taken": self._new_taken, "refused": self.refused} | self.pool.status()


def accepted_batches(accepted_samples: int, samples_per_batch: int) -> int:
    """Accepted batches from the ledger's accepted samples (every batch of a run has the same size:
    ``prompts_per_batch * group_size``; node/rollouts/assemble.py refuses partial ones)."""
    return accepted_samples // max(1, samples_per_batch)


def simulate_flood(cfg: QuotaConfig, sybils: int, seconds: float, honest_every_s: float = 5.0,
                   fail_after_s: float | None = None, *, origins: int | None = None, key_making: bool = False) -> int:
    """Batches an honest newcomer gets taken in ``seconds`` while ``sybils`` fresh keys flood the pool
    (issue 42's attack; tests/test_sybil_pool.py, bench/sybil_pool.py). Each Sybil sends junk back to
    back and retries at exactly the time a refusal names; the newcomer joins 1 s in, from an address
    of its own, and samples one batch every ``honest_every_s``. ``fail_after_s``: a validator fails
    each junk batch that long after it was taken (None: no validator looks, the worst case).
    ``origins``: the Sybils come from that many addresses (None: every key counts as its own origin,
    as on loopback); ``key_making``: a Sybil signs every attempt with a new key. Pure: the time is simulated."""
    book = QuotaBook(cfg)
    honest = "honest-newcomer"
    # (time, 0, sybil index or -1 for the newcomer): an attempt; (time, 1, key): a failed verdict
    events: list[tuple] = [(0.0, 0, i) for i in range(sybils)] + [(1.0, 0, -1)]
    heapq.heapify(events)
    attempts = [0] * sybils
    got = 0
    while events and events[0][0] < seconds:
        now, kind, who = heapq.heappop(events)
        if kind == 1:
            book.fail(who, now)
            continue
        if who < 0:
            key, origin = honest, honest
        else:
            attempts[who] += key_making
            key = f"sybil-{who}-{attempts[who]}" if key_making else f"sybil-{who}"
            origin = key if origins is None else f"addr-{who % origins}"
        refusal = book.check(key, 0, now, origin)
        if refusal is not None:
            heapq.heappush(events, (now + refusal.retry_after_s, 0, who))
            continue
        book.take(key, 0, now, origin)
        if who < 0:
            got += 1
            heapq.heappush(events, (now + honest_every_s, 0, who))
        else:
            heapq.heappush(events, (now + 0.001, 0, who))
            if fail_after_s is not None:
                heapq.heappush(events, (now + fail_after_s, 1, key))
    return got
