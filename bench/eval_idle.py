"""Held-out evaluation stays off the training path: the trainer's idle fraction with it on and off.

    .venv/bin/python bench/eval_idle.py [--steps 40] [--rounds 2] [--eval-every 5] [--max-seconds 300]

Runs bench/loop.py's swarm (the demo's run file: a relay, a trainer, a validator and two inference
nodes as processes on 127.0.0.1, the tiny model, the synthetic task) for ``--steps`` trainer steps,
``--rounds`` times with ``[trainer] eval_every = 0`` and as many with ``--eval-every``, alternated
(off, on, off, on...) so that a drift of this shared machine's load falls on both. Prints each
run's trainer idle fraction (the share of its time, once batches flow, spent waiting for verified
batches: node/app/loopfigures.py), steps per minute and the versions it scored, then the median
idle fraction of each setting, their difference in points (issue 40's bound: within 2) and the
ratio of the step rates. The baseline is the same swarm with evaluation off, in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from loop import run  # noqa: E402  (bench/, the script's own folder)
from quick import parse_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="trainer steps per run (default 40)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each setting (default 2)")
    ap.add_argument("--eval-every", type=int, default=5, help="[trainer] eval_every of the runs with evaluation on")
    ap.add_argument("--max-seconds", type=float, default=300.0, help="longest a run may take")
    args = parse_args(ap, {"steps": 2, "rounds": 1, "eval_every": 1, "max_seconds": 30.0})
    if args.eval_every < 1 or args.rounds < 1:
        ap.error("--eval-every and --rounds: at least 1")
    idle: dict[str, list[float]] = {"off": [], "on": []}
    rate: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(args.rounds):
        for name, every in (("off", 0), ("on", args.eval_every)):
            with tempfile.TemporaryDirectory(prefix="bench-eval-idle-") as tmp:
                f = run(args.steps, args.max_seconds, None, "", Path(tmp), False, eval_every=every)
            if f["trainer_idle_fraction"] is None or not f["steps"]:
                sys.exit(f"bench/eval_idle.py: the trainer made no step in {args.max_seconds:.0f} s (eval {name})")
            idle[name].append(f["trainer_idle_fraction"])
            rate[name].append(f["steps_per_minute"] or 0.0)
            ev = f.get("eval")
            scored = " ".join(f"v{v}={s:.3f}" for v, s in ev["points"]) if isinstance(ev, dict) else "-"
            print(f"round {i + 1} eval {name:3}: {f['steps']} steps in {f['seconds']:.0f} s, "
                  f"{f['steps_per_minute']} per minute, trainer idle {100 * f['trainer_idle_fraction']:.1f} %; "
                  f"scored: {scored}", flush=True)
    off, on = statistics.median(idle["off"]), statistics.median(idle["on"])
    print(f"median trainer idle: eval off {100 * off:.1f} %, eval on {100 * on:.1f} % "
          f"(difference {100 * (on - off):+.1f} points; bound: within 2)")
    r_off, r_on = statistics.median(rate["off"]), statistics.median(rate["on"])
    print(f"steps per minute, eval on / eval off: {r_on / r_off:.3f}" if r_off else "steps per minute: -")


if __name__ == "__main__":
    main()
