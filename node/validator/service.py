"""The validator service: batches in from trainers, checks, signed verdicts out, ledger entries.

How this works (DESIGN.md "The loop" step 4; the trainer side is node/trainer/gate.py):

* **Intake** (``/swarm/verify/1.0.0``, :meth:`ValidatorService.verify_handler`): a trainer of the run
  sends one frame holding a worker's signed batch envelope and gets one RolloutAck back:
  ``accepted`` = queued (or already judged: its verdict is sent again), ``reason="busy"`` when the
  bounded queue is full, so the trainer hands the batch to its next-ranked validator
  (node/validator/assign.py) instead of waiting on us. Batches come from trainers, not straight
  from workers, because the trainer already spooled them durably: a validator that dies loses
  nothing, the trainer re-assigns after its timeout, and workers need not know the validators.
  A batch whose checkpoint we do not hold is refused at once with ``reason="no-checkpoint"`` (and
  its fetch started): "cannot judge yet", no blame on anyone, so it does not wait in our queue for
  a download while the trainer's slot on us is held (issue 15). A version never announced to us
  (gossip lost it) is asked of a peer after one re-announcement period (``want_version``,
  node/shards/catchup.py) instead of waited for (issue 45).
* **Checking** (one batch at a time, in a worker thread so the node keeps answering probes): the
  batch's checkpoint is loaded from disk (the last ``keep_models`` versions stay loaded), then
  node/validator/pipeline.py judges it against the replay store, the worker's step window
  (node/rollouts/steps.py: a step used twice or from below the window; step-ahead is the trainer's
  to judge, "Who judges what") and the manifest root announced for the batch's version (the draw
  is keyed by it).
* **Cannot judge** (the checkpoint was pruned from our disk while the batch waited, or never came):
  a signed verdict of the ``unjudged`` kind goes to the trainer at once, and a fetch of the version
  starts; never a wait for the download in the check slot, which held every batch behind it for
  120 s (the old ``checkpoint_timeout``) and, for a version no peer held any more, for nothing
  (issue 39). It is neither stored nor in the ledger (it judges nothing, and the batch may be
  judged later, here or elsewhere).
* **Verdict**: signed (domain ``verdict``), stored with the batch's task slots in one SQLite
  transaction (node/validator/store.py), appended to the ledger as a ``verdict`` entry, and, for a
  rejected batch, a ``penalty`` entry (and a ban past the threshold, node/validator/policy.py).
* **Delivery** (``/swarm/verdicts/1.0.0``, a stream we open to the trainer): verdicts are sent until
  the trainer acknowledges them; undelivered ones survive a restart in the store and are re-sent.

When behind (queue full) we say so: ``behind`` in ``swarm-node status``, the queue-depth gauge and
the ``busy`` counter, and the trainer gets "busy" instead of a silent drop.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import trio

from ..dbthread import DbThread
from ..hashes import digest
from ..ledger.api import LedgerAPI, LedgerError
from ..ledger.entries import MAX_VERDICT_REASONS, Penalty
from ..ledger.entries import Verdict as LedgerVerdict
from ..net.reqres import CallFailure, FailureKind, open_call
from ..proofs.margins import ProofMargins
from ..refusals import Refusal
from ..rollouts.protocols import VERDICTS, VERIFY
from ..rollouts.schema import (
    DOMAIN_VERDICT,
    UNJUDGED_NO_CHECKPOINT,
    VERDICTS_PROTOCOL,
    VERIFY_PROTOCOL,
    RolloutAck,
    SignedBatch,
    Verdict,
)
from ..rollouts.quota import QuotaBook, accepted_batches, validator_scale
from ..rollouts.steps import VALIDATOR_WINDOW
from ..shards.api import ShardsAPI
from ..steptime import PhaseTimes
from ..wire import (
    MAX_FRAME,
    Envelope,
    RemoteProtocolError,
    decode_as,
    encode,
    seal,
)
from .config import ValidatorSections
from .pipeline import (
    BatchReason,
    BatchRules,
    CheckModel,
    Judgement,
    TaskSet,
    check_batch_rules,
    judge_batch,
    parse_batch,
    reject,
)
from .policy import PenaltyBook
from .store import DB_FILE, ValidatorStore

log = logging.getLogger("node.validator")

SOURCE = "validator"  # metrics label of rejections counted here
ZERO_ID = bytes(32)
DELIVER_PER_STREAM = 64  # verdict frames sent on one delivery stream before it is closed
BEHIND_FRACTION = 0.8  # queue fill at which status says "behind"
LEDGER_STEP_MAX = 2**32  # the ledger's verdict body bounds the step
FUTURE_GRACE = 5.0  # seconds to wait for the announcement of a version newer than any we know
# Window refusals (and bans) that are no fault of the worker leave its step window as it was (their
# verdict spellings, node/refusals.py). A step another batch used (duplicate-step) is a replay of its
# draw, ``replayed`` as the slots table says whether it still remembers it or not: the step stays used.
KEEPS_WINDOW = frozenset(r.verdict for r in Refusal if r.verdict and r.keeps_window and not r.fault)


@dataclass
class Job:
    """A batch waiting to be checked, and the trainer that sent it."""

    trainer: str
    signed: SignedBatch
    received_at: float


def batch_rules(run_name: str, sections: ValidatorSections) -> BatchRules:
    """The run's sampling, task and proof parameters every batch must carry."""
    rl, grpo, inference, cfg = sections.rl, sections.grpo, sections.inference, sections.validator
    return BatchRules(
        run=run_name, taskset=rl.taskset, temperature=rl.temperature, top_p=rl.top_p,
        max_new_tokens=rl.max_new_tokens, group_size=rl.group_size, prompts_per_batch=rl.prompts_per_batch,
        # The trainer judged staleness at intake and keeps an acknowledged batch trainable for
        # verify_grace_steps more steps, within max_off_policy_steps (node/trainer/intake.py): only a
        # batch older than that bound can no longer be trained, and only that one is refused here
        # (benign, no penalty), still before any prefill is spent on it.
        async_level=grpo.off_policy_bound(), proofs=sections.proofs,
        sampling_tolerance=cfg.sampling_tolerance, check_sampling=cfg.check_sampling, check_seed=cfg.check_seed,
        engines=inference.accepted_engines(), replay_engines=inference.replayed_engines(),
        dtype=None if inference.dtype == "auto" else inference.dtype, score_budget_s=cfg.score_budget_s,
    )


def _dtype(name: str):
    import torch

    return {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class ValidatorService:
    """Everything the validator does, handed back by :func:`serve_validator`. Checkpoints come from
    ``shards``; verdicts and penalties go to ``ledger``."""

    def __init__(self, node, sections: ValidatorSections, rules: BatchRules, tasks: TaskSet, store: ValidatorStore, *,
                 shards: ShardsAPI, ledger: LedgerAPI, wall_clock=time.time) -> None:
        self.node = node
        self.shards = shards
        self.ledger = ledger
        self.sections = sections
        self.cfg = cfg = sections.validator
        self.rules = rules
        self.tasks = tasks
        self.store = store  # queried here on its WAL reader; written only through self.db
        self.db = DbThread()  # the store's writes, off the event loop (node/dbthread.py)
        self.wall_clock = wall_clock
        run = node.config.run
        self.trainers = set(run.trainers)
        self.is_validator = node.peer_id in set(run.validators)
        # Step-ahead is the trainers' to judge; ours is the wide window below (node/rollouts/steps.py "Who judges what").
        self.step_window = VALIDATOR_WINDOW
        self.book = PenaltyBook(cfg)
        # The trainers' intake quota for fresh identities, scaled up: a backstop (node/rollouts/quota.py).
        self.quota = QuotaBook(sections.quota, validator_scale(len(self.trainers)))
        self.samples_per_batch = rules.prompts_per_batch * rules.group_size
        for peer, until, reason in store.bans(wall_clock()):
            self.book.apply_ban(peer, reason, until)
        self._send, self._recv = trio.open_memory_channel[Job](cfg.queue_size)
        self.queued: set[bytes] = set()
        self.checking: bytes | None = None
        self.models: OrderedDict[int, CheckModel] = OrderedDict()
        self.pending: dict[str, OrderedDict[bytes, bytes]] = collections.defaultdict(OrderedDict)  # trainer -> id -> verdict
        self._pending_changed = trio.Event()
        self.results: collections.Counter = collections.Counter()  # accepted / rejected / busy / dropped
        self.reasons: collections.Counter = collections.Counter()  # sample reason -> count
        self.margins = ProofMargins()  # how close accepted work comes to the proof thresholds
        self.tokens_checked = 0
        self.check_seconds = 0.0  # time spent judging batches (model work included)
        self.phases = PhaseTimes(node.metrics.phase_seconds())  # verify and rescore per batch, load per version (node/steptime.py)
        self.first_job_at: float | None = None  # wall time the first batch arrived (utilisation)
        m = node.metrics
        self.m_queue = m.gauge("validator_queue_depth", "Batches waiting to be checked")
        self.m_busy = m.counter("validator_busy_total", "Batches refused because the check queue was full")
        self.m_verdicts = m.counter("validator_verdicts_total", "Verdicts signed", ["result"])
        self.m_seconds = m.histogram("validator_check_seconds", "Time to check one batch (model work included)")
        self.m_tokens = m.counter("validator_tokens_total", "Completion tokens checked")
        for trainer, batch_id, verdict in ((t, b, v) for b, t, v in store.undelivered(cfg.max_pending_verdicts)):
            self.pending[trainer][batch_id] = verdict

    # ------------------------------------------------------------------ intake

    def verify_handler(self):
        """``/swarm/verify/1.0.0``: one signed batch from a trainer, one RolloutAck back."""
        return VERIFY.handler(self._answer_verify, admit=self._admit_verify, streams=self.sections.streams,
                              peers=self.node.peers, metrics=self.node.metrics)

    def _admit_verify(self, peer: str) -> str | None:
        return None if peer in self.trainers else "not-trainer"

    async def _answer_verify(self, peer: str, data: bytes) -> RolloutAck:
        batch_id, ok, reason = self.submit(peer, data, trio.current_time())
        return RolloutAck(batch_id=batch_id, accepted=ok, reason=reason)

    def submit(self, trainer: str, data: bytes, now: float) -> tuple[bytes, bool, str]:
        """Queue a batch from ``trainer``: (batch id, accepted, reason when refused)."""
        parsed = parse_batch(data, self.rules.run)
        if not isinstance(parsed, SignedBatch):
            # The trainer checks signatures at intake, so this is the trainer's fault, not a worker's.
            code = parsed.reason.value
            self.node.metrics.reject(VERIFY_PROTOCOL, code)
            return _payload_id(data), False, code
        batch_id = parsed.batch_id
        stored = self.store.verdict_of(batch_id)
        if stored is not None:  # judged before: send the same verdict to whoever asks now
            self._queue_delivery(trainer, batch_id, stored[1])
            return batch_id, True, ""
        if batch_id in self.queued or batch_id == self.checking:
            return batch_id, True, ""
        if not self.holds_checkpoint(parsed.batch.policy_version):
            # "Cannot judge yet", said at once: the batch would otherwise wait in our queue for a
            # download and hold the trainer's slot on us until its verify timeout (issue 15). No
            # blame on anyone; the trainer tries another validator, or us again a little later.
            self.want_checkpoint(parsed.batch.policy_version)
            self.results[UNJUDGED_NO_CHECKPOINT] += 1
            return batch_id, False, UNJUDGED_NO_CHECKPOINT
        worker = parsed.batch.worker
        history = accepted_batches(self.ledger.accepted_samples(worker), self.samples_per_batch)
        refusal = self.quota.check(worker, history, now)
        if refusal is not None:  # "not now" to the trainer, which keeps the batch and tries again
            self.results[refusal.reason] += 1
            self.node.metrics.reject(VERIFY_PROTOCOL, refusal.reason)
            return batch_id, False, refusal.reason
        try:
            self._send.send_nowait(Job(trainer, parsed, now))
        except trio.WouldBlock:
            self.results["busy"] += 1
            self.m_busy.inc()
            return batch_id, False, "busy"
        self.quota.take(worker, history, now)
        self.queued.add(batch_id)
        if self.first_job_at is None:
            self.first_job_at = self.wall_clock()
        self.m_queue.set(len(self.queued))
        return batch_id, True, ""

    # ------------------------------------------------------------------ checking

    def holds_checkpoint(self, version: int) -> bool:
        """True if ``version``'s checkpoint is loaded or on our disk (a check needs no download)."""
        return version in self.models or self.shards.path_of(version) is not None

    def want_checkpoint(self, version: int) -> None:
        """Start fetching ``version`` if it was announced (a validator needs old versions too); if it
        was not, the announcement may have been lost (issue 45's soak: none reached any node for two
        minutes), so the shards service is told the version exists and asks a peer, a trainer
        first, for that version's manifest when none comes within a re-announcement period.

        The claim is a worker's, but only trainers send us batches and they refuse versions newer
        than their own step (node/trainer/intake.py ``future``); a made-up far-future claim would
        still cost no more than one request a period, and nothing unverified is fetched: the
        reply must be the manifest of that version, signed by a trainer of the run
        (node/shards/catchup.py), exactly as an announcement must."""
        if self.shards.path_of(version) is not None:
            return
        if version in self.shards.announced:
            self.shards.fetch(version, *self.shards.announced[version])
        else:  # this very version: a newer one known would not judge the batch (issue 45)
            self.shards.want_version(version, exact=True)

    def current_version(self) -> int | None:
        """The newest checkpoint version this node knows of (held or announced)."""
        shards = self.shards
        known = [v for v in (shards.latest(),) if v is not None] + list(shards.announced)
        return max(known) if known else None

    async def check_loop(self) -> None:
        async for job in self._recv:
            self.queued.discard(job.signed.batch_id)
            self.m_queue.set(len(self.queued))
            self.checking = job.signed.batch_id
            try:
                await self.check_one(job)
            finally:
                self.checking = None

    async def check_one(self, job: Job) -> None:
        """Judge one batch, then sign, store, record and queue its verdict."""
        batch = job.signed.batch
        started = trio.current_time()
        judgement = await self.judge(job)
        if isinstance(judgement, str):  # cannot judge it here and now: say so, signed, no blame
            self.results[f"unjudged:{judgement}"] += 1
            unjudged = Verdict(
                run=self.rules.run, batch_id=job.signed.batch_id, worker=batch.worker, validator=self.node.peer_id,
                accepted=False, reasons=[], policy_version=batch.policy_version,
                created_ms=int(self.wall_clock() * 1000), unjudged=judgement,
            )
            # Not stored and not in the ledger: it judges nothing, and a later ask may get a verdict.
            self._queue_delivery(job.trainer, job.signed.batch_id, encode(seal(self.node.identity, DOMAIN_VERDICT, unjudged)))
            return
        elapsed = trio.current_time() - started
        self.check_seconds += elapsed
        self.tokens_checked += judgement.tokens
        self.m_seconds.observe(elapsed)
        self.m_tokens.inc(judgement.tokens)
        verdict = Verdict(
            run=self.rules.run, batch_id=job.signed.batch_id, worker=batch.worker, validator=self.node.peer_id,
            accepted=judgement.accepted, reasons=judgement.reasons, policy_version=batch.policy_version,
            created_ms=int(self.wall_clock() * 1000),
        )
        raw = encode(seal(self.node.identity, DOMAIN_VERDICT, verdict))
        await self.db.run(functools.partial(
            self.store.record, job.signed.batch_id, batch.worker, batch.step, [s.prompt_index for s in batch.samples],
            judgement.accepted, judgement.reasons, job.trainer, raw, verdict.created_ms,
            window=0 if judgement.main_reason() in KEEPS_WINDOW else self.step_window))
        result = "accepted" if judgement.accepted else "rejected"
        if judgement.accepted:  # only fully honest batches shape the recommended thresholds
            for chunks in judgement.proofs:
                self.margins.add(chunks, self.rules.proofs.topk)
        self.results[result] += 1
        self.m_verdicts.labels(result=result).inc()
        for r in judgement.reasons:
            if r != "ok":
                self.reasons[r] += 1
                self.node.metrics.reject(SOURCE, r)
        self._queue_delivery(job.trainer, job.signed.batch_id, raw)
        log.info("validator: batch %s of %s %s (%s)", job.signed.batch_id.hex()[:12], batch.worker[-8:], result,
                 judgement.main_reason())
        await self.record_in_ledger(job.signed, judgement)

    async def judge(self, job: Job) -> Judgement | str:
        """The batch's judgement, or why it cannot be judged here yet (no checkpoint): the trainer is
        told at once with an ``unjudged`` verdict and moves the batch on (node/trainer/gate.py)."""
        batch = job.signed.batch
        n = len(batch.samples)
        if self.book.is_banned(batch.worker, self.wall_clock()) or self.ledger.ban_of(batch.worker):
            # Our own ban, or one another validator or a trainer recorded in the ledger.
            return Judgement.uniform(n, reject(BatchReason.BANNED, "worker is banned"))
        window = self.store.step_window(batch.worker)
        outside = window.reason(batch.step, self.step_window, ahead=False)
        if outside:
            return Judgement.uniform(n, reject(BatchReason(Refusal(outside).verdict),
                                               f"step {batch.step}: {outside} (highest so far {window.high})"))
        current = self.current_version()
        if current is None or batch.policy_version > current:
            # Maybe the announcement is still on its way (gossip takes ~1 s); a longer wait would let
            # a cheat stall the queue with made-up future versions.
            with trio.move_on_after(FUTURE_GRACE):
                await self.shards.wait_announced(batch.policy_version - 1)
            current = self.current_version()
            if current is None:
                log.info("validator: no checkpoint known yet; batch %s left to another validator",
                         job.signed.batch_id.hex()[:12])
                return UNJUDGED_NO_CHECKPOINT
        announced = self.shards.announced.get(batch.policy_version)
        root = announced[0] if announced is not None else None
        rule = check_batch_rules(batch, self.rules, current, root)
        if not rule:
            return Judgement.uniform(n, rule)
        if root is None:  # a version we cannot know the draw of: we could not fetch it either
            log.info("validator: no manifest root for v%d; batch %s left to another validator",
                     batch.policy_version, job.signed.batch_id.hex()[:12])
            return UNJUDGED_NO_CHECKPOINT
        model = await self.model_for(batch.policy_version)
        if model is None:
            log.info("validator: checkpoint v%d not held here (fetch started); batch %s handed back unjudged",
                     batch.policy_version, job.signed.batch_id.hex()[:12])
            return UNJUDGED_NO_CHECKPOINT
        replayed = self.store.replayed_slots(batch.worker, batch.step, [s.prompt_index for s in batch.samples],
                                             job.signed.batch_id)
        started = trio.current_time()
        judgement = await trio.to_thread.run_sync(
            lambda: judge_batch(batch, self.rules, current_version=current, tasks=self.tasks, model=model,
                                replayed=replayed.__contains__, policy_root=root, clock=time.perf_counter),
            abandon_on_cancel=True,  # a long check must not hold up shutdown
        )
        self.phases.add("verify", trio.current_time() - started - judgement.rescore_s)
        self.phases.add("rescore", judgement.rescore_s)
        return judgement

    async def model_for(self, version: int) -> CheckModel | None:
        """The checkpoint of ``version``, loaded (LRU of ``keep_models``) from our disk; None, with a
        fetch through the shard swarm started, when it is not there (the caller hands the batch back)."""
        if version in self.models:
            self.models.move_to_end(version)
            return self.models[version]
        path = self.shards.path_of(version)
        if path is None:
            self.want_checkpoint(version)
            return None
        started = trio.current_time()
        try:
            model = await trio.to_thread.run_sync(self._load, path, version)
        except (OSError, ValueError, RuntimeError) as e:  # a complete, signed checkpoint that does not load
            log.error("validator: cannot load checkpoint v%d from %s: %s", version, path, e)
            self.results["load-errors"] += 1
            return None
        if self.models:  # the first load is start-up (imports, allocation), not a version's cost
            self.phases.add("load", trio.current_time() - started)
        self.models[version] = model
        while len(self.models) > self.cfg.keep_models:
            self.models.popitem(last=False)
        return model

    def _load(self, path, version: int) -> CheckModel:
        from ..engines.torch_engine import pick_device
        from ..engines.model import load_model, load_tokenizer

        # Prefill in the precision the workers generate in: TOPLOC tells bf16 from fp32 apart (paper §5).
        name = self.cfg.dtype if self.cfg.dtype != "auto" else self.sections.inference.dtype
        model = load_model(path, device=pick_device(self.cfg.device), dtype=_dtype(name))
        return CheckModel(model, load_tokenizer(path), version)

    async def record_in_ledger(self, signed: SignedBatch, judgement: Judgement) -> None:
        """A verdict entry, and a penalty entry (with a ban past the threshold) for a cheat."""
        batch = signed.batch
        now = self.wall_clock()
        decision = self.book.on_verdict(batch.worker, judgement.reasons, now)
        if decision is not None and decision.ban_seconds:
            await self.db.run(self.store.save_ban, batch.worker, now + decision.ban_seconds, decision.reason)
            log.warning("validator: banned %s for %ds (%s)", batch.worker, decision.ban_seconds, decision.reason)
        distinct = sorted(set(judgement.reasons), key=lambda r: (r == "ok", r))[:MAX_VERDICT_REASONS]
        bodies = [LedgerVerdict(worker=batch.worker, step=min(batch.step, LEDGER_STEP_MAX), batch_hash=signed.batch_id,
                                ok=judgement.accepted, reasons=tuple(distinct))]
        if decision is not None:
            bodies.append(Penalty(peer=decision.peer, reason=decision.reason, points=decision.points,
                                  ban_seconds=decision.ban_seconds))
        for body in bodies:
            try:
                await self.ledger.append(body)
            except LedgerError as e:  # e.g. we are not a validator of the run: ours to fix, keep checking
                self.node.metrics.reject(SOURCE, "ledger-refused")
                log.warning("validator: ledger refused a %s entry: %s", body.TYPE, e)

    # ------------------------------------------------------------------ delivery

    def _queue_delivery(self, trainer: str, batch_id: bytes, verdict: bytes) -> None:
        queue = self.pending[trainer]
        queue[batch_id] = verdict
        while len(queue) > self.cfg.max_pending_verdicts:
            queue.popitem(last=False)  # still undelivered in the store: re-sent after a restart
            self.results["delivery-dropped"] += 1
        self._pending_changed.set()

    async def deliver_loop(self) -> None:
        """Hand queued verdicts to their trainers; retry unreachable ones every ``deliver_retry`` seconds."""
        while True:
            self._pending_changed = trio.Event()
            failed = False
            for trainer in [t for t, q in self.pending.items() if q]:
                failed |= not await self.deliver_to(trainer)
            if failed:
                with trio.move_on_after(self.cfg.deliver_retry):
                    await self._pending_changed.wait()
            elif not any(self.pending.values()):
                await self._pending_changed.wait()

    async def deliver_to(self, trainer: str) -> bool:
        """Send up to DELIVER_PER_STREAM verdicts on one stream; True if all were acknowledged."""
        queue = self.pending[trainer]
        items = list(queue.items())[:DELIVER_PER_STREAM]
        try:
            async with open_call(self.node.host, trainer, VERDICTS.protocol, peers=self.node.peers) as caller:
                for batch_id, verdict in items:
                    ack = await caller.ask(verdict, VERDICTS.reply, VERDICTS.timeout)
                    if ack.batch_id != batch_id and ack.batch_id != ZERO_ID:
                        raise caller.garbage("wrong-ack", ack.batch_id.hex()[:12])
                    if not ack.accepted and ack.reason:
                        self.results[f"trainer:{ack.reason}"] += 1
                    # Recorded, or refused for good ("unknown-batch", "already-decided"): either way, done.
                    queue.pop(batch_id, None)
                    await self.db.run(self.store.mark_delivered, batch_id)
            return True
        except CallFailure as e:  # unreachable, silent or gone: keep the rest for the next try
            if e.kind is FailureKind.GARBAGE:
                self.node.metrics.reject(VERDICTS_PROTOCOL, e.reason)
            elif e.kind is FailureKind.UNREACHABLE:
                log.debug("validator: cannot reach trainer %s: %s", trainer[-8:], e)
            return False

    # ------------------------------------------------------------------ status

    def status(self) -> dict:
        now = self.wall_clock()
        depth = len(self.queued)
        return {
            "validator_of_run": self.is_validator,
            "queue": depth,
            "queue_max": self.cfg.queue_size,
            "behind": depth >= BEHIND_FRACTION * self.cfg.queue_size,
            "checking": self.checking.hex()[:12] if self.checking else None,
            "verdicts": dict(self.results),
            "reasons": dict(self.reasons),
            "bans": self.book.bans(now),
            "models_loaded": list(self.models),
            "undelivered": sum(len(q) for q in self.pending.values()),
            "tokens_per_s": round(self.tokens_checked / self.check_seconds, 1) if self.check_seconds else None,
            "check_seconds": round(self.check_seconds, 2),
            "phases_s": self.phases.status(),
            # Share of the time since the first batch arrived spent checking: 1.0 = the bottleneck.
            "utilisation": (round(self.check_seconds / elapsed, 4)
                            if self.first_job_at is not None and (elapsed := now - self.first_job_at) > 0
                            else None),
            "proof_margins": self.margins.status(self.rules.proofs),
        }


def _payload_id(data: bytes) -> bytes:
    """The batch id of an envelope that failed its checks, if it decodes at all (else zeros)."""
    try:
        return digest(decode_as(Envelope, data, MAX_FRAME).payload)
    except RemoteProtocolError:
        return ZERO_ID


async def serve_validator(node, sections: ValidatorSections, shards: ShardsAPI, ledger: LedgerAPI, *,
                          task_status=trio.TASK_STATUS_IGNORED, tasks: TaskSet | None = None) -> None:
    """Run the validator until cancelled (``tasks`` overrides the run's task set, for tests); hands
    back the :class:`ValidatorService` once it takes batches. ``sections`` are the run's tables it reads."""
    rules = batch_rules(node.run.name, sections)
    if tasks is None:
        from .tasks import RunTasks

        tasks = RunTasks(sections.rl)
    store = ValidatorStore(node.data_dir / DB_FILE)
    svc = ValidatorService(node, sections, rules, tasks, store, shards=shards, ledger=ledger)
    if not svc.is_validator:
        log.warning("validator: %s is not in the run's validators; trainers and the ledger will refuse its verdicts",
                    node.peer_id)
    node.status["validator"] = svc.status
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(svc.check_loop)
            nursery.start_soon(svc.deliver_loop)
            node.host.set_handler(VERIFY_PROTOCOL, svc.verify_handler())
            task_status.started(svc)
    finally:
        store.close()
