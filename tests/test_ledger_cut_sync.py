"""Trainer-signed ledger cuts in the running service (node/ledger/service.py, node/ledger/cutsync.py).

Real libp2p hosts on loopback. The run's cutter cuts its replica and drops the entries below; a
replica that holds the history fetches the cut in pages through anti-entropy, checks it against that
history and adopts it; a new node catches up from a peer that holds only the cut and the entries
above it; an honest worker's totals are those of a replica that kept the whole history; a restarted
node rebuilds from its store to the same digest. A peer that sends a cut that is not what it
announced, one of another run or signer, an old one, pages that lie, or names a cut it cannot serve,
is refused (scored down where that proves it at fault) and nothing is adopted; a trainer-signed cut
that the replica's own history contradicts is refused and kept as a fraud proof, history kept.
"""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager

import pytest
import trio

from node.identity import Identity
from node.ledger.chain import Ledger, Outcome
from node.ledger.config import LedgerConfig
from node.ledger.cut import make_cut, sign_cut
from node.ledger.cutsync import cutter_of
from node.ledger.entries import CheckpointPublished, RolloutsJudged, Verdict
from node.ledger.messages import CUT_PAGE_BYTES, PROTOCOL, PROTOCOL_CUTS, CutPage, CutPageRequest, SyncHello
from node.net.host import open_swarm_host
from node.wire import read_message, write_frame
from test_ledger_sync import LOOPBACK, RUN, TRAINER, VALIDATOR, WORKER, connect, ledger, open_ledger_node, run_config
from waiting import wait_for

from node import hashes

NO_CUTS = run_config(cut_every=0)  # cuts only when a test says so (LedgerService.cut_now)
_batch = iter(range(10**9))


def judged(step: int, worker: Identity = WORKER, samples: int = 4) -> RolloutsJudged:
    b = next(_batch).to_bytes(32, "big")
    return RolloutsJudged(worker=worker.peer_id, step=step, accepted=True, samples=samples, tokens=10 * samples,
                          batch_hash=b)


async def some_history(t, v, steps: int, start: int = 0) -> list:
    """The trainer publishes checkpoints and judges WORKER's batches, the validator verifies them."""
    out = []
    for step in range(start, start + steps):
        out.append(await ledger(t).append(CheckpointPublished(version=step, manifest_id=hashes.digest(b"m%d" % step),
                                                              total_bytes=1 << 20)))
        for _ in range(2):
            body = judged(step)
            out.append(await ledger(t).append(body))
            out.append(await ledger(v).append(Verdict(worker=WORKER.peer_id, step=step, batch_hash=body.batch_hash,
                                                      ok=True, reasons=("ok",))))
    return out


def keeper(entries) -> Ledger:
    """A replica that kept the whole history (in memory, entries in any order)."""
    replica = Ledger(RUN, [TRAINER.peer_id], [VALIDATOR.peer_id], max_skew_ms=10**9)
    pending = sorted(entries, key=lambda se: (se.author, se.seq))
    for se in pending:
        d = replica.check(se, se.time_ms)
        assert d.outcome is Outcome.ACCEPT, d
        replica.apply(d)
    return replica


def test_the_cutter_is_one_trainer_of_the_run():
    assert cutter_of(["zz", TRAINER.peer_id, "aa"]) == min(TRAINER.peer_id, "aa") and cutter_of([]) is None
    with pytest.raises(ValueError, match="cut_every"):
        LedgerConfig(cut_every=5).validate()
    with pytest.raises(ValueError, match="keep_steps"):
        LedgerConfig(keep_steps=0).validate()
    with pytest.raises(ValueError, match="keep_versions"):
        LedgerConfig(keep_versions=0).validate()
    LedgerConfig().validate()


async def test_a_cut_spreads_prunes_and_a_new_node_catches_up_from_it_with_every_credit(tmp_path):
    async with open_ledger_node(tmp_path, "t", TRAINER, NO_CUTS) as t, \
            open_ledger_node(tmp_path, "v", VALIDATOR, NO_CUTS) as v:
        await connect(t, v)
        entries = await some_history(t, v, 12)
        await wait_for(lambda: ledger(t).digest() == ledger(v).digest())
        assert ledger(t).is_cutter and not ledger(v).is_cutter
        opened = await ledger(t).cut_now()
        assert opened.cut.number == 1 and ledger(t).ledger.cut_number == 1
        assert ledger(t).store.count() == 0  # everything it held is at or below the heads it cut at
        # the validator holds the whole history: it fetches the cut, checks it against that, adopts it
        await wait_for(lambda: ledger(v).ledger.cut_number == 1, what="the validator adopts cut 1")
        assert ledger(v).cuts["adopted"] == 1 and not ledger(v).cuts["refused"]
        assert ledger(v).store.count() == 0 and ledger(v).store.latest_cut()[1] == opened.hash
        entries += await some_history(t, v, 5, start=12)
        await wait_for(lambda: ledger(t).digest() == ledger(v).digest())
        await wait_for(lambda: ledger(v).store.count() == len(entries) - sum(log.seq for log in opened.cut.logs))
        whole = keeper(entries)
        assert ledger(v).totals() == ledger(t).totals() == whole.totals()
        assert ledger(v).totals(WORKER.peer_id)[WORKER.peer_id]["rollouts_accepted"] == 17 * 2 * 4
        # a new node that reaches only the validator, which holds nothing below the cut
        async with open_ledger_node(tmp_path, "w", WORKER, NO_CUTS) as w:
            await connect(w, v)
            await wait_for(lambda: ledger(w).digest() == whole.digest(), what="the new node caught up")
            assert ledger(w).ledger.cut_number == 1 and ledger(w).totals() == whole.totals()
            # what it stores is what the validator stores: the entries above the cut (once committed)
            await wait_for(lambda: ledger(w).store.count() == ledger(v).store.count()
                           == w.status["ledger"]()["entries"])
            # gossipsub hands a new subscriber the recent messages it cached, entries below the cut among
            # them: old news it refuses, nothing else
            topic = ledger(w).topic
            assert set(ledger(w).rejections) <= {f"{topic}/below-cut"}, ledger(w).rejections
            assert not ledger(v).rejections
            digest, totals = ledger(w).digest(), ledger(w).totals()
    # restarted alone, the new node rebuilds from the cut and the entries above it
    async with open_ledger_node(tmp_path, "w", WORKER, NO_CUTS) as w:
        assert ledger(w).ledger.cut_number == 1
        assert ledger(w).digest() == digest and ledger(w).totals() == totals


async def test_the_cutter_cuts_every_cut_every_entries_and_cuts_follow_each_other(tmp_path):
    run = run_config(cut_every=100)
    async with open_ledger_node(tmp_path, "t", TRAINER, run) as t, \
            open_ledger_node(tmp_path, "v", VALIDATOR, run) as v:
        await connect(t, v)
        entries = await some_history(t, v, 45)  # 225 entries: two cuts
        await wait_for(lambda: ledger(t).ledger.cut_number >= 2, what="two cuts")
        await wait_for(lambda: ledger(v).ledger.cut_number == ledger(t).ledger.cut_number
                       and ledger(v).digest() == ledger(t).digest())
        assert not ledger(v).cuts["refused"] and ledger(v).cuts["adopted"] >= 1
        assert ledger(v).totals() == keeper(entries).totals()
        assert ledger(t).store.count() < 100 + 10  # what the cutter stores follows the period, not the run


async def test_a_restarted_cutter_counts_the_entries_it_stored_since_its_last_cut(tmp_path):
    """The count toward the next cut is what the store holds above the cut, not what this process
    took in: a cutter restarted more often than every cut_every entries (the soak's trainer: three
    lives in 20 minutes) never reached the count and never cut."""
    async with open_ledger_node(tmp_path, "t", TRAINER, NO_CUTS) as t, \
            open_ledger_node(tmp_path, "v", VALIDATOR, NO_CUTS) as v:
        await connect(t, v)
        entries = await some_history(t, v, 25)  # 125 entries, none cut
        await wait_for(lambda: ledger(t).store.count() == len(entries))
    async with open_ledger_node(tmp_path, "t", TRAINER, run_config(cut_every=100)) as t:
        await wait_for(lambda: ledger(t).ledger.cut_number == 1, what="a cut of what the last life stored")
        assert ledger(t).totals() == keeper(entries).totals()


@asynccontextmanager
async def mallory(victim, answer):
    """A peer that speaks the sync protocol with ``answer(message) -> reply`` (None: hang up); yields
    its peer id, connected to ``victim``."""
    async with open_swarm_host(Identity.generate(), LOOPBACK) as host:
        async def handler(stream):
            try:
                while (msg := await read_message(stream)) is not None:
                    reply = answer(msg)
                    if reply is None:
                        break
                    await write_frame(stream, reply)
            except Exception:  # noqa: BLE001 - the victim hanging up on us is the point
                pass
            finally:
                await stream.close()

        host.set_handler(PROTOCOL_CUTS, handler)  # cuts travel only in sessions of the cut-aware protocol
        await host.connect(victim.host.listen_addrs()[0])
        yield host.peer_id


def serving(raw: bytes, number: int, announce: bytes | None = None, page=None):
    """Answers that announce cut ``number`` (hash ``announce``, default raw's) and serve ``raw`` in
    pages, each passed through ``page(CutPage) -> CutPage`` when given."""
    count = max(1, -(-len(raw) // CUT_PAGE_BYTES))

    def answer(msg):
        if isinstance(msg, SyncHello):
            return SyncHello(heads=(), cut_number=number, cut_hash=announce or hashes.digest(raw))
        if isinstance(msg, CutPageRequest):
            p = CutPage(id=msg.id, number=msg.number, index=msg.index, count=count,
                        data=raw[msg.index * CUT_PAGE_BYTES:(msg.index + 1) * CUT_PAGE_BYTES])
            return page(p) if page else p
        return None

    return answer


async def victim_with_history(stack, tmp_path):
    t = await stack.enter_async_context(open_ledger_node(tmp_path, "t", TRAINER, NO_CUTS))
    v = await stack.enter_async_context(open_ledger_node(tmp_path, "v", VALIDATOR, NO_CUTS))
    await connect(t, v)
    entries = await some_history(t, v, 6)
    await wait_for(lambda: ledger(t).digest() == ledger(v).digest())
    return t, v, entries


def honest_cut(v, **changes) -> bytes:
    cut = make_cut(ledger(v).ledger, time_ms=ledger(v).now_ms(), keep_versions=8, keep_steps=64)
    return sign_cut(TRAINER, dataclasses.replace(cut, **changes))


def big(raw: bytes) -> bytes:
    return raw + b"\0" * (2 * CUT_PAGE_BYTES)  # three pages (the signature check fails; the pages decide first)


ATTACKS = {
    # (what mallory serves, the reason the victim gives, whether that proves mallory at fault)
    "signed-by-a-non-trainer": (lambda v: serving(sign_cut(Identity.generate(), make_cut(
        ledger(v).ledger, time_ms=0)), 1), "unauthorized", True),
    "another-run": (lambda v: serving(honest_cut(v, run="other-run"), 1), "wrong-run", True),
    "pages-do-not-hash-to-the-hello": (lambda v: serving(honest_cut(v), 1, announce=b"\1" * 32), "cut-hash", True),
    "announced-number-is-not-the-cuts": (lambda v: serving(honest_cut(v), 2), "cut-number", True),
    "page-index-out-of-order": (lambda v: serving(honest_cut(v), 1, page=lambda p: dataclasses.replace(
        p, index=p.index + 1)), "cut-page-index", True),
    "page-count-changes": (lambda v: serving(big(honest_cut(v)), 1, page=lambda p: dataclasses.replace(
        p, count=p.count + p.index)), "cut-page-count", True),
    "short-page-before-the-last": (lambda v: serving(big(honest_cut(v)), 1, page=lambda p: dataclasses.replace(
        p, data=p.data[:100])), "cut-page-size", True),
    "more-pages-than-a-cut-may-have": (lambda v: serving(honest_cut(v), 1, page=lambda p: dataclasses.replace(
        p, count=10**4)), "cut-too-large", True),
    "hello-hash-not-a-hash": (lambda v: serving(honest_cut(v), 1, announce=b"\1" * 5), "bad-cut-hash", True),
    "a-huge-number-it-cannot-serve": (lambda v: serving(b"", 2**50, announce=b"\2" * 32, page=lambda p: dataclasses.replace(
        p, count=0, data=b"")), None, False),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
async def test_a_cut_that_is_not_what_the_peer_announced_is_refused_and_a_real_one_still_adopted(tmp_path, attack):
    make_answer, reason, at_fault = ATTACKS[attack]
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        t, v, _entries = await victim_with_history(stack, tmp_path)
        stored, digest = ledger(v).store.count(), ledger(v).digest()
        async with mallory(v, make_answer(v)) as bad:
            await ledger(v).sync_with(bad)
            if reason:
                assert ledger(v).rejections[f"{PROTOCOL}/{reason}"] >= 1, ledger(v).rejections
            else:
                assert ledger(v).cuts["not-held"] >= 1
            score = v.context.peers.table.score(bad, trio.current_time())
            assert (score < 0) == at_fault, score
            assert ledger(v).ledger.cut_number == 0 and ledger(v).store.latest_cut() is None
            assert ledger(v).store.count() == stored and ledger(v).digest() == digest
            # not locked out: the next real cut, from an honest peer, is taken
            opened = await ledger(t).cut_now()
            await wait_for(lambda: ledger(v).ledger.cut_number == 1, what="the real cut adopted")
            assert ledger(v).store.latest_cut()[1] == opened.hash


async def test_a_trainer_signed_cut_the_replicas_history_contradicts_is_refused_and_kept_as_proof(tmp_path):
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        _t, v, entries = await victim_with_history(stack, tmp_path)
        stored, totals = ledger(v).store.count(), ledger(v).totals()
        cut = make_cut(ledger(v).ledger, time_ms=ledger(v).now_ms(), keep_versions=8, keep_steps=64)
        rows = tuple(dataclasses.replace(r, totals=tuple(x * 2 for x in r.totals)) if r.peer == WORKER.peer_id else r
                     for r in cut.rows)
        raw = sign_cut(TRAINER, dataclasses.replace(cut, rows=rows))  # the trainer's key, its totals doubled
        async with mallory(v, serving(raw, 1)) as relay:
            await ledger(v).sync_with(relay)
            assert ledger(v).cuts["refused"] == 1 and ledger(v).rejections["cut/rows-differ"] == 1
            assert ledger(v).ledger.cut_number == 0 and ledger(v).store.latest_cut() is None
            assert ledger(v).store.count() == stored == len(entries) and ledger(v).totals() == totals
            assert (v.data_dir / "ledger-refused-cut-1.bin").read_bytes() == raw
            await ledger(v).sync_with(relay)  # known to be wrong: not fetched and replayed again
            assert ledger(v).cuts["refused"] == 1 and ledger(v).ledger.cut_number == 0
            # the relay passed on a trainer's signed cut: not proof that it is at fault
            assert v.context.peers.table.score(relay, trio.current_time()) >= 0


async def test_a_trainer_signed_cut_that_does_not_load_is_refused_and_the_node_goes_on(tmp_path):
    """A cut that opens (a trainer's signature) but names a peer row it lacks raised out of the sync
    loop of every node that adopts on the signature (an empty one) and ended it, again after each restart."""
    from contextlib import AsyncExitStack

    from node.ledger.cut import CutBatch

    async with AsyncExitStack() as stack:
        _t, v, _entries = await victim_with_history(stack, tmp_path)
        fresh = await stack.enter_async_context(open_ledger_node(tmp_path, "fresh", Identity.generate(), NO_CUTS))
        raw = honest_cut(v, batches=(CutBatch(batch=bytes(32), claims=b"\xff" * 4 + bytes(21)),))
        async with mallory(fresh, serving(raw, 1)) as relay:
            await ledger(fresh).sync_with(relay)
            # >= 1: the node's own sync loop may pick the relay too and refuse it once more meanwhile
            assert ledger(fresh).cuts["refused"] >= 1 and ledger(fresh).ledger.cut_number == 0
            assert ledger(fresh).store.latest_cut() is None
        await connect(fresh, v)  # still syncing entries as before
        await wait_for(lambda: ledger(fresh).digest() == ledger(v).digest())


async def test_a_cut_the_cutter_cannot_make_is_counted_and_the_node_goes_on(tmp_path, monkeypatch):
    import node.ledger.service as service
    from node.wire import LocalProtocolError

    async with open_ledger_node(tmp_path, "t", TRAINER, NO_CUTS) as t, \
            open_ledger_node(tmp_path, "v", VALIDATOR, NO_CUTS) as v:
        await connect(t, v)
        await some_history(t, v, 3)

        def too_big(*_a):
            raise LocalProtocolError("envelope.payload: length > 4194304")

        monkeypatch.setattr(service, "sign_cut", too_big)
        assert await ledger(t).cut_now() is None and ledger(t).cuts["failed"] == 1
        monkeypatch.undo()
        assert (await ledger(t).cut_now()).cut.number == 1


async def test_an_old_cut_is_not_fetched_again_and_pages_out_of_range_are_refused(tmp_path):
    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        t, v, _entries = await victim_with_history(stack, tmp_path)
        first = await ledger(t).cut_now()
        await wait_for(lambda: ledger(v).ledger.cut_number == 1)
        replayed = ledger(t)._cut_raw
        # a peer announcing the cut we are based on (or an older one) is not asked for it
        asked = []

        def answer(msg):
            asked.append(type(msg).__name__)
            return serving(replayed, 1)(msg)

        async with mallory(v, answer) as old:
            await ledger(v).sync_with(old)
        assert "CutPageRequest" not in asked and ledger(v).store.latest_cut()[1] == first.hash
        # asking our node for a page past the end of its cut is the asker's fault
        async with open_swarm_host(Identity.generate(), LOOPBACK) as client:
            peer = await client.connect(t.host.listen_addrs()[0])
            stream = await client.open_stream(peer, PROTOCOL_CUTS)
            await write_frame(stream, SyncHello(heads=()))
            hello = await read_message(stream)
            assert (hello.cut_number, hello.cut_hash) == (1, first.hash)
            await write_frame(stream, CutPageRequest(id=3, number=1, index=0))
            page = await read_message(stream)
            assert page.count == 1 and page.data == replayed
            await write_frame(stream, CutPageRequest(id=4, number=1, index=1))
            await wait_for(lambda: ledger(t).rejections.get(f"{PROTOCOL}/bad-cut-page", 0) == 1)
            assert t.context.peers.table.score(client.peer_id, trio.current_time()) < 0


async def test_a_replica_that_missed_cuts_adopts_the_newest_and_stays_whole(tmp_path):
    quiet = run_config(cut_every=0, sync_interval=3600)  # gossip only: the validator hears of no cut meanwhile
    async with open_ledger_node(tmp_path, "t", TRAINER, quiet) as t, \
            open_ledger_node(tmp_path, "v", VALIDATOR, quiet) as v:
        await connect(t, v)
        entries = await some_history(t, v, 4)
        await ledger(t).cut_now()
        entries += await some_history(t, v, 4, start=4)
        second = await ledger(t).cut_now()
        entries += await some_history(t, v, 2, start=8)
        await wait_for(lambda: ledger(t).digest() == ledger(v).digest())
        assert ledger(v).ledger.cut_number == 0
        await ledger(v).sync_with(t.host.peer_id)
        # cut 2 follows a cut it never took: nothing to replay it from, the trainer's signature decides
        assert ledger(v).ledger.cut_number == 2 and ledger(v).store.latest_cut()[1] == second.hash
        assert ledger(v).cuts == {"adopted": 1}
        assert ledger(v).digest() == ledger(t).digest() and ledger(v).totals() == keeper(entries).totals()
        await wait_for(lambda: ledger(v).store.count() == len(entries) - sum(log.seq for log in second.cut.logs))


def test_the_catch_up_figure_compares_like_with_like():
    """bench/ledger.py --catch-up: both new nodes reach one state; the one from a cut stores only what is above."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import ledger as bench  # noqa: E402  bench/ledger.py

    entries = bench.make_history(400)
    whole = trio.run(bench.catch_up, entries, 0)
    from_cut = trio.run(bench.catch_up, entries, 300)
    assert (whole.stored, from_cut.stored) == (400, 100)
    assert whole.digest == from_cut.digest and whole.totals == from_cut.totals
    assert from_cut.wire_bytes < whole.wire_bytes


def test_a_cut_below_what_the_replica_adopted_or_at_other_heads_is_refused():
    """cutsync.refusal, pure: a newer cut that reaches below our bases would need entries we pruned; one
    naming another entry than ours at a head we hold disagrees with our history."""
    import test_ledger_cut as pure
    from node.ledger.cut import open_cut, rebase
    from node.ledger.cutsync import refusal

    entries = pure.history(6, seed=21)
    whole = pure.new_ledger()
    assert pure.deliver(whole, entries) == []

    def cut_of(k, **kw):
        maker = pure.new_ledger()
        assert pure.deliver(maker, entries[:k]) == []
        return make_cut(maker, time_ms=pure.NOW, keep_versions=4, keep_steps=4, **kw)

    first = open_cut(sign_cut(pure.T1, cut_of(3 * len(entries) // 4)), pure.new_ledger())
    based = rebase(whole, first)
    bases = {log.author: log.seq for log in first.cut.logs}
    lower = open_cut(sign_cut(pure.T1, cut_of(len(entries) // 2, number=2, prev=first.hash)), based)
    assert refusal(based, lower, bases, based.history, pure.new_ledger) == "below-our-cut"

    cut = cut_of(len(entries) // 2)
    logs = (dataclasses.replace(cut.logs[0], hash=b"\7" * 32),) + cut.logs[1:]
    other = open_cut(sign_cut(pure.T1, dataclasses.replace(cut, logs=logs)), pure.new_ledger())
    assert refusal(whole, other, {}, whole.history, pure.new_ledger) == "other-heads"
    honest = open_cut(sign_cut(pure.T1, cut), pure.new_ledger())
    assert refusal(whole, honest, {}, whole.history, pure.new_ledger) is None


def test_a_hello_without_a_cut_is_the_bytes_older_nodes_send_and_read():
    from node.wire import decode, encode

    from node.ledger.chain import Head

    heads = (Head(TRAINER.peer_id, 3, b"\1" * 32, 0),)
    plain = SyncHello(heads=heads).to_wire()
    assert set(plain) == {"t", "v", "heads"}
    assert decode(encode(SyncHello(heads=heads))) == SyncHello(heads=heads)
    based = SyncHello(heads=heads, cut_number=4, cut_hash=b"\2" * 32)
    assert decode(encode(based)) == based
