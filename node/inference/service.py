"""The inference service: turn CPU/GPU time into signed, proven rollout batches for the trainers.

How this works (DESIGN.md, the loop, step 3). :func:`serve_inference` runs three tasks in a nursery:

* **follow**: the shards service tells it of each newer complete checkpoint version
  (``shards.wait_newer``; it downloads every version the trainer announces) and it loads that
  into the engine — the first one with a full load, later ones by swapping weights in place,
  between two steps, never during one (a lock is held around every step and every swap);
* **generate**: once a version is loaded, runs one step after another in a worker thread
  (``trio.to_thread``: the node keeps answering probes, gossip and shard requests meanwhile):
  draw, sample, score, prove, sign (node/inference/generate.py), then queues the batch in the
  :class:`~node.inference.outbox.Outbox`. When the outbox is full (no trainer reachable) it waits:
  generation runs ahead of delivery by at most ``[worker] max_pending_batches`` batches;
* **submit**: hands each queued batch to an alive trainer of the run over ``/swarm/rollouts/1.0.0``
  and feeds the result (ack, refusal, failure) back to the outbox, which retries elsewhere with
  backoff and drops batches that became too old to train on (``[grpo] async_level``).

After steps and deliveries the node advertises its measured capacity (tokens/s) and load (queued
batches) in its membership record, republished only on a noticeable change and at most every
``ADVERTISE_MIN_INTERVAL_S``. Generation also pauses while the loaded version is too old for the
trainer's step (known from announcements and acks): such batches would only be refused.

The draw step counter is persisted in the data dir (write-then-rename) before each step, so a
restarted node never reuses a step: trainers refuse a second batch for the same (worker, step).
Steps are consecutive, so they stay inside the step window trainers and validators enforce
(node/rollouts/steps.py: a restart skips at most the lost outbox, well inside it). Batches lost
otherwise (dropped as stale, undeliverable) leave gaps too; so the generator does not draw a step
that could land past a trainer's window while a batch is still outstanding (issue 39: ``step_hold``
in node/inference/outbox.py), and says so in its status (``step_window.held``) and log.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from ..atomic import write_atomic
from ..context import NodeContext
from ..gossip.api import MembershipAPI
from ..net.failure import FailureKind
from ..rollouts.schema import ROLLOUTS_PROTOCOL
from ..rollouts.steps import step_window_size
from ..shards.api import ShardsAPI
from ..steptime import PhaseTimes
from .config import InferenceSections
from .outbox import BatchState, Outbox, Pending, alive_trainers
from .submit import SubmitFailure, call_submit

log = logging.getLogger(__name__)

STEP_FILE = "inference-step"  # next draw step, persisted before a step starts
COUNTED_FILE = "inference-step-counted"  # the outbox's counted_step (step headroom), persisted with it
TRAINER_RECHECK_S = 1.0  # how often the submit loop looks for trainers when none is usable
RATE_SMOOTHING = 0.3  # weight of the newest step in the tokens/s moving average
ADVERTISE_CHANGE = 0.25  # republish capacity when it moved by more than this fraction
ADVERTISE_MIN_INTERVAL_S = 10.0  # at most one record change per this many seconds (gossip cost)
STEP_ERROR_PAUSE_S = 2.0  # pause after a failed step (a bug or a bad checkpoint) before trying again
STEP_WRITE_RETRY_S = 5.0  # a step not written to disk (disk full) is not generated: tried again after this


def advertise_due(old: tuple[float, float], new: tuple[float, float], since_last: float) -> bool:
    """Whether a (capacity, load) change is worth a new signed membership record.

    Records are gossiped to the whole swarm, so: the first capacity figure goes out at once; later
    ones only when capacity moved by more than ``ADVERTISE_CHANGE`` or the load changed, and never
    more often than every ``ADVERTISE_MIN_INTERVAL_S`` (a busy node's queue depth changes every step).
    """
    (old_cap, old_load), (cap, load) = old, new
    if old_cap <= 0:
        return cap > 0
    if since_last < ADVERTISE_MIN_INTERVAL_S:
        return False
    return load != old_load or abs(cap - old_cap) / old_cap > ADVERTISE_CHANGE


def record_seq(membership, peer: str) -> int | None:
    """The sequence number of ``peer``'s member record (None when unknown, or for a stand-in
    membership that keeps no member table): only ``peer`` signs a newer one."""
    member = getattr(getattr(membership, "table", None), "members", {}).get(peer)
    return None if member is None else member.record.seq


def read_step(path: Path, default: int = 0) -> int:
    try:
        return max(0, int(path.read_text().strip()))
    except (OSError, ValueError):
        return default


def write_step(path: Path, step: int) -> None:
    """Atomically persist the next draw step (fsync, then rename over the old file)."""
    write_atomic(path, f"{step}\n".encode())


def honest_generator(**kwargs):
    """The honest :class:`~node.inference.generate.RolloutGenerator`, imported here because it loads
    torch (the service calls its factory in a worker thread)."""
    from .generate import RolloutGenerator

    return RolloutGenerator(**kwargs)


@dataclass(frozen=True)
class Makers:
    """How the service builds its generator and its outbox. The honest ones by default; for
    ``[worker] cheat`` the role (node/roles/inference.py) hands in the cheating ones of
    node/adversary/, which this package never imports (tests/test_architecture.py)."""

    generator: Callable = honest_generator  # (identity, run_name, rl, proofs, inference, worker) -> RolloutGenerator
    outbox: Callable[..., Outbox] = Outbox  # Outbox's own arguments


@dataclass
class Stats:
    steps: int = 0
    step_errors: int = 0
    load_errors: int = 0
    samples: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0  # moving average of completion tokens per second of generation
    proof_overhead: float = 0.0  # proof building time / generation time, last step
    last_mean_reward: float | None = None
    reward_sum: float = 0.0
    swaps: int = 0
    held_back: int = 0  # times the generator was ready for a step and waited (outbox full, weights too old, paced)
    paced_s: float = 0.0  # seconds the generator waited because trainers asked it to (back-pressure)


class InferenceService:
    """The running role, handed back by :func:`serve_inference`: it follows the checkpoints of
    ``shards`` and finds trainers (and advertises its capacity) in ``membership``."""

    def __init__(self, node: NodeContext, sections: InferenceSections, shards: ShardsAPI, membership: MembershipAPI,
                 makers: Makers = Makers(), generator=None) -> None:
        self.node = node
        self.shards = shards
        self.membership = membership
        self.rl = sections.rl
        self.inference_cfg = sections.inference
        self.proofs_cfg = sections.proofs
        self.async_level = sections.grpo.async_level
        self.cfg = sections.worker
        self.generator = generator  # built in run() (loads torch) unless a test gives one
        self.step_file = Path(node.data_dir) / STEP_FILE
        self.next_step = read_step(self.step_file)
        self.counted_file = Path(node.data_dir) / COUNTED_FILE
        counted = read_step(self.counted_file, -1)
        self.counted_written = counted
        self.makers = makers
        self.outbox = makers.outbox(self.cfg.max_pending_batches, max_attempts=self.cfg.max_attempts,
                                    backoff=self.cfg.backoff_s, backoff_max=self.cfg.backoff_max_s,
                                    async_level=self.async_level,
                                    step_window=step_window_size(self.cfg.max_pending_batches),
                                    first_step=self.next_step, counted_step=None if counted < 0 else counted)
        self.step_held = False  # waiting for an ack before the next step (issue 39, step headroom)
        self.step_unwritten: str | None = None  # why the next step could not be persisted (disk full), if so
        self.version: int | None = None  # policy version loaded in the engine
        self.stats = Stats()
        self.phases = PhaseTimes(node.metrics.phase_seconds())  # seconds per batch and per version (node/steptime.py)
        self.outcomes: Counter[str] = Counter()  # "accepted", "refused/<reason>", "dropped/<reason>"
        self.failures: Counter[str] = Counter()  # transport failures by kind (retried)
        self.sample_outcomes: Counter[str] = Counter()  # the same keys as outcomes, counted in samples
        self.sent = 0  # submissions attempted
        # Submissions a trainer answered (ack or refusal: the batch reached it), and when the last was:
        # beside the first ack after a restart, this tells a slow start from a trainer's full queue.
        self.answered = 0
        self.answered_at: float | None = None
        self.engine_lock = trio.Lock()  # held around each step and each weight swap
        self.loaded = trio.Event()
        self.waiting_for_checkpoint = False  # our version is too old for the trainer: not generating
        self._changed = trio.Event()  # outbox changed: a batch queued, or room freed
        self._advertised = (0.0, 0.0)
        self._advertised_at = 0.0
        mt = node.metrics
        self.m_steps = mt.counter("inference_steps_total", "Rollout steps generated")
        self.m_tokens = mt.counter("inference_tokens_total", "Completion tokens generated")
        self.m_batches = mt.counter("inference_batches_total", "Rollout batches by outcome", ["outcome", "reason"])
        self.m_rate = mt.gauge("inference_tokens_per_second", "Generation throughput (moving average)")
        self.m_queue = mt.gauge("inference_outbox_batches", "Signed batches waiting for a trainer")
        self.m_version = mt.gauge("inference_policy_version", "Checkpoint version loaded in the engine")

    # -- service -------------------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self.generator is None:
            self.generator = await trio.to_thread.run_sync(self._make_generator)
        self.node.status["inference"] = self.status
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_loop)
            nursery.start_soon(self._generate_loop)
            nursery.start_soon(self._submit_loop)
            task_status.started(self)

    def _make_generator(self):
        return self.makers.generator(identity=self.node.identity, run_name=self.node.run.name, rl=self.rl,
                              proofs=self.proofs_cfg, inference=self.inference_cfg, worker=self.cfg)

    # -- follow checkpoints ----------------------------------------------------------------------

    async def _follow_loop(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_announced)
            nursery.start_soon(self._follow_complete)

    async def _follow_announced(self) -> None:
        while True:
            # The newest announced version is the trainer's step even before it is downloaded here:
            # batches now too old for it are dropped instead of sent (INTELLECT-2's async level).
            announced = await self.shards.wait_announced(self.outbox.newest_version)
            for p in self.outbox.observe_version(announced):
                self._count("dropped", "stale", p.num_samples)
            self._notify()

    async def _follow_complete(self) -> None:
        tried: int | None = None  # newest version we loaded or failed to load
        while True:
            latest = await self.shards.wait_newer(tried)
            tried = latest  # a checkpoint we cannot load is not retried; the next one is
            path = self.shards.path_of(latest)
            if path is not None:
                await self._load(latest, path)

    async def _load(self, version: int, path: Path) -> bool:
        async with self.engine_lock:
            started = trio.current_time()
            try:
                how = await trio.to_thread.run_sync(self.generator.follow, path, abandon_on_cancel=True)
            except Exception as e:  # noqa: BLE001 — a checkpoint we cannot load: keep the current weights
                self.stats.load_errors += 1
                log.error("inference: cannot load checkpoint v%d from %s: %s", version, path, e)
                return False
            if self.version is not None:  # the first load is start-up (imports, allocation), not a version's cost
                self.phases.add("load", trio.current_time() - started)
        first = self.version is None
        self.version = version
        self.stats.swaps += 0 if first else 1
        self.m_version.set(version)
        log.info("inference: %s v%d", "loaded" if first else f"{how} to", version)
        self.loaded.set()
        for p in self.outbox.observe_version(version):
            self._count("dropped", "stale", p.num_samples)
        self._notify()
        return True

    # -- generate ----------------------------------------------------------------------------------

    async def _generate_loop(self) -> None:
        await self.loaded.wait()
        while True:
            while self.outbox.full:
                self.stats.held_back += 1
                await self._wait_changed()
            now = trio.current_time()
            hold = self.outbox.generation_hold(self.trainers(), now)
            if hold > now:
                # Back-pressure (node/trainer/pacing.py): every trainer asked us to wait; a batch made
                # now would queue behind work the trainer cannot absorb yet and age there.
                self.stats.held_back += 1
                with trio.move_on_at(hold):
                    await self._wait_changed()
                self.stats.paced_s += trio.current_time() - now
                continue
            if self.outbox.too_old_to_start(self.version):
                # The trainer moved (nearly) async_level steps past our weights (the download is
                # behind): anything generated now would be refused. Wait for the newer version.
                self.waiting_for_checkpoint = True
                while self.outbox.too_old_to_start(self.version):
                    self.stats.held_back += 1
                    # Its announcement may have been lost (issue 45's soak): shards asks a peer if none comes.
                    self.shards.want_version(self.outbox.oldest_to_start())
                    await self._wait_changed()  # a load or a newer step seen notifies
                self.waiting_for_checkpoint = False
            if self.outbox.step_hold(self.next_step):
                # Lost batches left a gap: one more step could land past the trainers' step window
                # (refused ``step-ahead``). Wait until an outstanding batch is answered.
                self.stats.held_back += 1
                if not self.step_held:
                    log.info("inference: holding step %d until a trainer answers a queued batch (it has counted "
                             "our steps up to %d; its window is %d)", self.next_step, self.outbox.counted_step,
                             self.outbox.step_window)
                self.step_held = True
                await self._wait_changed()
                continue
            self.step_held = False
            step = self.next_step
            try:
                await trio.to_thread.run_sync(self._persist_steps, step + 1, self.outbox.counted_step)
            except OSError as e:
                # Generated without being on disk, the step could be drawn again after a restart (a
                # replay the trainer refuses). A full disk (bench/soak.py's disk-full event ended the
                # node here) is waited out instead.
                if self.step_unwritten is None:
                    log.warning("inference: step %d not generated: cannot write %s (%s); trying again every %.0f s",
                                step, self.step_file, e.strerror or e, STEP_WRITE_RETRY_S)
                self.step_unwritten = str(e.strerror or e)
                await trio.sleep(STEP_WRITE_RETRY_S)
                continue
            if self.step_unwritten is not None:
                log.info("inference: the step file is written again; generating")
                self.step_unwritten = None
            self.next_step = step + 1
            async with self.engine_lock:
                version = self.version
                root = self.policy_root(version)
                created_ms = int(time.time() * 1000)  # edge of the system: a wall-clock stamp for people
                started = trio.current_time()
                try:
                    # Abandoned on cancel: a long step must not hold up shutdown (the process is exiting).
                    result = await trio.to_thread.run_sync(self.generator.run_step, step, version, created_ms, root,
                                                           abandon_on_cancel=True)
                except Exception:
                    self.stats.step_errors += 1
                    log.exception("inference: step %d failed", step)
                    result = None
            if result is None:
                await trio.sleep(STEP_ERROR_PAUSE_S)
                continue
            self._record_step(result, trio.current_time() - started)
            await self._queue(result)
            self._advertise()

    def _persist_steps(self, next_step: int, counted: int) -> None:
        """Before a step: the next step (never reused) and, when it moved, how far the trainers
        counted our steps (a restart must keep its step headroom, node/inference/outbox.py)."""
        write_step(self.step_file, next_step)
        if counted != self.counted_written and counted >= 0:
            write_step(self.counted_file, counted)
            self.counted_written = counted

    def policy_root(self, version: int) -> bytes:
        """The manifest root of ``version``: a draw input (node/rl/spec.py ``step_key``). Every version
        we loaded came through the shards service, which noted its signed manifest's root."""
        announced = self.shards.announced.get(version)
        if announced is None:  # our bug: a loaded version the shards service does not know
            raise RuntimeError(f"no manifest root known for loaded v{version}")
        return announced[0]

    def _record_step(self, r, seconds: float) -> None:
        """Count one step of ``seconds`` wall time (what its generate, score and proof phases left is
        the draw, the batch's assembly and its signature)."""
        st = self.stats
        st.steps += 1
        st.samples += r.samples
        st.tokens += r.completion_tokens
        rate = r.completion_tokens / r.generate_s if r.generate_s > 0 else 0.0
        st.tokens_per_s = rate if st.steps == 1 else (1 - RATE_SMOOTHING) * st.tokens_per_s + RATE_SMOOTHING * rate
        st.proof_overhead = r.proof_s / r.generate_s if r.generate_s > 0 else 0.0
        st.last_mean_reward = r.mean_true_reward
        st.reward_sum += r.mean_true_reward
        for phase, s in (("generate", r.generate_s), ("score", r.score_s), ("proofs", r.proof_s)):
            self.phases.add(phase, s)
        self.phases.add("assemble", seconds - r.generate_s - r.score_s - r.proof_s)
        self.m_steps.inc()
        self.m_tokens.inc(r.completion_tokens)
        self.m_rate.set(st.tokens_per_s)

    async def _queue(self, r) -> None:
        sealed = r.sealed
        if sealed is None:
            self._count("dropped", "oversized", r.samples)
            log.error("inference: step %d does not fit one frame and is not sent (a batch must hold every drawn "
                      "prompt); lower [rl] prompts_per_batch or max_new_tokens", r.step)
            return
        if self.outbox.drops_stale(r.step, r.policy_version):
            self._count("dropped", "stale", r.samples)  # a newer version arrived while we generated
            return
        while not self.outbox.offer(self._pending(sealed, r.policy_version, r.step)):
            await self._wait_changed()  # full: wait for a delivery or a drop
        self._notify()

    def _pending(self, sealed, version: int, step: int) -> Pending:
        return Pending(batch_id=sealed.batch_id, envelope=sealed.envelope, policy_version=version,
                       num_samples=len(sealed.batch.samples), created_at=trio.current_time(), step=step)

    # -- submit --------------------------------------------------------------------------------------

    def trainers(self) -> list[str]:
        members = self.membership.members()
        return alive_trainers(members, self.node.run.trainers, self.node.peer_id)

    async def _submit_loop(self) -> None:
        while True:
            now = trio.current_time()
            trainers = self.trainers()
            for trainer in trainers:  # a restarted trainer's new record ends the back-off of its old life
                seq = record_seq(self.membership, trainer)
                if seq is not None:
                    self.outbox.on_record(trainer, seq)
            got = self.outbox.take(trainers, now)
            if got is None:
                wake = min(self.outbox.next_wakeup(trainers, now), now + TRAINER_RECHECK_S)
                with trio.move_on_at(wake):
                    await self._wait_changed()
                continue
            item, trainer = got
            self.sent += 1
            try:
                await self._connect(trainer)
                ack = await call_submit(self.node.host, trainer, item.batch_id, item.envelope, self.cfg.submit_timeout_s)
            except SubmitFailure as e:
                self.failures[e.kind.value] += 1
                if e.kind is FailureKind.GARBAGE:  # the trainer's fault, not the network's: count it
                    self.node.metrics.reject(ROLLOUTS_PROTOCOL, "bad-ack")
                log.info("inference: batch %s to %s: %s", item.batch_id.hex()[:12], trainer[-8:], e)
                outcome = self.outbox.on_failure(item.batch_id, trainer, e.kind, trio.current_time())
            else:
                self.answered += 1
                self.answered_at = trio.current_time()
                outcome = self.outbox.on_ack(item.batch_id, trainer, ack, trio.current_time())
            if outcome.state is not BatchState.QUEUED:
                self._count(outcome.state.value, outcome.reason, item.num_samples)
            self._notify()
            self._advertise()

    async def _connect(self, trainer: str) -> None:
        """Dial the trainer if we have no connection (membership knows its addresses)."""
        host = self.node.host
        if host.is_connected(trainer):
            return
        addrs = self.membership.addrs_of(trainer)
        try:
            with trio.fail_after(self.cfg.submit_timeout_s):
                await host.connect_peer(trainer, addrs)
        except Exception as e:  # noqa: BLE001 — TooSlowError or any dial error (trio.Cancelled is not an Exception)
            raise SubmitFailure(FailureKind.UNREACHABLE, f"dial: {type(e).__name__}") from None

    # -- bookkeeping ---------------------------------------------------------------------------------

    def _count(self, state: str, reason: str, samples: int = 0) -> None:
        key = "accepted" if state == "accepted" else f"{state}/{reason}"
        self.outcomes[key] += 1
        self.sample_outcomes[key] += samples
        self.m_batches.labels(outcome=state, reason=reason).inc()
        self.m_queue.set(len(self.outbox))

    def _notify(self) -> None:
        self.m_queue.set(len(self.outbox))
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_changed(self) -> None:
        await self._changed.wait()

    def _advertise(self) -> None:
        new = (round(self.stats.tokens_per_s, 1), float(len(self.outbox)))
        now = trio.current_time()
        if advertise_due(self._advertised, new, now - self._advertised_at):
            self._advertised, self._advertised_at = new, now
            self.membership.update(capacity=new[0], load=new[1])

    def status(self) -> dict:
        st = self.stats
        refused = {k.split("/", 1)[1]: v for k, v in self.outcomes.items() if k.startswith("refused/")}
        dropped = {k.split("/", 1)[1]: v for k, v in self.outcomes.items() if k.startswith("dropped/")}
        return {
            "policy_version": self.version,
            "steps": st.steps,
            "next_step": self.next_step,
            "step_unwritten": self.step_unwritten,  # why no step is generated now (its step file cannot be written)
            "step_window": {"counted": self.outbox.counted_step, "held": self.step_held,
                      "step_ahead_refusals": self.outbox.step_ahead_refusals},
            "samples": st.samples,
            "tokens": st.tokens,
            "tokens_per_s": round(st.tokens_per_s, 1),
            "proof_overhead": round(st.proof_overhead, 4),
            "phases_s": self.phases.status(),
            "mean_reward": None if st.last_mean_reward is None else round(st.last_mean_reward, 4),
            "mean_reward_all": round(st.reward_sum / st.steps, 4) if st.steps else None,
            "batches": {
                "queued": len(self.outbox),
                "sent": self.sent,
                "answered": self.answered,
                "since_answered_s": (None if self.answered_at is None
                                     else round(trio.current_time() - self.answered_at, 1)),
                "accepted": self.outcomes.get("accepted", 0),
                "refused": refused,
                "dropped": dropped,
                "transport_failures": dict(self.failures),
            },
            "sample_outcomes": dict(self.sample_outcomes),
            "paced_s": round(st.paced_s, 2),
            "trainers_alive": len(self.trainers()),
            "weight_swaps": st.swaps,
            "waiting_for_checkpoint": self.waiting_for_checkpoint,
            "errors": {"step": st.step_errors, "load": st.load_errors},
            "cheat": self.cfg.cheat or None,
            "engine": self.generator.engine.name if self.generator is not None else None,
        }


async def serve_inference(node: NodeContext, sections: InferenceSections, shards: ShardsAPI, membership: MembershipAPI,
                          makers: Makers = Makers(), *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run the inference role until cancelled (see the module docstring); hands back the
    :class:`InferenceService` once it runs. ``sections`` are the run's tables it reads; ``makers``
    builds its generator and outbox."""
    await InferenceService(node, sections, shards, membership, makers).run(task_status=task_status)
