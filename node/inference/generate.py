"""One rollout step of an inference node: draw, sample, score, prove, sign (DESIGN.md, the loop, step 3).

How this works (:meth:`RolloutGenerator.run_step`, blocking; the role runs it in a worker thread):

1. draw ``prompts_per_batch`` tasks and the base sampling seed from the step key (run, peer id,
   manifest root of the loaded version, step; node/rl/spec.py), so the node cannot choose either;
2. sample ``group_size`` completions per prompt with the run's temperature / top-p / max tokens on the
   engine, which also records the final hidden states of every generated token;
3. score each completion with the task's verifier (node/rl/verifiers.py), minus INTELLECT-2's length
   penalty when ``[rl] length_reward`` is on, and compute group-relative advantages
   ((r - mean) / (std + 1e-6)): steps 1-3 are the one builder, ``node.rl.rollout.build_groups``,
   following the rules of node/rl/spec.py;
4. build the TOPLOC proofs of each completion's hidden states (node/proofs/toploc.py, batched over
   all chunks of the step);
5. assemble and sign one :class:`~node.rollouts.schema.RolloutBatch` holding every drawn prompt
   (never trimmed: a step too big for one frame is not sent, see node/rollouts/assemble.py).

The engine is loaded from the first checkpoint folder and follows newer versions by swapping weights
in place (:meth:`RolloutGenerator.follow`). The cheating modes of ``[worker] cheat`` live in
node/adversary/, as subclasses of this generator; nothing here knows about them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..proofs.toploc import build_proofs_many
from ..rl.rollout import ScoredGroup, build_groups
from ..rl.spec import OFFLINE_ROOT, DrawnStep, code_limits, draw_step
from ..rl.tasks import load_run_tasks
from ..rollouts.assemble import Sealed, make_samples, seal_within
from ..rollouts.config import WorkerConfig
from ..rollouts.schema import RolloutBatch

log = logging.getLogger(__name__)


def pick_engine(requested: str, accepted: tuple[str, ...], vllm_ok: bool) -> str:
    """The engine to run: ``requested``, or for "auto" vLLM when usable *and accepted*, else torch.

    Never one the run does not accept (its batches would all be refused): raises ValueError (a
    configuration error of this node) when nothing fits.
    """
    if requested != "auto":
        if requested not in accepted:
            raise ValueError(f"[inference] engine = {requested!r} is not in this run's engines {list(accepted)}")
        return requested
    for name, usable in (("vllm", vllm_ok), ("torch", True)):
        if usable and name in accepted:
            return name
    raise ValueError(f"[inference] engine = 'auto': no usable engine among this run's engines {list(accepted)} "
                     "(vllm needs the vllm package and a CUDA device; its CPU build only when named)")


def choose_engine(cfg) -> str:
    """The engine ``[inference]`` selects on this node (see :func:`pick_engine`).

    Raises ConfigError (one line, exit 2 at start) when the run selects vLLM and this node cannot
    run it: vLLM missing, at another version than the engine's, or without a device it runs on
    (``engine = "vllm"`` allows vLLM's CPU build; ``"auto"`` picks vLLM only on a CUDA GPU)."""
    from ..config import ConfigError

    accepted = cfg.accepted_engines()
    problem = None
    if cfg.engine == "vllm" or (cfg.engine == "auto" and "vllm" in accepted):
        from ..engines.vllm_engine import vllm_problem

        problem = vllm_problem(allow_cpu=cfg.engine == "vllm")
    try:
        name = pick_engine(cfg.engine, accepted, problem is None)
    except ValueError as e:
        raise ConfigError(f"run.inference.engine: {e}") from None
    if name == "vllm" and problem is not None:
        raise ConfigError(f"run.inference.engine = 'vllm': {problem}")
    return name


def open_engine(cfg):
    """The engine named by ``[inference]`` (see :func:`choose_engine`). Not loaded yet."""
    if choose_engine(cfg) == "vllm":
        from ..engines.vllm_engine import VLLMEngine

        return VLLMEngine(cfg)
    import torch

    from ..engines.torch_engine import TorchEngine

    return TorchEngine(device=cfg.device, dtype=None if cfg.dtype == "auto" else getattr(torch, cfg.dtype),
                       decode=cfg.decode)


@dataclass
class StepResult:
    """What one step produced, with the figures the role's status shows."""

    step: int
    policy_version: int
    sealed: Sealed | None  # None when the whole step does not fit a frame (it is never trimmed)
    samples: int
    completion_tokens: int
    generate_s: float  # sampling (with hidden-state capture)
    score_s: float  # verifiers
    proof_s: float  # TOPLOC building
    mean_reward: float  # over the claimed rewards of the step
    mean_true_reward: float  # over the verifiers' rewards (differs from the claimed mean only when cheating)


class RolloutGenerator:
    """Engine + task set + run parameters -> signed batches. Blocking; one step at a time.

    Honest by construction: every rule comes from node/rl/spec.py and the one builder
    (``node.rl.rollout.build_groups``). The deliberate cheats of ``[worker] cheat`` are subclasses in
    node/adversary/ that override :meth:`follow`, :meth:`draw` or :meth:`claim`.
    """

    def __init__(self, *, identity, run_name: str, rl, proofs, inference, worker: WorkerConfig, engine=None) -> None:
        self.identity = identity
        self.run_name = run_name
        self.rl = rl
        self.proofs = proofs
        self.inference = inference
        self.worker = worker
        self.taskset = load_run_tasks(rl)
        self.code_limits = code_limits(rl)
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
        return how

    # -- one step --------------------------------------------------------------------------------

    def draw(self, step: int, policy_root: bytes) -> DrawnStep:
        """The tasks, budgets and seed this worker must use at ``step`` on the checkpoint whose
        manifest root is ``policy_root`` (node/rl/spec.py)."""
        return draw_step(self.taskset, self.rl, self.run_name, self.identity.peer_id, policy_root, step)

    def claim(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        """The groups as this worker reports them: an honest one reports what the verifiers said."""
        return groups

    def run_step(self, step: int, policy_version: int, created_ms: int, policy_root: bytes = OFFLINE_ROOT) -> StepResult:
        """One step on the loaded checkpoint: ``policy_version`` and its manifest root ``policy_root``
        (known to the role from the shards service; the offline default only for ``swarm-node rollout``)."""
        if self.loaded is None:
            raise RuntimeError("run_step before a checkpoint was loaded")
        rl, peer = self.rl, self.identity.peer_id
        drawn = self.draw(step, policy_root)
        built = build_groups(self.engine, drawn, rl, self.code_limits, capture_hidden=True)
        true_mean = _mean([r for g in built.groups for r in g.rewards])
        groups = self.claim(built.groups)
        t2 = time.perf_counter()
        flat = [s for g in groups for s in g.samples]
        proofs = build_proofs_many([s.hidden for s in flat], self.proofs.chunk_tokens, self.proofs.topk)
        t3 = time.perf_counter()

        samples = make_samples([g.samples for g in groups], [g.task.id for g in groups], [g.scores for g in groups],
                               [g.advantages for g in groups], proofs)
        batch = RolloutBatch(
            run=self.run_name, worker=peer, step=step, policy_version=policy_version, policy_root=policy_root,
            taskset=self.taskset.name,
            seed=drawn.seed, temperature=rl.temperature, top_p=rl.top_p, max_new_tokens=rl.max_new_tokens,
            group_size=rl.group_size, created_ms=created_ms, samples=samples,
            engine=self.engine.name, dtype=self.engine.dtype_name,
        )
        sealed = seal_within(self.identity, batch, self.worker.max_batch_bytes)
        return StepResult(
            step=step, policy_version=policy_version, sealed=sealed, samples=len(samples),
            completion_tokens=sum(s.num_tokens for s in flat), generate_s=built.generate_s, score_s=built.score_s,
            proof_s=t3 - t2, mean_reward=_mean([s.reward for s in samples]), mean_true_reward=true_mean,
        )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
