"""A run upgraded node by node: nodes of the release before ledger cuts beside nodes holding a cut.

A node of the release before cuts speaks ``/swarm/ledger/1.0.0`` only, and its decoder refuses a
SyncHello carrying ``cut_number``/``cut_hash`` as ``unknown-field`` and scores the sender down. So the
cut-aware session goes on ``/swarm/ledger/1.1.0``, offered first; 1.0.0 is still served (a hello
without cut fields) and is what a caller falls back to when the peer does not speak 1.1.0.

The older node is emulated by a real ledger service that offers and serves 1.0.0 only
(``SYNC_PROTOCOLS``), whose handler records every byte it reads: no cut field may reach it.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio

from node.identity import Identity
from node.ledger import service as service_mod
from node.ledger.messages import PROTOCOL, PROTOCOL_CUTS, CutPageRequest, SyncHello
from node.net.host import open_swarm_host
from node.wire import decode, read_frame, write_frame
from test_ledger_cut_sync import some_history
from test_ledger_sync import LOOPBACK, TRAINER, VALIDATOR, WORKER, connect, ledger, open_ledger_node, run_config
from waiting import wait_for

QUIET = run_config(cut_every=0, sync_interval=3600)  # sessions only when the test calls sync_with


class Recording:
    """A stream whose reads are kept (what an older node's decoder would have seen)."""

    def __init__(self, stream, seen: list[bytes]) -> None:
        self._stream, self._seen = stream, seen

    def __getattr__(self, name):
        return getattr(self._stream, name)

    async def read(self, n: int | None = None) -> bytes:
        data = await self._stream.read(n)
        self._seen.append(data)
        return data


async def older_node(stack: AsyncExitStack, monkeypatch, tmp_path, name: str, identity: Identity, seen: list[bytes]):
    """A ledger node that offers and serves /swarm/ledger/1.0.0 only, recording what it reads there."""
    with monkeypatch.context() as m:
        m.setattr(service_mod, "SYNC_PROTOCOLS", (PROTOCOL,), raising=False)
        node = await stack.enter_async_context(open_ledger_node(tmp_path, name, identity, QUIET))
    handler = ledger(node).sync_handlers()[PROTOCOL]

    async def recording(stream) -> None:
        await handler(Recording(stream, seen))

    node.host.set_handler(PROTOCOL, recording)
    return node


async def completes(caller, answerer) -> None:
    """One sync session of ``caller`` with ``answerer`` runs to its end."""
    before = dict(ledger(caller).syncs)
    await ledger(caller).sync_with(answerer.peer_id)
    after = dict(ledger(caller).syncs)
    assert after.get("ok", 0) > before.get("ok", 0) and after.get("failed", 0) == before.get("failed", 0), after


def no_sync_faults(*nodes) -> None:
    now = trio.current_time()
    for a in nodes:
        assert not [k for k in ledger(a).rejections if k.startswith("/swarm/ledger/")], ledger(a).rejections
        for b in nodes:
            if a is not b:
                assert a.context.peers.table.score(b.peer_id, now) >= 0, (a.peer_id, b.peer_id)


async def test_a_node_holding_a_cut_and_one_that_speaks_only_1_0_0_sync_both_ways_without_penalties(tmp_path, monkeypatch):
    seen: list[bytes] = []
    async with AsyncExitStack() as stack:
        t = await stack.enter_async_context(open_ledger_node(tmp_path, "t", TRAINER, QUIET))
        old = await older_node(stack, monkeypatch, tmp_path, "old", VALIDATOR, seen)
        await connect(t, old)
        entries = await some_history(t, old, 4)
        await wait_for(lambda: ledger(t).digest() == ledger(old).digest())
        opened = await ledger(t).cut_now()  # the trainer now holds nothing below its cut
        assert ledger(t).store.count() == 0
        entries += await some_history(t, old, 2, start=4)
        await wait_for(lambda: ledger(t).digest() == ledger(old).digest())

        # new -> old: 1.1.0 refused at negotiation, the session goes on 1.0.0 without cut fields
        for _ in range(2):  # and again (the peer is remembered as one on 1.0.0)
            await completes(t, old)
        # old -> new: on 1.0.0 the answer names no cut
        await completes(old, t)
        assert ledger(old).ledger.cut_number == 0 and ledger(old).store.count() == len(entries)  # history kept

        # an older node that is empty asks the trainer for ranges it pruned: nothing, and no penalty
        late = await older_node(stack, monkeypatch, tmp_path, "late", Identity.generate(), seen)
        await connect(late, t)
        await completes(late, t)
        assert ledger(late).ledger.cut_number == 0

        # a new node joining through the older node alone catches up over 1.0.0 (the whole history)
        w = await stack.enter_async_context(open_ledger_node(tmp_path, "w", WORKER, QUIET))
        await connect(w, old)
        await completes(w, old)
        await wait_for(lambda: ledger(w).digest() == ledger(old).digest() == ledger(t).digest(), what="w caught up")
        assert ledger(w).totals() == ledger(t).totals()

        assert seen and b"cut_number" not in b"".join(seen) and b"cut_hash" not in b"".join(seen)
        no_sync_faults(t, old, w)
        no_sync_faults(t, late)

        # raw: the trainer's answer on 1.0.0 is the bytes an older node reads; on 1.1.0 it names the cut
        async with open_swarm_host(Identity.generate(), LOOPBACK) as client:
            peer = await client.connect(t.host.listen_addrs()[0])
            for protocol, named in ((PROTOCOL, False), (PROTOCOL_CUTS, True)):
                stream = await client.open_stream(peer, protocol)
                await write_frame(stream, SyncHello(heads=()))
                data = await read_frame(stream)
                await stream.close()
                hello = decode(data)
                assert (b"cut_number" in data) is named
                assert (hello.cut_number, hello.cut_hash) == ((1, opened.hash) if named else (0, b""))
            # no cut pages on 1.0.0 (the older release has no such message): the asker is at fault
            stream = await client.open_stream(peer, PROTOCOL)
            await write_frame(stream, SyncHello(heads=()))
            assert await read_frame(stream) is not None
            await write_frame(stream, CutPageRequest(id=1, number=1, index=0))
            await wait_for(lambda: ledger(t).rejections.get(f"{PROTOCOL}/unexpected-message", 0) == 1)
            assert t.context.peers.table.score(client.peer_id, trio.current_time()) < 0
