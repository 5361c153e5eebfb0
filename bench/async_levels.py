"""Async levels x [grpo] losses on the same seeds: which loss still learns on k-step-old rollouts?

    .venv/bin/python bench/async_levels.py [--levels 0,2,4,8] [--losses intellect2,dppo-tv,tis]
                                           [--seeds 0,1,2] [--steps 60]

The in-process loop (node/rl/loop.py ``run_local_loop``: the same draw, sampling, scoring and GRPO
step as the swarm's roles, no network) on the demo's settings (the tiny default model, the synthetic
digit-reversal task, the demo run file's [rl] and [grpo] tables), once per (async level, loss, seed),
each from the same initial model and the same sampling seeds; at level k step s samples from version
s - k, so every sample is trained k off-policy steps behind (the worst case a run with
``max_off_policy_steps = k`` allows). Each cell's final reward is read two ways:

* **final policy**: the mean reward of the trained model (the version the run ends with) on a fixed
  evaluation draw (``EVAL_DRAWS`` x prompts x group samples, the same draw and sampling seeds in
  every cell) -- the model a run delivers;
* **last 10 steps**: the mean reward of the rollouts of the run's last 10 steps -- what the swarm
  sees while it trains; at level k those come from versions k steps older than the trainer's.

Each is printed as a ratio to level 0 with the same loss and seed (the baseline measured in the same
run), as the mean over seeds and the lowest and highest seed; then the mean masked/clipped token
fraction and mismatch KL of each cell (node/rl/losses.py). The machine is shared and noisy: compare
ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from node.app.demo import RUN_TEMPLATE  # noqa: E402
from node.engines.torch_engine import TorchEngine  # noqa: E402
from node.rl.config import LOSSES, GRPOConfig, RLConfig  # noqa: E402
from node.rl.loop import LoopStep, run_local_loop  # noqa: E402
from node.rl.rollout import make_groups  # noqa: E402
from node.rl.tasks import load_taskset  # noqa: E402
from node.rl.warmup import create_default_model  # noqa: E402
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)

EVAL_DRAWS = 8  # evaluation batches of the final policy (prompts_per_batch x group_size samples each)
EVAL_SEED = 10_000_019  # sampling seeds of the evaluation draw, apart from every training seed
LAST = 10  # steps whose rollouts make the "last 10 steps" figure


def demo_tables() -> tuple[RLConfig, GRPOConfig]:
    run = tomllib.loads(RUN_TEMPLATE.format(trainer="t", validator="v"))
    rl, grpo = RLConfig(**run.get("rl", {})), GRPOConfig(**run.get("grpo", {}))
    rl.validate()
    grpo.validate()
    return rl, grpo


def final_policy_reward(engine, taskset, rl: RLConfig) -> float:
    """Mean sampled reward of ``engine``'s model on the fixed evaluation draw."""
    rewards = [r for i in range(EVAL_DRAWS)
               for g in make_groups(engine, taskset, rl, "eval", i, seed=EVAL_SEED + i) for r in g.rewards]
    return statistics.fmean(rewards)


def run_cell(model_dir: Path, rl: RLConfig, grpo: GRPOConfig, steps: int, seed: int, level: int,
             threads: int) -> tuple[float, list[LoopStep]]:
    """One (level, loss, seed) run from the initial model: (final policy's reward, the steps)."""
    torch.set_num_threads(threads)
    taskset = load_taskset(rl.taskset)
    torch.manual_seed(seed)
    engine = TorchEngine("cpu")
    engine.load(model_dir)
    hist = run_local_loop(engine, taskset, rl, grpo, steps, seed=seed, async_level=level)
    return final_policy_reward(engine, taskset, rl), hist


def spread(ratios: list[float]) -> str:
    return f"{statistics.fmean(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def table(title: str, figure: dict, levels: list[int], losses: list[str], seeds: list[int]) -> None:
    """Each (level, loss) cell over level 0 with the same loss and seed: mean (lowest-highest seed)."""
    print(f"\n{title}: ratio to level 0, same loss and seed; mean over seeds (lowest-highest)")
    print(f"{'level':>5}  " + "  ".join(f"{name:>22}" for name in losses))
    for level in levels:
        cells = [spread([figure[level, name, s] / max(figure[0, name, s], 1e-9) for s in seeds]) for name in losses]
        print(f"{level:>5}  " + "  ".join(f"{c:>22}" for c in cells))
    print(f"{'abs@0':>5}  " + "  ".join(f"{statistics.fmean(figure[0, n, s] for s in seeds):>22.3f}" for n in losses))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="0,2,4,8", help="comma-separated async levels; 0 (the baseline) is added")
    ap.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated [grpo] losses ({', '.join(LOSSES)})")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated sampling seeds, the same in every cell")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per cell")
    ap.add_argument("--jobs", type=int, default=1, help="cells run at once, each in its own process")
    ap.add_argument("--lr", type=float, default=None, help="override the demo's [grpo] lr (for tuning)")
    args = parse_args(ap, {"steps": 6, "levels": "0,2", "seeds": "0"})
    rl, grpo = demo_tables()
    if args.lr is not None:
        grpo.lr = args.lr
    levels = sorted({0, *(int(x) for x in args.levels.split(","))})
    losses = args.losses.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    for name in losses:
        replace(grpo, loss=name).validate()
    final: dict[tuple[int, str, int], float] = {}
    last: dict[tuple[int, str, int], float] = {}
    masked: dict[tuple[int, str], list[float]] = {}
    mismatch: dict[tuple[int, str], list[float]] = {}
    t0 = time.monotonic()
    cells = [(level, name, seed) for name in losses for level in levels for seed in seeds]
    # spawned, not forked: a fork of a process that already ran torch can hang in its thread pools
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp, \
            ProcessPoolExecutor(max(1, args.jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        model_dir = Path(tmp) / "model"
        torch.manual_seed(0)
        create_default_model(model_dir)
        runs = {pool.submit(run_cell, model_dir, rl, replace(grpo, loss=name), args.steps, seed, level,
                            args.threads): (level, name, seed) for level, name, seed in cells}
        for done in as_completed(runs):
            level, name, seed = key = runs[done]
            final[key], hist = done.result()
            last[key] = statistics.fmean(h.mean_reward for h in hist[-LAST:])
            masked.setdefault((level, name), []).extend(h.masked_frac for h in hist)
            mismatch.setdefault((level, name), []).extend(h.mismatch_kl for h in hist)
            print(f"level {level} {name} seed {seed}: final policy {final[key]:.3f}, last {LAST} steps "
                  f"{last[key]:.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"\n[rl] group_size {rl.group_size}, prompts {rl.prompts_per_batch}, max_new_tokens {rl.max_new_tokens}; "
          f"[grpo] lr {grpo.lr}, optimizer_steps {grpo.optimizer_steps}; {args.steps} steps, seeds {seeds}; "
          f"{time.monotonic() - t0:.0f} s")
    print(f"{'level':>5}  " + "  ".join(f"{'masked / mismatch KL ' + n:>34}" for n in losses))
    for level in levels:
        print(f"{level:>5}  " + "  ".join(f"{statistics.fmean(masked[level, n]):>22.3f} / "
                                          f"{statistics.fmean(mismatch[level, n]):>8.4f}" for n in losses))
    table(f"last {LAST} steps' rollouts", last, levels, losses, seeds)
    table("final policy (fixed evaluation draw)", final, levels, losses, seeds)


if __name__ == "__main__":
    main()
