"""The inference role in-process: a fake trainer publishes the tiny model and takes the batches.

What is checked on the batches the real inference node sends: signed by the node, tasks and seed are
the deterministic draw's, TOPLOC proofs verify against a validator-style prefill of the checkpoint
that generated them (and fail against the other version: weights really were swapped), log-probs,
rewards, advantages and termination recompute; and that the node stops generating while its weights are
too old for the trainer's step. Real libp2p hosts on loopback; real time, bounded.
"""

from __future__ import annotations

import torch
import trio
from swarmtest import node_config, open_nodes
from waiting import wait_for

from node.config import RunConfig
from node.identity import load_or_create_identity
from node.engines.model import create_tiny_model, load_model, load_tokenizer
from node.proofs.capture import logits_from_hidden, recompute_decode_states
from node.proofs.checks import check_logprobs, check_termination
from node.proofs.config import ProofsConfig
from node.proofs.toploc import verify_proofs
from node.rl.config import RLConfig
from node.rl.spec import draw_step, length_penalty, prompt_ids, token_logprobs
from node.rl.tasks import load_taskset
from node.rl.verifiers import task_reward
from node.rollouts.assemble import split_proofs
from node.rollouts.schema import (
    MAX_BATCH_BYTES,
    ROLLOUTS_PROTOCOL,
    RolloutAck,
    open_batch,
)
from node.validator.pipeline import advantage_results
from node.wire import read_frame, write_frame

RL = {"group_size": 3, "prompts_per_batch": 2, "max_new_tokens": 6}


def run_config(tmp_path, fast_membership, trainers: list[str], **worker) -> RunConfig:
    return RunConfig(name="test", trainers=trainers, tables={
        "membership": fast_membership,
        "shards": {"announce_interval": 1.0},
        "rl": dict(RL),
        "inference": {"engine": "torch", "device": "cpu"},
        "worker": {"backoff_s": 0.2, "backoff_max_s": 1.0, "submit_timeout_s": 10.0, **worker},
    })


class FakeTrainer:
    """Answers ROLLOUTS_PROTOCOL: checks each batch with open_batch, keeps it, acks per ``decide``."""

    def __init__(self, run: str, decide=lambda batch: (True, "")) -> None:
        self.run = run
        self.decide = decide
        self.step = 0  # trainer_step told in acks
        self.batches = []
        self.arrived = trio.Event()

    async def handle(self, stream) -> None:
        data = await read_frame(stream, MAX_BATCH_BYTES)
        sb = open_batch(data, self.run)
        accepted, reason = self.decide(sb.batch)
        self.batches.append(sb)
        await write_frame(stream, RolloutAck(batch_id=sb.batch_id, accepted=accepted, reason=reason,
                                             trainer_step=self.step))
        await stream.close()
        self.arrived.set()
        self.arrived = trio.Event()

    async def wait_for(self, predicate, timeout: float = 120.0):
        with trio.fail_after(timeout):
            while True:
                hits = [sb for sb in self.batches if predicate(sb)]
                if hits:
                    return hits[0]
                await self.arrived.wait()


def check_batch(sb, model, tokenizer, peer_id: str, version: int, rl: RLConfig | None = None) -> list[str]:
    """A validator's checks of one batch against ``model``; returns the failures (empty = valid)."""
    b = sb.batch
    rl = rl or RLConfig(**RL)
    failures = []
    drawn = draw_step(load_taskset(b.taskset), rl, "test", peer_id, b.policy_root, b.step)
    if b.worker != peer_id or b.policy_version != version or b.seed != drawn.seed:
        failures.append("header")
    cfg = ProofsConfig()
    hidden = recompute_decode_states(model, [s.prompt_ids for s in b.samples], [s.completion_ids for s in b.samples],
                                     tokenizer.pad_token_id)
    for s, h in zip(b.samples, hidden):
        task, budget = drawn.tasks[s.prompt_index], drawn.budgets[s.prompt_index]
        if s.task_id != task.id or s.prompt_ids != prompt_ids(tokenizer, task, budget, rl) or s.target_length != budget:
            failures.append(f"task {s.prompt_index}")
        proofs = split_proofs(s.proof, len(s.completion_ids), h.shape[1], cfg.chunk_tokens, cfg.topk)
        if proofs is None or not verify_proofs(h, proofs, cfg).ok:
            failures.append(f"proof {s.prompt_index}/{s.sample_index}")
        lp = token_logprobs(logits_from_hidden(model, h), torch.tensor(s.completion_ids), b.temperature)
        if not check_logprobs(s.logprobs, lp, tolerance_mean=1e-3, tolerance_max=1e-2):
            failures.append(f"logprobs {s.prompt_index}/{s.sample_index}")
        if not check_termination(s.completion_ids, [tokenizer.eos_token_id], b.max_new_tokens):
            failures.append(f"termination {s.prompt_index}/{s.sample_index}")
        text = tokenizer.decode(s.completion_ids, skip_special_tokens=True)
        penalty = rl.length_alpha * length_penalty(len(s.completion_ids), budget) if budget else 0.0
        if (abs(task_reward(task, text) - s.task_reward) > 1e-9 or abs(s.length_penalty - penalty) > 1e-9
                or abs(s.reward - (s.task_reward - s.length_penalty)) > 1e-9):
            failures.append(f"reward {s.prompt_index}/{s.sample_index}")
    for i in {s.prompt_index for s in b.samples}:
        group = [s for s in b.samples if s.prompt_index == i]
        if len(group) != b.group_size or not all(advantage_results(group, tolerance=1e-4)):
            failures.append(f"group {i}")
    return failures


async def test_inference_node_sends_valid_batches_and_follows_new_versions(tmp_path, fast_membership):
    trainer_id, _ = load_or_create_identity(tmp_path / "trainer")
    run = run_config(tmp_path, fast_membership, [trainer_id.peer_id])
    m0 = create_tiny_model(tmp_path / "m0", seed=0)
    m1 = create_tiny_model(tmp_path / "m1", seed=1)  # same architecture, other weights
    fake = FakeTrainer("test")
    configs = [node_config(tmp_path, "trainer", "relay", run=run), node_config(tmp_path, "worker", "inference", run=run)]
    async with open_nodes(configs) as (trainer, worker):
        assert trainer.peer_id == trainer_id.peer_id
        trainer.host.set_handler(ROLLOUTS_PROTOCOL, fake.handle)
        await trainer.shards.publish(m0, 0)

        first = await fake.wait_for(lambda sb: sb.batch.policy_version == 0)
        # The trainer says it is at step 3: v0 is now beyond async_level (2); the node must stop
        # generating batches that would be refused, and resume once it holds a recent version.
        fake.step = 3
        svc = worker.inference
        await wait_for(lambda: svc.status()["waiting_for_checkpoint"], what="the node notices its weights are too old")
        steps = svc.stats.steps
        # Wake the generator three times (as a delivery, a drop or an announcement would): each
        # time it looks again and holds back.
        for _ in range(3):
            held = svc.stats.held_back
            svc._notify()
            await wait_for(lambda: svc.stats.held_back > held, what="the generator re-checks while waiting")
        assert svc.stats.steps == steps and svc.status()["waiting_for_checkpoint"]
        await trainer.shards.publish(m1, 3)
        later = await fake.wait_for(lambda sb: sb.batch.policy_version == 3)

        status = worker.inference.status()
        assert status["policy_version"] == 3 and status["weight_swaps"] >= 1
        assert status["batches"]["accepted"] >= 2 and status["steps"] >= 2
        assert status["tokens_per_s"] > 0 and status["trainers_alive"] == 1
        # Where its time went (node/steptime.py): every phase of every step and every load, timed.
        phases = status["phases_s"]
        assert {p: phases[p]["n"] for p in ("generate", "score", "proofs", "assemble", "load")} == {
            "generate": status["steps"], "score": status["steps"], "proofs": status["steps"],
            "assemble": status["steps"], "load": status["weight_swaps"]}  # the first load is start-up, not a step's
        assert phases["generate"]["mean_s"] > 0 and phases["load"]["mean_s"] > 0
        assert worker.shards.status()["phases_s"]["transfer"]["n"] >= 2  # v0 and v3 came by download
        metrics = worker.metrics.render().decode()
        assert f'swarm_phase_seconds_count{{phase="generate"}} {float(status["steps"])}' in metrics
        assert 'swarm_phase_seconds_count{phase="transfer"}' in metrics
        record = worker.membership.record
        assert record.capacity > 0  # advertised tokens/s

    tok = load_tokenizer(m0)
    model0, model1 = load_model(m0), load_model(m1)
    assert check_batch(first, model0, tok, worker.peer_id, 0) == []
    assert check_batch(later, model1, tok, worker.peer_id, 3) == []
    # The proofs bind each batch to its own weights: checked against the other version they fail.
    assert any(f.startswith("proof") for f in check_batch(later, model0, tok, worker.peer_id, 3))
    steps = [sb.batch.step for sb in fake.batches]
    assert len(set(steps)) == len(steps)  # one batch per draw step


async def test_backpressure_retries_elsewhere_and_counts_refusals(tmp_path, fast_membership):
    """No usable trainer: the node generates up to its outbox bound, then waits. A trainer that resets
    streams is backed off; once a good trainer answers, every batch lands there, refusals counted."""
    ids = [load_or_create_identity(tmp_path / n)[0].peer_id for n in ("bad", "good")]
    run = run_config(tmp_path, fast_membership, ids, max_pending_batches=2)
    model = create_tiny_model(tmp_path / "m0", seed=0)
    refuse_first = iter([(False, "wrong_task")])
    good = FakeTrainer("test", decide=lambda batch: next(refuse_first, (True, "")))

    async def reset(stream) -> None:
        await stream.reset()

    configs = [node_config(tmp_path, "bad", "relay", run=run), node_config(tmp_path, "good", "relay", run=run),
               node_config(tmp_path, "worker", "inference", run=run)]
    async with open_nodes(configs) as (bad, good_node, worker):
        bad.host.set_handler(ROLLOUTS_PROTOCOL, reset)
        await bad.shards.publish(model, 0)
        svc = worker.inference
        await wait_for(lambda: svc.stats.steps >= 2 and svc.failures["stream"] + svc.failures["unreachable"] >= 2,
                       what="two batches generated and two refused deliveries")
        # Every failed delivery wakes the generator; with the outbox full it must hold back each time.
        held = svc.stats.held_back
        await wait_for(lambda: svc.stats.held_back >= held + 2, what="the generator re-checks the full outbox")
        assert svc.stats.steps == 2 and len(svc.outbox) == 2  # bounded: waits instead of generating more
        assert svc.status()["batches"]["accepted"] == 0

        good_node.host.set_handler(ROLLOUTS_PROTOCOL, good.handle)
        await wait_for(lambda: svc.status()["batches"]["accepted"] >= 3, what="three batches accepted")
        status = svc.status()["batches"]
        assert status["refused"] == {"wrong_task": 1}
        assert sum(status["transport_failures"].values()) >= 2  # both trainers failed at first
        assert svc.stats.steps >= 4  # generation resumed once batches drained
    assert {sb.batch.worker for sb in good.batches} == {worker.peer_id}
