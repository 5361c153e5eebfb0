"""Reachability by dial-back (node/reach/reachability.py, node/reach/dialback.py).

Pure tests drive the vote counting, the dialer's address filter and the relay choice; the
in-process tests use real hosts on loopback (127.0.0.1, with 127.0.0.2 standing in for a third
party) and real relays.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

from node.reach.dialback import (
    DIALBACK_PROTOCOL,
    DialBackReply,
    DialBackRequest,
    DialBackServer,
    ReachabilityService,
    serve_dialback,
)
from node.reach.reachability import (
    MAX_DIAL_PORTS,
    PRIVATE,
    PUBLIC,
    UNKNOWN,
    Reachability,
    Vote,
    advice,
    choose_relays,
    dialback_targets,
)
from node.reach.relay import circuit_addr, connect_addr, serve_relay_client, serve_relay_hop
from node.net.budget import StreamsConfig
from node.net.reqres import call, messages
from node.gossip.records import PeerRecord
from node.wire import encode, write_frame
from test_relay import open_node, open_triangle
from waiting import wait_for

PID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
REPLY = messages(DialBackReply, max_size=2048)


# ---------------------------------------------------------------------------------------------
# Pure: votes


def test_two_agreeing_votes_decide_and_one_peer_counts_once():
    r = Reachability()
    assert r.record("a", Vote.REACHED, 0.0) == UNKNOWN  # one vote is not enough
    assert r.record("a", Vote.REACHED, 1.0) == UNKNOWN  # the same peer again still counts once
    assert r.record("b", Vote.REACHED, 2.0) == PUBLIC
    assert not r.needs_votes(2.0)
    p = Reachability()
    p.record("a", Vote.NOT_REACHED, 0.0)
    assert p.record("b", Vote.NOT_REACHED, 0.0) == PRIVATE
    assert p.changed_at == 0.0


def test_split_votes_keep_the_last_verdict_and_old_votes_expire():
    r = Reachability(vote_ttl_s=100.0)
    r.record("a", Vote.NOT_REACHED, 0.0)
    r.record("b", Vote.NOT_REACHED, 0.0)
    assert r.state == PRIVATE
    r.record("c", Vote.REACHED, 10.0)
    r.record("d", Vote.REACHED, 10.0)  # 2 against 2: no majority, keep private
    assert r.state == PRIVATE
    assert r.decide(105.0) == PUBLIC  # a and b expired; c and d still count
    assert r.decide(200.0) == UNKNOWN  # nothing fresh left
    assert r.needs_votes(200.0)


def test_a_peer_changing_its_vote_replaces_the_old_one():
    r = Reachability()
    r.record("a", Vote.REACHED, 0.0)
    r.record("b", Vote.REACHED, 0.0)
    r.record("a", Vote.NOT_REACHED, 1.0)
    r.record("c", Vote.NOT_REACHED, 1.0)
    assert r.fresh(1.0) == {"a": Vote.NOT_REACHED, "b": Vote.REACHED, "c": Vote.NOT_REACHED}
    assert r.state == PRIVATE


# ---------------------------------------------------------------------------------------------
# Pure: what the dialer dials


def test_dialback_targets_use_only_the_observed_ip():
    asked = ["/ip4/198.51.100.7/tcp/4001", "/ip4/10.0.0.5/tcp/4002", "/ip4/10.0.0.5/tcp/4001"]
    assert dialback_targets(asked, "203.0.113.9") == ["/ip4/203.0.113.9/tcp/4001", "/ip4/203.0.113.9/tcp/4002"]
    assert dialback_targets(asked, "2001:db8::1") == ["/ip6/2001:db8::1/tcp/4001", "/ip6/2001:db8::1/tcp/4002"]
    assert dialback_targets(asked, None) == []  # relayed: we do not know the asker's IP
    assert dialback_targets(asked, "not an ip") == []
    many = [f"/ip4/1.2.3.4/tcp/{p}" for p in range(5000, 5020)]
    assert len(dialback_targets(many, "203.0.113.9")) == MAX_DIAL_PORTS
    circuit = [circuit_addr(f"/ip4/1.2.3.4/tcp/1/p2p/{PID}", PID), "/dns4/example.com/tcp/9", "garbage"]
    assert dialback_targets(circuit, "203.0.113.9") == ["/ip4/203.0.113.9/tcp/9"]


def test_relays_on_different_ips_are_chosen_first():
    relays = {
        "r1": ["/ip4/192.0.2.1/tcp/1"],
        "r2": ["/ip4/192.0.2.1/tcp/2"],  # same machine as r1
        "r3": [circuit_addr(f"/ip4/1.2.3.4/tcp/1/p2p/{PID}", PID), "/ip4/192.0.2.3/tcp/3"],
        "r4": [circuit_addr(f"/ip4/1.2.3.4/tcp/1/p2p/{PID}", PID)],  # only relayed itself: useless
    }
    assert choose_relays(relays) == ["/ip4/192.0.2.1/tcp/1/p2p/r1", "/ip4/192.0.2.3/tcp/3/p2p/r3"]
    assert choose_relays(relays, exclude=("r1",)) == ["/ip4/192.0.2.1/tcp/2/p2p/r2", "/ip4/192.0.2.3/tcp/3/p2p/r3"]
    assert choose_relays({"r1": relays["r1"], "r2": relays["r2"]}) == [
        "/ip4/192.0.2.1/tcp/1/p2p/r1", "/ip4/192.0.2.1/tcp/2/p2p/r2"]  # one IP only: still two slots
    assert choose_relays({}) == []


def test_advice_names_the_port_only_when_private():
    assert "forward TCP port 4001" in advice(PRIVATE, [4001])
    assert "--listen" in advice(PRIVATE, [])
    assert advice(PUBLIC, [4001]) is None and advice(UNKNOWN, [4001]) is None


def test_member_record_reachability_is_checked():
    base = dict(run="r", peer_id=PID, role="inference", addrs=[], software="x", seq=1)
    assert PeerRecord(**base).reachability == UNKNOWN
    assert PeerRecord(**base, reachability=PRIVATE).reachability == PRIVATE
    with pytest.raises(ValueError, match="reachability"):
        PeerRecord(**base, reachability="sometimes")


# ---------------------------------------------------------------------------------------------
# In-process: real hosts


async def _server(node) -> DialBackServer:
    server = DialBackServer(node.host, node.context.peers)
    node.host.set_handler(DIALBACK_PROTOCOL, server.handle)
    return server


async def test_a_dialable_asker_is_reached_by_a_fresh_verified_dial(tmp_path):
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(open_node(tmp_path, "a"))
        b = await stack.enter_async_context(open_node(tmp_path, "b"))
        c = await stack.enter_async_context(open_node(tmp_path, "c"))
        await _server(b)
        await _server(c)
        await a.host.connect(b.host.listen_addrs()[0])
        await a.host.connect(c.host.listen_addrs()[0])
        svc = ReachabilityService(a.context, None, None)
        assert await svc.round() == PUBLIC
        assert set(svc.reach.fresh(trio.current_time())) == {b.peer_id, c.peer_id}


async def test_nothing_listening_is_not_reached(tmp_path):
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(open_node(tmp_path, "a"))
        b = await stack.enter_async_context(open_node(tmp_path, "b"))
        await _server(b)
        await a.host.connect(b.host.listen_addrs()[0])
        closed = trio.socket.socket()
        await closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # a port nobody listens on
        reply = await call(a.host, b.peer_id, DIALBACK_PROTOCOL,
                           DialBackRequest(addrs=[f"/ip4/127.0.0.1/tcp/{port}"]), 30, reply=REPLY)
        assert reply.result == "not-reached"


async def test_the_dialer_never_dials_an_address_other_than_the_askers_own_ip(tmp_path):
    """A request naming a victim's IP must not make us connect to it (AutoNAT as a DDoS tool)."""
    accepted = {"victim": 0, "asker": 0}

    async def count(name: str, listener) -> None:
        while True:
            sock, _ = await listener.accept()
            accepted[name] += 1
            sock.close()

    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(open_node(tmp_path, "a"))  # the asker, at 127.0.0.1
        b = await stack.enter_async_context(open_node(tmp_path, "b"))
        server = await _server(b)
        await a.host.connect(b.host.listen_addrs()[0])
        victim = trio.socket.socket()
        await victim.bind(("127.0.0.2", 0))  # a third party on another IP
        port = victim.getsockname()[1]
        own = trio.socket.socket()
        await own.bind(("127.0.0.1", port))  # the same port on the asker's own IP
        victim.listen(8)
        own.listen(8)
        nursery = await stack.enter_async_context(trio.open_nursery())
        nursery.start_soon(count, "victim", victim)
        nursery.start_soon(count, "asker", own)
        reply = await call(a.host, b.peer_id, DIALBACK_PROTOCOL,
                           DialBackRequest(addrs=[f"/ip4/127.0.0.2/tcp/{port}"]), 30, reply=REPLY)
        assert reply.result == "not-reached"  # a bare socket proves no peer id
        assert reply.dialled == [f"/ip4/127.0.0.1/tcp/{port}"]
        await wait_for(lambda: accepted["asker"] == 1, what="the dial landed on the asker's IP")
        assert accepted["victim"] == 0
        assert server.dialled == [f"/ip4/127.0.0.1/tcp/{port}"]
        nursery.cancel_scope.cancel()
        victim.close()
        own.close()


async def test_a_request_over_a_relay_is_refused(tmp_path):
    """Over a circuit the IP we see is the relay's: dialling it would test the relay, not the asker."""
    async with open_triangle(tmp_path) as (a, b, c, a_addr):
        server = await _server(b)
        await connect_addr(c.host, circuit_addr(a_addr, b.peer_id))  # C reaches B only via A
        reply = await call(c.host, b.peer_id, DIALBACK_PROTOCOL,
                           DialBackRequest(addrs=["/ip4/127.0.0.1/tcp/1"]), 30, reply=REPLY)
        assert (reply.result, reply.reason) == ("refused", "no-observed-ip")
        assert server.served == 0


async def test_a_garbage_request_scores_the_asker_down(tmp_path):
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(open_node(tmp_path, "a"))
        b = await stack.enter_async_context(open_node(tmp_path, "b"))
        await _server(b)
        b.context.peers.set_rule("dialback", __import__("node.reach.dialback", fromlist=["FAULT_RULE"]).FAULT_RULE)
        await a.host.connect(b.host.listen_addrs()[0])
        stream = await a.host.open_stream(b.peer_id, DIALBACK_PROTOCOL)
        await write_frame(stream, encode(PeerRecord(run="r", peer_id=PID, role="x", addrs=[], software="x", seq=1)))
        await wait_for(lambda: b.context.peers.table.score(a.peer_id, trio.current_time()) < 0,
                       what="the asker scored down for a request of the wrong type")


class FakeMembers:
    def __init__(self, relays: dict[str, list[str]]) -> None:
        self.relays = relays
        self.fields: dict = {}

    def members(self) -> dict[str, str]:
        return {p: "relay" for p in self.relays}

    def addrs_of(self, peer_id: str) -> list[str]:
        return self.relays.get(peer_id, [])

    def update(self, **fields) -> None:
        self.fields.update(fields)


async def test_a_private_node_reserves_on_two_relays_from_the_table_and_drops_them_when_public(tmp_path, caplog):
    async with AsyncExitStack() as stack:
        r1 = await stack.enter_async_context(open_node(tmp_path, "r1", serve_relay_hop))
        r2 = await stack.enter_async_context(open_node(tmp_path, "r2", serve_relay_hop))
        r3 = await stack.enter_async_context(open_node(tmp_path, "r3", serve_relay_hop))
        n = await stack.enter_async_context(open_node(tmp_path, "n", serve_relay_client, relays=[]))
        table = {r.peer_id: r.host.transport_addrs() for r in (r1, r2, r3)}
        svc = ReachabilityService(n.context, n.relay, FakeMembers(table))
        with caplog.at_level("WARNING", logger="node.reach.dialback"):
            await svc.follow(PRIVATE)
        assert len(svc.auto_relays) == 2 and svc.auto_relays <= set(table)
        assert all(n.relay.has_reservation_on(r) for r in svc.auto_relays)
        assert len([a for a in n.relay.circuit_addrs() if "/p2p-circuit/" in a]) >= 2
        assert sum("forward TCP port" in r.getMessage() for r in caplog.records) == 1
        await svc.follow(PRIVATE)  # two held: nothing more
        assert len(n.relay.held) == 2
        await svc.follow(PUBLIC)
        assert svc.auto_relays == set() and n.relay.circuit_addrs() == []


async def test_a_private_node_handed_relays_reserves_none_of_its_own(tmp_path):
    """Relays handed to the relay client (the run's ``relay_via``, passed in by the role) are the
    operator's choice: dial-back keeps them and picks none from the table. What decides is the list
    the client was handed, not a field read off the node's config (which says none here)."""
    async with AsyncExitStack() as stack:
        r1 = await stack.enter_async_context(open_node(tmp_path, "r1", serve_relay_hop))
        r2 = await stack.enter_async_context(open_node(tmp_path, "r2", serve_relay_hop))
        given = r1.host.listen_addrs()[0]
        n = await stack.enter_async_context(open_node(tmp_path, "n", serve_relay_client, relays=[given]))
        assert n.context.config.relay_via == []
        svc = ReachabilityService(n.context, n.relay, FakeMembers({r2.peer_id: r2.host.transport_addrs()}))
        await svc.follow(PRIVATE)
        assert svc.auto_relays == set() and list(n.relay.held) == [r1.peer_id]
        assert n.relay.has_reservation_on(r1.peer_id)


async def test_serve_dialback_publishes_reachability_in_status_and_record(tmp_path):
    async with AsyncExitStack() as stack:
        b = await stack.enter_async_context(open_node(tmp_path, "b"))
        c = await stack.enter_async_context(open_node(tmp_path, "c"))
        await _server(b)
        await _server(c)
        a = await stack.enter_async_context(open_node(tmp_path, "a", serve_relay_client, relays=[]))
        members = FakeMembers({})
        nursery = await stack.enter_async_context(trio.open_nursery())
        await a.host.connect(b.host.listen_addrs()[0])
        await a.host.connect(c.host.listen_addrs()[0])
        svc = await nursery.start(lambda task_status: serve_dialback(a.context, StreamsConfig(), a.relay, members,
                                                                   task_status=task_status))
        await wait_for(lambda: members.fields.get("reachability") == PUBLIC, what="public in the record")
        status = a.context.status["reachability"]()
        assert status["reachability"] == PUBLIC and status["advice"] is None
        assert svc.reach.state == PUBLIC
        nursery.cancel_scope.cancel()


async def test_a_dial_back_must_prove_the_askers_peer_id(tmp_path):
    """Another peer answering on the asker's port is not the asker: not reached."""
    from node.reach.dialback import dial_verified

    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(open_node(tmp_path, "a"))
        b = await stack.enter_async_context(open_node(tmp_path, "b"))
        c = await stack.enter_async_context(open_node(tmp_path, "c"))
        assert await dial_verified(b.host, a.peer_id, a.host.transport_addrs()[0])
        assert not await dial_verified(b.host, a.peer_id, c.host.transport_addrs()[0])
        assert not b.host.is_connected(a.peer_id)  # the dial-back never joined the swarm


async def test_rounds_repeat_until_the_verdict_is_backed_then_only_rarely(monkeypatch, autojump_clock):
    """The asking schedule on a mock clock: every RETRY_ROUND_S while votes are missing, then
    every RECHECK_ROUND_S."""
    from node.reach import dialback

    host = type("H", (), {"direct_peers": lambda self: ["p1", "p2"]})()
    svc = ReachabilityService(type("N", (), {"host": host})(), None, None)
    times: list[float] = []

    async def fake_round() -> str:
        now = trio.current_time()
        times.append(now)
        if len(times) == 2:  # the second round brings two agreeing votes
            svc.reach.record("p1", Vote.NOT_REACHED, now)
            svc.reach.record("p2", Vote.NOT_REACHED, now)
        return svc.reach.state

    svc.round = fake_round
    start = trio.current_time()
    with trio.move_on_after(2 * dialback.RECHECK_ROUND_S + 60):
        await svc.keep_asking()
    gaps = [round(b - a) for a, b in zip(times, times[1:])]
    assert times[0] == start
    assert gaps == [dialback.RETRY_ROUND_S, dialback.RECHECK_ROUND_S, dialback.RECHECK_ROUND_S]
    assert svc.reach.state == PRIVATE


async def test_the_last_answers_kept_are_those_of_the_latest_peers_asked(monkeypatch, autojump_clock):
    """Issue 45: ``last`` (peer -> its last answer, shown in status) kept every peer ever asked;
    on a node that sees peers come and go for weeks it only grew."""
    from node.net.failure import CallFailure, FailureKind
    from node.reach import dialback

    async def no_answer(*args, **kwargs):
        raise CallFailure(FailureKind.TIMEOUT, "no answer")

    monkeypatch.setattr(dialback, "call", no_answer)
    host = type("H", (), {"transport_addrs": lambda self: []})()
    svc = ReachabilityService(type("N", (), {"host": host, "peers": None})(), None, None)
    peers = [f"peer-{i}" for i in range(3 * dialback.MAX_LAST_ANSWERS)]
    for p in peers:
        assert await svc.ask(p) is None
    await svc.ask(peers[0])  # asked again: the newest, kept
    assert list(svc.last) == peers[-dialback.MAX_LAST_ANSWERS + 1:] + [peers[0]]
