"""The policy being trained: model, optimizer, step counter and their saved state. No network here.

The version of the policy is its step: version 0 is the initial model, and rollout step ``s`` turns
version ``s - 1`` into version ``s``. :meth:`Policy.train` runs one rollout step with
:func:`node.rl.grpo.train_step` (``[grpo] optimizer_steps`` AdamW steps with warm-up and grad-norm
clipping); :meth:`Policy.save` writes the version's model folder, then the training state
(:mod:`node.trainer.checkpoints`), so a restart resumes at the last saved step exactly: weights,
AdamW moments, learning-rate schedule position and RNG states.

Online filtering (INTELLECT-2 §3.2; DAPO "dynamic sampling"): a group whose rewards are all equal
has all-zero advantages and gives no gradient, yet it would dilute the token-level mean; such groups
are dropped here, and the trainer waits until ``[grpo] min_batch_samples`` samples with signal are
available before it steps.
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch

from ..proofs.checks import logprob_tolerances
from ..proofs.config import ProofsConfig
from ..rl.config import GRPOConfig
from ..rl.grpo import StepStats, TrainSample, batch_loss, make_optimizer, pack, train_step
from ..rl.mismatch import EngineMismatch, step_mismatch
from ..rollouts.schema import RolloutBatch
from . import checkpoints
from .config import TrainerConfig

log = logging.getLogger("node.trainer")

FLAT_REWARD = 1e-9  # a group whose rewards differ by less than this carries no signal


def training_samples(batch: RolloutBatch) -> tuple[list[TrainSample], int]:
    """The batch's samples as :class:`TrainSample` s, zero-signal groups dropped; (samples, groups dropped)."""
    groups: dict[int, list] = defaultdict(list)
    for s in batch.samples:
        groups[s.prompt_index].append(s)
    out: list[TrainSample] = []
    dropped = 0
    for members in groups.values():
        rewards = [s.reward for s in members]
        if len(members) < 2 or max(rewards) - min(rewards) <= FLAT_REWARD:
            dropped += 1
            continue
        out.extend(
            TrainSample(list(s.prompt_ids), list(s.completion_ids), list(s.logprobs), s.advantage, batch.policy_version,
                        batch.engine, batch.dtype)
            for s in members
        )
    return out, dropped


def _initial_model(root: Path, source: str, tcfg: TrainerConfig):
    """(model, tokenizer) of version 0: ``run.model`` (a model folder, or a GGUF file converted into a
    temporary one: version 0's checkpoint is what restarts read), or the embedded default (tiny
    Qwen2 + warm-up)."""
    import shutil

    from ..engines.gguf_folder import convert_gguf, is_gguf_path
    from ..engines.model import load_model, load_tokenizer
    from ..rl.warmup import DEFAULT_WARMUP_STEPS, create_default_model

    if source and not is_gguf_path(source):
        return load_model(Path(source)), load_tokenizer(Path(source))
    tmp = Path(root) / "init.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if source:
        convert_gguf(Path(source), tmp)
    else:
        steps = DEFAULT_WARMUP_STEPS if tcfg.init_warmup_steps < 0 else tcfg.init_warmup_steps
        _, stats = create_default_model(tmp, seed=tcfg.seed, warmup_steps=steps)
        if stats is not None:
            log.info("trainer: supervised warm-up of the default model: loss %.3f -> %.3f in %d steps",
                     stats.first_loss, stats.last_loss, stats.steps)
    try:
        return load_model(tmp), load_tokenizer(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_optimizer(policy: Policy, saved: dict) -> None:
    """Restore AdamW state saved by one process (``optimizer.state_dict()``) or under FSDP (keyed by name)."""
    if saved.get("fsdp"):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(policy.model, policy.optimizer, saved["state"],
                                 options=StateDictOptions(full_state_dict=True))
    else:
        policy.optimizer.load_state_dict(saved)


class Policy:
    """Model + optimizer + step of the trainer (one process; see node/trainer/fsdp.py for several GPUs)."""

    def __init__(self, root: Path, model, tokenizer, cfg: GRPOConfig, tcfg: TrainerConfig, step: int,
                 device: str) -> None:
        self.root = Path(root)
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.tcfg = tcfg
        self.step = step
        self.device = device
        self.optimizer, self.scheduler = make_optimizer(model, cfg)
        self.ref_model = None

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, root: Path, source: str, cfg: GRPOConfig, tcfg: TrainerConfig) -> tuple[Policy, bool]:
        """Resume from ``<root>/state.pt`` or create version 0; returns (policy, created)."""
        from ..engines.torch_engine import pick_device
        from ..engines.model import load_model, load_tokenizer

        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        device = pick_device(tcfg.device)
        state = checkpoints.load_state(root)
        if state is None:
            torch.manual_seed(tcfg.seed)
            random.seed(tcfg.seed)
            model, tok = _initial_model(root, source, tcfg)
            model = model.to(device=device, dtype=torch.float32)
            policy = cls(root, model, tok, cfg, tcfg, 0, device)
            policy.save()
            created = True
        else:
            folder = checkpoints.model_dir(root, state["step"])
            model = load_model(folder, device=device, dtype=torch.float32)
            model.load_state_dict(state["model"])
            policy = cls(root, model, load_tokenizer(folder), cfg, tcfg, state["step"], device)
            _load_optimizer(policy, state["optimizer"])
            policy.scheduler.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(state["rng"]["python"])
            if torch.cuda.is_available() and state["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state_all(state["rng"]["cuda"])
            created = False
        policy.model.eval()
        if cfg.kl_coef > 0:
            # The KL reference is the initial policy (version 0), frozen; its folder is kept on disk.
            policy.ref_model = load_model(checkpoints.model_dir(root, 0), device=device, dtype=torch.float32)
            policy.ref_model.requires_grad_(False)
        return policy, created

    # ------------------------------------------------------------------ facts

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def pad_id(self) -> int:
        pid = self.tokenizer.pad_token_id
        return int(pid if pid is not None else self.tokenizer.eos_token_id or 0)

    def folder(self, version: int | None = None) -> Path:
        return checkpoints.model_dir(self.root, self.step if version is None else version)

    # ------------------------------------------------------------------ training

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.startswith("cuda") else nullcontext()

    def train(self, samples: list[TrainSample]) -> StepStats:
        """One rollout step on ``samples``; the step counter advances (version = step)."""
        with self._autocast():
            stats = train_step(self.model, self.optimizer, self.scheduler, samples, self.cfg,
                               ref_model=self.ref_model, pad_id=self.pad_id, version=self.step)
        self.step += 1
        return stats

    def mismatch(self, samples: list[TrainSample], most: int, proofs: ProofsConfig) -> dict[str, EngineMismatch]:
        """Each engine's log-prob mismatch against these weights, before :meth:`train` updates them,
        over up to ``most`` of the samples this version generated (node/rl/mismatch.py); a token is
        beyond tolerance as the validator would judge it, by the sample's dtype and ours."""
        ours = "bfloat16" if self.device.startswith("cuda") else "float32"  # what _autocast computes in

        def tolerance(dtype: str) -> float:
            return logprob_tolerances(proofs, dtype, ours)[1]

        with self._autocast():
            return step_mismatch(self.model, samples, self.step, most, self.cfg, tolerance, self.pad_id)

    def non_finite(self, groups: list[list[TrainSample]]) -> list[int]:
        """Indexes of the sample groups (one per batch) whose loss alone is not finite (forward only)."""
        bad = []
        with torch.no_grad():
            for i, samples in enumerate(groups):
                batch = pack(samples, self.cfg.pack_length, pad_id=self.pad_id)
                if not torch.isfinite(batch_loss(self.model, batch, self.cfg, self.ref_model).loss):
                    bad.append(i)
        self.model.eval()
        return bad

    def state(self) -> dict:
        return {
            "step": self.step,
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
        }

    def close(self) -> None:
        """Release what the policy holds beyond memory (FSDP: the follower ranks)."""

    def save(self) -> Path:
        """Write the model folder of the current version, then the training state; returns the folder."""
        folder = checkpoints.write_model_folder(self.root, self.step, self.model, self.tokenizer,
                                                dtype=self.tcfg.publish_dtype)
        checkpoints.save_state(self.root, self.state())
        protect = {0} if self.cfg.kl_coef > 0 else set()
        checkpoints.prune_model_folders(self.root, self.tcfg.keep_checkpoints, protect=protect | {self.step})
        return folder
