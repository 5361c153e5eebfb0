"""Peers that come and go leave no trio tasks behind in the node they visited (issue 45's soak: the
task count grew 36-860 per hour while members churned: a leak, or only more peers?).

A leak. py-libp2p's inbound connection handler, once the upgrade is done, waits for the *swarm* to
stop, not the connection: every inbound connection a node ever accepted kept a task, and kept its
place among the handshakes ``guard_inbound`` admits at once, so the 65th inbound connection of a
node's life was refused. And a host that stopped left its TCP listener running, still accepting.

Everything runs in this trio run, so :func:`node.status.trio_tasks` counts visitors too while they
run; once they have stopped, what it counts is the node's own.
"""

from __future__ import annotations

import trio

from node.identity import Identity
from node.net.host import MAX_PENDING_INBOUND, open_swarm_host
from node.status import trio_tasks

from hosts import LOOPBACK
from swarmtest import node_config, open_nodes
from waiting import wait_for

ROUNDS = 4
VISITORS = 3  # per round
SLACK = 12  # tasks a node may hold beyond its baseline at any one time (a probe, a dial, a sync in flight)


async def settled_tasks(node) -> int:
    """The task count once ``node`` holds no connection and the count has stayed put for 5 s."""
    await wait_for(lambda: not node.host.connected_peers(), what="the visitors' connections let go")
    counts: list[int] = []
    with trio.fail_after(120):
        while len(counts) < 20 or max(counts[-20:]) - min(counts[-20:]) > 2:
            counts.append(trio_tasks())
            await trio.sleep(0.25)
    return min(counts[-20:])


async def test_a_host_that_stopped_leaves_no_listener_behind():
    before = trio_tasks()
    async with open_swarm_host(Identity.generate(), LOOPBACK) as host:
        port = int(host.listen_addrs()[0].split("/tcp/")[1].split("/")[0])
    await wait_for(lambda: trio_tasks() == before, what=f"the tasks back to the {before} before the host")
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return
    await stream.aclose()
    raise AssertionError("the stopped host's port still accepts connections")


async def test_inbound_connections_past_the_handshake_limit_are_admitted_and_leave_no_task():
    async with open_swarm_host(Identity.generate(), LOOPBACK) as hub, \
            open_swarm_host(Identity.generate(), LOOPBACK) as client:
        addr = hub.listen_addrs()[0]
        base = trio_tasks()
        for i in range(MAX_PENDING_INBOUND + 8):  # one after another: never more than one in its handshake
            with trio.fail_after(30):
                await client.connect(addr)
                await client.ping(hub.peer_id)
            await client.disconnect(hub.peer_id)
            await wait_for(lambda: not hub.is_connected(client.peer_id), what=f"connection {i} let go")
        await wait_for(lambda: trio_tasks() <= base + SLACK,
                       what=f"the hub's tasks back near {base} after {MAX_PENDING_INBOUND + 8} connections")


async def test_silent_connections_still_hold_their_handshake_places():
    """What guard_inbound is for (issue 42): past MAX_PENDING_INBOUND connections that never finish a
    handshake, the next one is closed at once; once they go, connections are admitted again."""
    async with open_swarm_host(Identity.generate(), LOOPBACK) as hub, \
            open_swarm_host(Identity.generate(), LOOPBACK) as client:
        port = int(hub.listen_addrs()[0].split("/tcp/")[1].split("/")[0])
        silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(MAX_PENDING_INBOUND)]
        extra = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(30):
            assert await extra.receive_some(1) == b""  # closed by the hub without a word
        await extra.aclose()
        for s in silent:
            await s.aclose()
        with trio.fail_after(30):
            while True:  # the hub notices the closes on its own time
                try:
                    await client.connect(hub.listen_addrs()[0])
                    break
                except Exception:
                    await trio.sleep(0.1)
            await client.ping(hub.peer_id)


async def test_departed_peers_leave_no_tasks_behind(tmp_path, fast_membership):
    async with open_nodes([node_config(tmp_path, "hub", "relay", membership=fast_membership)]) as [hub]:
        base = await settled_tasks(hub)
        after: list[int] = []
        for r in range(ROUNDS):
            configs = [node_config(tmp_path, f"v{r}-{i}", "inference", bootstrap=hub.host.listen_addrs()[:1],
                                   membership=fast_membership) for i in range(VISITORS)]
            async with open_nodes(configs) as visitors:
                ids = {v.peer_id for v in visitors}
                await wait_for(lambda: ids <= set(hub.membership.members()), what="the hub sees every visitor")
            after.append(await settled_tasks(hub))
        print(f"hub tasks: baseline {base}, after each round of {VISITORS} visitors {after}")
        assert max(after) <= base + SLACK, (base, after)
