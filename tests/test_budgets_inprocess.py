"""Slot hogging and frame bloat against real nodes (libp2p hosts on loopback, one trio run).

Each test replays an attack of issue 14 from a hostile node that opens raw streams, then checks
what the node's per-protocol budget (node/net/budget.py, its counters via ``host.inbound``) and
peer table say, never elapsed time:

* 16 silent rollout streams (2 header bytes each) took every intake slot for 30 s; now the hostile
  peer holds only its share, an honest batch is acknowledged while those streams are still open,
  and the hostile peer is struck when its header deadline passes;
* 48 ledger-sync streams each announcing a 4 MiB frame and sending 3.5 MiB were all buffered; now
  at most the peer's byte share is reserved and every other stream is refused before its body;
* four silent status streams denied status to everyone; now another peer is answered at once;
* and on every protocol a relay answers with our framing, silent streams are cut and struck.
"""

from __future__ import annotations

import struct

import pytest
import trio
from swarmtest import node_config, open_nodes
from waiting import wait_for

from node.config import RunConfig
from node.identity import load_or_create_identity
from node.ledger.service import PROTOCOL as LEDGER_PROTOCOL, SYNC_LIMITS
from node.net.budget import PEER_BYTES, PEER_STREAMS
from node.peers.service import STALL_SOURCE
from node.net.reqres import Codec, call
from node.rollouts.schema import ROLLOUTS_PROTOCOL, RolloutAck
from node.status import STATUS_PROTOCOL, call_status
from node.trainer.testing import reversal_batch, sign_batch
from node.wire import MAX_FRAME, decode_as

# Long enough that an honest exchange on a loaded machine ends well inside it, short enough that
# the test then sees the stall strike soon.
STREAMS = {"header_timeout": 6.0}
MIB = 1024 * 1024
ACK = Codec(4096, lambda frame: decode_as(RolloutAck, frame, 4096))


async def hold_streams(nursery, node, target: str, protocol: str, n: int, payload: bytes, opened: list) -> None:
    """Open ``n`` streams from ``node`` to ``target`` and write ``payload`` on each, then keep them
    open (until the test ends or the target cuts them)."""

    async def one() -> None:
        try:
            stream = await node.host.open_stream(target, protocol)
            opened.append(stream)
            await stream.write(payload)
            await trio.sleep_forever()
        except Exception:  # noqa: BLE001 — the target resets refused streams: that is the point
            pass

    for _ in range(n):
        nursery.start_soon(one)


async def test_silent_rollout_streams_take_only_their_share_and_are_struck(tmp_path):
    trainer_id, _ = load_or_create_identity(tmp_path / "trainer")
    run = RunConfig(name="test", trainers=[trainer_id.peer_id])
    run.tables.update(trainer={"init_warmup_steps": 0}, grpo={"min_batch_samples": 1000}, streams=dict(STREAMS))
    cfgs = [node_config(tmp_path, n, "trainer" if n == "trainer" else "relay", run=run)
            for n in ("trainer", "hostile", "honest")]
    async with open_nodes(cfgs) as (tnode, hostile, honest):
        budget = tnode.host.inbound[ROLLOUTS_PROTOCOL].budget
        per_peer = budget.limits.streams_per_peer
        assert per_peer < budget.limits.streams == 16
        await honest.host.connect(tnode.host.listen_addrs()[0])
        async with trio.open_nursery() as nursery:
            await hold_streams(nursery, hostile, tnode.peer_id, ROLLOUTS_PROTOCOL, 16, b"\x00\x01", [])
            await wait_for(lambda: budget.held_by(hostile.peer_id)[0] == per_peer
                           and budget.refused[PEER_STREAMS] == 16 - per_peer, what="hostile streams admitted/refused")
            trainer = tnode.trainer
            policy = trainer.policy
            batch = sign_batch(honest.identity, reversal_batch(
                honest.identity, "test", step=0, policy_version=policy.step, tokenizer=policy.tokenizer,
                prompts=2, group_size=4, seed=1, policy_root=trainer.shards.announced[policy.step][0]))
            ack = await call(honest.host, tnode.peer_id, ROLLOUTS_PROTOCOL, batch, 60.0, reply=ACK)
            assert ack.accepted, ack.reason
            # Acknowledged while the hostile peer still holds its silent streams: it never waited on them.
            assert budget.held_by(hostile.peer_id)[0] == per_peer
            assert budget.stalled == 0
            # At the header deadline the hostile streams are cut and the peer struck: once, for they
            # stalled together (a peer stalling event after event is banned: tests/test_stall_strikes.py).
            await wait_for(lambda: budget.held_by(hostile.peer_id) == (0, 0), what="hostile streams cut")
            assert budget.stalled == per_peer
            assert tnode.peers.table.peers[hostile.peer_id].last.startswith(f"{STALL_SOURCE}/stalled")
            assert tnode.peers.table.peers[hostile.peer_id].strikes[STALL_SOURCE]
            assert not tnode.peers.is_banned(honest.peer_id)
            nursery.cancel_scope.cancel()


async def test_ledger_sync_buffers_at_most_the_peers_byte_share(tmp_path):
    run = RunConfig(name="test")
    run.tables.update(streams={**STREAMS, "min_body_rate": 16384.0})  # the held bodies stay held for the test
    cfgs = [node_config(tmp_path, n, run=run) for n in ("target", "hostile")]
    async with open_nodes(cfgs) as (target, hostile):
        budget = target.host.inbound[LEDGER_PROTOCOL].budget
        announced, sent = 4 * MIB, int(3.5 * MIB)
        assert announced <= MAX_FRAME
        payload = struct.pack(">I", announced) + b"\x00" * sent
        async with trio.open_nursery() as nursery:
            opened: list = []
            await hold_streams(nursery, hostile, target.peer_id, LEDGER_PROTOCOL, 48, payload, opened)
            held = SYNC_LIMITS.buffer_per_peer // announced  # frames that fit the peer's share: 2
            # Every stream is either holding a reservation or refused before its body was read.
            await wait_for(lambda: budget.refused[PEER_STREAMS] + budget.refused[PEER_BYTES] == 48 - held,
                           what="all 48 streams judged")
            assert budget.reserved == held * announced == SYNC_LIMITS.buffer_per_peer
            assert budget.peak_reserved <= SYNC_LIMITS.buffer_per_peer < SYNC_LIMITS.buffer_bytes
            assert budget.peak_peer_reserved == held * announced
            snapshot = (await call_status(hostile.host, target.host.listen_addrs()[0]))["streams"][LEDGER_PROTOCOL]
            assert snapshot["bytes"] == held * announced and snapshot["refused"][PEER_STREAMS] >= 1
            nursery.cancel_scope.cancel()


async def test_silent_status_streams_do_not_deny_status_to_another_peer(tmp_path):
    run = RunConfig(name="test")
    run.tables.update(streams=dict(STREAMS))
    cfgs = [node_config(tmp_path, n, run=run) for n in ("target", "hostile", "honest")]
    async with open_nodes(cfgs) as (target, hostile, honest):
        budget = target.host.inbound[STATUS_PROTOCOL].budget
        per_peer = budget.limits.streams_per_peer
        async with trio.open_nursery() as nursery:
            await hold_streams(nursery, hostile, target.peer_id, STATUS_PROTOCOL, 6, b"", [])
            await wait_for(lambda: budget.held_by(hostile.peer_id)[0] == per_peer
                           and budget.refused[PEER_STREAMS] == 6 - per_peer, what="hostile status streams held")
            status = await call_status(honest.host, target.host.listen_addrs()[0])
            assert status["peer_id"] == target.peer_id
            assert budget.held_by(hostile.peer_id)[0] == per_peer  # answered while they were held
            await wait_for(lambda: budget.stalled == per_peer, what="hostile status streams cut")
            assert STALL_SOURCE in target.peers.table.peers[hostile.peer_id].strikes
            nursery.cancel_scope.cancel()


def relay_protocols() -> list[str]:
    from node.gossip.service import PROBE_PROTOCOL, SYNC_PROTOCOL
    from node.reach.dialback import DIALBACK_PROTOCOL
    from node.net.host import PING_PROTOCOL
    from node.shards.protocol import PROTOCOL as SHARDS_PROTOCOL

    return [STATUS_PROTOCOL, LEDGER_PROTOCOL, SHARDS_PROTOCOL, SYNC_PROTOCOL, PROBE_PROTOCOL, str(PING_PROTOCOL),
            DIALBACK_PROTOCOL]


@pytest.mark.parametrize("protocol", relay_protocols())
async def test_every_budgeted_protocol_cuts_and_strikes_silent_streams(tmp_path, protocol):
    """Each protocol a relay answers with our framing: one peer's silent streams hold only its
    share (the rest refused at once) and are cut and struck at the header deadline."""
    run = RunConfig(name="test")
    run.tables.update(streams={"header_timeout": 2.0})
    cfgs = [node_config(tmp_path, n, run=run) for n in ("target", "hostile")]
    async with open_nodes(cfgs) as (target, hostile):
        budget = target.host.inbound[protocol].budget
        share = budget.limits.streams_per_peer
        assert share < budget.limits.streams
        async with trio.open_nursery() as nursery:
            await hold_streams(nursery, hostile, target.peer_id, protocol, share + 2, b"", [])
            await wait_for(lambda: budget.stalled + budget.held_by(hostile.peer_id)[0] >= share
                           and budget.refused[PEER_STREAMS] == 2, what=f"{protocol}: share held, the rest refused")
            # All cut at the deadline and struck as one event (they stalled together): not banned, so
            # the hostile node's own pings may take a ping slot again meanwhile.
            await wait_for(lambda: budget.stalled == share, what=f"{protocol}: silent streams cut")
            assert target.peers.table.peers[hostile.peer_id].strikes[STALL_SOURCE]
            assert not target.peers.is_banned(hostile.peer_id, STALL_SOURCE)
            nursery.cancel_scope.cancel()


async def test_pings_are_answered_under_the_budget(tmp_path):
    """Our own ping (node/net/host.py) against the budgeted handler, and its streams are given back."""
    from node.net.host import PING_PROTOCOL

    cfgs = [node_config(tmp_path, n) for n in ("a", "b")]
    async with open_nodes(cfgs) as (a, b):
        budget = a.host.inbound[PING_PROTOCOL].budget
        for _ in range(3 * budget.limits.streams_per_peer):  # more than its share, one after another
            assert await b.host.ping(a.peer_id) >= 0
        assert budget.held_by(b.peer_id) == (1, 0)  # they share the one stream b keeps
        await b.host._ping_streams.pop(a.peer_id).reset()
        await wait_for(lambda: budget.held_by(b.peer_id) == (0, 0), what="ping streams given back")
        assert budget.stalled == 0


async def test_py_libp2p_handlers_take_only_their_share_of_streams(tmp_path):
    """gossipsub's handler (py-libp2p's, no frames of ours): one peer's streams past its share are
    reset at once instead of being served."""
    from node.net.host import GOSSIPSUB_PROTOCOLS
    from node.net.patches.safety import OTHER_STREAMS

    cfgs = [node_config(tmp_path, n) for n in ("target", "hostile")]
    async with open_nodes(cfgs) as (target, hostile):
        protocol = str(GOSSIPSUB_PROTOCOLS[0])
        budget = target.host.inbound[protocol].budget
        held_before = budget.held_by(hostile.peer_id)[0]  # its own gossip stream
        extra = OTHER_STREAMS.streams_per_peer - held_before
        async with trio.open_nursery() as nursery:
            await hold_streams(nursery, hostile, target.peer_id, protocol, extra + 5, b"", [])
            await wait_for(lambda: budget.held_by(hostile.peer_id)[0] == OTHER_STREAMS.streams_per_peer
                           and budget.refused[PEER_STREAMS] >= 5, what="gossipsub streams capped")
            nursery.cancel_scope.cancel()
