"""Where a trainer step's time goes in a real swarm: every phase of every role, against bare sampling.

    .venv/bin/python bench/step_time.py [--model DIR] [--steps 3] [--max-seconds 600] [--hog]
                                        [--group-size N] [--prompts N] [--tokens N] [--step-samples N]
                                        [--threads 1] [--keep DIR] [--json FILE]

Starts the demo's swarm (node/app/demo.py ``demo_run_text``: a relay, a trainer, a validator and two
inference nodes as real processes on 127.0.0.1; the embedded tiny model on digit reversal, or with
``--model DIR`` that model on the demo's real task: ``--model .models/smollm2-135m-instruct``, made
by ``make smollm2``), waits for ``--steps`` trainer steps and prints node/steptime.py's table from
the nodes' statuses: the mean seconds of each phase (generation, scoring, proofs, transfer, load,
verification, re-scoring, training, save, publish) per batch, step or checkpoint version, and what
each costs one trainer step. ``--hog`` keeps one core busy for the whole run (bench/loop.py's hog).

Baseline, measured in the same run once the swarm has stopped: bare sampling of the same batches
(``engine.generate`` without hidden-state capture; no scoring, proofs or signing) on the trainer's
last checkpoint, with the nodes' torch threads. The ratio, printed last, is the work one trainer
step costs summed over the roles / bare sampling of the batches that step trains on: what the
swarm's checks, training and distribution add to the sampling any RL run pays for. On a 2-core
machine the swarm's five processes share the cores, so its generation alone is slower than the
baseline's: the table's generate row against the baseline line shows by how much.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.app.demo import DEMO_THREADS, demo_run_text  # noqa: E402
from node.steptime import format_step_time  # noqa: E402
from loop import run  # noqa: E402  (bench/, the script's own folder)
from quick import parse_args  # noqa: E402

BASELINE_REPEATS = 3  # bare batches timed (after one warm-up); the median is the baseline


def bare_sampling_s(root: Path, model: str, settings: dict, threads: int | None, repeats: int) -> tuple[float, int]:
    """(median seconds of one bare batch, trainer step it used) on the trainer's last checkpoint in ``root``."""
    import torch

    from node.config import build
    from node.engines.torch_engine import TorchEngine
    from node.rl.config import RLConfig
    from node.rl.spec import OFFLINE_ROOT, draw_step, prompt_ids
    from node.rl.tasks import load_run_tasks
    from node.trainer import checkpoints
    from loop import set_run_values

    if threads:
        torch.set_num_threads(threads)
    text = set_run_values(demo_run_text("trainer", "validator", model), settings)
    rl = build(RLConfig, tomllib.loads(text).get("rl", {}), "run.rl")
    trainer_root = root / "trainer" / "trainer"
    step = max(checkpoints.versions_on_disk(trainer_root))
    engine = TorchEngine("cpu")
    engine.load(checkpoints.model_dir(trainer_root, step))
    taskset = load_run_tasks(rl)
    seconds = []
    for i in range(repeats + 1):  # the first is a warm-up
        drawn = draw_step(taskset, rl, "bench", "bench-peer", OFFLINE_ROOT, i)
        prompts = [prompt_ids(engine.tokenizer, t, b, rl) for t, b in zip(drawn.tasks, drawn.budgets)]
        t0 = time.perf_counter()
        engine.generate(prompts, n=rl.group_size, temperature=rl.temperature, top_p=rl.top_p,
                        max_new_tokens=rl.max_new_tokens, seed=drawn.seed, capture_hidden=False)
        if i:
            seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds), step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="model folder (default: the embedded tiny model on digit reversal)")
    ap.add_argument("--steps", type=int, default=3, help="trainer steps to wait for")
    ap.add_argument("--max-seconds", type=float, default=600.0)
    ap.add_argument("--hog", action="store_true", help="keep one core busy with a CPU hog during the swarm's run")
    ap.add_argument("--group-size", type=int, default=None, help="override the demo's [rl] group_size")
    ap.add_argument("--prompts", type=int, default=None, help="override the demo's [rl] prompts_per_batch")
    ap.add_argument("--tokens", type=int, default=None, help="override the demo's [rl] max_new_tokens")
    ap.add_argument("--step-samples", type=int, default=None,
                    help="[trainer] max_step_samples: at most this many samples a step (batches are taken whole)")
    ap.add_argument("--threads", type=int, default=DEMO_THREADS,
                    help=f"torch threads per node process and for the baseline (default {DEMO_THREADS}, as the demo)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the nodes' data dirs and logs here")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parse_args(ap, {"steps": 2, "max_seconds": 60.0})
    model = str(Path(args.model).resolve()) if args.model else ""
    settings = {k: v for k, v in (("group_size", args.group_size), ("prompts_per_batch", args.prompts),
                                  ("max_new_tokens", args.tokens), ("trainer.max_step_samples", args.step_samples))
                if v is not None}
    with tempfile.TemporaryDirectory(prefix="bench-step-time-") as tmp:
        root = args.keep or Path(tmp)
        f = run(args.steps, args.max_seconds, None, "", root, args.hog, args.threads or None, model=model,
                settings=settings)
        st = f["step_time"]
        if f["steps"] < 1:  # no step: no share of one to show, nor a checkpoint to time the baseline on
            sys.exit(f"bench/step_time.py: the trainer made no step in {args.max_seconds:.0f} s\n{format_step_time(st)}")
        bare, version = bare_sampling_s(root, model, settings, args.threads or None, BASELINE_REPEATS)
    shape = (f"{Path(model).name if model else 'tiny default model'}, {args.threads or 'default'} torch thread(s) "
             f"per node{', one core kept busy' if args.hog else ''}")
    print(f"{f['steps']} trainer steps in {f['seconds']:.0f} s ({shape})")
    print(format_step_time(st))
    per_step_bare = bare * st["batches_per_step"]
    print(f"baseline: bare sampling of one batch (no capture, scoring, proofs, signing) on v{version}, "
          f"the swarm stopped: {bare:.3f} s; {per_step_bare:.2f} s for the {st['batches_per_step']:.2f} batches of a step")
    if args.json:
        args.json.write_text(json.dumps({**f, "bare_batch_s": bare}, indent=1))
    print(f"ratio work per trainer step / bare sampling of its batches: {st['per_step_s'] / per_step_bare:.2f}")
    if f["steps"] < args.steps:  # a stalled swarm is a failure, not a figure (make bench-quick fails on it)
        sys.exit(f"bench/step_time.py: the trainer made {f['steps']} of {args.steps} steps in {args.max_seconds:.0f} s")


if __name__ == "__main__":
    main()
