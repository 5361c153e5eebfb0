"""FSDP2 on CPU with gloo: two ranks make the same update as one process on the same samples.

Both resume from a one-process state of step 1 (so the AdamW moments are converted to the sharded
form), make step 2, and the FSDP-saved state is read back by one process (names back to positions).

With equal completion lengths every rank holds the same number of loss tokens, so the mean of the
per-rank token means is the global token mean, and the round-robin shares of a step's samples
rebuild exactly the one-process mini-batches. Weights after one step must then match.

Three ranks with uneven shares (20 samples: 7, 7 and 6, split into 4, 4 and 3 mini-batches) must
agree on the count and finish; before the agreement the third rank left early and the others hung
in ``all_gather``. torchrun starts every rank in a session of its own, so the helper records each
rank's process group and kills each on timeout (tested with ranks that never end).
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
from waiting import wait_until

from node.identity import Identity
from node.rl.config import GRPOConfig
from node.rl.grpo import TrainSample, split_minibatches
from node.trainer.fsdp import empty_batch, loss_scale, plan_minibatches
from node.trainer.config import TrainerConfig
from node.trainer.policy import Policy, training_samples
from node.trainer.testing import reversal_batch

CFG = {"optimizer_steps": 2, "pack_length": 64, "kl_coef": 0.0, "lr": 1e-3, "warmup_steps": 0, "min_batch_samples": 8}
WORKER = Identity.from_seed(b"f" * 32)
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from test_trainer_fsdp import record_rank
    record_rank({piddir!r})
    from node.trainer import fsdp
    from node.trainer.fsdp import open_policy
    from node.rl.config import GRPOConfig
    from node.trainer.config import TrainerConfig
    from node.engines.model import load_model, load_tokenizer
    from test_trainer_fsdp import step_samples
    fsdp.init_distributed()
    cfg, tcfg = GRPOConfig(**{cfg!r}), TrainerConfig()
    if dist.get_rank() == 0:
        v0 = {root!r} + "/models/v0"
        samples = step_samples(load_model(v0), load_tokenizer(v0), prompts={prompts!r})  # a plain copy: forward is not collective
        assert len(samples) == {expect!r}
        policy, created = open_policy({root!r}, "", cfg, tcfg)
        assert not created and isinstance(policy, fsdp.FSDPPolicy)
        stats = policy.train(samples)
        assert stats.optimizer_steps == cfg.optimizer_steps, stats
        policy.save()
        policy.close()
    else:
        fsdp.follow(cfg, tcfg)
    fsdp.leave()
    fsdp.exit_now(0)
""")


def _toy(n: int) -> list[TrainSample]:
    return [TrainSample([1, 2], [3, 4], [-1.0, -1.0], 1.0) for _ in range(n)]


def test_short_shares_are_padded_to_the_agreed_count():
    shares = [_toy(7), _toy(7), _toy(6)]  # 20 samples over 3 ranks
    own = [len(split_minibatches(s, 4)) for s in shares]
    assert own == [4, 4, 3]  # the counts that deadlocked
    plans = [plan_minibatches(s, 4, max(own)) for s in shares]
    assert [len(p) for p in plans] == [4, 4, 4]
    assert [len(mb) for mb in plans[2]] == [2, 2, 2, 0]
    assert [len(mb) for mb in plan_minibatches([], 4, 3)] == [0, 0, 0]  # a rank with no sample at all
    with pytest.raises(RuntimeError, match="below this rank"):
        plan_minibatches(_toy(7), 4, 3)


def test_scaled_rank_losses_average_to_the_global_token_mean():
    tokens, sums = [5, 3, 0], [2.0, 9.0, 0.0]  # loss tokens and summed token losses per rank
    means = [s / max(n, 1) for s, n in zip(sums, tokens)]
    fsdp_avg = sum(m * loss_scale(n, sum(tokens), 3) for m, n in zip(means, tokens)) / 3
    assert fsdp_avg == pytest.approx(sum(sums) / sum(tokens))
    assert loss_scale(0, 0, 3) == 0.0


def test_an_empty_minibatch_runs_a_forward_and_backward_that_change_nothing():
    from node.engines.model import build_tiny_model
    from node.rl.grpo import batch_loss

    model = build_tiny_model(64, 1, 0)
    batch = empty_batch(0, 64)
    assert batch.num_tokens == 0
    parts = batch_loss(model, batch, GRPOConfig(**CFG))
    parts.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(float(g.abs().max()) == 0.0 for g in grads)


def record_rank(piddir: str) -> None:
    """In a rank: write ``<pid> <pgid>`` to ``piddir/rank<R>`` so the test can reap it."""
    name = Path(piddir) / f"rank{os.environ.get('RANK', '0')}"
    name.write_text(f"{os.getpid()} {os.getpgid(0)}")


def step_samples(model, tokenizer, prompts: int = 2):
    """4 x ``prompts`` samples, completions all 5 characters + eos, with log-probs of ``model`` (version 0)."""
    from node.rl.synthetic import make_reversal_tasks

    answers = [(t["answer"] + "#####")[:5] for t in make_reversal_tasks(prompts, seed=3 + 7)]  # the draw of seed 3
    comps = [[a, a[:2] + "###", "#####", a[::-1]] for a in answers]
    b = reversal_batch(WORKER, "t", step=0, policy_version=0, tokenizer=tokenizer, model=model,
                       prompts=prompts, group_size=4, seed=3, completions=comps)
    samples, dropped = training_samples(b)
    assert len(samples) == 4 * prompts, dropped
    return samples


def run_ranks(tmp_path: Path, root: Path, ranks: int, cfg: dict, prompts: int, timeout: float = 300):
    script = SCRIPT.format(tests=str(ROOT / "tests"), root=str(root), piddir=str(tmp_path), cfg=cfg,
                           prompts=prompts, expect=4 * prompts)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return run_reaped([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                       str(_write(tmp_path / "ranks.py", script))], env=env, timeout=timeout, piddir=tmp_path)


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(tmp_path):
    cfg = GRPOConfig(**CFG)
    single, _ = Policy.open(tmp_path / "single", "", cfg, TrainerConfig(init_warmup_steps=0))
    samples = step_samples(single.model, single.tokenizer)
    single.train(samples)  # step 1 in one process, so AdamW has moments to hand over
    single.save()
    shutil.copytree(tmp_path / "single", tmp_path / "fsdp")  # both resume from this step-1 state
    single.train(samples)
    single.save()

    proc = run_ranks(tmp_path, tmp_path / "fsdp", 2, CFG, prompts=2)
    assert proc.returncode == 0, proc.stderr[-3000:]

    sharded, created = Policy.open(tmp_path / "fsdp", "", cfg, TrainerConfig())
    assert not created and sharded.step == 2
    for (k, a), (_, b) in zip(single.model.state_dict().items(), sharded.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow
def test_three_gloo_ranks_with_uneven_shares_agree_and_finish(tmp_path):
    """20 samples over 3 ranks (7, 7, 6) with 4 optimizer steps: 4, 4 and 3 own mini-batches."""
    cfg = {**CFG, "optimizer_steps": 4, "min_batch_samples": 20}
    policy, _ = Policy.open(tmp_path / "fsdp", "", GRPOConfig(**cfg), TrainerConfig(init_warmup_steps=0))
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    proc = run_ranks(tmp_path, tmp_path / "fsdp", 3, cfg, prompts=5)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    after, _ = Policy.open(tmp_path / "fsdp", "", GRPOConfig(**cfg), TrainerConfig())
    assert after.step == 1
    state = after.model.state_dict()
    assert all(torch.isfinite(v).all() for v in state.values())
    assert any(not torch.equal(before[k], state[k]) for k in before), "the step changed no weight"


HANG = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_trainer_fsdp import record_rank
    record_rank({piddir!r})
    time.sleep(3600)
""")


@pytest.mark.slow
def test_the_helper_reaps_every_rank_when_the_ranks_hang(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = _write(tmp_path / "hang.py", HANG.format(tests=str(ROOT / "tests"), piddir=str(tmp_path)))
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    # the timeout is the hang under test: it starts once both ranks have recorded themselves
    proc = run_reaped(args, env=env, timeout=1.0, piddir=tmp_path, ready=2)
    assert proc.returncode != 0
    pids = [int(f.read_text().split()[0]) for f in tmp_path.glob("rank*")]
    assert len(pids) == 2
    wait_until(lambda: not any(_alive(p) for p in pids), what="every rank reaped")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (dead, not yet waited for by torchrun) is gone for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run_reaped(args: list[str], env: dict, timeout: float, piddir: Path,
               ready: int = 0) -> subprocess.CompletedProcess:
    """Run torchrun in its own process group; on timeout kill it and every rank's own group.

    torchrun starts each rank with ``start_new_session=True``, so killing torchrun's group leaves the
    ranks running (and holding the test forever): each rank writes ``<pid> <pgid>`` to
    ``piddir/rank<R>`` (:func:`record_rank`) and every such group is killed. ``ready``: wait for that
    many rank files before the timeout starts counting (to test the reaping itself).
    """
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    if ready:
        wait_until(lambda: len(list(Path(piddir).glob("rank*"))) >= ready or proc.poll() is not None,
                   what="ranks started")
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for f in Path(piddir).glob("rank*"):
            try:
                pid, pgid = (int(x) for x in f.read_text().split())
            except ValueError:  # a rank was writing its file as we read it
                continue
            for kill, target in ((os.killpg, pgid), (os.kill, pid)):
                try:
                    kill(target, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
