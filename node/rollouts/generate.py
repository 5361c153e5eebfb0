"""One rollout step of an inference node: draw, sample, score, prove, sign (DESIGN.md, the loop, step 3).

How this works (:meth:`RolloutGenerator.run_step`, blocking; the role runs it in a worker thread):

1. draw ``prompts_per_batch`` tasks from (peer id, step, index) and the base sampling seed from
   (run, peer id, step) (node/rollouts/draw.py), so the node cannot choose either;
2. sample ``group_size`` completions per prompt with the run's temperature / top-p / max tokens on the
   engine, which also records the final hidden states of every generated token;
3. score each completion with the task's verifier (node/rl/verifiers.py), minus INTELLECT-2's length
   penalty when ``[rl] length_reward`` is on, and compute group-relative advantages
   (node/rl/rewards.py: (r - mean) / (std + 1e-6));
4. build the TOPLOC proofs of each completion's hidden states (node/proofs/toploc.py, batched over
   all chunks of the step);
5. assemble and sign one :class:`~node.rollouts.schema.RolloutBatch`, trimmed to one wire frame.

The engine is loaded from the first checkpoint folder and follows newer versions by swapping weights
in place (:meth:`RolloutGenerator.follow`). The cheating modes of ``[worker] cheat`` live here too,
each marked where it departs from the honest path; an honest node never enters those branches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .assemble import Scored, Sealed, make_samples, seal_within
from .config import WorkerConfig
from .draw import cherry_picked_tasks, draw_step, prompt_ids
from .schema import RolloutBatch

log = logging.getLogger(__name__)

PERTURB_SCALE = 0.1  # "perturbed-model" cheat: weight noise, relative to each tensor's std
FAKE_REWARD_BONUS = 0.5  # "fake-rewards" cheat: added to every claimed reward
SCORING_THREADS = 4  # code-task sandboxes run at once (each is a subprocess with its own limits)


def vllm_usable() -> bool:
    """vLLM is importable and a CUDA device is present (the only case its engine is chosen)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def open_engine(cfg):
    """The engine named by ``[inference]`` (``auto``: vLLM when usable, else torch). Not loaded yet."""
    name = cfg.engine
    if name == "auto":
        name = "vllm" if vllm_usable() else "torch"
    if name == "vllm":
        if not vllm_usable():
            raise RuntimeError("[inference] engine = 'vllm' needs the vllm package and a CUDA device")
        from ..engines.vllm_engine import VLLMEngine

        return VLLMEngine(cfg)
    import torch

    from ..engines.torch_engine import TorchEngine

    return TorchEngine(device=cfg.device, dtype=None if cfg.dtype == "auto" else getattr(torch, cfg.dtype))


@dataclass
class StepResult:
    """What one step produced, with the figures the role's status shows."""

    step: int
    policy_version: int
    sealed: Sealed | None  # None when not even one group fits a frame
    samples: int
    completion_tokens: int
    generate_s: float  # sampling (with hidden-state capture)
    score_s: float  # verifiers
    proof_s: float  # TOPLOC building
    mean_reward: float  # over the claimed rewards of the step
    mean_true_reward: float  # over the verifiers' rewards (differs from the claimed mean only when cheating)


class RolloutGenerator:
    """Engine + task set + run parameters -> signed batches. Blocking; one step at a time."""

    def __init__(self, *, identity, run_name: str, rl, proofs, inference, worker: WorkerConfig, engine=None) -> None:
        from ..rl.sandbox import Limits
        from ..rl.tasks import load_taskset

        self.identity = identity
        self.run_name = run_name
        self.rl = rl
        self.proofs = proofs
        self.inference = inference
        self.worker = worker
        self.taskset = load_taskset(rl.taskset)
        self.code_limits = Limits(wall_s=rl.code_timeout_s, cpu_s=max(1, int(rl.code_timeout_s)),
                                  memory_mb=rl.code_memory_mb, output_kb=rl.code_output_kb)
        self.engine = engine if engine is not None else open_engine(inference)
        self.loaded: Path | None = None

    # -- weights -------------------------------------------------------------------------------

    def follow(self, path: Path) -> str:
        """Load ``path`` (first time) or swap its weights in place; returns "load" or "swap"."""
        how = "swap"
        if self.loaded is None:
            self.engine.load(path)
            how = "load"
        else:
            try:
                self.engine.swap_weights(path)
            except ValueError as e:  # another architecture: a full load is the only way
                log.warning("inference: %s; loading the new checkpoint from scratch", e)
                self.engine.load(path)
                how = "load"
        self.loaded = Path(path)
        if self.worker.cheat == "perturbed-model":
            self._perturb_weights()
        return how

    def _perturb_weights(self) -> None:
        # CHEAT: pretend to run the run's model while running a different one (a cheaper or corrupted
        # model). TOPLOC's exponent/mantissa checks must catch the changed activations.
        import torch

        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.engine.model.parameters():
                if p.numel() > 1:
                    noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
                    p.add_(noise * p.float().std().to(p.dtype) * PERTURB_SCALE)

    # -- one step --------------------------------------------------------------------------------

    def run_step(self, step: int, policy_version: int, created_ms: int) -> StepResult:
        from ..proofs.toploc import build_proofs_many
        from ..rl.rewards import group_advantages, length_penalty

        if self.loaded is None:
            raise RuntimeError("run_step before a checkpoint was loaded")
        rl, peer = self.rl, self.identity.peer_id
        drawn = draw_step(self.taskset, rl, self.run_name, peer, step)
        tasks, budgets, seed = drawn.tasks, drawn.budgets, drawn.seed
        if self.worker.cheat == "cherry-pick":
            tasks = cherry_picked_tasks(self.taskset, peer, step, len(tasks))  # CHEAT: not the drawn tasks
        prompts = [prompt_ids(self.engine.tokenizer, t, b) for t, b in zip(tasks, budgets)]

        t0 = time.perf_counter()
        groups = self.engine.generate(prompts, n=rl.group_size, temperature=rl.temperature, top_p=rl.top_p,
                                      max_new_tokens=rl.max_new_tokens, seed=seed, capture_hidden=True)
        t1 = time.perf_counter()
        rewards = self._task_rewards(tasks, groups)
        scores: list[list[Scored]] = []
        for budget, group, group_rewards in zip(budgets, groups, rewards):
            row = []
            for s, r in zip(group, group_rewards):
                pen = rl.length_alpha * length_penalty(s.num_tokens, budget) if budget else 0.0
                row.append(Scored(r, pen, budget))
            scores.append(row)
        true_mean = _mean([sc.reward for row in scores for sc in row])
        if self.worker.cheat == "fake-rewards":
            # CHEAT: claim more reward than the verifier gave (advantages made consistent with the claim).
            scores = [[replace(sc, task_reward=sc.task_reward + FAKE_REWARD_BONUS) for sc in row] for row in scores]
        advantages = [group_advantages([sc.reward for sc in row]) for row in scores]
        t2 = time.perf_counter()
        flat = [s for group in groups for s in group]
        proofs = build_proofs_many([s.hidden for s in flat], self.proofs.chunk_tokens, self.proofs.topk)
        t3 = time.perf_counter()

        samples = make_samples(groups, [t.id for t in tasks], scores, advantages, proofs)
        batch = RolloutBatch(
            run=self.run_name, worker=peer, step=step, policy_version=policy_version, taskset=self.taskset.name,
            seed=seed, temperature=rl.temperature, top_p=rl.top_p, max_new_tokens=rl.max_new_tokens,
            group_size=rl.group_size, created_ms=created_ms, samples=samples,
        )
        sealed = seal_within(self.identity, batch, self.worker.max_batch_bytes)
        if sealed is not None and sealed.trimmed_groups:
            log.warning("inference: step %d trimmed %d groups to fit one frame; lower [rl] prompts_per_batch",
                        step, sealed.trimmed_groups)
        return StepResult(
            step=step, policy_version=policy_version, sealed=sealed, samples=len(samples),
            completion_tokens=sum(s.num_tokens for s in flat), generate_s=t1 - t0, score_s=t2 - t1,
            proof_s=t3 - t2, mean_reward=_mean([s.reward for s in samples]), mean_true_reward=true_mean,
        )


    def _task_rewards(self, tasks, groups) -> list[list[float]]:
        """Verifier rewards per group. Code tasks run in sandboxed subprocesses that mostly wait
        (on their time limits or on the OS), so they are scored ``SCORING_THREADS`` at a time."""
        from concurrent.futures import ThreadPoolExecutor

        from ..rl.verifiers import task_reward

        jobs = [(task, s.text) for task, group in zip(tasks, groups) for s in group]
        if any(task.kind == "code" for task, _ in jobs):
            with ThreadPoolExecutor(max_workers=SCORING_THREADS) as pool:
                flat = list(pool.map(lambda job: task_reward(job[0], job[1], self.code_limits), jobs))
        else:
            flat = [task_reward(task, text, self.code_limits) for task, text in jobs]
        it = iter(flat)
        return [[next(it) for _ in group] for group in groups]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
