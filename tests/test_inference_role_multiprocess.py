"""Real processes: a trainer and an inference node close the loop; the inference node is killed with
SIGKILL mid-run and restarted with the same data dir, and carries on without reusing a draw step."""

from __future__ import annotations

import signal

import pytest

from node.app.localswarm import LocalSwarm

pytestmark = pytest.mark.slow

RUN = """
[run]
name = "mp"
trainers = ["{trainer}"]

[membership]
probe_period = 0.5
probe_timeout = 0.4
indirect_timeout = 0.8
suspicion_mult = 3.0
min_sync = 5.0

[shards]
announce_interval = 1.0

[rl]
group_size = 4
prompts_per_batch = 2
max_new_tokens = 8

[grpo]
min_batch_samples = 8
optimizer_steps = 1

[trainer]
init_warmup_steps = 0
device = "cpu"

[inference]
engine = "torch"
device = "cpu"

[worker]
backoff_s = 0.2
backoff_max_s = 2.0
"""


def inference(swarm: LocalSwarm) -> dict:
    return swarm.status("worker").get("inference") or {}


def wait(swarm: LocalSwarm, predicate, timeout: float) -> None:
    try:
        swarm.wait_until(predicate, timeout=timeout)
    except TimeoutError:
        raise AssertionError(f"worker: {inference(swarm)}\ntrainer: {swarm.status('trainer').get('trainer')}\n"
                             f"{swarm.tail('worker')}\n{swarm.tail('trainer')}") from None


def test_trainer_and_inference_processes_survive_a_killed_worker(tmp_path):
    with LocalSwarm(tmp_path / "swarm", log_level="warning") as swarm:
        swarm.write_run_file(RUN.format(trainer=swarm.peer_id("trainer")))
        swarm.start("trainer", "trainer", wait=90)
        swarm.start("worker", "inference", wait=90)
        # A slow start may load v1 first (v0 skipped): then the swap is to v2, which follows.
        wait(swarm, lambda: inference(swarm).get("weight_swaps", 0) >= 1
             and inference(swarm)["batches"]["accepted"] >= 3, timeout=240)
        before = inference(swarm)
        assert before["policy_version"] >= 1 and before["tokens_per_s"] > 0

        swarm.kill("worker", signal.SIGKILL)
        swarm.restart("worker", wait=90)
        wait(swarm, lambda: inference(swarm).get("steps", 0) >= 2
             and inference(swarm)["batches"]["accepted"] >= 2, timeout=240)
        after = inference(swarm)
        assert after["next_step"] > before["next_step"]  # the step counter survived the kill
        assert "duplicate-step" not in after["batches"]["refused"], swarm.tail("trainer")
        trainer = swarm.status("trainer").get("trainer", {})
        assert trainer.get("intake", {}).get("accepted", 0) >= 5
