"""Subcommand ``swarm-node rollout``: run inference steps offline, exactly as the inference role would.

Why: before joining a run with a GPU (or a CPU), an operator wants to know that the model folder
loads, the task set parses, the engine runs, and what one step costs — without a swarm. This runs
``RolloutGenerator.run_step`` (draw, sample, score, prove, sign) on a local model folder with the
run file's ``[rl]``, ``[inference]``, ``[proofs]`` and ``[worker]`` tables, under a throw-away key,
and prints one line per step: tokens, tokens/s, mean reward, proof share of the step, batch bytes.
Nothing is sent anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def add_commands(sub) -> None:
    p = sub.add_parser("rollout", help="generate rollout steps offline with a model folder (no network)")
    p.add_argument("--model", type=Path, metavar="DIR",
                   help="Hugging Face model folder (default: a fresh embedded tiny model in a temp dir)")
    p.add_argument("--run", type=Path, metavar="FILE", help="run file: its [rl], [inference], [proofs], [worker] tables")
    p.add_argument("--steps", type=int, default=3, help="steps to run (default 3)")
    p.add_argument("--json", action="store_true", help="one JSON object per step instead of a table")
    p.set_defaults(func=cmd_rollout)


def cmd_rollout(args: argparse.Namespace) -> int:
    from ...config import ConfigError, RunConfig, build, read_run_file, split_run_table
    from ...engines.model import is_model_folder
    from ...rl.tasks import TaskFormatError

    def fail(msg: str) -> int:
        print(f"swarm-node rollout: {msg}", file=sys.stderr)
        return 2

    if not 1 <= args.steps <= 10_000:
        return fail("--steps must be 1..10000")
    if args.model is not None and not is_model_folder(args.model):
        return fail(f"{args.model}: not a model folder (config.json and *.safetensors)")
    try:
        run = build(RunConfig, split_run_table(read_run_file(args.run)) if args.run else {"tables": {}}, "run")
        run.check_sections()
        generator = _generator(run)
    except ConfigError as e:
        return fail(str(e))
    except TaskFormatError as e:
        return fail(f"task set: {e}")
    except RuntimeError as e:  # e.g. engine = "vllm" without vllm or CUDA
        return fail(str(e))

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from ...engines.model import create_tiny_model

            model = create_tiny_model(Path(tmp) / "tiny")
        try:
            generator.follow(model)
        except (OSError, ValueError) as e:
            return fail(f"{model}: cannot load ({e})")
        if not args.json:
            print(f"{'step':>4} {'samples':>7} {'tokens':>7} {'tokens/s':>9} {'reward':>7} {'proofs':>7} {'batch':>10}")
        for step in range(args.steps):
            r = generator.run_step(step, 0, 0)
            row = {
                "step": step,
                "samples": r.samples,
                "tokens": r.completion_tokens,
                "tokens_per_s": round(r.completion_tokens / r.generate_s, 1) if r.generate_s > 0 else None,
                "mean_reward": round(r.mean_true_reward, 4),
                "proof_share": round(r.proof_s / (r.generate_s + r.score_s + r.proof_s), 4),
                "batch_bytes": len(r.sealed.envelope) if r.sealed else None,
                "fits_frame": r.sealed is not None,  # a step too big for one frame would not be sent
            }
            if args.json:
                print(json.dumps(row))
            else:
                print(f"{step:>4} {row['samples']:>7} {row['tokens']:>7} {row['tokens_per_s'] or 0:>9.1f} "
                      f"{row['mean_reward']:>7.3f} {100 * row['proof_share']:>6.1f}% {row['batch_bytes'] or 0:>10}")
    return 0


def _generator(run):
    from ...identity import Identity
    from ...adversary.generator import make_generator
    from ...roles.sections import RunSections

    s = RunSections.of(run)
    return make_generator(identity=Identity.generate(), run_name=run.name, rl=s.rl, proofs=s.proofs,
                          inference=s.inference, worker=s.worker)
