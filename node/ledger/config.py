"""The ``[ledger]`` table of the run file. No libp2p or torch imports (config stays light)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LedgerConfig:
    """Ledger settings every peer of a run should share."""

    # Seconds between anti-entropy rounds with one random connected peer. Gossip carries new entries
    # at once; this only repairs what gossip missed (offline peers, partitions, new nodes).
    sync_interval: float = 10.0
    # Entries per range reply on /swarm/ledger/1.0.0 (also capped at MAX_REPLY_BYTES per reply).
    sync_batch: int = 512
    # Seconds one sync session may take before it is abandoned (progress so far is kept).
    sync_timeout: float = 60.0
    # Entries whose timestamp is more than this many seconds ahead of our clock are rejected
    # (they become acceptable once our clock catches up; anti-entropy brings them back).
    max_clock_skew: float = 120.0
    # Seconds between flushes of batched byte receipts (one entry per flush, not one per piece).
    receipt_interval: float = 30.0
    # Entries per author whose signature and links are re-verified when the node opens its database.
    tail_verify: int = 16
    # Receipts entries an author without standing (no trusted role, no trained rollouts, no bytes
    # vouched by a trainer's or validator's receipts) may have stored; more are refused (node/ledger/chain.py).
    unvouched_receipts: int = 4
    # Receipts entries an author with standing may have: this many, plus receipts_per_checkpoint per
    # checkpoint the run's trainers published (a downloader writes about one per checkpoint it fetches).
    receipts_burst: int = 16
    receipts_per_checkpoint: int = 4
    # Fraction of the bytes vouched for by an author without standing that counts as bytes_served (0 = none).
    unvouched_credit: float = 0.0
    # Trainer-signed cuts (node/ledger/cut.py, node/ledger/cutsync.py): the run's cutter (its first
    # trainer in sorted order) cuts its replica every ``cut_every`` entries stored above its last cut
    # (0 = never), and every replica drops the entries at or below a cut's heads once it adopted it.
    # Off by default for now: a replica holding the other branch of a forked author refuses every cut
    # (it cannot replay to the cut's heads), and a run file that drops the trainer that signed a stored
    # cut stops the nodes based on it from starting. 4000 suits a demo-sized run.
    cut_every: int = 0
    # Each worker's newest draw steps a cut leaves open: above a trainer's step window (26 by default)
    # plus the validators' lag (37 seen in soaks), so an honest batch never loses credit. A run file
    # at or below twice the step window is refused at start (keep_steps_floor).
    keep_steps: int = 64
    # Newest checkpoint versions a cut leaves open (the bytes vouched for their manifests stay per receipt).
    keep_versions: int = 8

    def limits(self):
        """The chain rules' per-author bounds (:class:`node.ledger.chain.AuthorLimits`)."""
        from .chain import AuthorLimits

        return AuthorLimits(self.unvouched_receipts, self.receipts_burst, self.receipts_per_checkpoint,
                            self.unvouched_credit)

    def validate(self) -> None:
        if not 0.05 <= self.sync_interval <= 3600:
            raise ValueError(f"sync_interval: 0.05..3600 seconds, got {self.sync_interval}")
        if not 1 <= self.sync_batch <= 4096:
            raise ValueError(f"sync_batch: 1..4096, got {self.sync_batch}")
        if not 1 <= self.sync_timeout <= 3600:
            raise ValueError(f"sync_timeout: 1..3600 seconds, got {self.sync_timeout}")
        if not 0 <= self.max_clock_skew <= 86400:
            raise ValueError(f"max_clock_skew: 0..86400 seconds, got {self.max_clock_skew}")
        if not 0.05 <= self.receipt_interval <= 86400:
            raise ValueError(f"receipt_interval: 0.05..86400 seconds, got {self.receipt_interval}")
        if not 0 <= self.tail_verify <= 1_000_000:
            raise ValueError(f"tail_verify: 0..1000000, got {self.tail_verify}")
        for name in ("unvouched_receipts", "receipts_burst", "receipts_per_checkpoint"):
            if not 0 <= getattr(self, name) <= 1_000_000:
                raise ValueError(f"{name}: 0..1000000, got {getattr(self, name)}")
        if not 0.0 <= self.unvouched_credit <= 1.0:
            raise ValueError(f"unvouched_credit: 0..1, got {self.unvouched_credit}")
        if not (self.cut_every == 0 or 100 <= self.cut_every <= 100_000_000):
            raise ValueError(f"cut_every: 0 (never) or 100..100000000 entries, got {self.cut_every}")
        if not 1 <= self.keep_steps <= 1_000_000:
            raise ValueError(f"keep_steps: 1..1000000 draw steps (keep it above the trainer's step window and "
                             f"the validators' lag), got {self.keep_steps}")
        if not 1 <= self.keep_versions <= 1_000_000:
            raise ValueError(f"keep_versions: 1..1000000 checkpoint versions, got {self.keep_versions}")



def keep_steps_floor(step_window: int) -> int:
    """The largest ``keep_steps`` a run whose trainers' step window is ``step_window`` (node/rollouts/steps.py
    ``step_window_size``) must not use: the window, within which a trainer still takes a batch below
    its worker's highest step, and as much again for the claims that reach the ledger after newer ones
    (validators judge in each trainer's deadline order, up to a trainer's queue apart: soak60b's claims
    were up to 37 steps behind their worker's highest, at a window of 26)."""
    return 2 * step_window


def keep_steps_problem(keep_steps: int, step_window: int, window_from: str) -> str | None:
    """Why a run's ``keep_steps`` would let a cut take an honest batch's credit (one line), or None;
    ``window_from`` says what set the step window."""
    floor = keep_steps_floor(step_window)
    if keep_steps > floor:
        return None
    return (f"run.ledger.keep_steps ({keep_steps}) must be above {floor}: the trainers' step window ({step_window}, "
            f"from {window_from}) and as much again for the validators' lag; a cut closes older draw steps, and "
            f"an honest batch claimed at a closed step counts nothing")
