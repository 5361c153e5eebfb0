"""The trainer in a real node: batches over the network -> a GRPO step -> version 1 published.

In-process nodes over loopback (tests/swarmtest.py): a trainer and a client acting as an inference
node that sends honest signed batches (node/trainer/testing.py). Also the validator gate end to end
with a fake validator, and a restart that resumes at the saved step with the same peer id.
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager

import trio

from swarmtest import node_config, open_nodes
from test_dbthread import HeldWrite
from waiting import wait_for

from node.config import RunConfig
from node.hashes import digest
from node.identity import load_or_create_identity
from node.rollouts.schema import (
    DOMAIN_VERDICT,
    ROLLOUTS_PROTOCOL,
    UNJUDGED_NO_CHECKPOINT,
    VERDICTS_PROTOCOL,
    VERIFY_PROTOCOL,
    RolloutAck,
    Verdict,
    open_batch,
)
from node.trainer import service
from node.trainer.spool import BatchState
from node.trainer.testing import reversal_batch, sign_batch
from node.wire import decode_as, encode, read_frame, seal, write_frame

NEVER_CLOSED = []  # spools that a failing stop test must leave open (test_a_node_stopping_waits_for_the_batch_being_spooled)

GRPO = {"min_batch_samples": 16, "optimizer_steps": 2, "pack_length": 64, "kl_coef": 0.0, "lr": 1e-3}


def make_run(tmp_path, validators=()):
    trainer_id, _ = load_or_create_identity(tmp_path / "trainer")
    run = RunConfig(name="test", trainers=[trainer_id.peer_id], validators=list(validators))
    run.tables.update(grpo=dict(GRPO), trainer={"verify_timeout_s": 5.0, "init_warmup_steps": 0})
    return run


async def submit(node, trainer_peer: str, data: bytes) -> RolloutAck:
    stream = await node.host.open_stream(trainer_peer, ROLLOUTS_PROTOCOL)
    await write_frame(stream, data)
    frame = await read_frame(stream, 4096)
    await stream.close()
    return decode_as(RolloutAck, frame, 4096)


def honest(client, trainer, step, seed):
    policy = trainer.policy
    return sign_batch(client.identity, reversal_batch(
        client.identity, "test", step=step, policy_version=policy.step, tokenizer=policy.tokenizer,
        model=policy.model, prompts=2, group_size=4, seed=seed, policy_root=trainer.shards.announced[policy.step][0]))


async def test_batches_make_a_step_and_version_1_is_published(tmp_path):
    run = make_run(tmp_path)
    cfgs = [node_config(tmp_path, "trainer", "trainer", run=run), node_config(tmp_path, "client", "relay", run=run)]
    async with open_nodes(cfgs) as (tnode, client):
        trainer = tnode.trainer
        shards = tnode.shards
        assert trainer.step == 0 and trainer.published == 0 and shards.latest() == 0
        first = honest(client, trainer, step=0, seed=1)
        ack = await submit(client, tnode.peer_id, first)
        assert ack.accepted, ack.reason
        # The train loop looked at it and waits: 16 samples with signal are needed, the batch has 8.
        await wait_for(lambda: trainer.status()["samples_in_hand"] == [8, 16], what="first batch picked and found short")
        assert trainer.step == 0
        ack = await submit(client, tnode.peer_id, honest(client, trainer, step=1, seed=2))
        assert ack.accepted, ack.reason
        await wait_for(lambda: trainer.published == 1)
        assert shards.latest() == 1 and trainer.step == 1
        status = trainer.status()
        assert status["batches"]["trained"] == 2 and status["last_step"]["samples"] == 16
        assert status["reward"][0][0] == 1
        assert status["gate"].startswith("off")
        metrics = tnode.metrics.render().decode()  # reward, loss and step time as Prometheus series
        assert "swarm_trainer_step_seconds_count 1.0" in metrics and "swarm_trainer_step_seconds_bucket{" in metrics
        assert "\nswarm_trainer_loss " in metrics and "\nswarm_trainer_reward " in metrics
        # Where the step's time went (node/steptime.py): one step of two batches, trained, saved, published
        # (the publish is timed once its call returns, just after the version is marked published).
        await wait_for(lambda: "publish" in trainer.status()["phases_s"], what="the step's publish timed")
        status = trainer.status()
        assert {p: f["n"] for p, f in status["phases_s"].items()} == {"train": 1, "save": 1, "publish": 1}
        assert status["step_batches"] == 2 and status["phases_s"]["train"]["mean_s"] > 0
        assert set(status["step_time_s"]) == {"wait", "train", "save", "publish"}
        assert 'swarm_phase_seconds_count{phase="publish"} 1.0' in tnode.metrics.render().decode()
        # ledger: accepted entries for the worker, and the checkpoint entries of v0 and v1
        ledger = tnode.ledger
        await wait_for(lambda: ledger.totals().get(client.peer_id, {}).get("rollouts_accepted", 0) == 16)
        # published is set before the ledger entry is appended: wait for it, do not race it
        await wait_for(lambda: ledger.totals().get(tnode.peer_id, {}).get("checkpoints", 0) == 2,
                       what="checkpoint entries of v0 and v1")
        # the new version differs from v0 and is a loadable HF folder
        folder = shards.path_of(1)
        assert (folder / "config.json").is_file() and digest((folder / "model.safetensors").read_bytes()) != \
            digest((shards.path_of(0) / "model.safetensors").read_bytes())
        replay = await submit(client, tnode.peer_id, first)
        assert replay.reason == "duplicate"
        again = await submit(client, tnode.peer_id, honest(client, trainer, step=1, seed=3))
        assert again.reason == "duplicate-step"
    # restart: same peer id, resumes at step 1, nothing retrained, v1 still served. The stored copy's
    # re-check is paced to never end here, so the trainer finds v1 not held and seeds it again.
    run = make_run(tmp_path)
    run.tables["shards"] = {"recheck_rate": 1}
    cfgs = [node_config(tmp_path, "trainer", "trainer", run=run)]
    async with open_nodes(cfgs) as (tnode,):
        trainer = tnode.trainer
        assert tnode.peer_id == run.trainers[0]
        assert trainer.step == 1 and trainer.published == 1 and tnode.shards.latest() == 1
        # v1 is seeded again from the trainer's folder while its stored copy is re-checked, but it is
        # not a new checkpoint: no second ledger entry (the publish at start ran before started()).
        assert tnode.ledger.totals()[tnode.peer_id]["checkpoints"] == 2
        assert trainer.spool.counts() == {"trained": 2, "rejected": 1}  # the duplicate-step one
        assert trainer.status()["reward"][0][0] == 1


async def test_validator_gate_end_to_end(tmp_path):
    """Batches wait for a verdict; a pass trains, a failure is rejected with the validator's reason."""
    val_id, _ = load_or_create_identity(tmp_path / "validator")
    run = make_run(tmp_path, validators=[val_id.peer_id])
    cfgs = [node_config(tmp_path, "trainer", "trainer", run=run),
            node_config(tmp_path, "validator", "relay", run=run),
            node_config(tmp_path, "client", "relay", run=run)]
    async with open_nodes(cfgs) as (tnode, vnode, client):
        trainer = tnode.trainer
        received: list[bytes] = []
        verdict_acks: list[RolloutAck] = []

        async def handle_verify(stream):  # a fake validator: queue, ack, and judge later
            data = await read_frame(stream, 8 * 1024 * 1024)
            signed = open_batch(data, "test")
            received.append(signed.batch_id)
            await write_frame(stream, RolloutAck(batch_id=signed.batch_id, accepted=True))
            await stream.close()
            ok = len(received) == 1  # first batch passes, second fails
            verdict = Verdict(run="test", batch_id=signed.batch_id, worker=signed.batch.worker,
                              validator=vnode.peer_id, accepted=ok,
                              reasons=["ok" if ok else "toploc-exponent"] * len(signed.batch.samples),
                              policy_version=signed.batch.policy_version, created_ms=0)
            out = await vnode.host.open_stream(tnode.peer_id, VERDICTS_PROTOCOL)
            await write_frame(out, encode(seal(vnode.identity, DOMAIN_VERDICT, verdict)))
            verdict_acks.append(decode_as(RolloutAck, await read_frame(out, 4096)))
            await out.close()

        vnode.host.set_handler(VERIFY_PROTOCOL, handle_verify)
        await wait_for(lambda: vnode.peer_id in trainer.live_validators(), what="validator alive")
        ack1 = await submit(client, tnode.peer_id, honest(client, trainer, step=0, seed=1))
        assert ack1.accepted
        assert trainer.spool.get(ack1.batch_id).state in (BatchState.GATED, BatchState.READY)
        await wait_for(lambda: len(verdict_acks) == 1)
        assert verdict_acks[0].accepted and trainer.spool.get(ack1.batch_id).state is not BatchState.GATED
        ack2 = await submit(client, tnode.peer_id, honest(client, trainer, step=1, seed=2))
        await wait_for(lambda: len(verdict_acks) == 2)
        row = trainer.spool.get(ack2.batch_id)
        assert row.state is BatchState.REJECTED and row.reason == "verdict:toploc-exponent"
        assert trainer.status()["gate"]["verdicts"] == {"passed": 1, "failed": 1}
        # a verdict signed by a peer that is not a validator of the run is refused
        forged = Verdict(run="test", batch_id=ack2.batch_id, worker=client.peer_id, validator=client.peer_id,
                         accepted=True, reasons=[], policy_version=0, created_ms=0)
        assert (await trainer.on_verdict_bytes(encode(seal(client.identity, DOMAIN_VERDICT, forged))))[2] == "not-validator"


async def test_a_non_finite_step_is_dropped_and_only_its_culprit_refused(tmp_path):
    """Defence behind the schema's bounds: should a step's loss still come out non-finite, nothing
    is saved or published, the batch that alone gives a non-finite loss is refused and its sender
    struck, and the other batch trains in the next step."""
    from node.rl.grpo import NonFiniteStep

    run = make_run(tmp_path)
    cfgs = [node_config(tmp_path, "trainer", "trainer", run=run), node_config(tmp_path, "client", "relay", run=run)]
    async with open_nodes(cfgs) as (tnode, client):
        trainer = tnode.trainer
        policy = trainer.policy
        train, non_finite = policy.train, policy.non_finite
        poisoned = []

        def poisoned_train(samples):
            raise NonFiniteStep("loss nan")

        def blame_second(groups):
            poisoned.append(len(groups))
            return [1]

        policy.train, policy.non_finite = poisoned_train, blame_second
        first, second = honest(client, trainer, step=0, seed=1), honest(client, trainer, step=1, seed=2)
        for data in (first, second):
            assert (await submit(client, tnode.peer_id, data)).accepted
        await wait_for(lambda: trainer.status()["dropped_steps"] == 1, what="the poisoned step dropped")
        assert poisoned == [2] and trainer.step == 0 and trainer.published == 0
        assert tnode.shards.latest() == 0 and not policy.folder(1).exists()
        assert trainer.spool.counts() == {"ready": 1, "rejected": 1}
        assert trainer.spool.rejected_by_reason() == {"non_finite": 1}
        struck = tnode.peers.table.peers[client.peer_id]  # the sender was struck
        assert struck.faults == 1 and struck.last == "rollouts/non_finite"
        policy.train, policy.non_finite = train, non_finite
        assert (await submit(client, tnode.peer_id, honest(client, trainer, step=2, seed=3))).accepted
        await wait_for(lambda: trainer.published == 1, what="the next honest step")
        assert trainer.spool.counts() == {"trained": 2, "rejected": 1}


async def test_a_validator_that_cannot_judge_yet_is_asked_again_without_waiting_the_verify_timeout(tmp_path):
    """Issue 15: "no-checkpoint" in the validator's ack, then a signed ``unjudged`` verdict, each free
    the batch at once (no blame on the worker); with a 600 s verify timeout the batch still trains."""
    val_id, _ = load_or_create_identity(tmp_path / "validator")
    run = make_run(tmp_path, validators=[val_id.peer_id])
    run.tables["trainer"].update(verify_timeout_s=600.0, unjudged_retry_s=0.2)
    cfgs = [node_config(tmp_path, "trainer", "trainer", run=run),
            node_config(tmp_path, "validator", "relay", run=run),
            node_config(tmp_path, "client", "relay", run=run)]
    async with open_nodes(cfgs) as (tnode, vnode, client):
        trainer = tnode.trainer
        asks: list[bytes] = []
        verdict_acks: list[RolloutAck] = []

        async def send_verdict(signed, **fields):
            verdict = Verdict(run="test", batch_id=signed.batch_id, worker=signed.batch.worker,
                              validator=vnode.peer_id, policy_version=signed.batch.policy_version, created_ms=0,
                              **fields)
            out = await vnode.host.open_stream(tnode.peer_id, VERDICTS_PROTOCOL)
            await write_frame(out, encode(seal(vnode.identity, DOMAIN_VERDICT, verdict)))
            verdict_acks.append(decode_as(RolloutAck, await read_frame(out, 4096)))
            await out.close()

        async def handle_verify(stream):  # 1st ask: refused at once; 2nd: queued, then unjudged; 3rd: passes
            signed = open_batch(await read_frame(stream, 8 * 1024 * 1024), "test")
            asks.append(signed.batch_id)
            first = len(asks) == 1
            await write_frame(stream, RolloutAck(batch_id=signed.batch_id, accepted=not first,
                                                 reason=UNJUDGED_NO_CHECKPOINT if first else ""))
            await stream.close()
            if len(asks) == 2:
                await send_verdict(signed, accepted=False, reasons=[], unjudged=UNJUDGED_NO_CHECKPOINT)
            elif len(asks) == 3:
                await send_verdict(signed, accepted=True, reasons=["ok"] * len(signed.batch.samples))

        vnode.host.set_handler(VERIFY_PROTOCOL, handle_verify)
        await wait_for(lambda: vnode.peer_id in trainer.live_validators(), what="validator alive")
        ack = await submit(client, tnode.peer_id, honest(client, trainer, step=0, seed=1))
        assert ack.accepted
        # A hang guard well under the verify timeout: without "not now" the batch would wait 600 s.
        # The verdict counted (after its spool write: waiting for the row alone raced the count).
        await wait_for(lambda: trainer.figures.verdicts["passed"] == 1, timeout=60, what="the batch verified on the third ask")
        assert asks == [ack.batch_id] * 3 and all(a.accepted for a in verdict_acks)
        gate = trainer.status()["gate"]
        assert gate["not_now"] == 2 and gate["timeouts"] == 0 and gate["verdicts"]["passed"] == 1
        assert trainer.spool.get(ack.batch_id).state is not BatchState.REJECTED


async def test_a_node_stopping_waits_for_the_batch_being_spooled(tmp_path, monkeypatch):
    """Rollouts arrive on handler tasks, outside the trainer's nursery, and are spooled in a worker
    thread. Stopping the node while one is inside its SQLite transaction must not close the spool
    under it (that is a SIGSEGV, not an exception): the batch is stored, then the spool closes."""
    held: list[HeldWrite] = []
    closes, opened = [], []
    real_open = service.open_spool

    @contextmanager
    def spied_open(path):
        manager = real_open(path)
        opened.append(manager.__enter__())
        try:
            yield opened[-1]
        finally:
            closes.append(bool(held) and held[0].held)
            if closes[-1]:  # closing under the held write would crash this test run, not fail it; kept
                NEVER_CLOSED.append(manager)  # referenced, or collecting the generator would close it
            else:
                manager.__exit__(None, None, None)

    monkeypatch.setattr(service, "open_spool", spied_open)
    run = make_run(tmp_path)
    cfgs = [node_config(tmp_path, "trainer", "trainer", run=run), node_config(tmp_path, "client", "relay", run=run)]
    batch_id = None
    async with trio.open_nursery() as outer:
        async with open_nodes(cfgs) as (tnode, client):
            held.append(HeldWrite(opened[0].db))
            data = honest(client, tnode.trainer, step=0, seed=1)
            batch_id = open_batch(data, "test").batch_id

            async def send() -> None:  # the ack never comes back: the node stops first
                with contextlib.suppress(Exception):
                    await submit(client, tnode.peer_id, data)

            outer.start_soon(send)
            assert await held[0].entered(), "the batch was never spooled"
            # the trainer's loops are gone: then serve_trainer has gone as far as it will
            outer.start_soon(held[0].release_once_stopped, lambda: not tnode.trainer._nursery.child_tasks, closes,
                             "trainer stopping")
        outer.cancel_scope.cancel()  # the sender's read outlives its host: py-libp2p never fails it
    assert closes == [False]
    with real_open(tmp_path / "trainer" / "trainer" / "spool.sqlite") as spool:
        assert spool.knows(batch_id)
