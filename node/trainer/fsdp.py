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
* ``TRAIN``: rank 0 scatters the samples round-robin; each rank splits its share into
  mini-batches. Every FSDP forward and backward is a collective (all-gather of each layer's
  parameters, reduce-scatter of its gradients), so every rank must make the same number of them:
  the ranks all-reduce the largest mini-batch count, and a rank whose share splits into fewer runs
  empty-weighted mini-batches (one pad token with a zero loss mask: a forward and a backward that
  add nothing). Shares of 7, 7 and 6 samples with ``optimizer_steps = 4`` split into 4, 4 and 3
  mini-batches; without the agreement the third rank left the loop while the others waited in
  ``all_gather`` forever. The ranks also all-reduce each mini-batch's loss-token count and scale
  their token-mean loss by ``local tokens x ranks / global tokens``; FSDP2 averages gradients over
  ranks, so the update is the one of the global token mean whatever the shares. ``clip_grad_norm_``
  over DTensors computes the global norm, and whether a step is finite is decided by an all-reduce,
  so either every rank steps or every rank raises.
* ``NONFINITE``: the forward-only search for the batch that made a step non-finite runs on every
  rank over the same samples (a forward on rank 0 alone would wait for the others' all-gathers).
* ``SAVE``: all ranks gather full, CPU-offloaded model and optimizer state dicts
  (``torch.distributed.checkpoint.state_dict``); rank 0 writes the model folder and ``state.pt``
  with the same atomic writes as one process.
* ``STOP``: followers leave when rank 0's trainer stops.

On CUDA the layers keep fp32 master weights and compute in bf16 (FSDP2's ``MixedPrecisionPolicy``,
gradients reduced in fp32), as one GPU process does under autocast.

Limits: one machine (ranks read rank 0's files); a ``state.pt`` written under FSDP holds optimizer state keyed by parameter name, so resume under FSDP
again (any N).
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..rl.config import GRPOConfig
from ..rl.grpo import (
    NonFiniteStep,
    PackedBatch,
    StepStats,
    TrainSample,
    accumulate,
    pack,
    split_minibatches,
)
from . import checkpoints
from .config import TrainerConfig
from .policy import Policy

log = logging.getLogger("node.trainer")

OPEN, TRAIN, NONFINITE, SAVE, STOP = "open", "train", "nonfinite", "save", "stop"
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

    cuda = device.startswith("cuda")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("FSDP wrapping expects a HF decoder with model.layers")
    kw = {}
    if cuda:  # bf16 compute, fp32 master weights and gradient reduction (CPU keeps fp32 throughout)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def plan_minibatches(samples: list[TrainSample], parts: int, count: int) -> list[list[TrainSample]]:
    """This rank's mini-batches, padded with empty ones to the ``count`` every rank agreed on.

    ``count`` is the all-reduced maximum of ``len(split_minibatches(share, parts))`` over ranks, so
    it is never below this rank's own count (a smaller one is a bug: raises).
    """
    own = split_minibatches(samples, parts) if samples else []
    if len(own) > count:
        raise RuntimeError(f"agreed mini-batch count {count} is below this rank's {len(own)}")
    return own + [[] for _ in range(count - len(own))]


def loss_scale(local_tokens: int, global_tokens: int, ranks: int) -> float:
    """Factor on a rank's token-mean loss so that FSDP's average over ranks is the global token mean.

    mean over ranks of (sum_r / n_r) x (n_r x ranks / N) = sum over ranks of sum_r / N.
    """
    if global_tokens <= 0:
        return 0.0
    return local_tokens * ranks / global_tokens


def empty_batch(pad_id: int, pack_length: int) -> PackedBatch:
    """One pad token that carries no loss: the forward/backward a short rank runs to keep in step."""
    batch = pack([TrainSample([pad_id], [pad_id], [0.0], 0.0)], max(2, pack_length), pad_id=pad_id)
    batch.loss_mask.zero_()
    batch.num_samples = 0
    return batch


def _all_reduce(values: list[float], op, device: str) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def train_agreed(model, optimizer, scheduler, share: list[TrainSample], cfg: GRPOConfig, device: str,
                 ref_model=None, pad_id: int = 0, version: int | None = None) -> StepStats:
    """Every rank: one rollout step on its ``share`` with the same number of collectives as the others.

    The counterpart of :func:`node.rl.grpo.train_step` under FSDP (see the module docstring); the
    figures it returns (off-policy, mismatch, masked) are of this rank's share.
    """
    stats = StepStats()
    stats.off_policy(share, version)
    ranks = dist.get_world_size()
    own = len(split_minibatches(share, cfg.optimizer_steps)) if share else 0
    count = int(_all_reduce([own], dist.ReduceOp.MAX, device)[0])
    plan = plan_minibatches(share, cfg.optimizer_steps, count)
    batches = [pack(mb, cfg.pack_length, pad_id=pad_id) if mb else empty_batch(pad_id, cfg.pack_length)
               for mb in plan]
    local = [b.num_tokens for b in batches]
    total = _all_reduce(local, dist.ReduceOp.SUM, device) if batches else []
    model.train()
    for k, (mb, batch) in enumerate(zip(plan, batches)):
        optimizer.zero_grad(set_to_none=True)
        # one pass per mini-batch (rows=all): every rank must run the same number of forwards and
        # backwards, since each is a round of collectives; micro-batching here would need agreed counts
        scale = loss_scale(local[k], int(total[k]), ranks)
        parts = accumulate(model, batch, cfg, ref_model, version=version if k == 0 else None,
                           scale=scale, rows=max(1, batch.input_ids.shape[0]))
        loss = parts.loss * scale
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
        finite = float(torch.isfinite(loss.detach()).item() and math.isfinite(gn))
        if _all_reduce([finite], dist.ReduceOp.MIN, device)[0] < 1.0:  # every rank raises, or none
            optimizer.zero_grad(set_to_none=True)
            model.eval()
            raise NonFiniteStep(f"mini-batch {k}: loss {float(loss.detach())}, grad norm {gn} (on some rank)")
        stats.lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        stats.add(parts, gn)
        stats.optimizer_steps += 1
        stats.samples += len(mb)
        stats.tokens += batch.num_tokens
        stats.rows += batch.input_ids.shape[0] if mb else 0
    model.eval()
    return stats


class FSDPPolicy(Policy):
    """A :class:`Policy` whose model is sharded over every rank of the process group."""

    @classmethod
    def open(cls, root: Path, source: str, cfg: GRPOConfig, tcfg: TrainerConfig) -> tuple[FSDPPolicy, bool]:
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
        stats = train_agreed(self.model, self.optimizer, self.scheduler, mine[0], self.cfg, self.device,
                             ref_model=self.ref_model, pad_id=self.pad_id, version=self.step)
        self.step += 1
        return stats

    def non_finite(self, groups: list[list[TrainSample]]) -> list[int]:
        """Every rank runs the same forwards over the same groups (each forward is a collective)."""
        if dist.get_rank() == 0:
            _broadcast((NONFINITE, groups))
        return Policy.non_finite(self, groups)

    def mismatch(self, samples: list[TrainSample], most: int, proofs) -> dict:
        """Not measured: a forward is a collective every rank must join, and rank 0 alone calls this."""
        return {}

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
                                                    state_dict=state["model"], dtype=self.tcfg.publish_dtype)
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
            try:
                policy.train([])
            except NonFiniteStep:  # rank 0 raised too (the decision is collective) and handles it
                pass
        elif cmd[0] == NONFINITE:
            policy.non_finite(cmd[1])
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

