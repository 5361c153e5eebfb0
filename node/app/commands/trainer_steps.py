"""``swarm-node trainer-steps``: the trainer's steps (mean reward, samples, loss) from its spool.

Reads ``<data dir>/trainer/spool.sqlite`` (read-only queries; safe while the trainer runs: SQLite
WAL readers never block the writer). ``--png FILE`` also draws the reward-per-step curve, with the
held-out score of the evaluated versions beside it; ``--eval`` lists those scores instead of the
steps (node/trainer/evaluation.py).
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path

from ...trainer.evaluation import EvalRecord, eval_summary
from ...trainer.spool import Spool


def add_commands(sub) -> None:
    p = sub.add_parser("trainer-steps", help="the trainer's steps: mean reward, samples, loss (and a reward plot)")
    p.add_argument("--data-dir", help="the trainer's data dir (default: the run's data dir)")
    p.add_argument("--run", metavar="FILE", type=Path, help="run file (TOML)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--png", metavar="FILE", type=Path, help="also write the reward-per-step curve as a PNG")
    p.add_argument("--eval", action="store_true",
                   help="list the held-out evaluation scores by version instead of the steps")
    p.set_defaults(func=cmd_steps)


def cmd_steps(args) -> int:
    from ...config import ConfigError, load_config

    try:
        config = load_config(args.run, dict(os.environ), {"data_dir": args.data_dir})
    except ConfigError as e:
        print(f"swarm-node: error: {e}", file=sys.stderr)
        return 2
    path = config.resolved_data_dir() / "trainer" / "spool.sqlite"
    if not path.is_file():
        print(f"swarm-node: error: no trainer spool at {path} (is this a trainer's data dir?)", file=sys.stderr)
        return 2
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            spool = Spool(db)
            steps, evals = spool.steps(), spool.evals()
        finally:
            db.close()
    except sqlite3.DatabaseError as e:
        print(f"swarm-node: error: cannot read {path}: {e}", file=sys.stderr)
        return 2
    if args.png:
        from ...trainer.plot import write_curve_png

        write_curve_png([(s.step, s.mean_reward) for s in steps], args.png,
                        evals=[(e.version, e.score) for e in evals])
    if args.eval:
        return _print_evals(evals, args.json)
    if args.json:
        print(json.dumps([s.__dict__ for s in steps]))
        return 0
    print(f"{'step':>6} {'reward':>8} {'samples':>8} {'batches':>8} {'tokens':>8} {'loss':>9} {'seconds':>8}")
    for s in steps:
        print(f"{s.step:>6} {s.mean_reward:>8.4f} {s.samples:>8} {s.batches:>8} {s.tokens:>8} {s.loss:>9.4f} "
              f"{s.seconds:>8.2f}")
    if evals:
        s = eval_summary(evals)
        base = "not scored" if s["base"] is None else f"{s['base']:.4f}"
        print(f"held-out score: base (v0) {base}, v{s['last'][0]} {s['last'][1]:.4f} "
              f"({len(evals)} versions scored: trainer-steps --eval)")
    if args.png:
        print(f"reward curve: {args.png}")
    return 0


def _print_evals(evals: list[EvalRecord], as_json: bool) -> int:
    if as_json:
        print(json.dumps([e.__dict__ for e in evals]))
        return 0
    print(f"{'version':>8} {'score':>8} {'tasks':>6} {'seconds':>8}")
    for e in evals:
        print(f"{e.version:>8} {e.score:>8.4f} {e.tasks:>6} {e.seconds:>8.2f}")
    if not evals:
        print("no version scored yet (is [trainer] eval_every 0?)")
    return 0
