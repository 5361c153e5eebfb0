"""bench/gpu.py, the script a GPU session runs once, keeps running: its CPU smoke mode end to end."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_bench_runs_in_smoke_mode_and_its_cuda_path_checks_hold_on_cpu(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "gpu.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["section_s"]) == set(bench.SECTIONS)
    c = res["correctness"]
    assert c["static_tokens_equal_dynamic"] and c["static_states_pass_toploc"]
    assert c["fused_vs_unfused_max_diff"] == 0.0 and c["packed_vs_alone_logprob_sum_diff"] < 1e-3
    assert res["decode"]["compiled_path"] == "static"  # no graphs on a CPU
    assert res["train"]["grpo_tok_s"] > 0 and res["validate"]["prefill_tok_s"] > 0
    assert 0 < res["train"]["mismatch_rescore_over_step"] < 10  # the trainer's per-step rescore ran
