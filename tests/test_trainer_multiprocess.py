"""The trainer as a real process: kill -9 right after an ack, restart, nothing acknowledged is lost.

One ``swarm-node --role trainer`` process on loopback; this test process plays the inference node
(a libp2p host sending honest signed batches). The trainer is killed with SIGKILL right after it
acknowledged a batch, restarted with the same data dir, and must come back with the same peer id,
the last saved step, the acknowledged batch still queued, and go on to train it.
"""

from __future__ import annotations

import time

import pytest
import trio

from node.net.host import open_swarm_host
from node.identity import Identity
from node.app.localswarm import LocalSwarm
from node.engines.model import load_model, load_tokenizer
from node.rollouts.schema import ROLLOUTS_PROTOCOL, RolloutAck
from node.shards.store import PieceStore
from node.trainer.testing import reversal_batch, sign_batch
from node.wire import decode_as, read_frame, write_frame

pytestmark = pytest.mark.slow

RUN_FILE = """
[run]
name = "mp-trainer"
trainers = ["{trainer}"]

[trainer]
keep_checkpoints = 3
init_warmup_steps = 0
"""
CLIENT = Identity.from_seed(b"c" * 32)


async def submit(host, trainer: str, data: bytes) -> RolloutAck:
    stream = await host.open_stream(trainer, ROLLOUTS_PROTOCOL)
    await write_frame(stream, data)
    ack = decode_as(RolloutAck, await read_frame(stream, 4096), 4096)
    await stream.close()
    return ack


def batch_for(swarm: LocalSwarm, step: int, version: int) -> bytes:
    folder = swarm.root / "trainer" / "trainer" / "models" / f"v{version}"
    model, tok = load_model(folder), load_tokenizer(folder)
    # The draw is keyed by the version's manifest root: the one the trainer stored for it.
    store = PieceStore(swarm.root / "trainer" / "checkpoints", "mp-trainer", [swarm.peer_id("trainer")])
    root = store.saved_manifest(version).root
    return sign_batch(CLIENT, reversal_batch(CLIENT, "mp-trainer", step=step, policy_version=version, policy_root=root,
                                             tokenizer=tok, model=model, prompts=2, group_size=4, seed=step))


def trainer_status(swarm: LocalSwarm) -> dict:
    return swarm.status("trainer").get("trainer", {})


async def send(swarm: LocalSwarm, step: int, version: int) -> RolloutAck:
    async with open_swarm_host(CLIENT, ["/ip4/127.0.0.1/tcp/0"]) as host:
        peer = await host.connect(swarm.addr("trainer"))
        return await submit(host, peer, batch_for(swarm, step, version))


def test_kill_9_after_ack_loses_nothing(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        trainer_id = swarm.peer_id("trainer")
        swarm.write_run_file(RUN_FILE.format(trainer=trainer_id))
        swarm.start("trainer", "trainer", wait=60)
        swarm.wait_until(lambda: trainer_status(swarm).get("published") == 0, timeout=120)
        # two batches of 8 samples with signal: the default min_batch_samples (16) makes one step
        for step in (0, 1):
            assert trio.run(send, swarm, step, 0).accepted
        swarm.wait_until(lambda: trainer_status(swarm).get("published") == 1, timeout=120)
        ack = trio.run(send, swarm, 2, 1)
        assert ack.accepted
        swarm.kill("trainer")  # SIGKILL right after the ack
        restarted = time.time()
        swarm.restart("trainer", wait=60)
        assert swarm.node_info("trainer")["peer_id"] == trainer_id
        # a status written by the new process (restart removed the killed one's)
        swarm.wait_until(lambda: swarm.status("trainer").get("time", 0) > restarted and trainer_status(swarm),
                         timeout=120)
        st = trainer_status(swarm)
        assert st["step"] == 1 and st["batches"]["ready"] == 1 and st["batches"]["trained"] == 2, st
        assert st["published"] == 1  # v1 is still held and served, not republished as new
        assert trio.run(send, swarm, 3, 1).accepted
        swarm.wait_until(lambda: trainer_status(swarm).get("published") == 2, timeout=120)
        st = trainer_status(swarm)
        assert st["batches"]["trained"] == 4 and [s for s, _ in st["reward"]] == [1, 2]
