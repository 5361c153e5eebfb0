"""A cheaper model passes? What the validator's checks tell apart from the run's checkpoint (issue 42, hole 7).

    .venv/bin/python bench/cheap_model.py            # 200 batches per change, 1,000 honest ones (~15 min idle)
    .venv/bin/python bench/cheap_model.py --quick    # a few of each, to see that it works

A worker saving compute runs a changed copy of the checkpoint and claims the checkpoint: it samples,
scores and proves with the changed weights (the cheapest lie; node/adversary/cheap.py). The changes:
every weight matrix fake-quantised per row to b bits, and Gaussian noise of s x each tensor's std
(node/validator/testing.py ``perturbed_model``). Batches are whole steps of the inference role's own
generator (node/inference/generate.py: draw, seeded sampling, verifier, TOPLOC proofs, signature) on
the embedded model (float32; ``--dtype bfloat16`` runs worker and validator in bf16) and the synthetic
task, 4 prompts x 4 completions = 16 per batch, judged by the validator's pipeline with the run's
rules against the real checkpoint. The baseline: the same
steps sampled with the real weights (false rejections). Each batch is judged twice: under the run's
rules, and with the bf16-sized log-prob tolerance for every dtype (before the float32 one,
``node.proofs.checks.logprob_tolerances``).

Printed per change: batches caught under each, how many batches hold any token the honest batch of
the same step does not (only those can the sampling replay see), and the reasons given; last, the
smallest change caught in >= 99 % of batches and the ratio of its caught share to the honest
false-rejection share.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quick import parse_args  # noqa: E402  (bench/, the script's own folder)

RUN = "cheap-model"
CAUGHT_GOAL = 0.99


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def run(args) -> None:
    import torch

    from node.adversary.cheap import quantise_rows
    from node.config import RunConfig
    from node.engines.model import create_tiny_model
    from node.engines.torch_engine import TorchEngine
    from node.identity import Identity
    from node.inference.generate import RolloutGenerator
    from node.proofs.config import ProofsConfig
    from node.rl.config import InferenceConfig, RLConfig
    from node.rl.spec import OFFLINE_ROOT
    from node.rollouts.config import WorkerConfig
    from node.rollouts.schema import open_batch
    from node.roles.sections import RunSections
    from node.validator.config import ValidatorSections
    from node.validator.pipeline import CheckModel, judge_batch
    from node.validator.service import batch_rules
    from node.validator.tasks import RunTasks
    from node.validator.testing import perturbed_model

    torch.set_num_threads(args.threads)
    run_cfg = RunConfig(name=RUN, tables={"rl": {"group_size": args.group_size, "prompts_per_batch": args.prompts,
                                                 "max_new_tokens": args.tokens}, "inference": {"dtype": args.dtype}})
    rules = batch_rules(RUN, RunSections.of(run_cfg).pick(ValidatorSections))
    one = replace(rules, proofs=replace(rules.proofs, logprob_tolerance_mean_fp32=rules.proofs.logprob_tolerance_mean,
                                        logprob_tolerance_max_fp32=rules.proofs.logprob_tolerance_max))
    tasks = RunTasks(run_cfg.section("rl", RLConfig))
    with tempfile.TemporaryDirectory() as tmp:
        folder = create_tiny_model(Path(tmp) / "v0")
        validator = TorchEngine("cpu", dtype=getattr(torch, args.dtype))
        validator.load(folder)
        model = CheckModel(validator.model, validator.tokenizer, 0)
        worker = RolloutGenerator(identity=Identity.from_seed(bytes(range(32))), run_name=RUN,
                                  rl=run_cfg.section("rl", RLConfig), proofs=run_cfg.section("proofs", ProofsConfig),
                                  inference=run_cfg.section("inference", InferenceConfig), worker=WorkerConfig())
        worker.follow(folder)
        real = copy.deepcopy(worker.engine.model)
        print(f"embedded model ({model.dtype}), {args.prompts} prompts x {args.group_size} completions a batch, "
              f"<= {args.tokens} tokens; log-prob tolerance (mean, max) float32 "
              f"({rules.proofs.logprob_tolerance_mean_fp32}, {rules.proofs.logprob_tolerance_max_fp32}), "
              f"else ({rules.proofs.logprob_tolerance_mean}, {rules.proofs.logprob_tolerance_max}); "
              f"sampling tolerance {rules.sampling_tolerance}", flush=True)

        honest_tokens: list[list[list[int]]] = []

        def measure(name: str, count: int) -> dict:
            caught, caught_one, differ, reasons = 0, 0, 0, Counter()
            t0 = time.perf_counter()
            for step in range(count):
                batch = open_batch(worker.run_step(step, 0, 0).sealed.envelope, RUN).batch
                tokens = [list(s.completion_ids) for s in batch.samples]
                if name == "honest":
                    honest_tokens.append(tokens)
                differ += tokens != honest_tokens[step]
                j = judge_batch(batch, rules, current_version=0, tasks=tasks, model=model, policy_root=OFFLINE_ROOT)
                caught += not j.accepted
                reasons.update(r for r in j.reasons if r != "ok")
                caught_one += not judge_batch(batch, one, current_version=0, tasks=tasks, model=model,
                                              policy_root=OFFLINE_ROOT).accepted
            row = {"name": name, "n": count, "caught": caught, "caught_one": caught_one, "differ": differ,
                   "reasons": dict(reasons.most_common()), "s": time.perf_counter() - t0}
            print(f"{name:>12} {count:>6} {caught:>6} {100 * caught / count:>6.1f} % {caught_one:>6} "
                  f"{100 * caught_one / count:>6.1f} % {differ:>7} {row['s']:>5.0f} s  {row['reasons'] or ''}", flush=True)
            return row

        print(f"{'change':>12} {'n':>6} {'caught (run rules)':>17} {'caught (one tol.)':>17} {'differ':>7} "
              f"{'time':>7}  reasons (run rules, samples)")
        honest = measure("honest", args.honest)
        rows = []
        changes = [(f"{b} bits", lambda m, b=b: quantise_rows(m, b)) for b in args.bits]
        changes += [(f"noise {s:g}", lambda m, s=s: perturbed_model(m, s)) for s in args.noise]
        try:
            for name, change in changes:
                worker.engine.model.load_state_dict(change(copy.deepcopy(real)).state_dict())
                rows.append(measure(name, min(args.batches, args.honest)))
        finally:
            worker.engine.model.load_state_dict(real.state_dict())
    false_rate = honest["caught"] / honest["n"]
    print(f"\nhonest false rejections: {honest['caught']} of {honest['n']} batches under the run's rules, "
          f"{honest['caught_one']} with one tolerance")
    for family in ("bits", "noise"):
        ok = [r for r in rows if family in r["name"] and r["caught"] >= CAUGHT_GOAL * r["n"]]
        # The smallest change: the most bits, the least noise.
        size = (lambda r: -float(r["name"].split()[0])) if family == "bits" else (lambda r: float(r["name"].split()[1]))
        best = min(ok, key=size, default=None)
        if best is None:
            print(f"{family}: no change caught in >= {CAUGHT_GOAL:.0%} of batches")
            continue
        rate = best["caught"] / best["n"]
        ratio = f"{rate / false_rate:.0f}x" if false_rate else "inf (no honest batch rejected)"
        print(f"{family}: smallest change caught in >= {CAUGHT_GOAL:.0%} of batches: {best['name']} "
              f"({best['caught']} of {best['n']}); caught share / honest false-rejection share: {ratio}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=200, help="batches per change")
    ap.add_argument("--honest", type=int, default=1000, help="honest batches (the baseline; at least --batches)")
    ap.add_argument("--bits", type=lambda t: [int(x) for x in floats(t)], default=[8, 6, 5, 4],
                    help="comma-separated bit widths of the per-row fake quantisation")
    ap.add_argument("--noise", type=floats, default=[0.001, 0.003, 0.01, 0.03],
                    help="comma-separated noise scales (x each tensor's std)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16, help="max_new_tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a shared machine: 1)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the run's [inference] dtype: the worker's and the validator's")
    args = parse_args(ap, {"batches": 4, "honest": 6, "bits": "8,4", "noise": "0.01"}, argv)
    run(args)


if __name__ == "__main__":
    main()
