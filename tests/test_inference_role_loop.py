"""The real loop in one process: the trainer role publishes v0, the inference role sends batches,
the trainer trains on them and publishes v1, the inference node swaps to v1 and keeps sending.
A second inference node replays its batches: the trainer refuses every replay as a duplicate."""

from __future__ import annotations

import copy

from swarmtest import node_config, open_nodes
from waiting import wait_for

from node.config import RunConfig
from node.identity import load_or_create_identity
from node.inference.service import read_step


async def test_trainer_and_inference_close_the_loop(tmp_path, fast_membership):
    trainer_id, _ = load_or_create_identity(tmp_path / "trainer")
    run = RunConfig(name="test", trainers=[trainer_id.peer_id], tables={
        "membership": fast_membership,
        "shards": {"announce_interval": 1.0},
        "rl": {"group_size": 4, "prompts_per_batch": 2, "max_new_tokens": 8},
        "grpo": {"min_batch_samples": 4, "optimizer_steps": 1},
        "trainer": {"init_warmup_steps": 0, "device": "cpu"},
        "inference": {"engine": "torch", "device": "cpu"},
        "worker": {"backoff_s": 0.2, "backoff_max_s": 1.0},
    })
    cheater_run = copy.deepcopy(run)
    cheater_run.tables["worker"]["cheat"] = "replay"  # node-local: only this node's run file says so
    configs = [node_config(tmp_path, "trainer", "trainer", run=run), node_config(tmp_path, "worker", "inference", run=run),
               node_config(tmp_path, "cheater", "inference", run=cheater_run)]
    async with open_nodes(configs) as (trainer, worker, cheater):
        svc, bad = worker.inference, cheater.inference
        # A slow start may load v1 first (v0 skipped): then the swap is to v2, which follows.
        await wait_for(lambda: (svc.stats.swaps >= 1 and svc.status()["batches"]["accepted"] >= 2
                                and bad.status()["batches"]["refused"].get("duplicate")),
                       timeout=240, what="a weight swap, two accepted batches and a refused replay")
        status = svc.status()
        assert status["weight_swaps"] >= 1 and status["policy_version"] >= 1
        assert set(status["batches"]["refused"]) <= {"stale"}  # the trainer may step past a slow batch
        # Step headroom (issue 39): the acks moved the worker's view of the trainer's step window,
        # and it is persisted before the next step, so a restart keeps it.
        assert status["step_window"]["counted"] >= 1 and status["step_window"]["step_ahead_refusals"] == 0
        await wait_for(lambda: read_step(svc.counted_file, -1) >= 1, timeout=120, what="the counted step persisted")
        assert trainer.status["trainer"]()["intake"]["accepted"] >= 3
        # Every batch the cheater replays after its acceptance is refused as a duplicate.
        bad_batches = bad.status()["batches"]
        assert bad_batches["refused"]["duplicate"] >= 1 and set(bad_batches["refused"]) <= {"duplicate", "stale"}
