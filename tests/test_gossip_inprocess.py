"""Several real nodes in one trio run over loopback sockets: convergence and garbage on gossip."""

from __future__ import annotations

import trio

from libp2p.peer.id import ID

from node.gossip.membership import MemberState
from node.gossip.records import DOMAIN_RECORD, PeerRecord
from node.net.host import open_swarm_host
from node.identity import Identity
from node.wire import encode, seal

from swarmtest import node_config, open_nodes
from waiting import HANG_GUARD_S, wait_for


def sees_all(nodes) -> bool:
    ids = {n.peer_id for n in nodes}
    return all(set(n.membership.table.alive()) == ids - {n.peer_id} for n in nodes)


async def test_nodes_converge_through_one_bootstrap(tmp_path, fast_membership):
    roles = ["relay", "trainer", "validator", "inference", "inference"]
    configs = [node_config(tmp_path, f"n{i}", role, membership=fast_membership) for i, role in enumerate(roles)]
    async with open_nodes(configs) as nodes:
        await wait_for(lambda: sees_all(nodes), what="every node sees every other alive")
        relay_view = nodes[0].membership.members()
        assert sorted(relay_view.values()) == sorted(roles[1:])


async def test_forged_and_oversized_records_rejected_and_counted(tmp_path, fast_membership):
    configs = [node_config(tmp_path, f"n{i}", membership=fast_membership) for i in range(2)]
    async with open_nodes(configs) as nodes:
        target = nodes[0]
        await wait_for(lambda: sees_all(nodes), what="every node sees every other alive")
        topic = target.topic("members")
        mallory, victim = Identity.generate(), nodes[1]
        async with open_swarm_host(mallory, ["/ip4/127.0.0.1/tcp/0"]) as host:
            await host.pubsub.subscribe(topic)
            await host.connect(target.host.listen_addrs()[0])
            await wait_for(lambda: host.mesh_size(topic) >= 1, what="mallory in the target's mesh")
            victim_record = target.membership.table.members[victim.peer_id].record
            forged = PeerRecord(
                run="test", peer_id=victim.peer_id, role="trainer", addrs=["/ip4/6.6.6.6/tcp/1"],
                software="evil", seq=victim_record.seq + 1000,
            )
            await host.pubsub.publish(topic, encode(seal(mallory, DOMAIN_RECORD, forged)))
            await host.pubsub.publish(topic, b"\x91" * 10_000)  # oversized garbage
            await host.pubsub.publish(topic, b"\xc1")  # invalid msgpack

            def counted() -> bool:
                r = target.metrics.rejections()
                return r.get(f"{topic}/forged", 0) >= 1 and r.get(f"{topic}/oversized", 0) >= 1 and r.get(f"{topic}/malformed", 0) >= 1

            await wait_for(counted)
        record = target.membership.table.members[victim.peer_id].record
        assert record.role == "relay" and record.software != "evil"  # state untouched
        status = target.status["membership"]()
        assert status["rejected"][f"{topic}/forged"] >= 1
        # still running: the victim's real record refresh is still accepted
        victim.membership.update(load=3.0)
        await wait_for(lambda: target.membership.table.members[victim.peer_id].record.load == 3.0)


async def test_metrics_endpoint_on_loopback(tmp_path, fast_membership):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    configs = [node_config(tmp_path, f"n{i}", membership=fast_membership) for i in range(2)]
    configs[0].metrics_port = port
    async with open_nodes(configs) as nodes:
        await wait_for(lambda: sees_all(nodes), what="every node sees every other alive")
        with trio.fail_after(HANG_GUARD_S):
            while True:  # the gauge follows the table at the next tick
                body = await trio.to_thread.run_sync(
                    lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                )
                if 'swarm_members{state="alive"} 1.0' in body:
                    break
                await trio.sleep(0.2)
    assert "swarm_messages_in_total" in body and "swarm_tcp_bytes_total" in body
    # Payload by protocol: membership's push-pull and gossipsub both moved bytes by now.
    sent = {line.split('protocol="')[1].split('"')[0]: float(line.split()[-1])
            for line in body.splitlines() if line.startswith("swarm_stream_bytes_total{") and 'direction="sent"' in line}
    assert sent.get("/swarm/members/1.0.0", 0) > 0 and any(p.startswith("/meshsub/") and n > 0 for p, n in sent.items())


async def test_garbage_on_the_gossipsub_stream_does_not_stop_the_node(tmp_path, fast_membership):
    """py-libp2p's own pubsub handler lets a protobuf DecodeError escape; our guard contains it."""
    configs = [node_config(tmp_path, f"n{i}", membership=fast_membership) for i in range(2)]
    async with open_nodes(configs) as nodes:
        target = nodes[0]
        await wait_for(lambda: sees_all(nodes), what="every node sees every other alive")
        async with open_swarm_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as mallory:
            await mallory.connect(target.host.listen_addrs()[0])
            for payload in (b"\x05\xff\xff\xff\xff\xff", b"\x03\x0a\xff\x01"):  # varint length + bad protobuf
                stream = await mallory.open_stream(target.peer_id, "/meshsub/1.1.0")
                await stream.write(payload)
            await wait_for(lambda: sum(target.host.handler_errors.counts.values()) >= 1)
        # the node still works: a record change from the other node still arrives
        nodes[1].membership.update(load=7.0)
        await wait_for(lambda: target.membership.table.members[nodes[1].peer_id].record.load == 7.0)


async def test_pruned_connections_are_announced_and_nobody_is_suspected(tmp_path, fast_membership):
    """More members than connections allowed: the managers prune, announcing it, and since probes
    follow the connections and an announced close is no failure, everyone stays alive.

    Probe timeouts are relaxed so that a machine starved by other work cannot fail a probe: what is
    tested is that pruning causes no suspicion, not how fast a starved node answers."""
    tight = dict(fast_membership, conn_low=2, conn_high=3, probe_timeout=5.0, indirect_timeout=10.0)
    configs = [node_config(tmp_path, f"n{i}", membership=tight) for i in range(6)]
    async with open_nodes(configs) as nodes:
        await wait_for(lambda: sees_all(nodes), what="every node sees every other alive")
        svcs = [n.membership for n in nodes]
        await wait_for(lambda: sum(s.closes["pruned_by_peer"] for s in svcs) >= 2, what="two announced prunes")
        # Each node answers probes across the pruning: many chances to suspect someone wrongly.
        ok_before = [s.table.probes["ok"] for s in svcs]
        await wait_for(lambda: all(s.table.probes["ok"] >= b + 10 for s, b in zip(svcs, ok_before)),
                       what="ten more successful probes by every node")
        assert [s.table.entered[MemberState.SUSPECT] for s in svcs] == [0] * len(svcs)
        assert [s.table.probes["failed"] for s in svcs] == [0] * len(svcs)
        assert sees_all(nodes)
        # Bounded: the managers bring every node to at most conn_high (+1: a dial in flight).
        await wait_for(lambda: all(len(n.host.connected_peers()) <= 3 + 1 for n in nodes[1:]), what="connections pruned")
        assert all(s.status()["mesh"] >= 1 for s in svcs)  # gossip still has a mesh to travel on


async def test_py_libp2p_does_not_dial_on_its_own(tmp_path):
    """Our connection manager is the only dialer: py-libp2p's auto-connector is switched off."""
    async with open_swarm_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as a, \
            open_swarm_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as b:
        network = a.host.get_network()
        a.host.get_peerstore().add_addrs(b.host.get_id(), b.host.get_addrs(), 3600)
        dials = []
        real_dial = network.dial_peer

        async def counting_dial(peer_id, *args, **kwargs):
            dials.append(peer_id)
            return await real_dial(peer_id, *args, **kwargs)

        network.dial_peer = counting_dial
        # py-libp2p's cycle awaits its dials inside maybe_connect: had it dialled, we would see it now.
        await network.auto_connector.maybe_connect()
        assert dials == [] and a.connected_peers() == []
        await a.connect(b.listen_addrs()[0])  # and the counter does see a real dial
        assert dials and a.connected_peers()


async def test_an_indirect_probe_dials_only_members_at_their_recorded_addresses(tmp_path, fast_membership):
    """A ping request naming an arbitrary address made the node dial it (32 connections from 12
    requests): anyone could aim a node's dials at a third party."""
    from node.gossip.service import PROBE_PROTOCOL, PingRequest, PingResult
    from node.net.reqres import call, messages

    accepted = []
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    aim = [f"/ip4/127.0.0.1/tcp/{port}"]

    async def count(listener):
        while True:
            conn = await listener.accept()
            accepted.append(conn)

    configs = [node_config(tmp_path, f"n{i}", membership=fast_membership) for i in range(2)]
    async with open_nodes(configs) as nodes, trio.open_nursery() as nursery:
        nursery.start_soon(count, listeners[0])
        await wait_for(lambda: sees_all(nodes), what="every node sees every other alive")
        target, member = nodes[0], nodes[1]
        async with open_swarm_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as mallory:
            await mallory.connect(target.host.listen_addrs()[0])
            for named in (Identity.generate().peer_id, member.peer_id):  # a stranger, and a member at our address
                res = await call(mallory, target.peer_id, PROBE_PROTOCOL, PingRequest(target=named, addrs=aim),
                                 timeout=30, reply=messages(PingResult))
                assert res.ok == (named == member.peer_id)  # the member answers at its own address
        assert accepted == []
        nursery.cancel_scope.cancel()
    for conn in accepted:
        await conn.aclose()


async def test_an_accusation_flood_by_a_non_prober_never_takes_a_live_member_out(tmp_path, fast_membership):
    """Issue 14, attack 4, against a real node: a peer that never probed the victim publishes 50
    DEAD and 49 SUSPECT accusations at 9 msg/s (under py-libp2p's 10 msg/s per peer and topic),
    at the victim's current seq and every tenth at the forged seq 2**63 - 1. The relay never takes
    the victim out of its live set (sampled throughout, and no state change at all); the victim
    refutes, and after ``refuted_limit`` refutations the relay ignores the accuser and scores it
    down. (At this pace refutations come before the accuser's token bucket runs dry: the bucket
    is tested in test_membership.py.)

    Probe timeouts are relaxed so that a starved machine cannot make the relay suspect the victim
    on its own: what is tested is what the accusations do."""
    from node.gossip.records import DOMAIN_DEAD, DOMAIN_SUSPECT, Accusation
    from node.gossip.membership import Verdict

    relaxed = dict(fast_membership, probe_timeout=5.0, indirect_timeout=10.0)
    configs = [node_config(tmp_path, f"n{i}", membership=relaxed) for i in range(2)]
    async with open_nodes(configs) as nodes:
        relay, victim = nodes
        await wait_for(lambda: sees_all(nodes), what="every node sees every other alive")
        table, topic = relay.membership.table, relay.topic("members")
        seq_before = victim.membership.record.seq
        snapshots: list[bool] = []
        mallory = Identity.generate()
        async with open_swarm_host(mallory, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as watch:
            await host.pubsub.subscribe(topic)
            await host.connect(relay.host.listen_addrs()[0])
            await wait_for(lambda: host.mesh_size(topic) >= 1, what="mallory in the relay's mesh")

            async def watch_relay() -> None:
                while True:
                    snapshots.append(victim.peer_id in relay.membership.members()
                                     and table.state_of(victim.peer_id) is MemberState.ALIVE)
                    await trio.sleep(0.005)

            watch.start_soon(watch_relay)
            for i in range(99):
                accused = 2**63 - 1 if i % 10 == 0 else table.members[victim.peer_id].record.seq
                acc = Accusation(run="test", target=victim.peer_id, seq=accused, accuser=mallory.peer_id)
                await host.pubsub.publish(topic, encode(seal(mallory, DOMAIN_DEAD if i < 50 else DOMAIN_SUSPECT, acc)))
                await trio.sleep(1 / 9)  # the attack's pace, not a wait for a result
            await wait_for(lambda: table.distrusted(mallory.peer_id, trio.current_time()),
                           what="the accuser refuted often enough to be ignored")
            await wait_for(lambda: victim.membership.record.seq > seq_before, what="the victim refuted")
            await wait_for(lambda: table.members[victim.peer_id].hearsay is None, what="the refutation reached the relay")
            watch.cancel_scope.cancel()
        assert snapshots and all(snapshots), f"{snapshots.count(False)} of {len(snapshots)} snapshots not alive"
        assert table.entered[MemberState.DEAD] == 0 and table.entered[MemberState.SUSPECT] == 0
        events = {v: relay.metrics.registry.get_sample_value("swarm_membership_events_total", {"verdict": v.value})
                  for v in (Verdict.DIED, Verdict.IGNORED, Verdict.SUSPECTED, Verdict.DISTRUSTED)}
        assert not events[Verdict.DIED] and events[Verdict.IGNORED] >= 1 and events[Verdict.DISTRUSTED] >= 1
        assert events[Verdict.SUSPECTED] <= table.config.refuted_limit
        assert relay.peers.table.score(mallory.peer_id, trio.current_time()) < 0  # scored through node/peers
        assert victim.peers.table.score(mallory.peer_id, trio.current_time()) < 0  # the victim knows it is false
        # Still working: a record change of the victim's arrives.
        victim.membership.update(load=5.0)
        await wait_for(lambda: table.members[victim.peer_id].record.load == 5.0)
        assert victim.peer_id in relay.membership.members()


async def test_throwaway_records_from_one_source_are_budgeted(tmp_path, fast_membership):
    """Issue 14, attack 5, against a real node: records of 30 throwaway identities published by one
    peer at 9 msg/s. The relay admits the source's budget, drops the rest and scores the source down."""
    configs = [node_config(tmp_path, "n0", membership=fast_membership)]
    async with open_nodes(configs) as nodes:
        relay = nodes[0]
        table, topic = relay.membership.table, relay.topic("members")
        mallory = Identity.generate()
        async with open_swarm_host(mallory, ["/ip4/127.0.0.1/tcp/0"]) as host:
            await host.pubsub.subscribe(topic)
            await host.connect(relay.host.listen_addrs()[0])
            await wait_for(lambda: host.mesh_size(topic) >= 1, what="mallory in the relay's mesh")
            fakes = [Identity.generate() for _ in range(30)]
            for fake in fakes:
                rec = PeerRecord(run="test", peer_id=fake.peer_id, role="inference", addrs=["/ip4/127.0.0.1/tcp/9"],
                                 software="x", seq=1)
                await host.pubsub.publish(topic, encode(seal(fake, DOMAIN_RECORD, rec)))
                await trio.sleep(1 / 9)  # the attack's pace (py-libp2p drops over 10 msg/s per peer)
            budget = table.config.new_member_burst
            await wait_for(lambda: table.dropped["limited_members"] >= len(fakes) - budget - 1,
                           what="the source over its budget")
        known = {f.peer_id for f in fakes} & set(table.members)
        assert budget <= len(known) <= budget + 1  # + one token refilled meanwhile at most
        assert relay.peers.table.score(mallory.peer_id, trio.current_time()) < 0


async def test_a_trainer_role_not_in_the_run_file_is_shown_as_unlisted(tmp_path, fast_membership):
    """Anyone may sign "role=trainer" into its own record; status marks it untrusted (issue 14, 12)."""
    from rich.console import Console

    from node.app.status_view import render_status
    from node.config import RunConfig

    listed, pretender = Identity.generate(), Identity.generate()
    run = RunConfig(name="test", trainers=[listed.peer_id])
    async with open_nodes([node_config(tmp_path, "n0", run=run, membership=fast_membership)]) as nodes:
        target = nodes[0]
        topic = target.topic("members")
        async with open_swarm_host(pretender, ["/ip4/127.0.0.1/tcp/0"]) as host:
            await host.pubsub.subscribe(topic)
            await host.connect(target.host.listen_addrs()[0])
            await wait_for(lambda: host.mesh_size(topic) >= 1, what="the pretender in the target's mesh")
            for ident in (pretender, listed):  # both signed by their own key: valid records
                record = PeerRecord(run="test", peer_id=ident.peer_id, role="trainer",
                                    addrs=["/ip4/127.0.0.1/tcp/9"], software="x", seq=1)
                await host.pubsub.publish(topic, encode(seal(ident, DOMAIN_RECORD, record)))
            await wait_for(lambda: {pretender.peer_id, listed.peer_id} <= set(target.membership.table.members),
                           what="both records taken")
            status = target.status["membership"]()
        rows = {r["peer_id"]: r for r in status["members"]}
        assert rows[pretender.peer_id]["role"] == "trainer" and rows[pretender.peer_id]["unlisted"] is True
        assert rows[listed.peer_id]["unlisted"] is False
        assert status["self"]["unlisted"] is False  # a relay claims no run-file role
        console = Console(record=True, width=250)
        render_status({"peer_id": target.peer_id, "role": "relay", "run": "test", "membership": status}, console)
        lines = console.export_text().splitlines()
        assert any(pretender.peer_id[:20] in ln and "trainer (unlisted)" in ln for ln in lines)
        assert any(listed.peer_id[:20] in ln and "trainer" in ln and "unlisted" not in ln for ln in lines)


async def test_a_delivered_message_is_checked_once_by_its_validator_not_again(tmp_path, fast_membership):
    """The topic validator's result for these bytes is what the subscriber gets, without a second
    check at delivery (one more Ed25519 verification per membership record)."""
    from node.gossip.topics import open_checked_topic

    configs = [node_config(tmp_path, f"n{i}", membership=fast_membership) for i in range(2)]
    async with open_nodes(configs) as (a, b):
        await wait_for(lambda: sees_all([a, b]), what="both nodes see each other")
        checked: list[bytes] = []

        def check(data: bytes) -> str:
            checked.append(data)
            return data.decode()

        name = a.topic("checked-once")
        async with open_checked_topic(b, name, check) as topic, open_checked_topic(a, name, lambda d: d) as out:
            await wait_for(lambda: ID.from_base58(a.peer_id) in b.host.pubsub.peer_topics.get(name, ()),
                           what="b knows a subscribes")
            await wait_for(lambda: ID.from_base58(b.peer_id) in a.host.pubsub.peer_topics.get(name, ()),
                           what="a knows b subscribes")
            await out.publish(b"hello")
            async for delivery in topic:
                assert delivery.value == "hello"
                break
        assert checked == [b"hello"]  # twice before: validator, then delivery


async def test_a_burst_of_our_own_messages_all_go_out():
    """A trainer writes a burst of ledger entries at a step (one per batch judged); py-libp2p's
    gossipsub rate limit (10 messages per second per forwarder and topic, on by default) dropped
    the eleventh on, counted against our own score, and the same limit would drop a relay's
    honest forwarding of many authors' messages."""
    topic, burst = "/swarm/test/ledger/1", 30
    a, b = Identity.generate(), Identity.generate()
    async with open_swarm_host(a, ["/ip4/127.0.0.1/tcp/0"]) as sender, \
            open_swarm_host(b, ["/ip4/127.0.0.1/tcp/0"]) as receiver:
        inbox = await receiver.pubsub.subscribe(topic)
        await sender.pubsub.subscribe(topic)
        await sender.connect(receiver.listen_addrs()[0])
        await wait_for(lambda: sender.mesh_size(topic) >= 1, what="the receiver in the sender's mesh")
        for i in range(burst):
            await sender.pubsub.publish(topic, b"entry %d" % i)
        got = set()
        with trio.fail_after(HANG_GUARD_S):
            while len(got) < burst:
                got.add((await inbox.get()).data)
        assert got == {b"entry %d" % i for i in range(burst)}


async def test_the_connection_manager_does_not_prune_peers_a_checkpoint_transfer_uses(tmp_path, fast_membership):
    """A download dials the members it fetches from (node/shards/peering.py): membership pruning
    such a connection above conn_high cut the transfer.
    The bootstrap node, which every joiner connects to, says every other node is in use by a
    transfer: it holds them all, above conn_high, and prunes none (it pruned 5 before)."""
    tight = dict(fast_membership, conn_low=2, conn_high=3, probe_timeout=5.0, indirect_timeout=10.0)
    configs = [node_config(tmp_path, f"n{i}", membership=tight) for i in range(6)]
    async with open_nodes(configs[:1]) as (busy,):
        # In use before anyone joins: set after the joins, the bootstrap could prune while they came.
        busy.shards.peers_in_use = lambda: set(busy.host.connected_peers())
        for cfg in configs[1:]:
            cfg.bootstrap = [busy.host.listen_addrs()[0]]
        async with open_nodes(configs[1:]) as others:
            nodes = [busy, *others]
            in_use = {n.peer_id for n in others}
            ok_before = busy.membership.table.probes["ok"]
            await wait_for(lambda: sees_all(nodes), what="every node sees every other alive")
            # Connection periods pass while it probes: ten successful probes after everyone joined.
            await wait_for(lambda: busy.membership.table.probes["ok"] >= ok_before + 10,
                           what="ten probes by the bootstrap")
            assert busy.membership.closes["pruned"] == 0
            assert set(busy.host.connected_peers()) >= in_use
