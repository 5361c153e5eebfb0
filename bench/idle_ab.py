"""Idle CPU of two versions of the code side by side, in one swarm of relays on loopback.

Separate runs of the same code on this shared machine read 0.99-1.47 % idle CPU per node at N=25,
more than most single changes save; so both versions run in one swarm, under the same load over
the same window. Every other node (after the bootstrap relay) runs the baseline checkout given
with ``--baseline``, the rest this checkout; after a settle, each node's user + system CPU per wall
second over the window is read from /proc, and the median of each group printed.

    .venv/bin/python bench/idle_ab.py --baseline /path/to/old/checkout [--n 25] [--window 90]

(a checkout of an older commit: ``git worktree add /tmp/old <commit>``). The children run with
the working directory in a temporary folder, because ``python -m node`` puts its working
directory first on ``sys.path``: started from a checkout, every node would run that checkout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from node.app.localswarm import LocalSwarm  # noqa: E402
from procstat import cpu_seconds  # noqa: E402
from quick import parse_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="a checkout of the code to compare against (its node/ is used; required)")
    ap.add_argument("--n", type=int, default=25, help="nodes, the bootstrap relay included (default 25)")
    ap.add_argument("--settle", type=float, default=40.0, help="seconds after the last start before the window")
    ap.add_argument("--window", type=float, default=90.0, help="seconds of CPU counted (default 90)")
    # Quick: this checkout against itself (an A/A run: the two medians should agree).
    args = parse_args(ap, {"baseline": str(HERE.parent), "n": 4, "settle": 5.0, "window": 10.0})
    if args.baseline is None:
        ap.error("--baseline DIR is required (or --quick, which compares this checkout with itself)")
    baseline = Path(args.baseline).resolve()
    if not (baseline / "node" / "__main__.py").exists():
        sys.exit(f"--baseline {baseline}: no node/ package there")
    paths = {"baseline": str(baseline), "this": str(HERE.parent)}
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(tmp), log_level="warning") as swarm:
        os.chdir(tmp)
        swarm.write_run_file('[run]\nname = "bench"\n')
        names = ["relay"] + [f"n{i}" for i in range(1, args.n)]
        group = {name: "baseline" if i % 2 else "this" for i, name in enumerate(names)}
        for name in names:
            os.environ["PYTHONPATH"] = paths[group[name]]  # read by LocalSwarm when it spawns the node
            swarm.start(name, "relay", wait=60)
        time.sleep(args.settle)  # a steady state to measure, not a condition to wait for
        pids = {name: swarm.procs[name].pid for name in names[1:]}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        t0 = time.monotonic()
        time.sleep(args.window)
        dt = time.monotonic() - t0
        pct = {name: (cpu_seconds(pid) - before[name]) / dt * 100 for name, pid in pids.items()}
    print(f"idle CPU per node, N={args.n}, {dt:.0f} s window after a {args.settle:.0f} s settle (median, mean of each group):")
    medians = {}
    for g in ("baseline", "this"):
        xs = [v for name, v in pct.items() if group[name] == g]
        medians[g] = statistics.median(xs)
        print(f"  {g:8s} ({paths[g]}): {medians[g]:.2f} % median, {statistics.mean(xs):.2f} % mean, {len(xs)} nodes")
    print(f"ratio this / baseline (median idle CPU): {medians['this'] / medians['baseline']:.2f}")


if __name__ == "__main__":
    main()
