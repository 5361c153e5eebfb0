"""A fake inference client for trainer tests and benchmarks: signed batches with honest log-probs.

Builds :class:`RolloutBatch` es the way an inference node would, minus generation and proofs:
prompts are synthetic reversal tasks (:mod:`node.rl.synthetic`), completions are random digit
strings (or given ones), rewards come from the real verifier, advantages are group-relative
(node/rl/spec.py: (r - mean) / (std + 1e-6), INTELLECT-2), and the log-probs are those of the given model at
temperature T, so the trainer's importance ratios start at 1 as they would for real rollouts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..rl.spec import group_advantages
from ..rollouts.schema import DOMAIN_BATCH, RolloutBatch, RolloutSample
from ..wire import encode, seal


def model_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> list[float]:
    """Per-token log-probs of ``completion_ids`` after ``prompt_ids`` under ``model`` at ``temperature``."""
    import torch

    from ..rl.grpo import TrainSample, pack, token_logprobs

    s = TrainSample(prompt_ids, completion_ids, [0.0] * len(completion_ids), 0.0)
    batch = pack([s], len(prompt_ids) + len(completion_ids))
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature)
    mask = batch.loss_mask[0].bool()
    return [float(x) for x in logp[0][mask]]


def reversal_batch(
    identity,
    run: str,
    *,
    step: int,
    policy_version: int,
    tokenizer,
    model=None,
    prompts: int = 2,
    group_size: int = 4,
    temperature: float = 1.0,
    seed: int = 0,
    completions: Sequence[Sequence[str]] | None = None,
    policy_root: bytes = bytes(32),
) -> RolloutBatch:
    """A batch of ``prompts`` reversal tasks x ``group_size`` completions, signed-ready.

    Each group holds the right answer once and random digit strings otherwise (so every group has
    signal); ``completions[p][g]`` overrides the text of sample g of prompt p.
    Without ``model`` the log-probs are uniform over the vocabulary.
    """
    import math

    from ..rl.synthetic import make_reversal_tasks, reversal_reward

    rng = random.Random(seed)
    tasks = make_reversal_tasks(prompts, seed=seed + 7)
    samples = []
    for p, task in enumerate(tasks):
        if completions:
            texts = list(completions[p])
        else:  # one right answer per group (a policy that sometimes succeeds), the rest random digits
            texts = [task["answer"]] + ["".join(rng.choice("0123456789") for _ in range(rng.randint(1, 6)))
                                        for _ in range(group_size - 1)]
        rewards = [reversal_reward(t, task["answer"]) for t in texts]
        advs = group_advantages(rewards)
        prompt_ids = tokenizer(task["prompt"], add_special_tokens=False)["input_ids"]
        for g, text in enumerate(texts):
            comp = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            if model is not None:
                lps = model_logprobs(model, prompt_ids, comp, temperature)
            else:
                lps = [-math.log(len(tokenizer))] * len(comp)
            samples.append(RolloutSample(
                prompt_index=p, sample_index=g, task_id=task["id"], prompt_ids=prompt_ids, completion_ids=comp,
                logprobs=lps, finish_reason="stop", reward=rewards[g], task_reward=rewards[g],
                advantage=advs[g], proof=b"",
            ))
    return RolloutBatch(run=run, worker=identity.peer_id, step=step, policy_version=policy_version,
                        policy_root=policy_root, taskset="synthetic", seed=seed, temperature=temperature, top_p=1.0, max_new_tokens=8,
                        group_size=group_size, created_ms=0, samples=samples)


def sign_batch(identity, batch: RolloutBatch) -> bytes:
    """The wire bytes of ``batch`` signed by ``identity`` (what ROLLOUTS_PROTOCOL carries)."""
    return encode(seal(identity, DOMAIN_BATCH, batch))


# -- stand-ins for the services a Trainer is wired to (node/roles/trainer.py wires the real ones) --


class FakeLedger:
    """Records appended entries; bans whom ``bans`` names (peer -> ban); ``accepted`` gives peers an
    accepted history (peer -> samples)."""

    def __init__(self, bans: dict | None = None, accepted: dict | None = None) -> None:
        self.entries: list = []
        self.bans = dict(bans or {})
        self.accepted = dict(accepted or {})

    async def append(self, body):
        self.entries.append(body)
        return body

    def ban_of(self, peer: str):
        return self.bans.get(peer)

    def accepted_samples(self, peer: str) -> int:
        return self.accepted.get(peer, 0)

    def note_received(self, peer: str, manifest_id: bytes, nbytes: int, pieces: int = 1) -> None:
        pass


class FakeMembership:
    """``alive`` (peer id -> role) are the members; our record's updates are kept in ``record``."""

    def __init__(self, alive: dict[str, str] | None = None) -> None:
        self.alive = dict(alive or {})
        self.record: dict = {}

    def members(self) -> dict[str, str]:
        return dict(self.alive)

    def addrs_of(self, peer_id: str) -> list[str]:
        return []

    def update(self, **fields) -> None:
        self.record.update(fields)


class FakeShards:
    """Takes published versions without hashing or seeding them (their manifests are stand-ins)."""

    def __init__(self) -> None:
        self.held: list[int] = []
        self.announced: dict[int, tuple[bytes, str]] = {}  # version -> (root, announcer), as ShardsAPI

    def path_of(self, version: int):
        return None

    def versions_held(self) -> list[int]:
        return list(self.held)

    async def publish(self, folder, version: int):
        from types import SimpleNamespace

        self.held.append(version)
        self.announced[version] = (bytes(32), "")
        return SimpleNamespace(root=bytes(32), manifest=SimpleNamespace(total_size=0))


def fake_wiring() -> dict:
    """Keyword arguments wiring a :class:`~node.trainer.service.Trainer` to stand-ins."""
    return {"shards": FakeShards(), "membership": FakeMembership(), "ledger": FakeLedger()}
