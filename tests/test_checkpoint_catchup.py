"""A node whose checkpoint announcement never arrived asks a peer for the newest manifest (issue 45's
soak: workers paused as too old for two minutes while the trainer's announcements reached nobody)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from swarmtest import node_config, open_nodes
from test_inference_role import FakeTrainer, run_config
from waiting import wait_for

from node.engines.model import create_tiny_model
from node.identity import Identity, load_or_create_identity
from node.rollouts.schema import ROLLOUTS_PROTOCOL
from node.shards.announce import call_newest
from node.shards.catchup import AnswerBudget, CatchUp
from node.shards.manifest import build_manifest, sign_manifest
from node.shards.protocol import ManifestReply
from node.shards.service import ShardsService
from node.shards.testing import open_shards_swarm, same_files, write_checkpoint
from node.wire import RemoteProtocolError

MiB = 1 << 20
FAST = dict(announce_interval=0.5, request_timeout=2.0, progress=False)


def deafen(node) -> list[bytes]:
    """Drop every checkpoint announcement ``node``'s pubsub receives (a lost gossip message, as in
    the soak); returns the list the dropped ones are appended to."""
    dropped: list[bytes] = []

    def drop(peer_id, msg) -> bool:
        dropped.append(msg.data)
        return False

    node.host.pubsub.set_topic_validator(node.topic("checkpoints"), drop, False)
    return dropped


# -- the pure parts ------------------------------------------------------------------------------


def test_catch_up_asks_one_period_after_the_want_then_once_a_period() -> None:
    c = CatchUp(period=15.0)
    assert c.due_at(None, 0.0) is None  # nothing wanted
    c.want(7, 100.0)
    c.want(5, 104.0)  # an older want neither lowers the version nor restarts the wait
    assert c.wanted == 7 and c.due_at(6, 104.0) == 115.0
    assert c.pick(["t", "r"], 115.0) == "t"
    assert c.due_at(6, 116.0) == 130.0  # one request a period
    c.answered(None)
    assert c.pick(["t", "r"], 130.0) == "r"  # the next candidate after a failure
    assert c.pick([], 145.0) is None and c.requests == 2
    assert c.due_at(6, 150.0) == 160.0  # a round with no candidate still counts as the period's
    assert c.due_at(7, 150.0) is None and c.wanted is None  # met: forgotten
    c.want(9, 200.0)
    assert c.due_at(7, 200.0) == 215.0  # a new want waits its own period


def test_catch_up_asks_the_next_peer_after_an_answer_older_than_wanted() -> None:
    """Review of issue 45: a relay (no trainer connected) answering each period with a real,
    trainer-signed manifest one version newer than ours walked us one version a period, asked
    again and again as it never failed. An answer short of the wanted version moves to the next."""
    c = CatchUp(period=15.0)
    c.want(20, 0.0)
    peers = ["relay", "honest"]
    assert c.pick(peers, 15.0) == "relay"
    c.answered(11)  # newer than the 10 we knew, older than the 20 wanted
    assert c.pick(peers, 30.0) == "honest"
    c.answered(19)
    assert c.pick(peers, 45.0) == "relay"
    c.answered(None)  # nothing newer, a refusal or no answer
    assert c.pick(peers, 60.0) == "honest"
    c.answered(20)  # the wanted version: the want is met, no rotation
    assert c.pick(peers, 75.0) == "honest"


def test_answer_budget_refuses_a_peer_asking_too_often_and_a_crowd() -> None:
    b = AnswerBudget(peer_interval=7.5, total=3, window=15.0)
    assert b.admit("a", 0.0) and not b.admit("a", 0.0)  # again at once
    assert not b.admit("a", 7.0) and b.admit("a", 7.5)
    assert b.admit("b", 8.0)
    assert not b.admit("c", 9.0)  # three answers in the window: everyone waits
    assert b.admit("c", 15.1)  # the answer at 0.0 left the window
    assert b.refused == 3


# -- real hosts on loopback ----------------------------------------------------------------------


async def test_node_deaf_to_announcements_gets_the_version_by_asking(tmp_path: Path) -> None:
    trainer = Identity.generate()
    with trio.fail_after(60):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=[trainer.peer_id], role="trainer", **FAST)
            w = await swarm.add(tmp_path / "w", trainers=[trainer.peer_id], role="inference", **FAST)
            dropped = deafen(w)
            await w.host.connect(t.host.listen_addrs()[0])
            # Its first contact's request (a late joiner's, answered: nothing held yet) is over.
            await wait_for(lambda: w.shards.catchup.turn == 1, what="the worker's first request answered")
            src = write_checkpoint(tmp_path / "v2", MiB, seed=2)
            await t.shards.publish(src, 2)
            # The announcement and a re-announcement reached the worker, which never heard of v2.
            await wait_for(lambda: len(dropped) >= 2, what="the worker drops the announcements")
            assert w.shards.announced == {} and w.shards.catchup.requests == 1
            w.shards.want_version(2)  # an ack said the trainer is at v2
            path = await w.shards.wait_version(2)
            assert same_files(src, path)
            assert w.shards.announced[2][1] == t.peer_id  # learnt from the trainer it asked
            assert w.shards.status()["catch_up"] == {"wanted": None, "wanted_exact": [], "requests": 2}


async def test_newest_request_is_budgeted_and_its_answer_verified(tmp_path: Path) -> None:
    trainer, stranger = Identity.generate(), Identity.generate()

    class Forger(ShardsService):
        """Answers with a manifest of a newer version signed by a key that is not the trainer's."""

        def _newest_reply(self, peer, above, version=-1):
            forged = sign_manifest(stranger, build_manifest(src, "test", 9))
            return ManifestReply(envelope=forged.envelope)

    src = write_checkpoint(tmp_path / "v1", MiB, seed=1)
    with trio.fail_after(60):
        async with open_shards_swarm() as swarm:
            # The trainer answers a peer at most once per 120 s (half its announce_interval), longer
            # than this whole test may take: its refusal below depends on no timing.
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=[trainer.peer_id], role="trainer",
                                **{**FAST, "announce_interval": 240.0})
            # The forger and the prober x fetch nothing, so they ask no one at first contact (x's
            # requests below are its first); the worker w does, which uses its one answer from t.
            f = await swarm.add(tmp_path / "f", trainers=[trainer.peer_id], role="relay", service_class=Forger,
                                **FAST, fetch="none")
            x = await swarm.add(tmp_path / "x", trainers=[trainer.peer_id], role="inference", **FAST, fetch="none")
            w = await swarm.add(tmp_path / "w", trainers=[trainer.peer_id], role="inference", **FAST)
            for a, b in ((x, t), (f, t), (x, f), (w, t), (w, f)):
                await a.host.connect(b.host.listen_addrs()[0])
            await t.shards.publish(src, 1)
            args = ("test", [trainer.peer_id])
            assert (await call_newest(x.host, t.peer_id, 0, *args)).version == 1
            assert await call_newest(x.host, t.peer_id, 0, *args) is None  # again: refused
            assert t.shards.newest_answers.refused == 1
            assert await call_newest(f.host, t.peer_id, 1, *args) is None  # nothing newer than v1
            with pytest.raises(RemoteProtocolError) as refused:
                await call_newest(x.host, f.peer_id, 1, *args)
            assert refused.value.reason == "not-trainer"
            # Asked by the catch-up (the trainer first, which refuses: asked too often; then the
            # forger), the forger's answer is refused and nothing is fetched.
            w.shards.want_version(9)
            await wait_for(lambda: w.metrics.rejections().get("shards/not-trainer"),
                           what="the worker asks the forger")
            assert 9 not in w.shards.announced and 9 not in w.shards.downloads


async def test_worker_paused_as_too_old_resumes_though_the_announcement_was_lost(tmp_path, fast_membership) -> None:
    """End to end: acks say the trainer moved on, the worker pauses (too old), the new version's
    announcement never reaches it, and it still loads that version and generates from it."""
    trainer_id, _ = load_or_create_identity(tmp_path / "trainer")
    run = run_config(tmp_path, fast_membership, [trainer_id.peer_id])
    m0 = create_tiny_model(tmp_path / "m0", seed=0)
    m1 = create_tiny_model(tmp_path / "m1", seed=1)
    fake = FakeTrainer("test")
    configs = [node_config(tmp_path, "trainer", "relay", run=run), node_config(tmp_path, "worker", "inference", run=run)]
    async with open_nodes(configs) as (trainer, worker):
        trainer.host.set_handler(ROLLOUTS_PROTOCOL, fake.handle)
        await trainer.shards.publish(m0, 0)
        await fake.wait_for(lambda sb: sb.batch.policy_version == 0)
        dropped = deafen(worker)
        fake.step = 3  # async_level 2: v0 is too old now
        await wait_for(lambda: worker.inference.status()["waiting_for_checkpoint"], what="the worker pauses")
        await trainer.shards.publish(m1, 3)
        await wait_for(lambda: dropped, what="the announcement of v3 reaches the worker's pubsub")
        await fake.wait_for(lambda sb: sb.batch.policy_version == 3)
        assert worker.shards.status()["catch_up"]["requests"] >= 1


async def test_a_late_joiner_asks_its_first_peer_instead_of_waiting_for_an_announcement(tmp_path: Path) -> None:
    """Issue 45: a newcomer learnt the newest version only from the next announcement, 3-10 s after
    it joined. It asks the first peer it connects to (a relay holding the version here) at once."""
    trainer = Identity.generate()
    slow = dict(FAST, announce_interval=600.0)  # no re-announcement while the test runs
    with trio.fail_after(60):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=[trainer.peer_id], role="trainer", **slow)
            r = await swarm.add(tmp_path / "r", trainers=[trainer.peer_id], role="relay", **slow)
            await r.host.connect(t.host.listen_addrs()[0])
            src = write_checkpoint(tmp_path / "v3", MiB, seed=3)
            await t.shards.publish(src, 3)
            await r.shards.wait_version(3)  # the relay heard the one announcement and holds v3
            w = await swarm.add(tmp_path / "w", trainers=[trainer.peer_id], role="inference", **slow)
            deafen(w)  # gossip may still replay the old announcement from its cache: not what is tested
            await w.host.connect(r.host.listen_addrs()[0])
            with trio.fail_after(20):
                path = await w.shards.wait_version(3)
            assert same_files(src, path)
            assert w.shards.announced[3][1] == r.peer_id and w.shards.catchup.requests == 1
