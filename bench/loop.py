"""The whole loop on loopback for a fixed number of trainer steps: where honest work goes.

    .venv/bin/python bench/loop.py [--steps 40] [--max-seconds 300] [--async-level 2] [--hog] [--cheat KIND]
                                   [--threads 1] [--optimizer-steps 8] [--keep DIR]

Starts the demo's swarm (``swarm-node demo``'s run file: a relay, a trainer, a validator and two
inference nodes as real processes on 127.0.0.1, the tiny default model, the synthetic task), waits
until the trainer has made ``--steps`` steps (or ``--max-seconds`` passed), stops it and prints
node/app/loopfigures.py's figures: the fraction of honest samples trained and lost by reason, trainer
idle fraction, validator utilisation, steps per minute, the breakdown of the trainer's time (waiting
for verified batches, training, checkpoint write, publish) and the mean life of a trained sample
(generated -> acked -> verified -> trained), then the reward of the first and last 10 steps. The
baseline is the ideal in the same units: every honest sample trained (ratio = trained fraction).
``--hog`` runs a CPU hog on one core for the whole run (the issue's "shared machine" case).

The machine is shared and noisy (2 cores for several agents): compare ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.app.demo import DEMO_THREADS, demo_run_text, node_env  # noqa: E402
from node.app.localswarm import LocalSwarm  # noqa: E402
from node.app.loopfigures import format_figures, loop_figures, reward_ratio  # noqa: E402
from node.steptime import step_time_figures  # noqa: E402
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)

HOG = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end: pass\n"


def set_run_values(text: str, values: dict) -> str:
    """The run file ``text`` with the ``key = value`` line of each of ``values`` (the demo's settings)
    changed: "key" is its first such line, "table.key" the one in ``[table]``, added there if absent."""
    for key, value in values.items():
        table, _, name = key.rpartition(".")
        start = text.find(f"[{table}]\n") if table else 0
        if start < 0:
            raise ValueError(f"the demo's run file has no [{table}] table")
        body_at = text.index("\n", start) + 1 if table else 0
        end = re.search(r"(?m)^\[", text[body_at:])
        end = body_at + end.start() if table and end else len(text)
        body, n = re.subn(rf"(?m)^{name} = .*$", f"{name} = {value}", text[body_at:end], count=1)
        if not n and not table:
            raise ValueError(f"the demo's run file has no {key} setting to change")
        text = text[:body_at] + (body if n else f"{name} = {value}\n" + body) + text[end:]
    return text


def run(steps: int, max_seconds: float, async_level: int | None, cheat: str, root: Path, hog: bool,
        threads: int | None = DEMO_THREADS, optimizer_steps: int | None = None, eval_every: int | None = None,
        model: str = "", settings: dict | None = None) -> dict:
    """``model``: a model folder, run on the demo's real task (node/app/demo.py ``demo_run_text``);
    ``settings``: values of the demo's run file to change (e.g. {"group_size": 4})."""
    hog_proc = None
    if hog:  # one busy core, bounded even if we are killed
        hog_proc = subprocess.Popen([sys.executable, "-c", HOG.format(limit=max_seconds + 120)])
    try:
        with LocalSwarm(root, log_level="warning", extra_env=node_env(threads)) as swarm:
            text = demo_run_text(swarm.peer_id("trainer"), swarm.peer_id("validator"), model)
            if async_level is not None:  # the demo's run file has a [grpo] table
                text = text.replace("[grpo]\n", f"[grpo]\nasync_level = {async_level}\n", 1)
            if eval_every is not None:  # the demo's run file has a [trainer] table (bench/eval_idle.py)
                text = text.replace("[trainer]\n", f"[trainer]\neval_every = {eval_every}\n", 1)
            text = set_run_values(text, {**({} if optimizer_steps is None else {"optimizer_steps": optimizer_steps}),
                                         **(settings or {})})
            swarm.write_run_file(text)
            for name, role in (("relay", "relay"), ("trainer", "trainer"), ("validator", "validator"),
                               ("inference-1", "inference"), ("inference-2", "inference")):
                swarm.start(name, role)
            if cheat:
                cheat_run = root / "cheat.toml"
                cheat_run.write_text(text.replace("[worker]\n", f'[worker]\ncheat = "{cheat}"\n'))
                swarm.start("cheater", "inference", "--run", str(cheat_run))
            started = time.monotonic()
            while time.monotonic() - started < max_seconds:
                # A step counts once published (its save and publish timed too: node/steptime.py).
                trainer = swarm.status("trainer").get("trainer") or {}
                if (((trainer.get("phases_s") or {}).get("publish") or {}).get("n") or 0) >= steps:
                    break
                time.sleep(0.5)
            seconds = time.monotonic() - started
            statuses = {name: (p.role, swarm.status(name)) for name, p in swarm.procs.items()}
    finally:
        if hog_proc is not None:
            os.kill(hog_proc.pid, signal.SIGKILL)
            hog_proc.wait()
    figures = loop_figures(statuses, seconds)
    figures["reward"] = (statuses["trainer"][1].get("trainer") or {}).get("reward") or []
    figures["step_time"] = step_time_figures(statuses)  # where a step's time went (node/steptime.py)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--async-level", type=int, default=None, help="override the demo's [grpo] async_level")
    ap.add_argument("--hog", action="store_true", help="keep one core busy with a CPU hog during the run")
    ap.add_argument("--cheat", default="", help="add a cheating inference node (see swarm-node demo --cheat)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures and reward curve here")
    ap.add_argument("--threads", type=int, default=DEMO_THREADS,
                    help=f"torch threads per node process (default {DEMO_THREADS}, as the demo; 0 = torch's own default)")
    ap.add_argument("--optimizer-steps", type=int, default=None, help="override the demo's [grpo] optimizer_steps")
    ap.add_argument("--keep", type=Path, default=None, help="keep the nodes' data dirs and logs here")
    args = parse_args(ap, {"steps": 3, "max_seconds": 45.0})
    if args.keep:
        f = run(args.steps, args.max_seconds, args.async_level, args.cheat, args.keep, args.hog, args.threads or None,
                args.optimizer_steps)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
            f = run(args.steps, args.max_seconds, args.async_level, args.cheat, Path(tmp), args.hog, args.threads or None,
                    args.optimizer_steps)
    print(format_figures(f))
    ratio = reward_ratio(f["reward"])
    if ratio is not None:
        print(f"mean reward: first 10 steps {ratio[0]:.3f}, last 10 steps {ratio[1]:.3f}"
              + (f", ratio {ratio[2]:.2f}" if ratio[2] is not None else ""))
    print(f"honest samples trained / generated (ideal 1.0): {f['trained_fraction']}")
    if args.json:
        args.json.write_text(json.dumps(f, indent=1))
    if f["steps"] < args.steps:  # a stalled swarm is a failure, not a figure (make bench-quick fails on it)
        sys.exit(f"bench/loop.py: the trainer made {f['steps']} of {args.steps} steps in {args.max_seconds:.0f} s")


if __name__ == "__main__":
    main()
