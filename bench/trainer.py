"""Trainer benchmark: step throughput beside plain transformers, and idle time vs the async level.

    .venv/bin/python bench/trainer.py [--steps 6] [--seconds 45] [--levels 0,1,2] [--threads 1]
    .venv/bin/python bench/trainer.py --quick      # 2 steps, 10 s at levels 0 and 2 (about 30 s)

1. Tokens/s of the trainer's rollout step on the tiny default model on CPU: what the loop really
   does (GRPO train_step with packing, ``optimizer_steps`` AdamW steps, then the model folder and
   training state written atomically), beside a plain transformers step on the same samples in the
   same run (one right-padded sample per row, cross-entropy on the completion tokens, forward +
   backward + AdamW, no checkpoint). Loss tokens (completion tokens) are counted for both.
2. The fraction of wall time the trainer sat idle waiting for rollouts, at async level 0, 1, 2:
   a real trainer node in this process (``run_node``: intake, spool, loop, ledger, checkpoint
   publishing) with two simulated inference workers that generate with the torch engine from the
   newest published version and hand signed batches to the same intake (no stream, no proofs),
   paced by the inference node's own outbox (node/inference/outbox.py). At level 0 every batch
   generated while a step runs becomes stale; the async design lets workers keep going.

The machine is shared and noisy (2 cores for several agents): compare ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from swarmtest import node_config  # noqa: E402

import torch
import trio.lowlevel

from node.app.demo import DEMO_THREADS
from node.config import RunConfig
from node.engines.torch_engine import TorchEngine
from node.identity import Identity, load_or_create_identity
from node.rl.config import GRPOConfig
from node.rl.spec import group_advantages
from node.rl.synthetic import make_reversal_tasks, reversal_reward
from node.roles.core import run_node
from node.rollouts.config import WorkerConfig
from node.rollouts.schema import RolloutBatch, RolloutSample, batch_id_of
from node.inference.outbox import BatchState, Outbox, Pending
from node.trainer.config import TrainerConfig
from node.trainer.policy import Policy, training_samples
from node.trainer.testing import reversal_batch, sign_batch
from node.wire import Envelope, decode_as
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)

RUN = "bench"
PROMPTS, GROUP, NEW_TOKENS = 4, 8, 8


def grpo_cfg(**kw) -> GRPOConfig:
    return GRPOConfig(**{"pack_length": 64, "kl_coef": 0.0, "min_batch_samples": 32, **kw})


# ------------------------------------------------------------------------------------- 1. throughput


def plain_step(model, optimizer, samples, pad_id: int) -> int:
    """Baseline: padded rows, cross-entropy on completion tokens, forward+backward+AdamW."""
    L = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    ids = torch.full((len(samples), L), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), L), -100, dtype=torch.long)
    attn = torch.zeros((len(samples), L), dtype=torch.long)
    for r, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        ids[r, :len(seq)] = torch.tensor(seq)
        labels[r, len(s.prompt_ids):len(seq)] = torch.tensor(s.completion_ids)
        attn[r, :len(seq)] = 1
    model.train()
    loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    model.eval()
    return int((labels != -100).sum())


def bench_throughput(steps: int) -> None:
    worker = Identity.from_seed(b"b" * 32)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = grpo_cfg(optimizer_steps=1)
        tcfg = TrainerConfig(init_warmup_steps=0)  # random weights: a step's speed does not depend on them
        policy, _ = Policy.open(Path(tmp) / "t", "", cfg, tcfg)
        batches = [training_samples(reversal_batch(worker, RUN, step=i, policy_version=0, tokenizer=policy.tokenizer,
                                                   model=policy.model, prompts=PROMPTS, group_size=GROUP, seed=i))[0]
                   for i in range(steps + 1)]
        base_model, _ = Policy.open(Path(tmp) / "b", "", cfg, tcfg)
        base_opt = torch.optim.AdamW(base_model.model.parameters(), lr=cfg.lr)
        # warm-up (first-call allocations) for both, then timed steps alternating to share the noise
        policy.train(batches[0])
        plain_step(base_model.model, base_opt, batches[0], policy.pad_id)
        t_trainer = t_plain = t_train_only = 0.0
        tok_trainer = tok_plain = 0
        for b in batches[1:]:
            t0 = time.perf_counter()
            stats = policy.train(b)
            t_train_only += time.perf_counter() - t0
            policy.save()
            t_trainer += time.perf_counter() - t0
            tok_trainer += stats.tokens
            t0 = time.perf_counter()
            tok_plain += plain_step(base_model.model, base_opt, b, policy.pad_id)
            t_plain += time.perf_counter() - t0
    tr, pl = tok_trainer / t_trainer, tok_plain / t_plain
    print(f"1. rollout step throughput, tiny model, CPU, {steps} steps of {PROMPTS}x{GROUP} samples")
    print(f"   trainer (GRPO packed + save):      {tr:10.0f} loss tokens/s")
    print(f"   of which train_step alone:         {tok_trainer / t_train_only:10.0f} loss tokens/s"
          f"  (save = {100 * (1 - t_train_only / t_trainer):.0f}% of the step)")
    print(f"   plain transformers fwd+bwd+AdamW:  {pl:10.0f} loss tokens/s")
    print(f"   ratio trainer / plain:             {tr / pl:10.2f}")


# ------------------------------------------------------------------------------------- 2. idle time


# transformers' from_pretrained patches torch's init functions process-wide: two loads at once in two
# threads of one process can leave tied weights untied. Real nodes load one model per process.
_LOAD_LOCK = threading.Lock()


def _serialized(fn, *args):
    with _LOAD_LOCK:
        return fn(*args)


def make_batch(engine: TorchEngine, ident: Identity, step: int, version: int, root: bytes) -> bytes:
    """One signed batch of PROMPTS x GROUP completions of the reversal task from the loaded weights."""
    tasks = make_reversal_tasks(PROMPTS, seed=hash((ident.peer_id, step)) % 2**31)
    prompts = [engine.tokenizer(t["prompt"], add_special_tokens=False)["input_ids"] for t in tasks]
    groups = engine.generate(prompts, n=GROUP, temperature=1.0, top_p=1.0, max_new_tokens=NEW_TOKENS, seed=step,
                             capture_hidden=False)
    samples = []
    for p, (task, group) in enumerate(zip(tasks, groups)):
        rewards = [reversal_reward(s.text, task["answer"]) for s in group]
        for s, r, a in zip(group, rewards, group_advantages(rewards)):
            samples.append(RolloutSample(prompt_index=p, sample_index=s.sample_index, task_id=task["id"],
                                         prompt_ids=list(s.prompt_ids), completion_ids=list(s.completion_ids),
                                         logprobs=list(s.logprobs), finish_reason=s.finish_reason, reward=r,
                                         task_reward=r, advantage=a, proof=b""))
    return sign_batch(ident, RolloutBatch(
        run=RUN, worker=ident.peer_id, step=step, policy_version=version, policy_root=root, taskset="synthetic",
        seed=step, temperature=1.0, top_p=1.0, max_new_tokens=NEW_TOKENS, group_size=GROUP, created_ms=0,
        samples=samples))


async def worker_loop(tnode, ident: Identity, outbox: Outbox, counts: Counter) -> None:
    """A simulated inference node: newest version -> generate -> score -> sign -> submit.

    It paces itself as node/inference/service.py does, through the same :class:`Outbox` (the
    trainer's back-pressure, "not now" refusals kept and retried, stale batches dropped, consecutive
    step numbers), and hands its batches to the trainer's intake directly (no stream)."""
    trainer, me = tnode.trainer, [tnode.peer_id]
    engine = TorchEngine(device="cpu")
    loaded = -1
    step = 0
    while True:
        while (got := outbox.take(me, trio.current_time())) is not None:
            item, _ = got
            ack = await trainer.judge(item.envelope, ident.peer_id)
            outcome = outbox.on_ack(item.batch_id, me[0], ack, trio.current_time())
            if outcome.state is not BatchState.QUEUED:
                counts[outcome.reason if outcome.reason != "ok" else "accepted"] += 1
        now = trio.current_time()
        # Full: wait until a queued batch can go; else until the trainer's pacing lets us generate.
        wake = outbox.next_wakeup(me, now)
        if not outbox.full:
            wake = min(wake, outbox.generation_hold(me, now))
        if wake > now:
            await trio.sleep_until(min(wake, now + 1.0))
            continue
        version = trainer.step
        for _ in outbox.observe_version(version):
            counts["stale"] += 1
        announced = trainer.shards.announced.get(version)
        if announced is None:  # not published yet (the step counter leads the save and the publish)
            await trio.sleep(0.05)
            continue
        if loaded != version:
            load = engine.load if loaded < 0 else engine.swap_weights
            await trio.to_thread.run_sync(_serialized, load, trainer.policy.folder(version))
            loaded = version
        root = announced[0]
        data = await trio.to_thread.run_sync(make_batch, engine, ident, step, version, root)
        step += 1
        if outbox.is_stale(version):
            counts["stale"] += 1
            continue
        outbox.offer(Pending(batch_id=batch_id_of(decode_as(Envelope, data)), envelope=data, policy_version=version,
                             num_samples=PROMPTS * GROUP, created_at=trio.current_time()))
        await trio.lowlevel.checkpoint()


async def idle_at(level: int, seconds: float, tmp: Path) -> dict:
    """The trainer role of a real node (run_node: policy, spool, ledger, shards, membership) fed by two
    simulated workers for ``seconds``."""
    trainer_id, _ = load_or_create_identity(tmp / "trainer")
    run = RunConfig(name=RUN, trainers=[trainer_id.peer_id])
    run.tables.update(grpo={"pack_length": 64, "kl_coef": 0.0, "min_batch_samples": 32, "async_level": level},
                      trainer={"init_warmup_steps": 0, "keep_checkpoints": 8})
    wcfg = run.section("worker", WorkerConfig)
    counts: Counter = Counter()
    async with trio.open_nursery() as nursery:
        cfg = node_config(tmp, "trainer", "trainer", run=run)
        tnode = await nursery.start(lambda task_status: run_node(cfg, task_status=task_status, handle_signals=False))
        trainer = tnode.trainer
        with trio.move_on_after(seconds):
            async with trio.open_nursery() as workers:
                for i in range(2):
                    outbox = Outbox(wcfg.max_pending_batches, max_attempts=wcfg.max_attempts, backoff=wcfg.backoff_s,
                                    backoff_max=wcfg.backoff_max_s, async_level=level)
                    workers.start_soon(worker_loop, tnode, Identity.from_seed(bytes([i + 1]) * 32), outbox, counts)
        st = trainer.status()
        rewards = [r.mean_reward for r in trainer.spool.steps()]  # every step (status keeps only the last 200)
        nursery.cancel_scope.cancel()
    return {"level": level, "steps": trainer.step, "idle": st["idle_fraction"], "batches": dict(counts),
            "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
            "curve": [round(sum(c) / len(c), 3) for c in _chunks(rewards, 8)]}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _chunks(xs: list[float], n: int) -> list[list[float]]:
    """``xs`` cut into ``n`` nearly equal consecutive runs (fewer when shorter), for a coarse curve."""
    k = max(1, -(-len(xs) // n))
    return [xs[i:i + k] for i in range(0, len(xs), k)]


def bench_idle(levels: list[int], seconds: float) -> None:
    print(f"2. trainer idle fraction, 2 simulated workers, {PROMPTS}x{GROUP} samples per batch, "
          f"min_batch_samples 32, {seconds:.0f} s per level")
    rows = []
    for level in levels:
        with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
            rows.append(trio.run(idle_at, level, seconds, Path(tmp)))
    for r in rows:
        print(f"   async level {r['level']}: steps {r['steps']:3d}  idle {r['idle']}  batches {r['batches']}  "
              f"reward first/last step {_fmt(r['reward_first'])} / {_fmt(r['reward_last'])}")
        print(f"      mean reward in 8 consecutive slices of the steps: {r['curve']}")
    base = rows[0]["idle"]
    for r in rows[1:]:
        if base and r["idle"] is not None:
            print(f"   ratio idle(level {r['level']}) / idle(level {rows[0]['level']}): {r['idle'] / base:.2f}")
    stuck = [r["level"] for r in rows if not r["steps"]]
    if stuck:  # two workers feeding it and no step at all: broken, not slow (make bench-quick fails on it)
        sys.exit(f"bench/trainer.py: no training step in {seconds:g} s at async level {stuck}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed rollout steps for the throughput figure")
    ap.add_argument("--seconds", type=float, default=45.0, help="wall time per async level")
    ap.add_argument("--levels", default="0,1,2", help="async levels to compare")
    ap.add_argument("--threads", type=int, default=DEMO_THREADS,
                    help=f"torch threads (default {DEMO_THREADS}, as each demo node; 0 = torch's own default)")
    args = parse_args(ap, {"steps": 2, "seconds": 10.0, "levels": "0,2"})
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_throughput(args.steps)
    bench_idle([int(x) for x in args.levels.split(",")], args.seconds)


if __name__ == "__main__":
    main()
