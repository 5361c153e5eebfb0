"""A slow commit does not stall the event loop (node/dbthread.py).

Each test holds one store write inside its SQLite transaction, where a slow fsync would hold it,
and checks that meanwhile another trio task keeps ticking and queries on the trio thread answer
(from the WAL reader, without the pending write); released, the write completes as before.
And a store is closed only once no write of it is running (``DbThread.stop``).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from waiting import HANG_GUARD_S, wait_for

from node.config import NodeConfig, RunConfig
from node.context import NodeContext
from node.dbthread import DbThread, StoreClosed
from node.identity import Identity
from node.ledger.config import LedgerConfig
from node.ledger.entries import RolloutsJudged
from node.ledger.store import open_ledger_store
from node.ledger.service import LedgerService
from node.rl.config import GRPOConfig
from node.rollouts.schema import open_batch
from node.trainer.config import TrainerSections
from node.trainer.service import Trainer
from node.trainer.spool import open_spool
from node.trainer.testing import fake_wiring, sign_batch
from node.validator.store import ValidatorStore
from test_trainer_intake import RUN, TOK, WORKER, batch, fake_node

TICKS = 100  # checkpoints another task must get through while the write is held


class HeldWrite:
    """Holds the next write transaction on ``conn`` inside SQLite until :meth:`release` (SQLite's
    progress handler runs in the writing thread); :meth:`entered` waits for it to get there."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.inside, self._released = threading.Event(), threading.Event()
        conn.set_progress_handler(self._stall, 1)

    def _stall(self) -> int:
        if self.conn.in_transaction and not self.inside.is_set():
            self.inside.set()
            if not self._released.wait(HANG_GUARD_S):  # only reached when nothing ever releases it
                return 1  # abort the statement: the test fails instead of hanging
        return 0

    @property
    def held(self) -> bool:
        return self.inside.is_set() and not self._released.is_set()

    async def entered(self) -> bool:
        return await trio.to_thread.run_sync(self.inside.wait, HANG_GUARD_S)

    def release(self) -> None:
        self._released.set()

    async def release_once_stopped(self, stopped: Callable[[], bool], closes: list[bool], what: str) -> None:
        """Wait until ``stopped()`` (the owner's last step before its store) and every task has gone
        as far as it will, check that no close happened yet (``closes``: one ``held`` per close),
        then release the write."""
        try:
            await wait_for(stopped, what=what)
            await trio.testing.wait_all_tasks_blocked()
            assert closes == []
        finally:
            self.release()


async def while_write_is_held(conn: sqlite3.Connection, write: Callable[[], Awaitable], during: Callable[[], None]):
    """Run ``write()``; once it is inside its transaction on ``conn``, hold it there, let a ticker
    task run TICKS checkpoints and call ``during()`` on the trio thread; then release it.
    Returns what ``write()`` returned."""
    held = HeldWrite(conn)
    result, done, ticks = [], trio.Event(), [0]

    async def writer() -> None:
        result.append(await write())
        done.set()

    async def ticker() -> None:
        while ticks[0] < TICKS:
            ticks[0] += 1
            await trio.sleep(0)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            assert await held.entered(), "the write never started"
            async with trio.open_nursery() as inner:
                inner.start_soon(ticker)
            assert ticks[0] == TICKS and not done.is_set()  # the loop ran; the write is still held
            during()
            held.release()
            await done.wait()
    finally:
        held.release()
        conn.set_progress_handler(None, 1)
    return result[0]


async def test_trainer_intake_runs_on_while_the_spool_commits(tmp_path):
    policy = SimpleNamespace(step=5, vocab_size=len(TOK), device="cpu")
    with open_spool(tmp_path / "spool.sqlite") as spool:
        trainer = Trainer(fake_node(), policy, spool, TrainerSections(grpo=GRPOConfig(async_level=2, pack_length=64)),
                          clock=lambda: 0.0, **fake_wiring())
        data = sign_batch(WORKER, batch())
        batch_id = open_batch(data, RUN).batch_id

        def during() -> None:  # not spooled yet, so not acknowledged yet; status still answers
            assert not spool.knows(batch_id) and spool.pending() == 0
            assert trainer.status()["batches"]["ready"] == 0

        ack = await while_write_is_held(spool.db, lambda: trainer.judge(data, WORKER.peer_id), during)
        assert ack.accepted and spool.knows(batch_id) and spool.pending() == 1


async def test_validator_verdict_commit_leaves_queries_answering(tmp_path):
    store = ValidatorStore(tmp_path / "validator.sqlite")
    try:
        db = DbThread()
        bid = b"\x01" * 32

        def during() -> None:
            assert store.verdict_of(bid) is None and store.counts()["accepted"] == 0

        await while_write_is_held(
            store._db, lambda: db.run(store.record, bid, "w", 0, [0], True, ["ok"], "t", b"v", 1), during)
        assert store.verdict_of(bid) == ("t", b"v")
    finally:
        store.close()


async def test_a_durable_ledger_append_runs_beside_the_event_loop(tmp_path):
    trainer = Identity.from_seed(b"t" * 32)
    run = RunConfig(name=RUN, trainers=[trainer.peer_id])
    published = []

    async def publish(topic, data):
        published.append(data)

    host = SimpleNamespace(connected_peers=lambda: [], pubsub=SimpleNamespace(publish=publish))
    node = NodeContext(NodeConfig(data_dir=str(tmp_path), run=run), trainer, host=host, data_dir=tmp_path)
    with open_ledger_store(tmp_path) as store:
        store.bind_run(RUN)
        svc = LedgerService(node, store, LedgerConfig())
        body = RolloutsJudged(worker=WORKER.peer_id, step=1, accepted=True, samples=8, tokens=80, batch_hash=b"h" * 32)

        def during() -> None:  # neither stored nor applied nor published before it is durable
            assert store.count() == 0 and svc.ledger.head_of(trainer.peer_id) == 0 and not published

        se = await while_write_is_held(store._db, lambda: svc.append(body), during)
        assert store.count() == 1 and svc.ledger.head_of(trainer.peer_id) == 1 and published == [se.raw]


async def test_writes_run_one_at_a_time_in_call_order():
    db = DbThread()
    running, order, most = [0], [], [0]

    def work(i: int) -> int:
        running[0] += 1
        most[0] = max(most[0], running[0])
        order.append(i)
        running[0] -= 1
        return i

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(db.run, work, i)
            await trio.sleep(0)  # each call reaches the limiter before the next starts
    assert order == list(range(20)) and most[0] == 1

    def fail() -> None:
        raise ValueError("from the thread")

    with pytest.raises(ValueError, match="from the thread"):
        await db.run(fail)


async def test_stop_waits_for_the_write_running_and_refuses_the_rest():
    """Closing a SQLite connection while a worker thread is inside one of its statements crashes
    the process (CPython's sqlite3 frees what the thread is using): a store may only close once
    :meth:`DbThread.stop` has returned, and stop must not return while a write runs."""
    db = DbThread()
    inside, release = threading.Event(), threading.Event()
    ran, stopped = [], trio.Event()

    def held() -> str:
        inside.set()
        assert release.wait(HANG_GUARD_S), "never released"
        ran.append("held")
        return "done"

    async def stop() -> None:
        with trio.CancelScope() as scope:
            scope.cancel()  # the node is stopping; stop must wait for the write all the same
            await db.stop()
        stopped.set()

    async with trio.open_nursery() as nursery:
        results = []

        async def first() -> None:
            results.append(await db.run(held))

        async def queued() -> None:  # asked for before the stop began, not started yet
            with pytest.raises(StoreClosed):
                await db.run(ran.append, "queued")
            results.append("refused")

        nursery.start_soon(first)
        assert await trio.to_thread.run_sync(inside.wait, HANG_GUARD_S), "the write never started"
        nursery.start_soon(queued)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(stop)
        await trio.testing.wait_all_tasks_blocked()
        assert not stopped.is_set() and ran == []
        release.set()
    assert stopped.is_set() and ran == ["held"] and sorted(results) == ["done", "refused"]
    with pytest.raises(StoreClosed):
        await db.run(ran.append, "late")
    assert ran == ["held"]
