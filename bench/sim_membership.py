"""Membership at N = 100, 1,000 (10,000 if time allows) by simulation of the project's own code (issue 46).

sim/ drives node/gossip/membership.py's MemberTable, SyncPlanner, ConnectionManager, AddressBackoff,
CloseWatch and LocalHealth over a simulated internet (sim/network.py). Two parts:

* **agreement** (N = 10, 25, 50 on a simulated loopback, no loss, no churn: bench/membership.py's
  scenario): nodes start one after another, each after its bootstrap dial; convergence from the
  last one ready until every node holds every other alive; bytes sent per node over a steady
  window of at least one record refresh interval; then a ``kill -9`` of the last node (RST at
  once) until every other node marks it DEAD. Printed beside the real figures from
  docs/benchmarks.md (measured with real processes, not re-run here).
* **scale**: N nodes with one-way latency 5-60 ms, uplinks 10-100 Mbit/s, ``--nat`` of them behind
  NAT (reached through a relay), ``--loss`` message loss, and churn at ``--churn`` per node-hour
  (half clean leaves, half crashes of the host: dials time out, connections linger 15 s), each
  replaced by a new identity joining through the bootstrap node (a server: 1 Gbit/s up and down,
  ``Profile.server_mbit``; the ramp's 20 joins a second each pull the whole table from it); plus
  ``--events`` extra joins and crashes spread over the window so that every size has samples. Printed per N: time until 99 %
  of live nodes hold a new member, time until no live node holds a crashed one as live, false
  suspicions (our own failed probes of a live member) per node-hour, members held DEAD while
  alive, bytes/s and messages/s sent per node, and the smallest share of live nodes any live node
  (up >= 60 s) held at a sample (goal: >= 99 % at every one). Then every sample: its smallest view
  among every live node, among nodes up longer than the join window (the longest a newcomer here
  took to hold 99 % of live nodes itself) and among nodes up 60 s, with the last one's age and the
  live nodes it lacks (their age, how it holds them, for how long): a node still joining and a hole
  in a settled table look alike in the floor alone. The ratio last: per-node bytes/s at the largest
  N over that at the smallest (goal <= 2).

    .venv/bin/python bench/sim_membership.py                       # agreement, then N = 100, 1000
    .venv/bin/python bench/sim_membership.py --sizes 100 --duration 600 --agreement ""
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.gossip.membership import MembershipConfig, MemberState, load_model  # noqa: E402
from node.gossip.service import TICK  # noqa: E402
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)
from sim.membership import Profile, Swarm, ViewSample  # noqa: E402

# bench/membership.py's real figures, N = 10-50 real processes on one machine (docs/benchmarks.md).
REAL = {"converge_s": (1.5, 2.0), "detect_s": (5.5, 9.9), "bytes_s": (3000.0, 6500.0)}
START_GAP = 1.0  # seconds between real node starts (each waits for the previous one to be ready)
VIEW_GRACE = 60.0  # a node's view is sampled once it has been up this long
CRASH_NOTICE = 15.0  # a gone host's connections linger this long (keepalive), seconds
SAMPLE = 5.0  # seconds between view samples


def run_until(swarm: Swarm, done, limit: float, step: float) -> float | None:
    """Advance in ``step``s until ``done()``; the virtual time it held, or None at ``limit``."""
    start = swarm.sim.now
    while swarm.sim.now - start < limit:
        swarm.sim.run(swarm.sim.now + step)
        if done():
            return swarm.sim.now
    return None


def agreement(n: int, steady: float, seed: int) -> dict:
    swarm = Swarm(seed=seed, profile=Profile.loopback())
    nodes = [swarm.spawn(bootstrap=True)]
    for _ in range(n - 1):
        swarm.sim.run(swarm.sim.now + START_GAP)
        nodes.append(swarm.spawn())
    run_until(swarm, lambda: all(x.ready is not None for x in nodes), 30, 0.01)
    last_ready = max(x.ready for x in nodes)
    t = run_until(swarm, lambda: swarm.view_floor(0)[0] == 1.0, 120, 0.05)
    out = {"n": n, "converge_s": (t - last_ready) if t is not None else math.nan}
    swarm.sim.run(swarm.sim.now + 30)  # the connections settle (bench/membership.py waits for them too)
    window = max(steady, MembershipConfig().refresh_interval(n) + 5)
    before = swarm.traffic()
    swarm.sim.run(swarm.sim.now + window)
    after = swarm.traffic()
    out["bytes_s"] = statistics.median((after[p][0] - before[p][0]) / window for p in before)
    victim = nodes[-1]
    swarm.crash(victim, refuses=True, notice=0.0)
    t0 = swarm.sim.now
    others = [x for x in nodes if x is not victim]
    t = run_until(swarm, lambda: all(x.table.state_of(victim.pid) is MemberState.DEAD for x in others), 120, 0.05)
    out["detect_s"] = (t - t0) if t is not None else math.nan
    return out


def scale(n: int, args) -> dict:
    """One swarm of ``n`` under loss and churn; see the module docstring for what is measured."""
    wall, cpu = time.monotonic(), time.process_time()
    swarm = Swarm(seed=args.seed, loss=args.loss, profile=Profile(nat=args.nat), tick=args.tick)
    rng = swarm.rng
    swarm.spawn(bootstrap=True)
    for _ in range(n - 1):
        swarm.sim.run(swarm.sim.now + 1.0 / args.join_rate)
        swarm.spawn()
    t = run_until(swarm, lambda: swarm.view_floor(0)[0] >= 0.99, 600, 1.0)
    out: dict = {"n": n, "ramp_s": swarm.sim.now, "converge_s": math.nan if t is None else t}
    swarm.sim.run(swarm.sim.now + args.settle)

    start, end = swarm.sim.now, swarm.sim.now + args.duration
    joins: dict[str, float] = {}  # pid -> joined at, while not yet held by 99 %
    filling: dict[str, float] = {}  # pid -> joined at, while its own view is under 99 %
    fill_s: list[float] = []  # newcomers' own view: time from start to holding 99 % of live nodes
    crashes: dict[str, float] = {}  # pid -> crashed at, while some live node holds it live
    join_s: list[float] = []
    detect_s: list[float] = []

    def churn_one(kind: str) -> None:
        victims = [x for x in swarm.live() if x.pid not in swarm.bootstrap]
        if kind in ("leave", "crash") and victims:
            v = rng.choice(victims)
            if kind == "leave":
                swarm.leave(v)
            else:
                swarm.crash(v, refuses=False, notice=CRASH_NOTICE)
                crashes[v.pid] = swarm.sim.now
        new = swarm.spawn()  # replaced by a new identity
        joins[new.pid] = filling[new.pid] = swarm.sim.now

    rate = n * args.churn / 3600.0
    at = start + rng.expovariate(rate) if rate else math.inf
    extra = [start + (i + 0.5) * args.duration / max(1, args.events) for i in range(args.events)]
    samples: list[tuple[ViewSample, dict[tuple[str, str], float]]] = []
    missing_since: dict[tuple[str, str], float] = {}  # (holder, live node it lacks) -> first sample lacking it
    next_sample = start + SAMPLE
    traffic_before, kinds_before = swarm.traffic(), swarm.traffic_kinds()
    suspicions_before = len(swarm.counters.suspicions)
    step = 0.25
    while swarm.sim.now < end:
        swarm.sim.run(swarm.sim.now + step)
        now = swarm.sim.now
        while at <= now:
            churn_one(rng.choice(("leave", "crash")))
            at += rng.expovariate(rate)
        while extra and extra[0] <= now:
            extra.pop(0)
            churn_one("crash")
        for pid, t0 in list(joins.items()):
            if swarm.nodes[pid].running and swarm.known_by(pid) >= 0.99:
                join_s.append(now - t0)
                del joins[pid]
        for pid, t0 in list(filling.items()):
            if not swarm.nodes[pid].running:
                del filling[pid]
            elif swarm.view_of(pid) >= 0.99:
                fill_s.append(now - t0)
                del filling[pid]
        for pid, t0 in list(crashes.items()):
            if swarm.dead_everywhere(pid):
                detect_s.append(now - t0)
                del crashes[pid]
        if now >= next_sample:
            next_sample += SAMPLE
            vs = swarm.sample_views()
            pairs = {(h, q) for h, lack in vs.missing.items() for q in lack}
            missing_since = {k: missing_since.get(k, now) for k in pairs}
            samples.append((vs, {k: now - t for k, t in missing_since.items()}))
    after = swarm.traffic()
    stayed = [p for p in traffic_before if p in after]
    secs = args.duration
    out["bytes_s"] = statistics.mean((after[p][0] - traffic_before[p][0]) / secs for p in stayed)
    out["bytes_s_max"] = max((after[p][0] - traffic_before[p][0]) / secs for p in stayed)
    out["msgs_s"] = statistics.mean((after[p][1] - traffic_before[p][1]) / secs for p in stayed)
    kinds_after = swarm.traffic_kinds()
    kinds: dict[str, float] = {}
    for p in stayed:
        for k, b in kinds_after[p].items():
            kinds[k] = kinds.get(k, 0.0) + (b - kinds_before[p].get(k, 0)) / secs / len(stayed)
    out["kinds"] = kinds  # mean bytes/s per node by kind: what the cost is made of
    sus = swarm.counters.suspicions[suspicions_before:]
    node_hours = n * secs / 3600.0
    out["false_susp_per_node_h"] = sum(1 for s in sus if s[3]) / node_hours
    out["join_s"] = join_s
    out["detect_s"] = detect_s
    out["undetected"] = len(crashes)
    out["unjoined"] = len(joins)
    out["fill_s"] = fill_s
    out["unfilled"] = len(filling)
    out["samples"] = samples
    out["view_floor"] = min((vs.floor(VIEW_GRACE)[0] for vs, _ in samples), default=1.0)
    out["dead_while_live"] = max((vs.dead_while_live(VIEW_GRACE) for vs, _ in samples), default=0)
    out["wall_s"] = time.monotonic() - wall
    out["cpu_s"] = time.process_time() - cpu  # the simulator's own cost (wall time depends on the machine's load)
    out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # so far in this process
    out["events"] = swarm.sim.events_run
    return out


def print_views(r: dict, shown: int = 4) -> None:
    """The smallest view at each sample, three ways: every live node (a node seconds old holds
    almost nobody yet), nodes up longer than the join window W (the longest a newcomer measured here
    took to hold 99 % of live nodes itself), and nodes up VIEW_GRACE s (the goal's figure above).
    For the smallest of the last: its age, and each live node it lacks with that node's age, how it
    is held ("absent": never learned, expired or forgotten), and for how long it has been lacking
    (sampled every SAMPLE s; ">=" when since the window's first sample)."""
    fill = r["fill_s"]
    w = max(fill) if fill else math.nan
    print(f"       newcomers' own view to 99 %: p50 {pct(fill, .5):.1f} s, max {pct(fill, 1):.1f} s "
          f"({len(fill)} measured, {r['unfilled']} not yet); join window W = {w:.1f} s")
    first = r["samples"][0][0].at if r["samples"] else 0.0
    mins = {"all": 1.0, "W": 1.0, "grace": 1.0}
    print(f"       {'t s':>6} {'all':>6} {'age s':>6} {'up>=W':>6} {'up>=60s':>7} {'<99%':>4}  smallest up >= 60 s: "
          f"age s, lacks: node (its age s, held as, lacking for s)")
    for vs, lacking_for in r["samples"]:
        f_all, w_all = vs.floor(0.0)
        f_w = vs.floor(w)[0] if fill else math.nan
        f_g, worst = vs.floor(VIEW_GRACE)
        mins["all"], mins["grace"] = min(mins["all"], f_all), min(mins["grace"], f_g)
        if fill:
            mins["W"] = min(mins["W"], f_w)
        below = sum(1 for v in vs.views(VIEW_GRACE).values() if v < 0.99)
        detail = ""
        if worst is not None and f_g < 1.0:
            settled = {p for p, a in vs.ages.items() if a >= VIEW_GRACE}
            lacks = sorted((q for q in vs.missing[worst] if q in settled), key=lambda q: -lacking_for[(worst, q)])
            since_first = lambda q: ">=" if vs.at - lacking_for[(worst, q)] <= first else ""  # noqa: E731
            detail = f"{vs.ages[worst]:.0f}, lacks {len(lacks)}: " + ", ".join(
                f"{q} ({vs.ages[q]:.0f}, {vs.missing[worst][q]}, {since_first(q)}{lacking_for[(worst, q)]:.0f})"
                for q in lacks[:shown]) + (" ..." if len(lacks) > shown else "")
        age_all = f"{vs.ages[w_all]:.0f}" if w_all is not None and f_all < 1.0 else "-"
        print(f"       {vs.at:>6.0f} {f_all:>6.3f} {age_all:>6} {f_w:>6.3f} {f_g:>7.3f} {below:>4}  {detail}")
    print(f"       smallest over the window: every live node {mins['all']:.3f}, up >= W ({w:.1f} s) "
          f"{mins['W'] if fill else math.nan:.3f}, up >= {VIEW_GRACE:.0f} s {mins['grace']:.3f} (goal >= 0.99)")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000", help="swarm sizes for the scale part")
    ap.add_argument("--agreement", default="10,25,50", help="sizes for the agreement part ('' to skip)")
    ap.add_argument("--duration", type=float, default=300.0, help="virtual seconds of churn measured per size")
    ap.add_argument("--settle", type=float, default=60.0, help="virtual seconds after convergence before measuring")
    ap.add_argument("--loss", type=float, default=0.01, help="message loss probability")
    ap.add_argument("--churn", type=float, default=0.2, help="leaves + crashes per node per hour (each replaced)")
    ap.add_argument("--events", type=int, default=4, help="extra crashes (each with a join) spread over the window")
    ap.add_argument("--nat", type=float, default=0.3, help="share of nodes behind NAT")
    ap.add_argument("--join-rate", type=float, default=20.0, help="nodes started per virtual second while ramping up")
    ap.add_argument("--tick", type=float, default=TICK, help="membership tick, virtual seconds (the service's: 0.25)")
    ap.add_argument("--steady", type=float, default=30.0, help="agreement: steady window, virtual seconds (at least one refresh)")
    ap.add_argument("--seed", type=int, default=1)
    args = parse_args(ap, {"sizes": "40", "agreement": "10", "duration": 40.0, "settle": 10.0, "events": 2}, argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    agree = [int(s) for s in args.agreement.split(",") if s]

    if agree:
        print("agreement with real processes (bench/membership.py, docs/benchmarks.md), loopback, no loss:")
        print(f"{'N':>5} {'converge s':>11} {'real':>9} {'detect s':>9} {'real':>9} {'B/s/node':>9} {'real':>11}")
        for n in agree:
            r = agreement(n, args.steady, args.seed)
            lo_c, hi_c = REAL["converge_s"]
            lo_d, hi_d = REAL["detect_s"]
            lo_b, hi_b = REAL["bytes_s"]
            print(f"{n:>5} {r['converge_s']:>11.2f} {f'{lo_c}-{hi_c}':>9} {r['detect_s']:>9.2f} {f'{lo_d}-{hi_d}':>9} "
                  f"{r['bytes_s']:>9.0f} {f'{lo_b:.0f}-{hi_b:.0f}':>11}", flush=True)

    rows = []
    if sizes:
        print(f"\nscale: loss {args.loss:.0%}, churn {args.churn:.0%}/node-hour, {args.nat:.0%} behind NAT, "
              f"{args.duration:.0f} virtual s per size, tick {args.tick} s")
        print(f"{'N':>6} {'join99 s p50/max':>17} {'detect s p50/max':>17} {'false susp/node-h':>18} "
              f"{'dead-while-live':>16} {'B/s/node':>9} {'max':>8} {'msg/s':>6} {'view min':>9} {'wall s':>7} {'cpu s':>7} {'MiB':>6}")
    for n in sizes:
        r = scale(n, args)
        rows.append(r)
        j, d = r["join_s"], r["detect_s"]
        print(f"{n:>6} {pct(j, .5):>8.1f}/{pct(j, 1):<8.1f} {pct(d, .5):>8.1f}/{pct(d, 1):<8.1f} "
              f"{r['false_susp_per_node_h']:>18.2f} {r['dead_while_live']:>16} {r['bytes_s']:>9.0f} "
              f"{r['bytes_s_max']:>8.0f} {r['msgs_s']:>6.1f} {r['view_floor']:>9.3f} {r['wall_s']:>7.0f} "
              f"{r['cpu_s']:>7.0f} {r['peak_mib']:>6.0f}", flush=True)
        print(f"       ({len(j)} joins, {len(d)} crashes measured; last start at {r['ramp_s']:.0f} s, every view "
              f">= 99 % at {r['converge_s']:.0f} s (virtual); {r['events']} events)")
        print("       bytes/s per node by kind: " + ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(r["kinds"].items(), key=lambda kv: -kv[1]) if v >= 0.5))
        print_views(r)
        if r["undetected"] or r["unjoined"]:
            print(f"       ({r['undetected']} crashes still held live, {r['unjoined']} joins not yet at 99 % when the window ended)")
    if rows:
        # The window above follows a ramp in which every node started within seconds of the others,
        # so their refresh (refresh_interval(N): 3600 s at N >= 900) and push-pull (N s) timers are
        # in step and mostly outside a short window. The module's load model gives the steady state
        # of a swarm whose timers have spread out (no churn): the figure the window cannot show.
        model = {n: load_model(n, MembershipConfig()) for n in sorted({r["n"] for r in rows} | {100, 1_000, 10_000})}
        print("\nsteady state by node/gossip/membership.py's load model (no churn, timers spread out):")
        print("       " + "  ".join(f"N={n}: {m['msgs_per_s']:.2f} msg/s {m['bytes_per_s']:.0f} B/s" for n, m in model.items()))
        for n, m in model.items():
            parts = ", ".join(f"{k} {v:.0f}" for k, v in m["bytes_by_kind"].items())
            print(f"       N={n}: {parts} B/s ({m['records_per_s']:.2f} records/s received, "
                  f"refresh every {MembershipConfig().refresh_interval(n):.0f} s)")
        first = min(model)
        print(f"model per-node bytes/s, N = 10000 over N = {first}: "
              f"{model[10_000]['bytes_per_s'] / model[first]['bytes_per_s']:.2f} (goal <= 2)")
    failed = [r["n"] for r in rows if r["view_floor"] < 0.99]
    if len(rows) >= 2:
        print(f"\nper-node messages/s, N = {rows[-1]['n']} over N = {rows[0]['n']}: "
              f"{rows[-1]['msgs_s'] / rows[0]['msgs_s']:.2f}")
        print(f"per-node bytes/s, N = {rows[-1]['n']} over N = {rows[0]['n']}: "
              f"{rows[-1]['bytes_s'] / rows[0]['bytes_s']:.2f} (goal <= 2)")
    if failed:
        print(f"bench/sim_membership.py: a live node held fewer than 99 % of live nodes at N = {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
