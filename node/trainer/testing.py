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
from pathlib import Path
from types import SimpleNamespace

import trio

from ..hashes import digest
from ..ledger.entries import TOTAL_FIELDS, Penalty, check_receipt
from ..rl.spec import group_advantages
from ..rollouts.schema import DOMAIN_BATCH, RolloutBatch, RolloutSample
from ..shards.config import ShardsConfig
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
# tests/test_fakes_conformance.py runs each against the real service, and names what each lacks.


class FakeLedger:
    """Records appended entries and what the real ledger derives from them: a penalty with
    ``ban_seconds`` bans its peer (for good: the fake has no clock), and each entry's credits
    (node/ledger/entries.py) add up in :meth:`totals`, a batch's at its largest claim, with one
    ``entries`` to ``peer_id``, the author. ``bans`` (peer -> ban) and ``accepted`` (peer -> samples of
    history) start with what they name. Unlike the real one it takes every kind of entry (the real
    one refuses what this node's role may not author), and bytes served are not capped at the
    checkpoint's published size."""

    def __init__(self, bans: dict | None = None, accepted: dict | None = None, peer_id: str = "") -> None:
        self.entries: list = []
        self.bans = dict(bans or {})
        self.accepted = dict(accepted or {})
        self.peer_id = peer_id
        self._totals: dict[str, dict[str, int]] = {}  # peer -> field -> amount
        self._claims: dict[tuple[str, str, bytes], int] = {}  # (peer, field, batch) -> amount counted

    async def append(self, body):
        self.entries.append(body)
        if isinstance(body, Penalty) and body.ban_seconds:
            self.bans.setdefault(body.peer, body)
        self._add(self.peer_id, "entries", 1)
        for c in body.credits(self.peer_id):
            if c.field not in TOTAL_FIELDS:  # the published size: a cap the fake does not apply
                continue
            if c.batch is None:
                self._add(c.peer, c.field, c.amount)
                continue
            before = self._claims.get((c.peer, c.field, c.batch), 0)  # as the chain: the largest claim
            self._claims[(c.peer, c.field, c.batch)] = max(before, c.amount)
            self._add(c.peer, c.field, max(0, c.amount - before))
        return body

    def _add(self, peer: str, field: str, amount: int) -> None:
        self._totals.setdefault(peer, dict.fromkeys(TOTAL_FIELDS, 0))[field] += amount

    def totals(self, peer: str | None = None) -> dict[str, dict[str, int]]:
        if peer is not None:
            return {peer: dict(self._totals.get(peer) or dict.fromkeys(TOTAL_FIELDS, 0))}
        return {p: dict(t) for p, t in sorted(self._totals.items()) if any(t.values())}

    def ban_of(self, peer: str):
        return self.bans.get(peer)

    def accepted_samples(self, peer: str) -> int:
        return self.accepted.get(peer, 0) + self._totals.get(peer, {}).get("rollouts_accepted", 0)

    def note_received(self, peer: str, manifest_id: bytes, nbytes: int, pieces: int = 1) -> None:
        check_receipt(peer, manifest_id, nbytes, pieces)


class FakeMembership:
    """``alive`` (peer id -> role) are the members, ``addrs`` (peer id -> addresses) what they
    advertise; our record's updates are kept in ``record`` as handed (the real record keeps the newest
    versions that fit and only its own fields: node/gossip/records.py, which a role may not import)."""

    def __init__(self, alive: dict[str, str] | None = None, addrs: dict[str, list[str]] | None = None) -> None:
        self.alive = dict(alive or {})
        self.addrs = dict(addrs or {})
        self.record: dict = {}

    def members(self) -> dict[str, str]:
        return dict(self.alive)

    def addrs_of(self, peer_id: str) -> list[str]:
        return list(self.addrs.get(peer_id, []))

    def update(self, **fields) -> None:
        self.record.update(fields)


class FakeShards:
    """Takes published versions without hashing or seeding them: the root names the version and
    folder, ``path_of`` is the folder handed in, and the newest ``keep_versions`` are held (as the real
    store prunes). ``peer_id`` is the publisher the announcements name. ``held`` (version -> folder)
    and ``announced`` start with what they name; :meth:`hold` is a download completing. :meth:`fetch`
    notes the announcement as the real one does, and lists the version in ``fetches`` where the real
    one would start its download (nothing is downloaded: a fetched version stays missing)."""

    def __init__(self, peer_id: str = "", keep_versions: int | None = None, *, held: dict[int, Path] | None = None,
                 announced: dict[int, tuple[bytes, str]] | None = None) -> None:
        self.peer_id = peer_id
        self.keep_versions = keep_versions or ShardsConfig.keep_versions
        self.folders: dict[int, Path] = {}  # version -> folder, the newest keep_versions
        self.announced: dict[int, tuple[bytes, str]] = dict(announced or {})  # version -> (root, announcer)
        self.fetches: list[int] = []  # versions whose download the real service would have started
        self.wanted: list[int] = []  # versions asked for by want_version (the real service asks peers)
        self._news = trio.Event()
        for version, folder in (held or {}).items():
            self.hold(version, folder)

    @property
    def held(self) -> list[int]:
        return sorted(self.folders)

    def latest(self) -> int | None:
        return self.held[-1] if self.folders else None

    def path_of(self, version: int) -> Path | None:
        return self.folders.get(version)

    def versions_held(self) -> list[int]:
        return self.held

    def hold(self, version: int, folder) -> None:
        """``version`` is complete here, in ``folder``."""
        self.folders[version] = Path(folder)
        for old in self.held[:-self.keep_versions]:
            del self.folders[old]
        self._tell_news()

    async def publish(self, folder, version: int):
        folder = Path(folder)
        root = digest(f"{version}:{folder.resolve()}".encode())
        self.hold(version, folder)
        self._note_announced(version, root, self.peer_id)
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        return SimpleNamespace(root=root, manifest=SimpleNamespace(total_size=size))

    def fetch(self, version: int, root: bytes, source: str) -> None:
        self._note_announced(version, root, source)
        if self.path_of(version) is None and version not in self.fetches:
            self.fetches.append(version)

    def want_version(self, version: int, exact: bool = False) -> None:
        self.wanted.append(version)

    def peers_in_use(self) -> set[str]:
        return set()  # nothing is transferred

    async def wait_version(self, version: int) -> Path:
        return await self._until(lambda: self.path_of(version))

    async def wait_newer(self, version: int | None) -> int:
        return await self._until(lambda: _newer(self.held, version))

    async def wait_announced(self, version: int) -> int:
        return await self._until(lambda: _newer(sorted(self.announced), version))

    async def _until(self, answer):
        """``answer()`` once it is not None, asked again at each change."""
        while (value := answer()) is None:
            await self._news.wait()
        return value

    def _note_announced(self, version: int, root: bytes, source: str) -> None:
        if version not in self.announced:  # the first announcement stands
            self.announced[version] = (root, source)
            self._tell_news()

    def _tell_news(self) -> None:
        self._news.set()
        self._news = trio.Event()


def _newer(versions: list[int], than: int | None) -> int | None:
    """The newest of ``versions`` (sorted) if newer than ``than`` (any, if None), else None."""
    return versions[-1] if versions and (than is None or versions[-1] > than) else None


def fake_wiring() -> dict:
    """Keyword arguments wiring a :class:`~node.trainer.service.Trainer` to stand-ins."""
    return {"shards": FakeShards(), "membership": FakeMembership(), "ledger": FakeLedger()}


def fake_context(run, *, remote_ip=lambda peer: "127.0.0.1", is_connected=lambda peer: True) -> SimpleNamespace:
    """The parts of a node context (node/context.py) a :class:`~node.trainer.service.Trainer` reads,
    without a libp2p host: ``remote_ip(peer)`` and ``is_connected(peer)`` stand for
    :class:`SwarmHost`'s (by default every peer is on this machine, as in the demo, and connected)."""
    from ..config import NodeConfig
    from ..metrics import Metrics
    from ..peers import Peers

    metrics = Metrics()
    return SimpleNamespace(config=NodeConfig(run=run), run=run, metrics=metrics, status={}, peer_id="me",
                           peers=Peers(None, metrics), host=SimpleNamespace(remote_ip=remote_ip, is_connected=is_connected))
