"""A validator whose checkpoint announcements were lost still judges a batch of the new version
(issue 45's soak: no node heard v130-v136 for about two minutes; a validator handed each batch made
on them back ``unjudged`` while it waited on gossip alone), and a batch of a version older than the
newest it knows."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import trio
from swarmtest import node_config, open_nodes
from test_checkpoint_catchup import deafen
from test_validator_service import FAST_SHARDS, RL, _stub_service, _tiny_batch, held_nowhere, send_batch
from waiting import wait_for

from node.config import RunConfig
from node.engines.model import create_tiny_model
from node.engines.torch_engine import TorchEngine
from node.identity import Identity, load_or_create_identity
from node.rl.config import RLConfig
from node.roles.sections import RunSections
from node.rollouts.schema import UNJUDGED_NO_CHECKPOINT, VERDICTS_PROTOCOL
from node.trainer.testing import FakeShards
from node.validator import testing as T
from node.validator.config import ValidatorSections
from node.validator.service import batch_rules
from node.validator.store import ValidatorStore
from node.validator.tasks import RunTasks


@asynccontextmanager
async def deaf_validator(tmp_path: Path):
    """A trainer (a relay node signing as the run's trainer, its verdicts collected) and a validator
    whose pubsub drops every checkpoint announcement: yields (trainer, validator, make_batch(v,
    root), verdicts by batch id, the announcements dropped)."""
    tid, _ = load_or_create_identity(tmp_path / "t")
    vid, _ = load_or_create_identity(tmp_path / "v")
    run = RunConfig(name="test", trainers=[tid.peer_id], validators=[vid.peer_id],
                    tables={"rl": RL, "shards": FAST_SHARDS})
    engine = TorchEngine("cpu")
    engine.load(create_tiny_model(tmp_path / "model"))
    rules = batch_rules(run.name, RunSections.of(run).pick(ValidatorSections))
    verdicts: dict[bytes, object] = {}
    sink = T.verdict_sink(run.name, set(run.validators), lambda v, raw: verdicts.__setitem__(v.batch_id, v))
    worker = Identity.generate()

    def make_batch(version: int, root: bytes):
        return T.make_batch(engine, worker, rules, RunTasks(RLConfig(**RL)), step=version, policy_version=version,
                            policy_root=root)

    configs = [node_config(tmp_path, "t", role="relay", run=run), node_config(tmp_path, "v", role="validator", run=run)]
    async with open_nodes(configs) as (trainer, validator):
        trainer.host.set_handler(VERDICTS_PROTOCOL, sink)
        yield trainer, validator, make_batch, verdicts, deafen(validator)


async def test_validator_deaf_to_announcements_fetches_the_batchs_version_and_judges_it(tmp_path: Path) -> None:
    with trio.fail_after(240):
        async with deaf_validator(tmp_path) as (trainer, validator, make_batch, verdicts, dropped):
            root = (await trainer.shards.publish(tmp_path / "model", 0)).root
            batch = make_batch(0, root)
            # The announcement and a re-announcement reached the validator, which never heard of v0.
            await wait_for(lambda: len(dropped) >= 2, what="the validator drops the announcements")
            assert validator.shards.announced == {}
            first = await send_batch(trainer, validator.peer_id, batch.envelope)
            assert not first.accepted and first.reason == UNJUDGED_NO_CHECKPOINT
            # The batch says v0 exists: the validator asks the trainer for its manifest.
            await wait_for(lambda: validator.shards.path_of(0) is not None, what="the validator fetching v0")
            assert validator.shards.announced[0] == (root, trainer.peer_id)
            assert validator.shards.status()["catch_up"]["requests"] >= 1
            again = await send_batch(trainer, validator.peer_id, batch.envelope)  # the trainer's retry
            assert again.accepted, again.reason
            verdict = await wait_for(lambda: verdicts.get(batch.batch_id), what="the batch's verdict")
            assert not verdict.unjudged and verdict.accepted, verdict.reasons


async def test_a_validator_deaf_to_announcements_fetches_an_older_batchs_version_and_judges_it(tmp_path: Path):
    """The catch-up request asked only for the newest manifest (issue 45): with v1 known, a batch of
    v0, whose announcement the validator never heard, stayed ``unjudged`` until a re-announcement
    that never comes for a superseded version. The validator now asks for v0 by number."""
    with trio.fail_after(240):
        async with deaf_validator(tmp_path) as (trainer, validator, make_batch, verdicts, dropped):
            roots = [(await trainer.shards.publish(tmp_path / "model", v)).root for v in (0, 1)]
            old, new = make_batch(0, roots[0]), make_batch(1, roots[1])
            await wait_for(lambda: len(dropped) >= 2, what="the validator drops the announcements")
            assert not (await send_batch(trainer, validator.peer_id, new.envelope)).accepted
            await wait_for(lambda: validator.shards.path_of(1) is not None, what="the validator fetching v1, the newest")
            first = await send_batch(trainer, validator.peer_id, old.envelope)
            assert not first.accepted and first.reason == UNJUDGED_NO_CHECKPOINT
            # v1 is known, v0 never announced here: the validator asks for v0 itself.
            await wait_for(lambda: validator.shards.path_of(0) is not None, what="the validator fetching v0 by number")
            assert validator.shards.announced[0] == (roots[0], trainer.peer_id)
            again = await send_batch(trainer, validator.peer_id, old.envelope)  # the trainer's retry
            assert again.accepted, again.reason
            verdict = await wait_for(lambda: verdicts.get(old.batch_id), what="the older batch's verdict")
            assert not verdict.unjudged and verdict.accepted, verdict.reasons


def test_a_batch_of_a_version_never_announced_makes_the_validator_ask_for_it(tmp_path: Path) -> None:
    """An announced version is fetched; one never announced is wanted (the shards service asks a
    peer for it after a period); a held one is neither."""
    trainer = Identity.generate().peer_id
    shards = FakeShards(held=held_nowhere(0), announced={1: (b"r" * 32, "trainer-peer")})
    svc = _stub_service(tmp_path, trainer, ValidatorStore(tmp_path / "v.sqlite"), shards=shards)
    worker = Identity.generate()
    for step, version in enumerate((0, 1, 2)):
        signed = T.sign_batch(worker, replace(_tiny_batch(worker.peer_id, step), policy_version=version))
        svc.submit(trainer, signed.envelope, 0.0)
    assert shards.fetches == [1] and shards.wanted == [2]
