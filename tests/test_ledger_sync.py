"""Ledger service in one process: real libp2p hosts on loopback, gossip and anti-entropy sync."""

from __future__ import annotations

import itertools
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import trio

from node.config import NodeConfig, RunConfig
from node.context import NodeContext, RunningNode
from node.net.host import open_swarm_host
from node.identity import Identity
from node.ledger.chain import Head
from node.ledger.entries import (
    CheckpointPublished,
    GENESIS,
    Penalty,
    RolloutsJudged,
    make_entry,
    parse_entry,
)
from node.dbthread import StoreClosed
from node.ledger.api import LedgerError
from node.ledger.store import LedgerStore, open_ledger_store
from node.ledger.messages import PROTOCOL, RangeReply, RangeRequest, SyncHello
from node.ledger.config import LedgerConfig
from node.ledger.service import LedgerService, serve_ledger
from node.net.budget import StreamsConfig
from node.roles.sections import RunSections
from node.wire import read_message, write_frame
from test_dbthread import HeldWrite
from waiting import wait_for

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RUN = "ledger-test"
TRAINER = Identity.from_seed(b"t" * 32)
VALIDATOR = Identity.from_seed(b"v" * 32)
WORKER = Identity.from_seed(b"w" * 32)
FAST = {"sync_interval": 0.3, "sync_timeout": 10.0, "receipt_interval": 0.3, "sync_batch": 7}


def run_config(**ledger) -> RunConfig:
    return RunConfig(
        name=RUN, trainers=[TRAINER.peer_id], validators=[VALIDATOR.peer_id], tables={"ledger": {**FAST, **ledger}}
    )


def ledger_sections(run: RunConfig) -> tuple[LedgerConfig, StreamsConfig]:
    """What serve_ledger reads of ``run`` (as node/roles/core.py hands it)."""
    sections = RunSections.of(run)
    return sections.ledger, sections.streams


@dataclass
class LedgerNode(RunningNode):
    ledger: LedgerService


@asynccontextmanager
async def open_ledger_node(tmp_path, name: str, identity: Identity | None = None, run: RunConfig | None = None):
    """A host plus the ledger service only (no membership), in its own data dir."""
    identity = identity or Identity.generate()
    config = NodeConfig(listen=LOOPBACK, data_dir=str(tmp_path / name), run=run or run_config())
    async with open_swarm_host(identity, LOOPBACK) as host:
        node = NodeContext(config, identity, host, tmp_path / name)
        async with trio.open_nursery() as nursery:
            yield LedgerNode(node, await nursery.start(serve_ledger, node, *ledger_sections(config.run)))
            nursery.cancel_scope.cancel()


_batches = itertools.count()


def rollouts(samples: int, worker: Identity = WORKER) -> RolloutsJudged:
    """A new batch per call (credit is per batch)."""
    return RolloutsJudged(worker=worker.peer_id, step=1, accepted=True, samples=samples, tokens=samples * 10,
                          batch_hash=next(_batches).to_bytes(32, "big"))


def penalty(points: int) -> Penalty:
    return Penalty(peer=WORKER.peer_id, reason="slow", points=points)


async def connect(a: NodeContext, b: NodeContext) -> None:
    await a.host.connect(b.host.listen_addrs()[0])


def ledger(node: NodeContext):
    return node.ledger


async def test_three_nodes_offline_node_catches_up(tmp_path):
    """Two nodes append while the third is offline; it starts later and reaches the same digest."""
    async with open_ledger_node(tmp_path, "t", TRAINER) as t, open_ledger_node(tmp_path, "v", VALIDATOR) as v:
        await connect(t, v)
        for i in range(20):
            await ledger(t).append(rollouts(i + 1))
            await ledger(v).append(penalty(i))
        await wait_for(lambda: ledger(t).digest() == ledger(v).digest())
        async with open_ledger_node(tmp_path, "w", WORKER) as w:
            assert len(ledger(w).ledger) == 0
            await connect(w, t)
            await wait_for(lambda: ledger(w).digest() == ledger(t).digest())
            assert len(ledger(w).ledger) == 40
            # By anti-entropy or by gossipsub's IHAVE of its recent messages, whichever comes first
            # (the latter took all 40 in about one run of ten); anti-entropy alone is tested below,
            # on entries that were never gossiped (test_gossip_gap_triggers_sync_without_periodic_rounds).
            assert ledger(w).totals() == ledger(t).totals()
            assert ledger(w).totals(WORKER.peer_id)[WORKER.peer_id]["rollouts_accepted"] == sum(range(1, 21))
            # nothing was rejected along the way
            assert not ledger(w).rejections and not ledger(t).rejections and not ledger(v).rejections
            # and the worker's own entries flow back (credited once the trainer's checkpoint is known)
            await ledger(t).append(CheckpointPublished(version=1, manifest_id=b"m" * 32, total_bytes=10_000))
            ledger(w).note_received(TRAINER.peer_id, b"m" * 32, 5000)
            ledger(w).note_received(TRAINER.peer_id, b"m" * 32, 3000)
            await wait_for(lambda: ledger(t).totals(TRAINER.peer_id)[TRAINER.peer_id]["bytes_served"] == 8000)
            assert ledger(w).ledger.head_of(WORKER.peer_id) == 1  # one batched receipt entry


async def test_restart_resumes_from_disk(tmp_path):
    async with open_ledger_node(tmp_path, "t", TRAINER) as t:
        for i in range(5):
            await ledger(t).append(rollouts(i + 1))
        digest = ledger(t).digest()
        status = t.status["ledger"]()
        assert status["entries"] == 5 and status["own_seq"] == 5
    async with open_ledger_node(tmp_path, "t", TRAINER) as t:
        assert ledger(t).digest() == digest
        se = await ledger(t).append(rollouts(9))
        assert se.seq == 6


async def test_unauthorized_append_is_refused_locally(tmp_path):
    async with open_ledger_node(tmp_path, "w", WORKER) as w:
        with pytest.raises(LedgerError):
            await ledger(w).append(rollouts(1))
        assert len(ledger(w).ledger) == 0


async def test_wrong_run_database_is_refused(tmp_path):
    async with open_ledger_node(tmp_path, "n", WORKER):
        pass
    other = RunConfig(name="another-run", tables={"ledger": FAST})
    with pytest.raises(BaseException) as info:
        async with open_ledger_node(tmp_path, "n", WORKER, run=other):
            pass
    assert any("belongs to run 'ledger-test'" in str(e) for e in leaves(info.value))


def leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


async def test_forged_and_bad_entries_rejected_over_gossip(tmp_path):
    """Garbage, forged signatures, unauthorized kinds and wrong-run entries are counted, not stored."""
    async with open_ledger_node(tmp_path, "t", TRAINER) as t, open_ledger_node(tmp_path, "w", WORKER) as w:
        await connect(t, w)
        await ledger(t).append(rollouts(1))
        await wait_for(lambda: ledger(w).digest() == ledger(t).digest())
        topic = ledger(t).topic
        forged_bytes = bytearray(make_entry(TRAINER, RUN, 2, ledger(t).ledger.hash_at(TRAINER.peer_id, 1), 1, rollouts(99)).raw)
        forged_bytes[-1] ^= 1  # break the signature
        # publish from the raw pubsub of a third, hostile host so our own validator isn't in the way
        mallory = Identity.generate()
        async with open_swarm_host(mallory, LOOPBACK) as m:
            await m.connect(w.host.listen_addrs()[0])
            await m.pubsub.subscribe(topic)
            await wait_for(lambda: m.mesh_size(topic) >= 1, what="mallory in the node's mesh")
            bad = [
                b"\x93garbage",
                bytes(forged_bytes),
                make_entry(mallory, RUN, 1, GENESIS, 1, rollouts(1000)).raw,  # not a trainer
                make_entry(mallory, "other-run", 1, GENESIS, 1, penalty(1)).raw,
            ]
            for data in bad:
                await m.pubsub.publish(topic, data)
            await wait_for(lambda: sum(ledger(w).rejections.values()) >= 4)
            rej = ledger(w).rejections
            assert rej[f"{topic}/malformed"] == 1
            assert rej[f"{topic}/bad-signature"] == 1
            assert rej[f"{topic}/unauthorized"] == 1
            assert rej[f"{topic}/wrong-run"] == 1
            assert len(ledger(w).ledger) == 1
            assert ledger(w).totals(WORKER.peer_id)[WORKER.peer_id]["rollouts_accepted"] == 1
            with open_ledger_store(w.data_dir) as store:
                assert store.count() == 1

            # an equivocation (a second, different seq 1 signed by the trainer) relayed by gossip:
            # kept as evidence, the trainer flagged, its credit from seq 1 on withdrawn
            fork = make_entry(TRAINER, RUN, 1, GENESIS, 1, rollouts(77))
            await m.pubsub.publish(topic, fork.raw)
            await wait_for(lambda: ledger(w).ledger.flagged() == {TRAINER.peer_id: 1})
            assert ledger(w).totals(WORKER.peer_id)[WORKER.peer_id]["rollouts_accepted"] == 0
            assert w.status["ledger"]()["flagged"] == {TRAINER.peer_id: 1}
            with open_ledger_store(w.data_dir) as store:
                assert store.count() == 1 and len(list(store.iter_evidence())) == 1


async def test_equivocation_is_caught_spread_and_shown(tmp_path):
    """A trainer signs two different seq-2 entries and shows each to a different peer."""
    a_first = make_entry(TRAINER, RUN, 1, GENESIS, 1, rollouts(1))
    x = make_entry(TRAINER, RUN, 2, a_first.hash, 2, rollouts(10))
    y = make_entry(TRAINER, RUN, 2, a_first.hash, 2, rollouts(500))
    async with open_ledger_node(tmp_path, "p", VALIDATOR) as p, open_ledger_node(tmp_path, "q", WORKER) as q:
        rep_p = await ledger(p).ingest([a_first.raw, x.raw], "test")
        rep_q = await ledger(q).ingest([a_first.raw, y.raw], "test")
        assert rep_p.accepted == rep_q.accepted == 2
        assert ledger(p).digest() != ledger(q).digest()
        await connect(p, q)
        await wait_for(lambda: ledger(p).ledger.flagged() and ledger(q).ledger.flagged())
        await wait_for(lambda: ledger(p).digest() == ledger(q).digest())
        for node in (p, q):
            assert ledger(node).ledger.flagged() == {TRAINER.peer_id: 2}
            assert node.status["ledger"]()["flagged"] == {TRAINER.peer_id: 2}
            # only the entry before the fork counts
            assert ledger(node).totals(WORKER.peer_id)[WORKER.peer_id]["rollouts_accepted"] == 1
            with open_ledger_store(node.data_dir) as store:
                assert len(list(store.iter_evidence())) == 1
        # the evidence survives a restart
    async with open_ledger_node(tmp_path, "p", VALIDATOR) as p:
        assert ledger(p).ledger.flagged() == {TRAINER.peer_id: 2}


async def test_sync_server_answers_bounded_batches_and_rejects_junk(tmp_path):
    async with open_ledger_node(tmp_path, "t", TRAINER) as t:
        for i in range(20):
            await ledger(t).append(rollouts(i + 1))
        async with open_swarm_host(Identity.generate(), LOOPBACK) as client:
            peer = await client.connect(t.host.listen_addrs()[0])
            stream = await client.open_stream(peer, PROTOCOL)
            await write_frame(stream, SyncHello(heads=()))
            hello = await read_message(stream)
            assert isinstance(hello, SyncHello)
            assert hello.heads == (Head(TRAINER.peer_id, 20, ledger(t).ledger.hash_at(TRAINER.peer_id, 20), 0),)
            await write_frame(stream, RangeRequest(id=7, author=TRAINER.peer_id, start=3, end=1000))
            reply = await read_message(stream)
            assert isinstance(reply, RangeReply) and reply.id == 7
            assert [parse_entry(r).seq for r in reply.entries] == list(range(3, 10))  # sync_batch = 7
            await write_frame(stream, b"\x00\x01junk")
            await wait_for(lambda: ledger(t).rejections.get(f"{PROTOCOL}/malformed", 0) == 1)


async def test_gossip_gap_triggers_sync_without_periodic_rounds(tmp_path):
    """With anti-entropy rounds effectively off, an entry that arrives by gossip ahead of a gap makes
    the receiver pull the missing range from the publisher at once."""
    slow = run_config(sync_interval=3600.0)
    async with open_ledger_node(tmp_path, "t", TRAINER, run=slow) as t, open_ledger_node(tmp_path, "w", WORKER, run=slow) as w:
        # t's first five entries reach t without gossip (as if restored from its disk), so w can
        # only learn them by pulling; gossipsub's IHAVE/IWANT would replay recently published ones.
        prev = GENESIS
        for i in range(5):
            se = make_entry(TRAINER, RUN, i + 1, prev, 1000 + i, rollouts(i + 1))
            assert (await ledger(t).ingest([se.raw], "test")).accepted == 1
            prev = se.hash
        await connect(w, t)

        async def keep_appending():
            # the mesh forms within a heartbeat or two; keep publishing until one gets through
            while True:
                await ledger(t).append(rollouts(1))
                await trio.sleep(0.5)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_appending)
            await wait_for(lambda: len(ledger(w).ledger) >= 6)
            nursery.cancel_scope.cancel()
        await wait_for(lambda: ledger(w).digest() == ledger(t).digest())
        await wait_for(lambda: ledger(w).syncs["ok"] >= 1)  # w pulled (the session ends after the data)
        assert ledger(w).accepted[PROTOCOL] >= 5
        assert ledger(w).ledger.head_of(TRAINER.peer_id) == ledger(t).ledger.head_of(TRAINER.peer_id)


async def test_node_that_lost_its_database_does_not_equivocate(tmp_path):
    """A trainer whose database is gone relearns its own log from a peer before appending again."""
    async with open_ledger_node(tmp_path, "w", WORKER) as w:
        async with open_ledger_node(tmp_path, "t", TRAINER) as t:
            await connect(t, w)
            for i in range(3):
                await ledger(t).append(rollouts(i + 1))
            await wait_for(lambda: ledger(w).ledger.head_of(TRAINER.peer_id) == 3)
        for f in (tmp_path / "t").glob("ledger.sqlite*"):
            f.unlink()
        # no periodic rounds on t: only the pull before its first append can bring its log back
        async with open_ledger_node(tmp_path, "t", TRAINER, run=run_config(sync_interval=3600.0)) as t:
            assert len(ledger(t).ledger) == 0
            await connect(t, w)
            se = await ledger(t).append(rollouts(4))
            assert se.seq == 4 and se.prev == ledger(w).ledger.hash_at(TRAINER.peer_id, 3)
            # a newcomer that hears from both sees one consistent log, no equivocation
            async with open_ledger_node(tmp_path, "x", VALIDATOR) as x:
                await connect(x, t)
                await connect(x, w)
                await wait_for(lambda: ledger(x).ledger.head_of(TRAINER.peer_id) == 4)
                await wait_for(lambda: ledger(x).ledger.head_of(WORKER.peer_id) == ledger(w).ledger.head_of(WORKER.peer_id))
                assert ledger(x).ledger.flagged() == {} and ledger(t).ledger.flagged() == {}
                assert ledger(x).ledger.hash_at(TRAINER.peer_id, 3) == ledger(w).ledger.hash_at(TRAINER.peer_id, 3)


async def test_entries_past_a_fork_cost_only_the_equivocator_gossip_score(tmp_path):
    from types import SimpleNamespace

    from libp2p.peer.id import ID

    from node.ledger.config import LedgerConfig
    from node.ledger.service import LedgerService

    first = make_entry(TRAINER, RUN, 1, GENESIS, 1, rollouts(1))
    x = make_entry(TRAINER, RUN, 2, first.hash, 2, rollouts(10))
    y = make_entry(TRAINER, RUN, 2, first.hash, 2, rollouts(500))
    later = make_entry(TRAINER, RUN, 3, x.hash, 3, rollouts(7))
    node = NodeContext(NodeConfig(data_dir=str(tmp_path), run=run_config()), WORKER, host=None, data_dir=tmp_path)
    with open_ledger_store(tmp_path) as store:
        svc = LedgerService(node, store, LedgerConfig())
        await svc.ingest([first.raw, x.raw], "test")
        await svc.ingest([y.raw], "test")
        assert svc.ledger.flagged() == {TRAINER.peer_id: 2}
        msg = SimpleNamespace(data=later.raw)
        assert svc.validate_gossip(ID.from_base58(VALIDATOR.peer_id), msg)  # an honest relay: no penalty
        assert not svc.validate_gossip(ID.from_base58(TRAINER.peer_id), msg)  # the equivocator itself
        assert (await svc.ingest([later.raw], "test")).accepted == 0  # and it is never stored


def test_note_received_refuses_impossible_receipts(tmp_path):
    from node.ledger.config import LedgerConfig
    from node.ledger.service import LedgerService

    config = NodeConfig(data_dir=str(tmp_path), run=run_config())
    node = NodeContext(config, WORKER, host=None, data_dir=tmp_path)
    with open_ledger_store(tmp_path) as store:
        svc = LedgerService(node, store, LedgerConfig())
        for args in (("nope", b"m" * 32, 1), (TRAINER.peer_id, b"short", 1), (TRAINER.peer_id, b"m" * 32, -1)):
            with pytest.raises(ValueError):
                svc.note_received(*args)
        svc.note_received(WORKER.peer_id, b"m" * 32, 100)  # from ourselves: no credit, nothing pending
        svc.note_received(TRAINER.peer_id, b"m" * 32, 100)
        svc.note_received(TRAINER.peer_id, b"m" * 32, 50, pieces=2)
        assert svc.status()["pending_receipts"] == 1


async def test_the_store_stays_open_until_an_append_in_flight_has_committed(tmp_path, monkeypatch):
    """The trainer and the validator call ``append`` from their own tasks, outside the ledger's
    nursery. CI once died of SIGSEGV when serve_ledger, stopping, closed its store while such an
    append was committing in a worker thread (closing a SQLite connection under a running statement
    frees what that thread is using). Stopping must wait for the commit, then refuse later appends."""
    held: HeldWrite | None = None
    closes = []  # per close: was a commit held inside its transaction at that moment?
    real_close = LedgerStore.close

    def close(store: LedgerStore) -> None:
        closes.append(held is not None and held.held)
        if not closes[-1]:  # closing under the held commit would crash this test run, not fail it
            real_close(store)

    monkeypatch.setattr(LedgerStore, "close", close)
    config = NodeConfig(listen=LOOPBACK, data_dir=str(tmp_path / "t"), run=run_config())
    async with open_swarm_host(TRAINER, LOOPBACK) as host:
        node = NodeContext(config, TRAINER, host, tmp_path / "t")
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as services:
                svc = await services.start(serve_ledger, node, *ledger_sections(config.run))
                held = HeldWrite(svc.store._db)
                outer.start_soon(svc.append, rollouts(8))  # as the trainer does, from its own task
                assert await held.entered(), "the append never committed"
                # serve_ledger's last step before the store: then it has gone as far as it will
                outer.start_soon(held.release_once_stopped, lambda: svc.topic not in host.pubsub.topic_validators,
                                 closes, "ledger stopping")
                services.cancel_scope.cancel()
        assert closes == [False]
        with pytest.raises(StoreClosed):
            await svc.append(rollouts(1))
    with open_ledger_store(tmp_path / "t") as store:
        assert store.count() == 1


async def test_status_shows_the_trusted_authors_heads_as_this_replica_holds_them(tmp_path):
    first = make_entry(TRAINER, RUN, 1, GENESIS, 1, rollouts(1))
    second = make_entry(TRAINER, RUN, 2, first.hash, 2, rollouts(2))
    node = NodeContext(NodeConfig(data_dir=str(tmp_path), run=run_config()), WORKER, host=None, data_dir=tmp_path)
    with open_ledger_store(tmp_path) as store:
        svc = LedgerService(node, store, LedgerConfig())
        assert svc.status()["trusted_heads"] == {TRAINER.peer_id: 0, VALIDATOR.peer_id: 0}
        await svc.ingest([first.raw, second.raw], "test")
        assert svc.status()["trusted_heads"] == {TRAINER.peer_id: 2, VALIDATOR.peer_id: 0}


async def test_a_fork_found_later_takes_back_entries_stored_held_back_by_a_full_disk_and_in_the_same_batch(tmp_path):
    """The replica re-reads the entries past a new fork point to take back their credits (issue 45: it
    no longer keeps them in memory). Here they are in three places at once: stored, held in memory by
    a full disk, and in the batch being ingested; a restart reads them all back from the store."""
    t = [make_entry(TRAINER, RUN, 1, GENESIS, 1, rollouts(1))]
    for i in range(2, 41):
        t.append(make_entry(TRAINER, RUN, i, t[-1].hash, i, rollouts(i)))
    fork = make_entry(TRAINER, RUN, 2, t[0].hash, 2, rollouts(500))
    async with open_ledger_node(tmp_path, "v", VALIDATOR) as v:
        assert (await ledger(v).ingest([se.raw for se in t[:3]], "test")).accepted == 3
        db = ledger(v).store._db
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")  # the disk is full
        assert (await ledger(v).ingest([se.raw for se in t[3:33]], "test")).accepted == 30
        assert ledger(v).totals(WORKER.peer_id)[WORKER.peer_id]["rollouts_accepted"] == sum(range(1, 34))
        report = await ledger(v).ingest([se.raw for se in t[33:]] + [fork.raw], "test")
        assert (report.accepted, report.equivocations) == (7, 1)
        assert ledger(v).ledger.flagged() == {TRAINER.peer_id: 2}
        assert ledger(v).totals(WORKER.peer_id)[WORKER.peer_id]["rollouts_accepted"] == 1  # only seq 1 counts
        assert ledger(v).totals(TRAINER.peer_id)[TRAINER.peer_id]["entries"] == 1
        with open_ledger_store(v.data_dir) as store:
            assert store.count() < 33  # the page that had room took a few; the rest wait in memory
        db.execute("PRAGMA max_page_count = 1073741823")  # room again: the next commit stores what was held
        await ledger(v).ingest([], "test")
        with open_ledger_store(v.data_dir) as store:
            assert store.count() == 40 and len(list(store.iter_evidence())) == 1
        digest, totals = ledger(v).digest(), ledger(v).totals()
    async with open_ledger_node(tmp_path, "v", VALIDATOR) as v:
        assert ledger(v).ledger.flagged() == {TRAINER.peer_id: 2}
        assert (ledger(v).digest(), ledger(v).totals()) == (digest, totals)
