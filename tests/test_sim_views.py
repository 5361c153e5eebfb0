"""What bench/sim_membership.py reports about views (issue 46 item 2): the smallest view at each
sample, whose it is, how old that node is, and what it lacks and for how long, so that a node still
joining is told apart from a live member missing from a settled node's table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sim.membership import Profile, Swarm, ViewSample

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import sim_membership as bench  # noqa: E402  bench/sim_membership.py


def test_a_view_sample_separates_a_joining_node_from_a_settled_one_missing_a_member():
    ages = {"old": 300.0, "mid": 120.0, "young": 2.0, "other": 200.0}
    missing = {
        "old": {"mid": "absent"},  # a settled node lacking a settled member
        "mid": {},
        "young": {"old": "absent", "mid": "absent", "other": "absent"},  # still filling its view
        "other": {"mid": "dead", "young": "absent"},
    }
    vs = ViewSample(500.0, ages, missing)
    assert vs.floor(0.0) == (0.0, "young")  # every live node: the newcomer holds nobody yet
    floor, worst = vs.floor(60.0)  # old and other each lack mid, one of the two others up >= 60 s
    assert (floor, worst) == (0.5, "old")
    assert vs.views(60.0) == {"old": 0.5, "mid": 1.0, "other": 0.5}
    assert vs.floor(150.0) == (1.0, "old")  # mid (120 s) is no longer counted, as holder or member
    assert vs.floor(1000.0) == (1.0, None)
    assert vs.dead_while_live(60.0) == 1 and vs.dead_while_live(150.0) == 0


def test_the_swarm_samples_every_live_nodes_view_with_its_age():
    swarm = Swarm(seed=3, profile=Profile(nat=0.3))
    nodes = [swarm.spawn(bootstrap=True)] + [swarm.spawn() for _ in range(7)]
    swarm.sim.run(20)
    newcomer = swarm.spawn()
    swarm.crash(nodes[-1], refuses=True)
    vs = swarm.sample_views()
    assert set(vs.ages) == {n.pid for n in swarm.live()}  # the crashed node is nobody's to hold
    assert vs.ages[newcomer.pid] == 0.0 and vs.ages[nodes[0].pid] == 20.0
    assert vs.floor(0.0) == (0.0, newcomer.pid)
    assert swarm.view_of(newcomer.pid) == 0.0
    assert vs.floor(10.0)[0] == 1.0  # the settled nodes hold each other
    assert set(vs.missing[nodes[0].pid]) == {newcomer.pid}


def test_the_benchmark_reports_each_samples_smallest_view_with_its_age_and_what_it_lacks_for_how_long(capsys):
    args = argparse.Namespace(seed=1, loss=0.01, nat=0.3, tick=0.25, join_rate=20.0, settle=62.0, duration=20.0,
                              churn=0.0, events=2)
    r = bench.scale(20, args)
    assert len(r["samples"]) == 4 and r["fill_s"] and r["unfilled"] == 0
    # The two joins (at 5 and 15 s into the window) are seconds old at the next sample: the strict floor
    # counts them; up >= 60 s does not.
    strict = [vs.floor(0.0) for vs, _ in r["samples"]]
    assert min(f for f, _ in strict) < 0.5
    # Hand the report a settled node that lacks a settled member since the first sample.
    vs, lacking = r["samples"][-1]
    holder, member = sorted(p for p, a in vs.ages.items() if a >= bench.VIEW_GRACE)[:2]
    for i, (s, lack) in enumerate(r["samples"]):
        s.missing[holder][member] = "absent"
        lack[(holder, member)] = 5.0 * i
    bench.print_views(r)
    out = capsys.readouterr().out
    age = f"{vs.ages[holder]:.0f}"
    assert f"{age}, lacks 1: {member} ({vs.ages[member]:.0f}, absent, >=15)" in out, out
    assert "join window W" in out and "smallest over the window: every live node" in out
