"""The simulator of issue 46 (sim/): its clock, its network, and the real member table on it."""

from __future__ import annotations

import pytest

from node.gossip.membership import MembershipConfig, MemberState
from sim.events import Simulation
from sim.membership import Profile, Swarm
from sim.network import HANDSHAKE_TRIPS, Endpoint, Network


def test_events_run_in_time_order_ties_in_the_order_scheduled_and_cancelled_ones_never():
    sim, seen = Simulation(), []
    sim.at(2.0, seen.append, "b")
    sim.at(1.0, seen.append, "a")
    sim.at(2.0, seen.append, "c")
    sim.at(1.5, seen.append, "x").cancel()
    sim.at(3.0, lambda: sim.after(0.5, seen.append, (sim.now, "d")))
    sim.run(until=2.5)
    assert seen == ["a", "b", "c"] and sim.now == 2.5
    sim.run(until=10)
    assert seen[-1] == (3.0, "d") and sim.now == 10
    with pytest.raises(ValueError):
        sim.at(9.0, seen.append, "past")


def two(loss: float = 0.0) -> tuple[Simulation, Network]:
    sim = Simulation()
    net = Network(sim, loss=loss)
    net.add("a", Endpoint(latency=0.01, up=1000.0, down=1e9))
    net.add("b", Endpoint(latency=0.02, up=1e9, down=2000.0))
    return sim, net


def connect(sim: Simulation, net: Network, a: str, b: str) -> list[bool]:
    got: list[bool] = []
    net.dial(a, b, got.append)
    sim.run(sim.now + 10)
    return got


def test_a_message_takes_uplink_latency_and_downlink_and_queues_behind_the_one_before():
    sim, net = two()
    assert connect(sim, net, "a", "b") == [True]
    t0, arrived = sim.now, []
    net.send("a", "b", 100, lambda: arrived.append(sim.now - t0))
    net.send("a", "b", 100, lambda: arrived.append(sim.now - t0))
    sim.run(sim.now + 10)
    # 100 B on a 1000 B/s uplink, 10 + 20 ms, 100 B on a 2000 B/s downlink; the second waits its turn.
    assert arrived == pytest.approx([0.1 + 0.03 + 0.05, 0.2 + 0.03 + 0.05])
    assert net.endpoints["a"].sent_bytes == 200 and net.endpoints["b"].recv_msgs == 2


def test_a_lost_message_is_paid_for_but_never_arrives_and_no_connection_sends_nothing():
    sim, net = two(loss=1.0)
    connect(sim, net, "a", "b")
    arrived: list[int] = []
    assert net.send("a", "b", 50, arrived.append, 1)
    assert not net.send("b", "x", 50, arrived.append, 2)
    sim.run(sim.now + 10)
    assert arrived == [] and net.endpoints["a"].sent_bytes == 50 and net.dropped == 1


def test_a_skipped_message_is_counted_and_holds_the_downlink_but_is_never_handed_over():
    sim, net = two()
    connect(sim, net, "a", "b")
    net.endpoints["a"].up = 1e9
    t0, arrived, asked = sim.now, [], []
    net.send("a", "b", 100, arrived.append, "dup", skip=lambda x: asked.append(sim.now - t0) or True)
    net.send("a", "b", 100, lambda: arrived.append(sim.now - t0))
    sim.run(sim.now + 10)
    # Asked on arrival (10 + 20 ms); the next message still waits for its 50 ms on b's downlink.
    assert asked == [pytest.approx(0.03, abs=1e-6)] and arrived == [pytest.approx(0.03 + 0.05 + 0.05, abs=1e-6)]
    assert net.endpoints["b"].recv_msgs == 2 and net.endpoints["b"].recv_bytes == 200


def test_a_natted_endpoint_is_reached_through_its_relay_which_carries_the_bytes():
    sim = Simulation()
    net = Network(sim)
    net.add("r", Endpoint(latency=0.05, up=1e9, down=1e9))
    net.add("home", Endpoint(latency=0.01, up=1e9, down=1e9, nat=True, relay="r"))
    net.add("c", Endpoint(latency=0.01, up=1e9, down=1e9))
    t0 = sim.now
    got: list[bool] = []
    net.dial("c", "home", lambda ok: got.append((ok, sim.now - t0)))
    sim.run(10)
    assert got == [(True, pytest.approx(HANDSHAKE_TRIPS * (0.01 + 0.1 + 0.01)))]
    net.send("c", "home", 1000, lambda: None)
    sim.run(20)
    assert net.endpoints["r"].relayed_bytes == 2000
    net.go_down("r")  # its circuits close with it, and the home node cannot be dialled meanwhile
    assert not net.is_connected("c", "home")
    got.clear()
    net.dial("c", "home", lambda ok: got.append(ok))
    sim.run(30)
    assert got == [False]


def test_a_killed_process_refuses_dials_a_gone_host_never_answers_and_its_peers_notice_late():
    sim, net = two()
    connect(sim, net, "a", "b")
    net.go_down("b", refuses=False, notice=15.0)
    assert net.is_connected("a", "b")  # a half-open connection: a has not noticed yet
    arrived: list[int] = []
    net.send("a", "b", 10, arrived.append, 1)
    sim.run(sim.now + 16)
    assert arrived == [] and not net.is_connected("a", "b")
    got: list[bool] = []
    net.dial("a", "b", got.append)
    sim.run(sim.now + 60)
    assert got == []  # the caller's timeout decides
    net.endpoints["b"].refuses = True
    net.dial("a", "b", got.append)
    sim.run(sim.now + 60)
    assert got == [False]


def test_the_real_member_table_converges_and_declares_a_killed_node_dead_in_time():
    swarm = Swarm(seed=3, loss=0.01, profile=Profile(nat=0.3))
    nodes = [swarm.spawn(bootstrap=True)] + [swarm.spawn() for _ in range(11)]
    swarm.sim.run(20)
    assert swarm.view_floor(0)[0] == 1.0
    victim, leaver = nodes[-1], nodes[-2]
    swarm.crash(victim, refuses=True)
    swarm.leave(leaver)
    t0 = swarm.sim.now
    config = MembershipConfig()
    # First-hand suspicion within a few probe rounds, then the suspicion timeout, then the tick.
    swarm.sim.run(t0 + 3 * config.probe_period + config.indirect_timeout + config.suspicion_timeout(12) + 1)
    others = [n for n in nodes if n.running]
    assert all(n.table.state_of(victim.pid) is MemberState.DEAD for n in others)
    assert all(n.table.state_of(leaver.pid) is MemberState.LEFT for n in others)
    assert swarm.view_floor(0) == (1.0, 0)
    assert not [s for s in swarm.counters.suspicions if s[3]]  # nobody live was suspected


def test_the_simulated_node_takes_its_connection_decisions_from_the_real_pure_module(monkeypatch):
    """sim/ must drive node/gossip/connections.py, not a copy of its rules (issue 46 item 1): the
    bootstrap redial and the per-address dial backoff are the real ones, at the service's period."""
    from node.gossip import connections
    from node.gossip.service import CONNECTION_PERIOD

    calls: dict[str, list[float]] = {"needs_bootstrap": [], "reserve": []}
    real_needs, real_reserve = connections.ConnectionManager.needs_bootstrap, connections.AddressBackoff.reserve

    def needs(self, connected, bootstrap):
        calls["needs_bootstrap"].append(swarm.sim.now)
        return real_needs(self, connected, bootstrap)

    def reserve(self, addrs, now):
        calls["reserve"].append(now)
        return real_reserve(self, addrs, now)

    monkeypatch.setattr(connections.ConnectionManager, "needs_bootstrap", needs)
    monkeypatch.setattr(connections.AddressBackoff, "reserve", reserve)
    swarm = Swarm(seed=5, profile=Profile(nat=0.3))
    for i in range(8):
        swarm.spawn(bootstrap=i == 0)
    swarm.sim.run(10 * CONNECTION_PERIOD)
    assert swarm.view_floor(0)[0] == 1.0 and calls["reserve"]  # members were dialled through the backoff
    # Every node asks at every period once its loops run: 8 nodes, about 10 periods each.
    assert 8 * 8 <= len(calls["needs_bootstrap"]) <= 8 * 11
