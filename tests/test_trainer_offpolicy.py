"""The run's [grpo] loss and each step's off-policy figures in a real trainer node's status and metrics.

In-process nodes over loopback (tests/swarmtest.py), batches from the fake honest client of
node/trainer/testing.py, as in tests/test_trainer_loop.py.
"""

from __future__ import annotations

from swarmtest import node_config, open_nodes
from test_trainer_loop import make_run, submit
from waiting import wait_for

from node.trainer.testing import reversal_batch, sign_batch


def batch_of(client, trainer, *, step, version, seed):
    """An honest batch stamped with ``version`` (its log-probs are the trainer's current model's)."""
    policy = trainer.policy
    return sign_batch(client.identity, reversal_batch(
        client.identity, "test", step=step, policy_version=version, tokenizer=policy.tokenizer, model=policy.model,
        prompts=2, group_size=4, seed=seed, policy_root=trainer.shards.announced[version][0]))


async def test_status_and_metrics_carry_the_loss_and_the_off_policy_figures_of_each_step(tmp_path):
    run = make_run(tmp_path)
    run.tables["grpo"].update(loss="dppo-tv", max_off_policy_steps=3)
    cfgs = [node_config(tmp_path, "trainer", "trainer", run=run), node_config(tmp_path, "client", "relay", run=run)]
    async with open_nodes(cfgs) as (tnode, client):
        trainer = tnode.trainer
        status = trainer.status()
        assert (status["loss"], status["max_off_policy_steps"]) == ("dppo-tv", 3)  # async_level 2 + grace within 3
        for step in (0, 1):  # version 1 from two batches of version 0, with the engine's log-probs: no mismatch
            ack = await submit(client, tnode.peer_id, batch_of(client, trainer, step=step, version=0, seed=step + 1))
            assert ack.accepted, ack.reason
        await wait_for(lambda: trainer.published == 1, what="version 1")
        first = trainer.status()["last_step"]
        assert first["off_policy_steps"] == {"mean": 0.0, "max": 0}
        assert 0 <= first["mismatch_kl_same_version"] < 1e-4  # the same weights scored the tokens
        assert 0 <= first["masked_frac"] <= 1
        for step in (2, 3):  # version 2 from two more batches of version 0: one version behind
            ack = await submit(client, tnode.peer_id, batch_of(client, trainer, step=step, version=0, seed=step + 1))
            assert ack.accepted, ack.reason
        await wait_for(lambda: trainer.published == 2, what="version 2")
        second = trainer.status()["last_step"]
        assert second["off_policy_steps"] == {"mean": 1.0, "max": 1}
        assert second["mismatch_kl_same_version"] is None  # no token of version 1 in that step
        metrics = tnode.metrics.render().decode()
        assert 'swarm_trainer_off_policy_steps{stat="max"} 1.0' in metrics
        assert "\nswarm_trainer_mismatch_kl " in metrics and "\nswarm_trainer_masked_token_fraction " in metrics
        assert "\nswarm_trainer_mismatch_kl_same_version " in metrics
