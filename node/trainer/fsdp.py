"""Several GPUs: the trainer's policy sharded with FSDP2 under ``torchrun``. Rank 0 is the swarm node.

Launch on one machine with N GPUs (the same flags as ``swarm-node``)::

    torchrun --standalone --nproc-per-node N -m node.app.torchrun --role trainer --run run.toml --data-dir DIR

How it works
------------
* Every rank joins the process group (NCCL on GPUs, gloo on CPU) and a 1-D device mesh; each
  decoder layer and then the whole model are wrapped with ``fully_shard`` (FSDP2, per-parameter
  DTensor sharding; torch docs "torch.distributed.fsdp.fully_shard").
* Rank 0 runs the whole swarm node (``node.app.cli.main``, from :mod:`node.app.torchrun`). Its trainer service calls
  :func:`node.trainer.policy.open_policy`, which returns an :class:`FSDPPolicy` when a process group
  of more than one rank exists. Each method of it first broadcasts a command to the other ranks,
  which sit in :func:`follow` and do the same call, so every collective is entered by every rank.
* ``OPEN``: rank 0 creates or resumes the policy exactly as one process would, saves it, then every
  rank loads that saved state from the same data dir (one machine: same disk) and shards it.
* ``TRAIN``: rank 0 scatters the samples round-robin; each rank runs
  :func:`node.rl.grpo.train_step` on its share. FSDP2 reduce-scatters (averages) gradients, and
  ``clip_grad_norm_`` over DTensors computes the global norm, so the update is the data-parallel
  one. The loss is a token mean per rank, averaged over ranks: equal to the global token mean when
  ranks get equal token counts (round-robin keeps them close).
* ``SAVE``: all ranks gather full, CPU-offloaded model and optimizer state dicts
  (``torch.distributed.checkpoint.state_dict``); rank 0 writes the model folder and ``state.pt``
  with the same atomic writes as one process.
* ``STOP``: followers leave when rank 0's trainer stops.

Limits: one machine (ranks read rank 0's files); every rank needs at least ``optimizer_steps``
samples per step, so ``[grpo] min_batch_samples`` must be >= N x ``optimizer_steps`` (checked);
a ``state.pt`` written under FSDP holds optimizer state keyed by parameter name, so resume under FSDP
again (any N).
"""

from __future__ import annotations

import logging
import os
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..rl.config import GRPOConfig
from ..rl.grpo import StepStats, TrainSample, train_step
from . import checkpoints
from .config import TrainerConfig
from .policy import Policy

log = logging.getLogger("node.trainer")

OPEN, TRAIN, SAVE, STOP = "open", "train", "save", "stop"
_stopped = False  # rank 0: STOP was broadcast (followers are gone; never broadcast again)


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def init_distributed() -> str:
    """Join the torchrun process group; returns this rank's device."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return f"cuda:{local}"
    dist.init_process_group("gloo")
    return "cpu"


def _broadcast(cmd: tuple | None) -> tuple:
    box = [cmd]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard_model(model, device: str):
    """Wrap ``model`` with FSDP2: each decoder layer, then the root (which holds embeddings and head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (dist.get_world_size(),))
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("FSDP wrapping expects a HF decoder with model.layers")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class FSDPPolicy(Policy):
    """A :class:`Policy` whose model is sharded over every rank of the process group."""

    @classmethod
    def open(cls, root: Path, source: str, cfg: GRPOConfig, tcfg: TrainerConfig) -> tuple[FSDPPolicy, bool]:
        n = world()
        if cfg.min_batch_samples < n * cfg.optimizer_steps:
            raise ValueError(f"[grpo] min_batch_samples must be >= ranks x optimizer_steps = {n * cfg.optimizer_steps}")
        created = False
        if dist.get_rank() == 0:
            # Create or resume exactly as one process, so state.pt holds the latest step.
            _, created = Policy.open(root, source, cfg, tcfg)
            _broadcast((OPEN, str(root), source))
        return cls._load_sharded(Path(root), cfg, tcfg), created

    @classmethod
    def _load_sharded(cls, root: Path, cfg: GRPOConfig, tcfg: TrainerConfig) -> FSDPPolicy:
        """Every rank: load the saved state, shard the model, restore the optimizer (collective)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        from ..engines.model import load_model, load_tokenizer

        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        state = checkpoints.load_state(root)
        folder = checkpoints.model_dir(root, state["step"])
        model = load_model(folder, device="cpu", dtype=torch.float32)
        model.load_state_dict(state["model"])
        model = shard_model(model.to(device), device)
        policy = cls(root, model, load_tokenizer(folder), cfg, tcfg, state["step"], device)
        opt_state = state["optimizer"]
        if opt_state.get("fsdp"):
            set_optimizer_state_dict(model, policy.optimizer, opt_state["state"],
                                     options=StateDictOptions(full_state_dict=True))
        elif opt_state.get("state"):
            # One process's AdamW state is keyed by parameter position, which sharding keeps: convert it
            # to names so the DCP loader can shard the moments.
            names = [n for n, _ in model.named_parameters()]
            by_name = {names[i]: v for i, v in opt_state["state"].items()}
            set_optimizer_state_dict(model, policy.optimizer, {"state": by_name, "param_groups": [
                {**g, "params": [names[i] for i in g["params"]]} for g in opt_state["param_groups"]]},
                options=StateDictOptions(full_state_dict=True))
        policy.scheduler.load_state_dict(state["scheduler"])
        if cfg.kl_coef > 0:
            ref = load_model(checkpoints.model_dir(root, 0), device="cpu", dtype=torch.float32).to(device)
            policy.ref_model = shard_model(ref.requires_grad_(False), device)
        policy.model.eval()
        return policy

    def train(self, samples: list[TrainSample]) -> StepStats:
        if dist.get_rank() == 0:
            _broadcast((TRAIN,))
            n = world()
            shares = [samples[r::n] for r in range(n)]
        else:
            shares = None
        mine = [None]
        dist.scatter_object_list(mine, shares, src=0)
        stats = train_step(self.model, self.optimizer, self.scheduler, mine[0], self.cfg,
                           ref_model=self.ref_model, pad_id=self.pad_id)
        self.step += 1
        return stats

    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(self.model, options=opts)
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        return {
            "step": self.step,
            "model": model_sd,
            "optimizer": {"fsdp": True, "state": optim_sd},
            "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }

    def save(self) -> Path:
        if dist.get_rank() == 0:
            _broadcast((SAVE,))
        state = self.state()  # collective: every rank
        folder = self.folder()
        if dist.get_rank() == 0:
            folder = checkpoints.write_model_folder(self.root, self.step, self.model, self.tokenizer,
                                                    state_dict=state["model"])
            checkpoints.save_state(self.root, state)
            protect = {0} if self.cfg.kl_coef > 0 else set()
            checkpoints.prune_model_folders(self.root, self.tcfg.keep_checkpoints, protect=protect | {self.step})
        return folder

    def close(self) -> None:
        if dist.get_rank() == 0:
            stop_followers()


def stop_followers() -> None:
    """Rank 0: tell the followers to leave (once)."""
    global _stopped
    if not _stopped:
        _stopped = True
        _broadcast((STOP,))


def open_policy(root: Path, source: str, cfg: GRPOConfig, tcfg: TrainerConfig) -> tuple[Policy, bool]:
    """The trainer's policy: sharded over the ranks when launched under torchrun, else one process's."""
    if world() > 1:
        return FSDPPolicy.open(root, source, cfg, tcfg)
    return Policy.open(root, source, cfg, tcfg)


def follow(cfg: GRPOConfig, tcfg: TrainerConfig) -> int:
    """Ranks > 0: mirror rank 0's policy calls until it says stop (``cfg``/``tcfg``: the run's
    [grpo] and [trainer] tables, read from the same flags and run file as rank 0)."""
    policy: FSDPPolicy | None = None
    while True:
        cmd = _broadcast(None)
        if cmd[0] == OPEN:
            policy = FSDPPolicy._load_sharded(Path(cmd[1]), cfg, tcfg)
        elif cmd[0] == TRAIN:
            policy.train([])
        elif cmd[0] == SAVE:
            policy.save()
        elif cmd[0] == STOP:
            return 0


def leave() -> None:
    """Every rank: wait for the others, then tear the process group down (gloo aborts otherwise)."""
    dist.barrier()
    dist.destroy_process_group()


def exit_now(code: int | None) -> None:
    """End a rank after :func:`leave` without the interpreter's finalization.

    Even after ``destroy_process_group`` that finalization intermittently aborts both ranks with
    "terminate called without an active exception" (seen once in CI on 2 cores, exit -6 after the
    checkpoint was written; pytorch#190489 reports the same abort from gloo threads that outlive
    the interpreter). Everything worth keeping is saved and fsync'd before this point.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))

