"""A download short of ``max_peers`` direct peers dials public members (node/shards/peering.py,
``DialBook``), found in membership's view: real nodes (the core of every role:
ledger, shards, relay side, membership, dial-back) on loopback.

Membership here keeps one connection (``conn_low = 1``), so that nothing but the download dials:
the downloader holds only its connection to the origin, and learns of the other holder through
membership's records alone.
"""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack
from pathlib import Path

import trio

from node.config import RunConfig
from node.identity import Identity, load_or_create_identity
from node.net.host import open_swarm_host
from node.shards.protocol import PROTOCOL, Bitfield, Hello, read_shards_message
from node.shards.testing import StaticMembers, open_shards_swarm, same_files, write_checkpoint
from node.wire import write_frame

from swarmtest import node_config, open_nodes
from test_shards_swarm import reached_over_a_circuit
from waiting import wait_for

MiB = 1 << 20


async def test_a_download_dials_a_public_member_it_learned_of_through_membership(tmp_path: Path) -> None:
    origin, _ = load_or_create_identity(tmp_path / "o")
    run = RunConfig(name="test", trainers=[origin.peer_id], tables={
        "membership": {"conn_low": 1},
        # The origin's uplink is the narrow one, so a downloader that reaches the other holder uses it.
        "shards": {"upload_rate": MiB, "announce_interval": 0.5, "request_timeout": 2.0, "progress": False},
    })
    configs = [node_config(tmp_path, name, run=run) for name in ("o", "h", "d")]
    src = write_checkpoint(tmp_path / "ckpt", 4 * MiB, seed=3)
    with trio.fail_after(120):
        async with open_nodes(configs) as (o, h, d):
            await wait_for(lambda: h.peer_id in d.membership.members(), what="the downloader knows the holder")
            assert h.peer_id not in d.host.connected_peers()  # nobody dialled it
            signed = await o.shards.publish(src, 1)
            # The peers a transfer uses are not for membership to prune (gossip/service.py protected()).
            await wait_for(lambda: {o.peer_id, h.peer_id} <= d.shards.peers_in_use(),
                           what="the downloader's sessions with both holders are in use")
            # The origin's upload is not: its downloaders chose themselves (a Sybil crowd of them,
            # all protected, would leave membership only honest peers to prune; see below).
            assert d.peer_id not in o.shards.peers_in_use()
            path = await d.shards.wait_version(1)
            assert same_files(src, path)
            received = {peer: n for (peer, root), n in d.shards.receipts().items() if root == signed.root.hex()}
            assert received.get(h.peer_id, 0) > 0, received
            assert h.peer_id in d.host.direct_peers()


async def test_peers_downloading_from_us_are_not_in_use(tmp_path: Path) -> None:
    """Review of issue 46 (eclipse): membership never prunes the peers in use, so these must be
    peers our downloads chose. Five raw hosts open a transfer session to a seeder, send their Hello
    and go silent (a session may rest with no deadline): none of them is in use, so a crowd of such
    keys cannot make membership prune every honest connection above ``conn_high`` instead."""
    trainer = Identity.generate()
    src = write_checkpoint(tmp_path / "ckpt", MiB, seed=8)
    with trio.fail_after(60):
        async with open_shards_swarm() as swarm, AsyncExitStack() as stack:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=[trainer.peer_id], role="trainer",
                                announce_interval=0.5, progress=False)
            signed = await t.shards.publish(src, 1)
            silent = []
            for _ in range(5):
                host = await stack.enter_async_context(open_swarm_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]))
                await host.connect(t.host.listen_addrs()[0])
                stream = await host.open_stream(t.peer_id, PROTOCOL)
                await write_frame(stream, Hello(root=signed.root, bitfield=b""))
                assert isinstance(await read_shards_message(stream), Bitfield)
                silent.append(host.peer_id)
            await wait_for(lambda: t.shards.downloaders_of(signed.root) == set(silent),
                           what="the seeder holds a session for each silent downloader")
            in_use = t.shards.peers_in_use()
    assert in_use == set()


async def download_past_a_circuit(tmp_path: Path, fakes: dict[str, tuple[str, list[str]]]) -> None:
    """The downloader holds a relay circuit to the trainer and nothing else but the relay; its
    membership view lists the trainer, the relay and ``fakes``. It must get bytes from the trainer,
    directly: the trainer's dial is not lost among the fakes'."""
    src = write_checkpoint(tmp_path / "ckpt", 4 * MiB, seed=6)
    with trio.fail_after(90):
        async with open_shards_swarm() as swarm, trio.open_nursery() as services:
            r, _, t, d = await reached_over_a_circuit(swarm, services, tmp_path, upload_rate=MiB)
            d.shards.rng.seed(4)
            d.shards.use_members(StaticMembers({t.peer_id: ("public", t.host.transport_addrs()),
                                                r.peer_id: ("public", r.host.transport_addrs())} | fakes))

            signed = await t.shards.publish(src, 3)
            assert same_files(src, await d.shards.wait_version(3))
            received = {peer: n for (peer, root), n in d.shards.receipts().items() if root == signed.root.hex()}
            assert received.get(t.peer_id, 0) > 0, received
            assert t.peer_id in d.host.direct_peers()
            services.cancel_scope.cancel()


async def test_a_download_dials_a_public_member_it_holds_only_a_relay_circuit_to(tmp_path: Path) -> None:
    """A NAT'd node's connections from public members are relay circuits (they dialled its relayed
    address), which carry no checkpoint bytes. Its download dials such a member's direct address all
    the same: the circuit no longer stands for a connection (py-libp2p's connect returned at once
    on any connection, so the dial did nothing and the member's upload was lost to it)."""
    await download_past_a_circuit(tmp_path, {})


async def test_a_crowd_of_fake_public_records_does_not_hide_a_member_we_hold_a_circuit_to(tmp_path: Path) -> None:
    """Review of issue 46: 200 member records claim ``public`` at a black hole (a listener that
    never accepts: a dial's TCP handshake completes, its Noise handshake never does, and it holds
    a dial slot for DIAL_TIMEOUT). The circuit is evidence the trainer exists: it is dialled first,
    not drawn among the fakes (before: ~3 of 202 every 10 s, so the download ended, through the
    relay, before the trainer was dialled)."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(1024)
        addr = f"/ip4/127.0.0.1/tcp/{hole.getsockname()[1]}"
        fakes = {Identity.from_seed(bytes([1, k]) * 16).peer_id: ("public", [addr]) for k in range(200)}
        await download_past_a_circuit(tmp_path, fakes)
