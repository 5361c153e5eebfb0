"""FSDP2 on CPU with gloo: two ranks make the same update as one process on the same samples.

Both resume from a one-process state of step 1 (so the AdamW moments are converted to the sharded
form), make step 2, and the FSDP-saved state is read back by one process (names back to positions).

With equal completion lengths every rank holds the same number of loss tokens, so the mean of the
per-rank token means is the global token mean, and the round-robin shares of a step's samples
rebuild exactly the one-process mini-batches. Weights after one step must then match.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from node.identity import Identity
from node.rl.config import GRPOConfig
from node.trainer.config import TrainerConfig
from node.trainer.policy import Policy, training_samples
from node.trainer.testing import reversal_batch

pytestmark = pytest.mark.slow

CFG = {"optimizer_steps": 2, "pack_length": 64, "kl_coef": 0.0, "lr": 1e-3, "warmup_steps": 0, "min_batch_samples": 8}
WORKER = Identity.from_seed(b"f" * 32)
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from node.trainer import fsdp
    from node.trainer.fsdp import open_policy
    from node.rl.config import GRPOConfig
    from node.trainer.config import TrainerConfig
    from node.engines.model import load_model, load_tokenizer
    from test_trainer_fsdp import CFG, step_samples
    fsdp.init_distributed()
    cfg, tcfg = GRPOConfig(**CFG), TrainerConfig()
    if dist.get_rank() == 0:
        v0 = {root!r} + "/models/v0"
        samples = step_samples(load_model(v0), load_tokenizer(v0))  # a plain copy: forward is not collective
        policy, created = open_policy({root!r}, "", cfg, tcfg)
        assert not created and isinstance(policy, fsdp.FSDPPolicy)
        policy.train(samples)
        policy.save()
        policy.close()
    else:
        fsdp.follow(cfg, tcfg)
    fsdp.leave()
    fsdp.exit_now(0)
""")


def step_samples(model, tokenizer):
    """8 samples, completions all 5 characters + eos, with log-probs of ``model`` (version 0)."""
    from node.rl.synthetic import make_reversal_tasks

    answers = [(t["answer"] + "#####")[:5] for t in make_reversal_tasks(2, seed=3 + 7)]  # the draw of seed 3
    comps = [[a, a[:2] + "###", "#####", a[::-1]] for a in answers]
    b = reversal_batch(WORKER, "t", step=0, policy_version=0, tokenizer=tokenizer, model=model,
                       prompts=2, group_size=4, seed=3, completions=comps)
    samples, dropped = training_samples(b)
    assert len(samples) == 8, dropped
    return samples


def test_two_gloo_ranks_match_one_process(tmp_path):
    cfg = GRPOConfig(**CFG)
    single, _ = Policy.open(tmp_path / "single", "", cfg, TrainerConfig(init_warmup_steps=0))
    samples = step_samples(single.model, single.tokenizer)
    single.train(samples)  # step 1 in one process, so AdamW has moments to hand over
    single.save()
    shutil.copytree(tmp_path / "single", tmp_path / "fsdp")  # both resume from this step-1 state
    single.train(samples)
    single.save()

    script = SCRIPT.format(tests=str(ROOT / "tests"), root=str(tmp_path / "fsdp"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = run_reaped([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       str(_write(tmp_path / "ranks.py", script))], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    sharded, created = Policy.open(tmp_path / "fsdp", "", cfg, TrainerConfig())
    assert not created and sharded.step == 2
    for (k, a), (_, b) in zip(single.model.state_dict().items(), sharded.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run_reaped(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run torchrun in its own process group and kill the whole group (ranks too) on timeout."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
