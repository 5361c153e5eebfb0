"""The trainer service: intake of rollout batches, the validator gate, the GRPO loop, publishing.

How this works
--------------
* **Intake** (``/swarm/rollouts/1.0.0``, :meth:`Trainer.rollouts_handler`): one frame in, one
  :class:`RolloutAck` out. ``open_batch`` checks size, signature, schema, run and signer; then the
  pure :func:`node.trainer.intake.intake_reason` checks replay, staleness and shape against the
  trainer's state, and a batch that passes all of that is still refused ``quota`` when its worker,
  short of accepted history, used its allowance for this interval (node/rollouts/quota.py). The
  batch is committed to the spool (SQLite, fsync) *before* the ack is written, so an acknowledged
  batch survives ``kill -9``.
* **Validator gate**: when the run names validators, a spooled batch is GATED: the gate
  (:mod:`node.trainer.gate`) picks a live validator by rendezvous hashing and we forward the signed
  batch over ``/swarm/verify/1.0.0``; the validator later opens ``/swarm/verdicts/1.0.0`` to us with
  a signed Verdict (:meth:`Trainer.verdicts_handler`). A pass makes the batch READY, a failure
  REJECTED; a silent validator is skipped for that batch after ``verify_timeout_s``, and one that
  cannot judge it yet (no checkpoint: its ack says ``no-checkpoint``, or a signed ``unjudged``
  verdict) at once, with no blame on the worker (gate.py ``not_now``). The gate sends
  the nearest deadline first and drops, before any prefill, batches the trainer can no longer use.
  With no validators the gate is off (shown in status) and batches are READY at once.
* **Staleness** is judged once, at intake (node/trainer/intake.py ``trainable_until``): a batch
  acknowledged at step ``a`` stays trainable until step ``a + [grpo] verify_grace_steps``, and never
  past ``[grpo] max_off_policy_steps`` versions after the one that generated it (``GRPOConfig.grace_steps``).
* **Back-pressure** (node/trainer/pacing.py): every ack carries ``retry_after_ms``, the time the
  trainer needs to drain its queue back to ``target_pending_batches`` at its measured rate; workers
  wait that long before generating again. ``busy`` (queue at its bound) carries the same wait.
* **Loop** (:meth:`Trainer.train_loop`): take every READY batch still trainable (nearest deadline
  first, up to ``max_step_samples``), drop zero-signal groups (online filtering), and once
  ``min_batch_samples`` samples with signal are there, run one rollout step in a worker thread,
  save the model folder and training state, publish the folder through the shard swarm as the
  next version and record it in the ledger. Generation never waits for training and training never
  waits for one inference node: whatever batches are ready make the step.
* **Ledger** (:meth:`Trainer.ledger_loop`): one "rollouts" entry per judged batch (accepted when
  trained, rejected with its reason), written from the spool's ``ledger_due`` rows so none is lost.
* **Loops and figures**: the train, gate, ledger and evaluation loops each wait on their own
  :class:`Wakeup` (``Trainer.wake``), which the event that gives them work sets, or on their tick.
  What status and the metrics show is kept in node/trainer/figures.py (pure; nothing decides on it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ..dbthread import DbThread
from ..gossip.api import MembershipAPI
from ..hashes import digest
from ..ledger.api import LedgerAPI, LedgerError
from ..net.origins import address_group
from ..net.reqres import CallFailure, FailureKind
from ..peers import ActionKind, FaultRule
from ..rl.grpo import NonFiniteStep, TrainSample
from ..rl.mismatch import MismatchWindow
from ..rollouts.protocols import ROLLOUTS, VERDICTS, VERIFY
from ..rollouts.schema import (
    ROLLOUTS_PROTOCOL,
    UNJUDGED_NO_CHECKPOINT,
    VERDICTS_PROTOCOL,
    VERIFY_PROTOCOL,
    RolloutAck,
    open_batch,
    open_verdict,
)
from ..rollouts.quota import QuotaBook, QuotaRefusal, accepted_batches
from ..rollouts.steps import step_window_size
from ..shards.api import ShardsAPI
from ..steptime import PhaseTimes
from ..wire import RemoteProtocolError
from .checkpoints import NonFiniteCheckpoint, check_finite_folder
from .config import TrainerSections
from .evaluation import EvalBook, EvalRecord
from .evaluator import serve_evaluation
from .figures import TrainerFigures, TrainerGauges, reward_points, step_figures
from .gate import ValidatorGate, VerdictOutcome
from .intake import (
    KEEPS_WINDOW,
    NOT_ATTRIBUTABLE,
    IntakeLimits,
    NOT_STRIKES,
    expired,
    intake_reason,
    trainable_until,
)
from .pacing import Pacer
from .roster import Roster, member_state
from .readiness import intake_protocol
from .progress import STALL_AFTER_S, Backlog, Progress, idle_fraction, stall_cause, stall_kind
from .fsdp import open_policy
from .policy import Policy, training_samples
from .spool import BatchState, Spool, SpooledBatch, StepRecord, open_spool

log = logging.getLogger("node.trainer")

SOURCE = ROLLOUTS.source  # metrics label of refused batches, fault source in the peer table
VERDICT_SOURCE = VERDICTS.source
SEND_TIMEOUT = 30.0  # seconds to hand a batch to a validator and get its ack
LEDGER_CHUNK = 32  # ledger entries written per wake-up
GATE_TICK = 1.0  # seconds between gate passes when nothing happens
STATUS_STEPS = 200  # reward-curve points in status (longer runs are averaged into this many buckets)
ZERO_ID = bytes(32)


class Wakeup:
    """One loop's wake-up: setting it ends the loop's current wait early; each wait arms it afresh."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> None:
        """Until set or ``timeout`` seconds have passed."""
        with trio.move_on_after(timeout):
            await self._event.wait()
        self._event = trio.Event()


@dataclass
class Wakeups:
    """What wakes each loop of the trainer before its tick: work for it has arrived."""

    train: Wakeup = field(default_factory=Wakeup)  # a batch is READY (or a verdict passed one)
    gate: Wakeup = field(default_factory=Wakeup)  # a batch is GATED, or a validator slot came free
    ledger: Wakeup = field(default_factory=Wakeup)  # a judged batch is due its ledger entry
    eval: Wakeup = field(default_factory=Wakeup)  # a version was published


class Trainer:
    """The running trainer, handed back by :func:`serve_trainer`. It publishes each new version
    through ``shards``, advertises it in ``membership`` and records its work in ``ledger``."""

    def __init__(self, node, policy: Policy, spool: Spool, sections: TrainerSections, *,
                 shards: ShardsAPI, membership: MembershipAPI, ledger: LedgerAPI,
                 clock=trio.current_time) -> None:
        self.node = node
        self.shards = shards
        self.membership = membership
        self.ledger = ledger
        self.clock = clock  # for strikes and bans (a fake in sync unit tests)
        self.policy = policy
        self.spool = spool  # queried here on its WAL reader; written only through self.db
        self.db = DbThread()  # the spool's writes, off the event loop (node/dbthread.py)
        self._spool_lock = trio.Lock()  # held from a spool read to the write it decides
        self.sections = sections
        self.cfg = cfg = sections.grpo
        self.tcfg = tcfg = sections.trainer
        run = node.config.run
        self.run_name = run.name
        self.validators = set(run.validators)
        self.roster = Roster()  # the validators the gate was last given (changes logged)
        self.gate = (ValidatorGate(tcfg.verify_timeout_s, tcfg.max_verify_in_flight, tcfg.max_verify_per_validator,
                                    tcfg.unjudged_retry_s)
                     if self.validators else None)
        # The default target adapts to what validators check within the grace steps (pacing.py).
        self.pacer = Pacer(tcfg.pacing_target(), tcfg.max_pending_batches, tcfg.max_retry_after_s,
                           horizon_steps=0 if tcfg.target_pending_batches or not self.validators
                           else max(1, cfg.grace_steps()))
        self.progress = Progress(clock())
        self.stepping_since: float | None = None  # trio time the running step began
        self.hold_since: float | None = None  # when the coming step began waiting for expiring batches
        self.stall_logged = ""  # the stall cause last logged ("" while stepping)
        self.wall_clock = time.time  # the sample-life figures compare with workers' created_ms stamps
        self.limits = IntakeLimits(policy.vocab_size, cfg.pack_length, cfg.temperature, cfg.async_level,
                                   sections.inference.accepted_engines())
        # The step window (node/rollouts/steps.py) is sized by the run's [worker] table, as the workers' outboxes are.
        self.step_window = step_window_size(sections.worker.max_pending_batches)
        # Fresh identities get a small quota per interval until batches of theirs train (node/rollouts/quota.py).
        self.samples_per_batch = sections.rl.prompts_per_batch * sections.rl.group_size
        self.quota = QuotaBook(sections.quota)
        node.peers.set_rule(SOURCE, FaultRule(strikes=tcfg.ban_after_strikes, window=tcfg.strike_window_s,
                                              ban_seconds=tcfg.ban_seconds))
        self._nursery: trio.Nursery | None = None
        self._samples: dict[bytes, tuple[list[TrainSample], int]] = {}  # decoded READY batches (cache)
        self.wake = Wakeups()
        self.published: int | None = None
        self.figures = TrainerFigures(reward_curve=[(r.step, r.mean_reward) for r in spool.steps()])
        self.gauges = TrainerGauges(node.metrics, policy.step)
        # Seconds of step wall time by phase: train, save, publish (wait = figures.idle_s); node/steptime.py.
        self.phases = PhaseTimes(node.metrics.phase_seconds())
        # Held-out scores of published versions, kept in the spool (node/trainer/evaluation.py).
        self.evals = EvalBook(tcfg.eval_every, tcfg.eval_tasks, spool.evals())
        # Each engine's log-prob mismatch at the weights that generated the samples (node/rl/mismatch.py).
        self.proofs = sections.proofs  # the validator's log-prob tolerances
        self.mismatch = MismatchWindow()

    # ------------------------------------------------------------------ helpers

    @property
    def step(self) -> int:
        return self.policy.step

    def live_validators(self) -> list[str]:
        """Validators of the run that membership believes alive."""
        alive = self.membership.members()
        return sorted(v for v in self.validators if v in alive)

    # ------------------------------------------------------------------ intake

    def worker_banned(self, worker: str) -> bool:
        """Banned by a penalty entry in the ledger (ours or any validator's): its batches are refused."""
        return self.ledger.ban_of(worker) is not None

    async def judge(self, data: bytes, sender: str) -> RolloutAck:
        """Judge one received batch and spool it; the returned ack is true once this returns."""
        try:
            signed = open_batch(data, self.run_name)
        except RemoteProtocolError as e:
            return self._refuse(digest(data), e.reason, sender)
        b = signed.batch
        if self.worker_banned(b.worker):
            return self._refuse(signed.batch_id, "banned", sender)
        # The capacity, replay and step-window checks hold until the batch is spooled: no other judge in between.
        async with self._spool_lock:
            pending = self.spool.pending()
            if self.pacer.busy(pending) and not self.spool.knows(signed.batch_id):
                return self._refuse(signed.batch_id, "busy", sender,
                                    retry_after=self.pacer.retry_after(pending, self.clock()))
            announced = self.shards.announced.get(b.policy_version)  # (root, announcer) of our own manifest
            reason = intake_reason(
                b,
                known_batch=self.spool.knows(signed.batch_id),
                known_worker_step=self.spool.knows_worker_step(b.worker, b.step),
                step=self.step,
                limits=self.limits,
                window_reason=self.spool.step_window(b.worker).reason(b.step, self.step_window),
                # An unknown root (a version older than what we kept since a restart) is left to the
                # validators, who check the draw; a root that contradicts ours is the worker's lie.
                root_ok=announced is None or announced[0] == b.policy_root,
            )
            history = accepted_batches(self.ledger.accepted_samples(b.worker), self.samples_per_batch)
            # The pool of fresh keys is shared per address, not per key (keys are free): quota.py.
            origin = address_group(self.node.host.remote_ip(sender)) if history <= 0 else None
            if reason is None:
                refusal = self.quota.check(b.worker, history, self.clock(), origin)
                if refusal is not None:
                    return self._refuse_quota(signed.batch_id, refusal, sender)
            if reason is not None:
                if reason not in NOT_ATTRIBUTABLE:
                    # A third party may replay a worker's signed batch: only the worker's own submission
                    # is recorded against it in the ledger.
                    await self.db.run(functools.partial(
                        self.spool.add, signed, BatchState.REJECTED, reason=reason, ledger_due=sender == b.worker,
                        window=0 if reason in KEEPS_WINDOW else self.step_window))
                    self.wake.ledger.set()
                return self._refuse(signed.batch_id, reason, sender)
            # Staleness was judged just now, against the step of this acknowledgement: from here on the
            # batch's wait is ours, and it is trainable until trainable_until() (intake.py).
            state = BatchState.GATED if self.gate is not None else BatchState.READY
            await self.db.run(functools.partial(self.spool.add, signed, state, window=self.step_window,
                                                accepted_step=self.step))
            self.figures.on_acked(signed.batch_id, b.created_ms / 1000.0, self.wall_clock())
            if self.gate is not None:
                self.gate.add(signed.batch_id, b.policy_version, self._expiry(b.policy_version, self.step))
                self.wake.gate.set()
            else:
                self.wake.train.set()
            self.quota.take(b.worker, history, self.clock(), origin)
            self.progress.on_work(self.clock())
            wait = self.pacer.retry_after(pending + 1, self.clock())
        self.figures.intake["accepted"] += 1
        self.gauges.batches.labels(outcome="accepted").inc()
        return RolloutAck(batch_id=signed.batch_id, accepted=True, trainer_step=self.step,
                          retry_after_ms=int(wait * 1000))

    def _expiry(self, policy_version: int, accepted_step: int | None) -> int:
        return trainable_until(policy_version, accepted_step, self.cfg.async_level, self.cfg.grace_steps())

    def _refuse(self, batch_id: bytes, reason: str, sender: str, retry_after: float = 0.0) -> RolloutAck:
        self.figures.intake[reason] += 1
        self.gauges.batches.labels(outcome=reason).inc()
        self.node.metrics.reject(SOURCE, reason)
        self._strike(sender, reason)
        return RolloutAck(batch_id=batch_id, accepted=False, reason=reason, trainer_step=self.step,
                          retry_after_ms=int(retry_after * 1000))

    def _refuse_quota(self, batch_id: bytes, refusal: QuotaRefusal, sender: str) -> RolloutAck:
        """Not now: the worker has used its quota for this interval (no strike, no ledger entry)."""
        log.info("trainer: batch %s of %s refused: %s, %s; next interval in %.0fs", batch_id.hex()[:12],
                 sender[-8:], refusal.reason, refusal.detail, refusal.retry_after_s)
        return self._refuse(batch_id, refusal.reason, sender, retry_after=refusal.retry_after_s)

    def _strike(self, sender: str, reason: str) -> None:
        """Report a refusal that is the sender's fault to the peer table; a ban it earns is recorded."""
        if not sender or reason in NOT_STRIKES:
            return
        actions = self.node.peers.report(sender, SOURCE, reason, self.clock())
        if any(a.kind is ActionKind.BAN for a in actions):
            self._ban(sender, reason)

    def _ban(self, peer: str, reason: str) -> None:
        """The peer table banned ``peer`` (and disconnects it): record a penalty in the ledger."""
        log.warning("trainer: banned %s for %.0fs after repeated invalid batches (last: %s)", peer[-8:],
                    self.tcfg.ban_seconds, reason)
        self.node.metrics.reject(SOURCE, "banned")
        if self._nursery is not None:
            self._nursery.start_soon(self._record_penalty, peer, reason)

    async def _record_penalty(self, peer: str, reason: str) -> None:
        from ..ledger.entries import Penalty

        try:
            await self.ledger.append(Penalty(peer=peer, reason=f"trainer:{reason}"[:64], points=self.tcfg.ban_after_strikes,
                                             ban_seconds=int(min(self.tcfg.ban_seconds, 30 * 86400))))
        except (LedgerError, ValueError) as e:
            log.error("trainer: ledger refused a penalty for %s: %s", peer[-8:], e)

    def _admit_rollouts(self, sender: str) -> str | None:
        if self.node.peers.is_banned(sender, SOURCE, self.clock()):
            self.figures.intake["banned"] += 1
            return "banned"
        return None

    def _rollouts_fault(self, sender: str, reason: str) -> None:
        """A broken or slow rollouts frame (a spooled batch stays spooled)."""
        self.node.metrics.reject(SOURCE, reason)
        if reason != "timeout":
            self.figures.intake[reason] += 1
            self._strike(sender, reason)

    async def _answer_rollouts(self, sender: str, data: bytes) -> RolloutAck:
        return await self.judge(data, sender)

    def rollouts_handler(self):
        """``/swarm/rollouts/1.0.0``: one batch frame in, one ack frame out."""
        return intake_protocol(self.tcfg).handler(self._answer_rollouts, admit=self._admit_rollouts, on_fault=self._rollouts_fault,
                              streams=self.sections.streams, peers=self.node.peers, metrics=self.node.metrics)

    # ------------------------------------------------------------------ validator gate

    async def _answer_verdict(self, validator: str, data: bytes) -> RolloutAck:
        batch_id, ok, reason = await self.on_verdict_bytes(data)
        return RolloutAck(batch_id=batch_id, accepted=ok, reason=reason, trainer_step=self.step)

    def _verdicts_fault(self, validator: str, reason: str) -> None:
        if reason != "timeout":
            self.node.metrics.reject(VERDICT_SOURCE, reason)

    def verdicts_handler(self):
        """``/swarm/verdicts/1.0.0``: signed verdict frames from a validator, one ack each."""
        return VERDICTS.handler(self._answer_verdict, on_fault=self._verdicts_fault, streams=self.sections.streams,
                                peers=self.node.peers, metrics=self.node.metrics)

    async def on_verdict_bytes(self, data: bytes) -> tuple[bytes, bool, str]:
        """Check and apply one verdict; (batch id, recorded?, reason)."""
        try:
            verdict = open_verdict(data, self.run_name, self.validators)
        except RemoteProtocolError as e:
            return self._verdict_ignored(ZERO_ID, e.reason)
        async with self._spool_lock:  # the state read holds until the decision is spooled
            row = self.spool.get(verdict.batch_id)
            reason = verdict_mismatch(verdict, row, gated=self.gate is not None)
            if reason:
                return self._verdict_ignored(verdict.batch_id, reason)
            if verdict.unjudged:  # "cannot judge yet": no verdict, no blame; the batch moves on
                self._not_now(verdict.batch_id, verdict.validator, f"unjudged:{verdict.unjudged}")
                return verdict.batch_id, True, ""
            outcome = self.gate.on_verdict(verdict.batch_id, verdict.accepted, verdict.reasons)
            if not outcome.decided:
                return self._verdict_ignored(verdict.batch_id, outcome.reason)
            await self.db.run(self.spool.decide, verdict.batch_id, outcome.passed, outcome.reason, data)
            self._decided(row, outcome)
        return verdict.batch_id, True, ""

    def _verdict_ignored(self, batch_id: bytes, reason: str) -> tuple[bytes, bool, str]:
        self.figures.verdicts[reason] += 1
        self.node.metrics.reject(VERDICT_SOURCE, reason)
        # A repeated verdict is not the validator's fault: acknowledge it as recorded.
        return batch_id, reason == "already-decided", reason

    def _not_now(self, batch_id: bytes, validator: str, why: str) -> None:
        """The validator cannot judge the batch yet (gate.py ``not_now``): no blame, the batch moves on."""
        self.gate.not_now(batch_id, validator, trio.current_time())
        self.figures.verdicts[why] += 1
        self.wake.gate.set()

    def _decided(self, row: SpooledBatch, outcome: VerdictOutcome) -> None:
        """A verdict decided a gated batch (already spooled): figures, the quota, the loops it wakes."""
        self.figures.verdicts["passed" if outcome.passed else "failed"] += 1
        if outcome.passed:
            self.figures.on_verified(row.batch_id, self.wall_clock())
            self.wake.train.set()
        else:
            self._gone([row.batch_id], row.samples, outcome.reason)
            if outcome.workers_fault:  # a fresh key's junk costs it the pool; a stale batch does not
                self.quota.fail(row.worker, self.clock())
            self.wake.ledger.set()
        self.wake.gate.set()  # a validator slot is free: send the next batch now, not at the next tick

    async def gate_loop(self) -> None:
        """Send due batches to their validators; wake on new batches, deadlines or every GATE_TICK."""
        assert self.gate is not None
        async with trio.open_nursery() as nursery:
            while True:
                now = trio.current_time()
                skipped = self.gate.drop_expired(self.step)
                if skipped:  # before any validator spends a prefill on them (gate.py)
                    await self._expire(skipped)
                for batch_id, validator in self.gate_pass(now):
                    nursery.start_soon(self._send_to_validator, batch_id, validator)
                nxt = self.gate.next_deadline(now)
                await self.wake.gate.wait(GATE_TICK if nxt is None else max(0.0, min(GATE_TICK, nxt - now)))

    def gate_pass(self, now: float) -> list[tuple[bytes, str]]:
        """The hand-offs due now (batch id, validator). First the batches awaiting a validator we hold
        no connection to come back (gate.py "A validator that lost its queue": killed, it lost them),
        and each change of the set of validators handed batches is logged with its reason (roster.py)."""
        live = self.live_validators()
        for line in self.roster.update(live, lambda v: member_state(self.membership, v)):
            log.info("trainer: %s", line)
        for validator in sorted(self.gate.holding()):
            if not self.node.host.is_connected(validator):
                released = self.gate.release(validator)
                log.info("trainer: no connection to validator %s: %d batches awaiting its verdict handed out again",
                         validator[-8:], len(released))
        return self.gate.due(live, now)

    async def _send_to_validator(self, batch_id: bytes, validator: str) -> None:
        envelope = self.spool.envelope(batch_id)
        if envelope is None:  # decided meanwhile
            self.gate.send_failed(batch_id)
            return
        ok = False
        try:
            ack = await VERIFY.call(self.node.host, validator, envelope, SEND_TIMEOUT, peers=self.node.peers)
            ok = ack.accepted and ack.batch_id == batch_id
            if not ok and ack.reason == UNJUDGED_NO_CHECKPOINT and ack.batch_id == batch_id:
                self._not_now(batch_id, validator, f"unjudged:{ack.reason}")
                return
        except CallFailure as e:
            if e.kind is FailureKind.GARBAGE:
                self.node.metrics.reject(VERIFY_PROTOCOL, e.reason)
            else:  # unreachable, silent or gone: another validator may take it
                log.info("trainer: cannot hand batch %s to validator %s: %s", batch_id.hex()[:12], validator[-8:], e)
        if ok:
            self.gate.sent(batch_id, trio.current_time())
        else:
            self.gate.send_failed(batch_id)
            self.wake.gate.set()

    # ------------------------------------------------------------------ training

    def _decoded(self, batch_id: bytes) -> tuple[list[TrainSample], int]:
        if batch_id not in self._samples:
            envelope = self.spool.envelope(batch_id)
            # Our own spool: it passed open_batch before it was written.
            signed = open_batch(envelope, self.run_name)
            self._samples[batch_id] = training_samples(signed.batch)
        return self._samples[batch_id]

    async def pick(self) -> tuple[list[bytes], list[TrainSample], float] | None:
        """READY batches for the next step: (ids, samples, mean reward), or None to keep waiting.

        Batches the trainer can no longer train (past :func:`node.trainer.intake.trainable_until`)
        are rejected ("expired": our delay, not the worker's fault, so no ledger entry). Batches whose
        every group is flat (online filtering left nothing) are consumed at once by the coming step:
        valid work, credited, but they must not fill the queue while a weak policy scores everything
        alike. The rest are taken whole, nearest deadline first, *all* of them up to
        ``max_step_samples``: a step that took only ``min_batch_samples`` left the rest to age past
        their deadline while workers kept sending (issue 15); ``min_batch_samples`` is the least a
        step waits for.
        """
        ids: list[bytes] = []
        samples: list[TrainSample] = []
        reward_sum = 0.0
        n_all = 0
        gone, flat = [], []
        rows = self.spool.in_state(BatchState.READY, limit=self.tcfg.max_pending_batches)
        rows.sort(key=lambda r: (self._expiry(r.policy_version, r.accepted_step), -r.policy_version))
        for row in rows:
            if expired(row.policy_version, row.accepted_step, self.step, self.cfg.async_level, self.cfg.grace_steps()):
                gone.append(row.batch_id)
                continue
            got, _ = self._decoded(row.batch_id)
            if not got:
                flat.append(row.batch_id)
                continue
            if ids and len(samples) + len(got) > self.tcfg.max_step_samples:
                break
            ids.append(row.batch_id)
            samples.extend(got)
            reward_sum += row.mean_reward * row.samples
            n_all += row.samples
        if gone:
            await self._expire(gone)
        if flat:
            await self.db.run(self.spool.take, flat, self.step + 1)  # like any batch of that step: back to READY if it is lost
            self.figures.no_signal_batches += len(flat)
            self._trained(flat)
            self.wake.ledger.set()
        for bid in gone + flat:
            self._samples.pop(bid, None)
        self.figures.samples_in_hand = len(samples)
        if len(samples) < self.cfg.min_batch_samples:
            return None
        return ids, samples, reward_sum / max(n_all, 1)

    async def _expire(self, batch_ids: list[bytes]) -> None:
        """Reject acknowledged batches the trainer can no longer train: our queueing, so no ledger
        entry and no strike (the worker was fresh when we took its batch)."""
        rows = [r for r in map(self.spool.get, batch_ids) if r is not None]
        samples = sum(r.samples for r in rows)
        log.info("trainer: %d batches expired at step %d before they could be trained (%s)", len(rows), self.step,
                 ", ".join(f"v{r.policy_version} acked at {r.accepted_step} {r.state.value}" for r in rows[:4]))
        await self.db.run(functools.partial(self.spool.reject, batch_ids, "expired", ledger_due=False))
        self._gone(batch_ids, samples, "expired")

    def _gone(self, batch_ids: list[bytes], samples: int, reason: str) -> None:
        """Acknowledged batches that left the queue untrained (figures, and pacing for those a verdict
        refused: an expired batch took no validator time, so it says nothing of the drain rate)."""
        self.figures.on_gone(batch_ids, samples, reason)
        if reason != "expired":
            self.pacer.on_drained(len(batch_ids), self.clock())

    def _trained(self, batch_ids: list[bytes]) -> None:
        """Batches consumed by the coming step: sample figures, the stages of their life, pacing."""
        now = self.wall_clock()
        for bid in batch_ids:
            row = self.spool.get(bid)
            self.figures.on_trained(bid, None if row is None else row.samples, now)
        self.pacer.on_drained(len(batch_ids), self.clock())

    async def train_loop(self) -> None:
        """Step whenever enough READY samples are there; publish each new version."""
        while True:
            picked = await self.pick()
            if picked is not None and self._hold_step():
                await self.wake.train.wait(GATE_TICK)
                continue
            if picked is None:
                t0 = trio.current_time()
                await self.wake.train.wait(GATE_TICK)
                if self.figures.intake["accepted"] or self.spool.pending():  # idle = waiting once rollouts flow
                    self.figures.idle_s += trio.current_time() - t0
                continue
            self.stepping_since = self.clock()
            try:
                await self.run_step(*picked)
            finally:  # a dropped step (a non-finite update) ends its hold too: the next one waits afresh
                self.stepping_since = self.hold_since = None

    def _hold_step(self) -> bool:
        """True while the next step should wait for verdicts on batches it would leave to expire
        (gate.py ``expiring``), at most ``step_hold_s`` seconds per step."""
        if self.gate is None or not self.gate.expiring(self.step):
            return False
        now = self.clock()
        if self.hold_since is None:
            self.hold_since = now
        return now - self.hold_since < self.tcfg.step_hold_s

    async def run_step(self, ids: list[bytes], samples: list[TrainSample], mean_reward: float) -> StepRecord | None:
        """One rollout step on the given READY batches, recorded, saved and published (None: dropped)."""
        version = self.step + 1
        await self.db.run(self.spool.take, ids, version)  # before training: see Spool.recover
        self._trained(ids)
        t0 = trio.current_time()
        by_engine = await trio.to_thread.run_sync(self.policy.mismatch, samples, self.tcfg.mismatch_samples,
                                                  self.proofs)
        try:
            stats = await trio.to_thread.run_sync(self.policy.train, samples)
        except NonFiniteStep as e:
            await self._drop_step(ids, e)
            return None
        seconds = trio.current_time() - t0
        self.phases.add("train", seconds)
        self.figures.step_batches += len(ids)
        record = StepRecord(version, mean_reward, len(samples), len(ids), stats.tokens, stats.loss, seconds)
        t1 = trio.current_time()
        await self.db.run(self.spool.record_step, record)  # then the model: never a saved model without its record
        await trio.to_thread.run_sync(self.policy.save)
        await self.db.run(self.spool.finish_step, record)
        self.phases.add("save", trio.current_time() - t1)
        for bid in ids:
            self._samples.pop(bid, None)
        self.figures.reward_curve.append((version, mean_reward))
        self.figures.last_step = step_figures(version, len(samples), len(ids), stats, seconds, by_engine)
        self.mismatch.add(by_engine)
        self.gauges.on_step(version, stats, mean_reward, seconds, by_engine)
        log.info("trainer: step %d: %d samples from %d batches, mean reward %.3f, loss %.4f, %.2fs",
                 version, len(samples), len(ids), mean_reward, stats.loss, seconds)
        self._stepped()
        await self.db.run(self.spool.prune, version - self.cfg.off_policy_bound() - 1)
        self.wake.ledger.set()
        t2 = trio.current_time()
        await self.publish(version)
        self.phases.add("publish", trio.current_time() - t2)
        self.figures.busy_s += trio.current_time() - t0
        return record

    async def _drop_step(self, ids: list[bytes], error: NonFiniteStep) -> None:
        """A step whose loss or gradients were not finite is not taken: its batches go back to READY
        but for those that alone give a non-finite loss, which are refused and their senders struck.
        The weights stepped by earlier mini-batches were finite; nothing was saved or published."""
        per_batch = [self._decoded(bid)[0] for bid in ids]
        bad = await trio.to_thread.run_sync(self.policy.non_finite, per_batch)
        culprits = [ids[i] for i in bad]
        log.error("trainer: step %d dropped (%s); %d of %d batches give a non-finite loss",
                  self.step + 1, error, len(culprits), len(ids))
        await self.db.run(self.spool.untake, ids)
        if culprits:
            await self.db.run(self.spool.reject, culprits, "non_finite")
        # counted by _trained at the take; not trained after all
        self.figures.sample_outcomes["trained"] -= sum(r.samples for r in map(self.spool.get, ids) if r is not None)
        for bid in culprits:
            row = self.spool.get(bid)
            self._samples.pop(bid, None)
            if row is not None:
                self._strike(row.worker, "non_finite")
        self.figures.dropped_steps += 1

    async def publish(self, version: int, *, ledger: bool = True) -> None:
        """Announce the model folder of ``version`` through the shard swarm and (``ledger``) the ledger."""
        folder = self.policy.folder(version)
        try:
            # Never a NaN out: this also catches a folder saved before the check existed (issue 14).
            await trio.to_thread.run_sync(check_finite_folder, folder)
            signed = await self.shards.publish(folder, version)
        except (PermissionError, OSError, ValueError, NonFiniteCheckpoint) as e:
            self.figures.publish_error = str(e)
            log.error("trainer: publishing v%d failed: %s", version, e)
            return
        self.published = version
        self.figures.publish_error = ""
        self.wake.eval.set()
        from ..ledger.entries import CheckpointPublished

        # Advertise the versions we seed in our peer record.
        self.membership.update(checkpoints=list(self.shards.versions_held()))
        if not ledger:
            return
        try:
            await self.ledger.append(CheckpointPublished(version=version, manifest_id=signed.root,
                                                         total_bytes=signed.manifest.total_size))
        except LedgerError as e:  # a refused entry is our bug; the checkpoint itself is out
            log.error("trainer: ledger refused checkpoint v%d: %s", version, e)

    # ------------------------------------------------------------------ held-out evaluation

    async def eval_loop(self) -> None:
        """Score version 0 and every ``eval_every``-th published version beside training
        (node/trainer/evaluator.py: a separate process at the lowest CPU priority)."""
        import dataclasses

        settings = {"rl": dataclasses.asdict(self.sections.rl), "tasks": self.tcfg.eval_tasks,
                    "device": self.tcfg.eval_device, "threads": self.tcfg.eval_threads}
        await serve_evaluation(self.evals, settings, self.policy.root, latest=lambda: self.published,
                               record=self._record_eval, wait=self.wake.eval.wait)

    async def _record_eval(self, record: EvalRecord) -> None:
        await self.db.run(self.spool.record_eval, record)
        self.gauges.on_eval(record.version, record.score)

    # ------------------------------------------------------------------ progress

    def _stepped(self) -> None:
        now = self.clock()
        self.hold_since = None
        if self.stall_logged:
            log.info("trainer: stepping again after %.0f s", self.progress.seconds_since_step(now))
            self.stall_logged = ""
        self.progress.on_step(now)
        self.pacer.on_step(now)

    def backlog(self) -> Backlog:
        """The queues as the stall check sees them (node/trainer/progress.py)."""
        waiting = self.gate.status()["waiting"] if self.gate is not None else {}
        sent = waiting.get("sending", 0) + waiting.get("awaiting", 0)
        return Backlog(
            stepping_s=None if self.stepping_since is None else self.clock() - self.stepping_since,
            gated_unsent=waiting.get("unassigned", 0), gated_sent=sent,
            ready=self.spool.counts().get(BatchState.READY.value, 0),
            samples_in_hand=self.figures.samples_in_hand, min_samples=self.cfg.min_batch_samples,
            validators=len(self.validators), live_validators=len(self.live_validators()) if self.validators else 0)

    def stall(self) -> str:
        """Why no step came for ``STALL_AFTER_S`` seconds, or "" (progress.py)."""
        return stall_cause(self.backlog()) if self.progress.stalled(self.clock()) else ""

    async def watch_loop(self) -> None:
        """Log one warning when a stall starts or its cause changes."""
        while True:
            await trio.sleep(STALL_AFTER_S / 9)
            cause = self.stall()
            if cause and stall_kind(cause) != stall_kind(self.stall_logged):
                log.warning("trainer: stalled: no step for %.0f s: %s", self.progress.seconds_since_step(self.clock()),
                            cause)
                self.stall_logged = cause

    # ------------------------------------------------------------------ ledger

    async def ledger_loop(self) -> None:
        """Write the due "rollouts" entries (accepted when trained, rejected with a reason)."""
        from ..ledger.entries import RolloutsJudged

        while True:
            rows = self.spool.ledger_due(LEDGER_CHUNK)
            for row in rows:
                body = RolloutsJudged(worker=row.worker, step=min(row.step, 2**32), accepted=row.state is BatchState.TRAINED,
                                      samples=min(row.samples, 2**20), tokens=row.tokens, batch_hash=row.batch_id,
                                      reason=row.reason)
                try:
                    await self.ledger.append(body)
                except LedgerError as e:  # our own entry refused (a bug): log it, do not retry forever
                    log.error("trainer: ledger refused rollouts entry for %s: %s", row.batch_id.hex()[:12], e)
                await self.db.run(self.spool.mark_ledger_done, row.batch_id)
            if len(rows) < LEDGER_CHUNK:
                await self.wake.ledger.wait(5.0)

    # ------------------------------------------------------------------ status

    def status(self) -> dict:
        counts = self.spool.counts()
        gate: dict | str
        if self.gate is None:
            gate = "off (no validators in the run)"
        else:
            gate = {"live_validators": len(self.live_validators()), "validators": len(self.validators),
                    **self.gate.status(), "verdicts": dict(self.figures.verdicts)}
        now = self.clock()
        running = now - self.stepping_since if self.stepping_since is not None else None
        last = self.progress.last_step()
        per_min = self.progress.steps_per_minute(now)
        return {
            "step": self.step,
            "version": self.step,
            # The run's policy term and off-policy bound ([grpo]); the last step's figures are in last_step.
            "loss": self.cfg.loss,
            "max_off_policy_steps": self.cfg.off_policy_bound(),
            # Liveness at a glance (issue 39): wall time of the last step this process made, seconds
            # since it (or since start), steps per minute over the last ten, and why it is stalled
            # ("" while it steps; node/trainer/progress.py).
            "last_step_at": None if last is None else round(self.wall_clock() - (now - last), 3),
            "seconds_since_step": round(self.progress.seconds_since_step(now), 1),
            "steps_per_min": None if per_min is None else round(per_min, 3),
            "stalled": self.stall(),
            "published": self.published,
            "publish_error": self.figures.publish_error,
            "device": self.policy.device,
            "intake": dict(self.figures.intake),
            "banned": sum(SOURCE in b for b in self.node.peers.table.bans(self.clock()).values()),
            "batches": {
                "gated": counts.get(BatchState.GATED.value, 0),
                "ready": counts.get(BatchState.READY.value, 0),
                "trained": counts.get(BatchState.TRAINED.value, 0),
                "rejected": counts.get(BatchState.REJECTED.value, 0),
                "no_signal": self.figures.no_signal_batches,
            },
            "samples_in_hand": [self.figures.samples_in_hand, self.cfg.min_batch_samples],
            "dropped_steps": self.figures.dropped_steps,
            "quota": self.quota.status(),
            "rejected_by_reason": self.spool.rejected_by_reason(),
            "gate": gate,
            "reward": reward_points(self.figures.reward_curve, STATUS_STEPS),
            "eval": self.evals.status(),  # held-out scores by version (node/trainer/evaluation.py)
            "last_step": self.figures.last_step,
            "mismatch_by_engine": self.mismatch.status(),  # over each engine's last 20 measured steps
            "idle_fraction": idle_fraction(self.figures.idle_s, self.figures.busy_s, running),
            "step_time_s": {"wait": round(self.figures.idle_s, 2), **{k: round(v, 2) for k, v in self.phases.totals.items()}},
            "phases_s": self.phases.status(),
            "step_batches": self.figures.step_batches,
            "sample_outcomes": dict(self.figures.sample_outcomes),
            "sample_life_s": self.figures.sample_life(),
            "pacing": self.pacer.status(self.spool.pending(), self.clock()),
        }


def verdict_mismatch(verdict, row: SpooledBatch | None, *, gated: bool) -> str:
    """Why a checked verdict applies to no batch awaiting one ("" when it does)."""
    if row is None:
        return "unknown-batch"
    if row.worker != verdict.worker:
        return "wrong-worker"
    if row.state is not BatchState.GATED or not gated:
        return "already-decided"
    return ""


async def serve_trainer(node, sections: TrainerSections, shards: ShardsAPI, membership: MembershipAPI,
                        ledger: LedgerAPI, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run the trainer role's service until cancelled (see the module docstring); hands back the
    :class:`Trainer` once it takes batches. ``sections`` are the run's tables it reads."""
    if node.peer_id not in node.run.trainers:
        log.error("trainer: this node (%s) is not in run.trainers: peers will refuse its checkpoints; "
                  "add its peer id to the run file", node.peer_id)
    cfg, tcfg = sections.grpo, sections.trainer
    root = Path(node.data_dir) / "trainer"
    policy, created = await trio.to_thread.run_sync(open_policy, root, node.run.model, cfg, tcfg)
    with open_spool(root / "spool.sqlite") as spool, contextlib.closing(policy):
        returned = await trio.to_thread.run_sync(spool.recover, policy.step)
        if returned:
            log.warning("trainer: %d batches of an unsaved step go back to the queue", returned)
        trainer = Trainer(node, policy, spool, sections, shards=shards, membership=membership, ledger=ledger)
        if trainer.gate is not None:
            for row in spool.in_state(BatchState.GATED):
                trainer.gate.add(row.batch_id, row.policy_version, trainer._expiry(row.policy_version, row.accepted_step))
        if shards.path_of(policy.step) is None:
            # Not held, or held but not yet re-checked since start (node/shards/service.py): seeded
            # again from our own folder, checked finite; its ledger entry exists if it was published.
            await trainer.publish(policy.step, ledger=policy.step not in shards.announced)
        else:
            trainer.published = policy.step
        node.host.set_handler(ROLLOUTS_PROTOCOL, trainer.rollouts_handler())  # replaces "not-ready" (readiness.py)
        node.host.set_handler(VERDICTS_PROTOCOL, trainer.verdicts_handler())
        node.status["trainer"] = trainer.status
        log.info("trainer: %s at step %d on %s", "created the policy" if created else "resumed", policy.step,
                 policy.device)
        try:
            async with trio.open_nursery() as nursery:
                trainer._nursery = nursery
                nursery.start_soon(trainer.train_loop)
                nursery.start_soon(trainer.ledger_loop)
                nursery.start_soon(trainer.watch_loop)
                if tcfg.eval_every > 0:
                    nursery.start_soon(trainer.eval_loop)
                if trainer.gate is not None:
                    nursery.start_soon(trainer.gate_loop)
                task_status.started(trainer)
        finally:
            await trainer.db.stop()  # handler tasks may be spooling a batch: the spool closes after

