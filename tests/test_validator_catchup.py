"""A validator whose checkpoint announcements were lost still judges a batch of the new version
(issue 45's soak: no node heard v130-v136 for about two minutes; a validator handed each batch made
on them back ``unjudged`` while it waited on gossip alone)."""

from __future__ import annotations

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


async def test_validator_deaf_to_announcements_fetches_the_batchs_version_and_judges_it(tmp_path: Path) -> None:
    tid, _ = load_or_create_identity(tmp_path / "t")
    vid, _ = load_or_create_identity(tmp_path / "v")
    run = RunConfig(name="test", trainers=[tid.peer_id], validators=[vid.peer_id],
                    tables={"rl": RL, "shards": FAST_SHARDS})
    folder = create_tiny_model(tmp_path / "model")
    engine = TorchEngine("cpu")
    engine.load(folder)
    rules = batch_rules(run.name, RunSections.of(run).pick(ValidatorSections))
    verdicts: dict[bytes, object] = {}
    sink = T.verdict_sink(run.name, set(run.validators), lambda v, raw: verdicts.__setitem__(v.batch_id, v))

    configs = [node_config(tmp_path, "t", role="relay", run=run), node_config(tmp_path, "v", role="validator", run=run)]
    with trio.fail_after(240):
        async with open_nodes(configs) as (trainer, validator):
            trainer.host.set_handler(VERDICTS_PROTOCOL, sink)
            dropped = deafen(validator)
            root = (await trainer.shards.publish(folder, 0)).root
            batch = T.make_batch(engine, Identity.generate(), rules, RunTasks(RLConfig(**RL)), step=0,
                                 policy_version=0, policy_root=root)
            # The announcement and a re-announcement reached the validator, which never heard of v0.
            await wait_for(lambda: len(dropped) >= 2, what="the validator drops the announcements")
            assert validator.shards.announced == {}
            first = await send_batch(trainer, validator.peer_id, batch.envelope)
            assert not first.accepted and first.reason == UNJUDGED_NO_CHECKPOINT
            # The batch says v0 exists: the validator asks the trainer for its newest manifest.
            await wait_for(lambda: validator.shards.path_of(0) is not None, what="the validator fetching v0")
            assert validator.shards.announced[0] == (root, trainer.peer_id)
            assert validator.shards.status()["catch_up"]["requests"] >= 1
            again = await send_batch(trainer, validator.peer_id, batch.envelope)  # the trainer's retry
            assert again.accepted, again.reason
            verdict = await wait_for(lambda: verdicts.get(batch.batch_id), what="the batch's verdict")
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
