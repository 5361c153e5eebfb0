"""A restarting trainer is in the member table before its model is loaded (its core, membership
included, starts first). Workers that submit in that gap must be told "not yet, retry in a moment"
rather than fail and back the trainer off exponentially: in issue 45's soak their back-offs reached
8-16 s while the trainer loaded, and they came back up to 16 s after it was ready.

Real nodes on loopback: a relay whose host plays the worker, and a trainer whose model load is held
until the test lets it go."""

from __future__ import annotations

import threading

import trio

from swarmtest import node_config, open_nodes
from waiting import wait_for

from node.config import RunConfig
from node.engines.model import build_tokenizer
from node.identity import Identity, load_or_create_identity
from node.inference.outbox import Outbox, Pending
from node.net.failure import FailureKind
from node.inference.submit import call_submit
from node.roles.core import run_node
from node.rollouts.schema import batch_id_of
from node.trainer import service
from node.trainer.readiness import NOT_READY_RETRY_S, not_ready_ack
from node.trainer.testing import reversal_batch, sign_batch
from node.wire import Envelope, decode_as

RUN = "test"
WORKER = Identity.from_seed(b"r" * 32)


def signed_batch(step: int) -> tuple[bytes, bytes]:
    envelope = sign_batch(WORKER, reversal_batch(WORKER, RUN, step=step, policy_version=0, tokenizer=build_tokenizer()))
    return batch_id_of(decode_as(Envelope, envelope)), envelope


def test_not_ready_answers_the_batch_it_was_sent_and_garbage_with_its_digest():
    batch_id, envelope = signed_batch(0)
    ack = not_ready_ack(envelope)
    assert ack.batch_id == batch_id and not ack.accepted and ack.reason == "not-ready"
    assert ack.retry_after_ms == int(NOT_READY_RETRY_S * 1000) and ack.trainer_step == 0
    junk = not_ready_ack(b"\x00not an envelope")
    assert len(junk.batch_id) == 32 and junk.reason == "not-ready"


async def test_a_loading_trainer_answers_not_ready_and_the_worker_backs_off_no_further(
        tmp_path, fast_membership, monkeypatch):
    release = threading.Event()
    real_open = service.open_policy

    def held_open(*args, **kwargs):  # runs in a worker thread: the model load the soak saw take 15-36 s
        release.wait(300)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(service, "open_policy", held_open)
    trainer_id, _ = load_or_create_identity(tmp_path / "trainer")
    run = RunConfig(name=RUN, trainers=[trainer_id.peer_id], tables={
        "membership": fast_membership,
        "trainer": {"init_warmup_steps": 0, "device": "cpu", "eval_every": 0},
    })
    trainer_started: list = []
    async with open_nodes([node_config(tmp_path, "worker", "relay", run=run)]) as (worker,), \
            trio.open_nursery() as nursery:
        try:
            cfg = node_config(tmp_path, "trainer", "trainer", run=run,
                              bootstrap=[worker.host.listen_addrs()[0]])

            async def run_trainer():
                trainer_started.append(await nursery.start(
                    lambda task_status: run_node(cfg, task_status=task_status, handle_signals=False)))

            nursery.start_soon(run_trainer)
            trainer = trainer_id.peer_id
            await wait_for(lambda: trainer in worker.membership.members(), what="the loading trainer's record")
            await worker.host.connect_peer(trainer, worker.membership.addrs_of(trainer))

            # The worker's outbox (backoff 1 s doubling to 16 s, as the soak's workers) fed by real calls.
            outbox = Outbox(4, max_attempts=3, backoff=1.0, backoff_max=16.0, async_level=2)
            now = 0.0
            batch_id, envelope = signed_batch(0)
            assert outbox.offer(Pending(batch_id, envelope, policy_version=0, num_samples=8, created_at=now, step=0))
            for _ in range(4):
                item, to = outbox.take([trainer], now)
                ack = await call_submit(worker.host, to, item.batch_id, item.envelope, 30.0)
                assert ack.reason == "not-ready" and ack.retry_after_ms == int(NOT_READY_RETRY_S * 1000)
                outbox.on_ack(item.batch_id, to, ack, now)
                # No exponential back-off: the trainer is due again after the wait it named, the batch kept.
                assert outbox.backoff_of(to) == 0.0 and len(outbox) == 1
                assert outbox.next_wakeup([trainer], now) == now + NOT_READY_RETRY_S
                now = outbox.next_wakeup([trainer], now)
            assert not trainer_started, "the trainer was ready before its model load was let go"

            release.set()
            await wait_for(lambda: trainer_started, timeout=240, what="the trainer ready")
            batch_id, envelope = signed_batch(10)
            ack = await call_submit(worker.host, trainer, batch_id, envelope, 30.0)
            assert ack.reason != "not-ready"  # the real intake answers now (this batch's root is not v0's)
            nursery.cancel_scope.cancel()
        finally:
            release.set()  # else a failure waits for the held load thread before it is reported


def test_not_ready_leaves_the_workers_step_headroom_where_it_was():
    """A loading trainer judged nothing, so its step window did not record the batch's step: the
    worker must not count it either (else its edge moves past the trainer's window: ``step-ahead``)."""
    outbox = Outbox(4, max_attempts=3, backoff=1.0, backoff_max=16.0, async_level=2, step_window=64,
                    first_step=100, counted_step=40)
    batch_id, envelope = signed_batch(100)
    outbox.offer(Pending(batch_id, envelope, policy_version=0, num_samples=8, created_at=0.0, step=100))
    item, trainer = outbox.take(["t"], 0.0)
    outbox.on_ack(item.batch_id, trainer, not_ready_ack(envelope), 0.0)
    assert outbox.counted_step == 40 and len(outbox) == 1


def test_a_newer_record_of_the_trainer_ends_the_backoff_its_dead_process_built():
    """Killed and restarted within the suspicion timeout, a trainer never leaves the member table:
    the failed dials to the dead process built a 16 s back-off, which outlived the new process's
    start (and, with a short model load, its readiness). The new process's record (signed by it, a
    higher sequence number) says it runs now: tried at once, then paced by its 'not-ready'."""
    outbox = Outbox(4, max_attempts=3, backoff=1.0, backoff_max=16.0, async_level=2)
    batch_id, envelope = signed_batch(0)
    outbox.offer(Pending(batch_id, envelope, policy_version=0, num_samples=8, created_at=0.0, step=0))
    outbox.on_record("t", 1000)  # the first record seen: nothing to end
    now = 0.0
    for attempt in range(5):  # dials to the dead process, each when the back-off allows
        now = outbox.next_wakeup(["t"], now) if attempt else now
        item, to = outbox.take(["t"], now)
        outbox.on_failure(item.batch_id, to, FailureKind.UNREACHABLE, now)
    assert outbox.backoff_of("t") == 16.0 and outbox.next_wakeup(["t"], now) == now + 16.0
    outbox.on_record("t", 1000)  # the same record again (gossip): no sign of a new life
    assert outbox.next_wakeup(["t"], now) == now + 16.0
    outbox.on_record("t", 2000)
    assert outbox.backoff_of("t") == 0.0 and outbox.take(["t"], now) is not None
