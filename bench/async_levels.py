"""Async levels side by side on the same seeds: does training on k-step-old rollouts still learn?

    .venv/bin/python bench/async_levels.py [--levels 0,2,4] [--steps 60] [--seeds 0]

The in-process loop (node/rl/loop.py ``run_local_loop``: the same draw, sampling, scoring and GRPO
step as the swarm's roles, no network) on the demo's settings (the tiny default model, the synthetic
digit-reversal task, the demo run file's [rl] and [grpo] tables), once per async level, each from the
same initial model and the same sampling seeds; at level k step s samples from version s - k. Prints
the mean reward per step as an ASCII curve per level, the first/last 10 steps' means, and each
level's last-10 mean over level 0's (the baseline measured in the same run; INTELLECT-2 reports
async level 2 close to synchronous). The machine is shared and noisy: compare ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from node.app.demo import RUN_TEMPLATE, reward_plot  # noqa: E402
from node.engines.torch_engine import TorchEngine  # noqa: E402
from node.rl.config import GRPOConfig, RLConfig  # noqa: E402
from node.rl.loop import run_local_loop  # noqa: E402
from node.rl.tasks import load_taskset  # noqa: E402
from node.rl.warmup import create_default_model  # noqa: E402
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)


def demo_tables() -> tuple[RLConfig, GRPOConfig]:
    run = tomllib.loads(RUN_TEMPLATE.format(trainer="t", validator="v"))
    rl, grpo = RLConfig(**run.get("rl", {})), GRPOConfig(**run.get("grpo", {}))
    rl.validate()
    grpo.validate()
    return rl, grpo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="0,2,4")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="0", help="comma-separated sampling seeds; curves are averaged over them")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=None, help="override the demo's [grpo] lr (for tuning)")
    args = parse_args(ap, {"steps": 12, "levels": "0,2"})
    torch.set_num_threads(args.threads)
    rl, grpo = demo_tables()
    if args.lr is not None:
        grpo.lr = args.lr
    taskset = load_taskset(rl.taskset)
    levels = [int(x) for x in args.levels.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    curves: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        model_dir = Path(tmp) / "model"
        torch.manual_seed(0)
        create_default_model(model_dir)
        for level in levels:
            per_seed = []
            for seed in seeds:
                torch.manual_seed(seed)
                engine = TorchEngine("cpu")
                engine.load(model_dir)
                hist = run_local_loop(engine, taskset, rl, grpo, args.steps, seed=seed, async_level=level)
                per_seed.append([h.mean_reward for h in hist])
            curves[level] = [statistics.fmean(col) for col in zip(*per_seed)]
    print(f"[rl] group_size {rl.group_size}, prompts {rl.prompts_per_batch}, max_new_tokens {rl.max_new_tokens}; "
          f"[grpo] lr {grpo.lr}; {args.steps} steps, seeds {seeds}")
    base = statistics.fmean(curves[levels[0]][-10:])
    for level in levels:
        c = curves[level]
        first, last = statistics.fmean(c[:10]), statistics.fmean(c[-10:])
        print(f"\nasync level {level}: mean reward first 10 steps {first:.3f}, last 10 {last:.3f} "
              f"({last / first:.2f}x); last 10 over level {levels[0]}'s: {last / base:.2f}")
        print(reward_plot([[i + 1, r] for i, r in enumerate(c)], height=8))


if __name__ == "__main__":
    main()
