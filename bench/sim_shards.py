"""The checkpoint swarm at N = 100 and 1,000 by simulation of node/shards' own Picker, SuperSeeder and
peering choices (issue 46 item 3), against the Kumar-Ross bound for heterogeneous peers.

sim/shards.py drives the real picker, super-seeder and session choices over sim/network.py. Two parts:

* **agreement** (N = 8, 16, 24): bench/shards.py swarm's scenario, 32 MiB from a seed to N
  downloaders on one bridge, every host's upload capped at 10 Mbit/s, automatic pieces; printed
  beside the real ratios from docs/benchmarks.md (measured in network namespaces, not re-run here).
* **scale**: a ``--size-mib`` checkpoint from an origin at 1 Gbit/s to N downloaders, 10 % of them
  at 1 Gbit/s and the rest 10-100 Mbit/s up (300-1000 Mbit/s down), one-way latency 5-60 ms,
  ``--nat`` of the slow ones behind NAT (reached through relays, which carry no checkpoint bytes);
  then a delta of ``--delta-ratio`` of the checkpoint to the same N holders of the base. Printed per
  N: the full distribution time T, the bound T_min (sim/shards.py kumar_ross:
  max(F/u_s, F/d_min, N*F/(u_s + sum u_i))), T/T_min (goal <= 1.3 at N = 1,000), the last public
  and the last NAT'd downloader (a picker that starves NAT'd peers shows here), the origin's upload
  in checkpoints, the delta's time and its ratio to T (goal <= 0.15), and the wall time.

The super-seeding origin turns ordinary seed once every piece is held by a downloader
(``--no-hand-over``: super-seeding to the end), and a download short of ``max_peers`` direct peers
dials public ones (``--no-dial-direct``: it does not, and NAT'd nodes holding only relay circuits
are left out of the run), and a downloader's picker asks a peer 4x faster than the one a block
waits on for it too (``--no-race``: it does not; node/shards/picker.py ``race_factor``). All
three off is the code before issue 46's fixes; the real node has the
hand-over (node/shards/superseed.py) and the dials (node/shards/client.py, chosen by the node's
DialBook in node/shards/peering.py, which sim/shards.py drives).

    .venv/bin/python bench/sim_shards.py                                   # agreement, then N = 100, 1000
    .venv/bin/python bench/sim_shards.py --agreement "" --sizes 100 --piece-mib 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quick import parse_args  # noqa: E402  (bench/, the script's own folder)
from sim.shards import ORIGIN, Distribution, Links, Topology  # noqa: E402

MiB = 1 << 20
# bench/shards.py swarm's real ratios to T_min, 32 MiB at 10 Mbit/s (docs/benchmarks.md, 2026-12-05).
REAL = {8: "1.10-1.12", 16: "1.18", 24: "1.21"}
# bench/shards.py deltas (docs/benchmarks.md): 3 % of bf16 values changed made a 590 KB delta of 32 MiB.
DELTA_RATIO = 590e3 / (32 * MiB)


def agreement(n: int, args) -> tuple[float, float]:
    """bench/shards.py swarm's scenario simulated: (distribution time, its ratio to T_min)."""
    topo = Topology(n, Links.namespaces(10.0), seed=args.seed)
    full = Distribution(topo, 32 * MiB, super_seed=args.super_seed, hand_over=args.hand_over,
                        dial_direct=args.dial_direct, race=args.race)
    t = full.run(limit=600.0)
    return t, t / full.bound()


def scale(n: int, args) -> dict:
    wall = time.monotonic()
    topo = Topology(n, Links(nat=args.nat), seed=args.seed)
    size = args.size_mib * MiB
    piece = args.piece_mib * MiB if args.piece_mib else 0
    full = Distribution(topo, size, piece_size=piece, block_size=piece or None, super_seed=args.super_seed,
                        hand_over=args.hand_over, dial_direct=args.dial_direct, race=args.race)
    t = full.run(limit=args.limit)
    if t is None:
        return {"n": n, "t": None, "wall_s": time.monotonic() - wall}
    e = topo.net.endpoints
    done = {p: h.done_at - full.t0 for p, h in full.holders.items() if p != ORIGIN and h.done_at is not None}
    nat = [d for p, d in done.items() if e[p].nat]
    public = [d for p, d in done.items() if not e[p].nat]
    out = {"n": n, "t": t, "t_min": full.bound(), "pieces": full.num_pieces,
           "last_public": max(public), "last_nat": max(nat) if nat else float("nan"),
           "origin_up": e[ORIGIN].sent_bytes / size, "stranded": len(full.left_out)}
    delta = Distribution(topo, int(size * args.delta_ratio), super_seed=args.super_seed, hand_over=args.hand_over,
                         dial_direct=args.dial_direct, race=args.race)
    out["delta_t"] = delta.run(limit=args.limit)
    out["wall_s"] = time.monotonic() - wall
    out["events"] = topo.sim.events_run
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000", help="swarm sizes for the scale part")
    ap.add_argument("--agreement", default="8,16,24", help="sizes for the agreement part ('' to skip)")
    ap.add_argument("--size-mib", type=int, default=1024, help="checkpoint size, MiB")
    ap.add_argument("--piece-mib", type=int, default=0,
                    help="piece size, MiB, sent whole in one request (0: the automatic pieces and 256 KiB blocks)")
    ap.add_argument("--delta-ratio", type=float, default=DELTA_RATIO, help="delta size over the checkpoint's")
    ap.add_argument("--nat", type=float, default=0.3, help="share of the slow downloaders behind NAT")
    ap.add_argument("--limit", type=float, default=3600.0, help="virtual seconds a distribution may take")
    ap.add_argument("--super-seed", action=argparse.BooleanOptionalAction, default=True,
                    help="the origin super-seeds ([shards] super_seed, on by default)")
    ap.add_argument("--hand-over", action=argparse.BooleanOptionalAction, default=True,
                    help="the super-seeding origin turns ordinary seed once every piece is held by a downloader")
    ap.add_argument("--dial-direct", action=argparse.BooleanOptionalAction, default=True,
                    help="a download short of max_peers direct peers dials public ones (NAT'd nodes)")
    ap.add_argument("--race", action=argparse.BooleanOptionalAction, default=True,
                    help="a peer 4x faster than the one a block waits on is asked for it too (picker race_factor)")
    ap.add_argument("--seed", type=int, default=1)
    args = parse_args(ap, {"sizes": "20", "agreement": "8", "size_mib": 64}, argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    agree = [int(s) for s in args.agreement.split(",") if s]

    if agree:
        print("agreement with bench/shards.py swarm (real processes in namespaces, docs/benchmarks.md): "
              "32 MiB, 10 Mbit/s up each")
        print(f"{'N':>4} {'T s':>7} {'T/T_min':>8} {'real':>10}")
        for n in agree:
            t, ratio = agreement(n, args)
            print(f"{n:>4} {t:>7.1f} {ratio:>8.2f} {REAL.get(n, '-'):>10}", flush=True)

    rows = []
    if sizes:
        seeding = "off" if not args.super_seed else "on" if args.hand_over else "on (to the end)"
        print(f"\nscale: {args.size_mib} MiB, {'automatic pieces' if not args.piece_mib else f'{args.piece_mib} MiB pieces'}, "
              f"{args.nat:.0%} of slow downloaders behind NAT, super-seeding {seeding}, "
              f"{'' if args.dial_direct else 'no '}dials for direct peers, delta {args.delta_ratio:.2%} of the checkpoint")
        print(f"{'N':>6} {'pieces':>6} {'T s':>7} {'T_min s':>8} {'last public':>11} {'last NAT':>9} "
              f"{'origin up x':>11} {'delta s':>8} {'delta/T':>8} {'wall s':>7} {'T/T_min':>8}")
    for n in sizes:
        r = scale(n, args)
        rows.append(r)
        if r["t"] is None:
            print(f"{n:>6} not every downloader done in {args.limit:.0f} virtual s (wall {r['wall_s']:.0f} s)")
            continue
        dt = r["delta_t"]
        print(f"{n:>6} {r['pieces']:>6} {r['t']:>7.1f} {r['t_min']:>8.1f} {r['last_public']:>11.1f} "
              f"{r['last_nat']:>9.1f} {r['origin_up']:>11.2f} {dt if dt is not None else float('nan'):>8.2f} "
              f"{(dt or float('nan')) / r['t']:>8.3f} {r['wall_s']:>7.0f} {r['t'] / r['t_min']:>8.2f}", flush=True)
        if r["stranded"]:
            print(f"       ({r['stranded']} NAT'd downloaders hold only relay circuits: no transfer session reaches them, "
                  "left out of T and T_min)")
    if any(r["t"] is None for r in rows):
        print("bench/sim_shards.py: a distribution did not finish", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
