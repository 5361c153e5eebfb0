"""The loop as real processes: relay + trainer + 2 inference nodes on loopback (issue 7's end-to-end).

Versions advance on every node, and once the trainer stops, every replica of the ledger shows the
same rollout counts per worker as the trainer's own database.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from node.app.localswarm import LocalSwarm

RUN = """\
[run]
name = "loop-test"
trainers = ["{trainer}"]

[rl]
group_size = 4
prompts_per_batch = 2
max_new_tokens = 8

[grpo]
min_batch_samples = 8

[ledger]
sync_interval = 1.0

[membership]
probe_period = 0.5
"""
STEPS = 3
BOUND = 240.0  # correctness bound for a loaded 2-core machine, not a speed figure
COUNTED = ("rollouts_accepted", "rollouts_rejected", "tokens", "checkpoints")


def ledger_totals(data_dir) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "node", "ledger", "--json", "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    totals = json.loads(proc.stdout)["totals"]
    return {peer: {k: t[k] for k in COUNTED} for peer, t in totals.items() if any(t[k] for k in COUNTED)}


@pytest.mark.slow
def test_relay_trainer_two_inference_versions_advance_and_ledgers_agree(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        swarm.write_run_file(RUN.format(trainer=swarm.peer_id("trainer")))
        swarm.start("relay", "relay")
        swarm.start("trainer", "trainer")
        swarm.start("inf-1", "inference")
        swarm.start("inf-2", "inference")

        def step() -> int:
            return (swarm.status("trainer").get("trainer") or {}).get("step", 0)

        swarm.wait_until(lambda: step() >= STEPS, BOUND, poll=1.0)
        for name in ("inf-1", "inf-2"):  # every worker follows the versions
            swarm.wait_until(
                lambda n=name: ((swarm.status(n).get("inference") or {}).get("policy_version") or 0) >= STEPS - 1,
                BOUND, poll=1.0,
            )
        swarm.wait_until(lambda: max((swarm.status("relay").get("shards") or {}).get("held") or [0]) >= STEPS - 1, BOUND)

        # Stop the workers: no more rollouts, so the trainer soon stops appending entries.
        for name in ("inf-1", "inf-2"):
            swarm.kill(name, signal.SIGTERM)

        def digest(name: str):
            return (swarm.status(name).get("ledger") or {}).get("digest")

        def settled() -> bool:  # trainer and relay agree, twice in a row a few seconds apart
            first = digest("trainer")
            if first is None or first != digest("relay"):
                return False
            time.sleep(3)
            return digest("trainer") == digest("relay") == first

        swarm.wait_until(settled, BOUND, poll=1.0)
        swarm.kill("trainer", signal.SIGTERM)
        reference = ledger_totals(swarm.procs["trainer"].data_dir)
        assert sum(t["rollouts_accepted"] for t in reference.values()) > 0
        # The workers come back without a trainer and catch up from the relay by anti-entropy.
        for name in ("inf-1", "inf-2"):
            swarm.restart(name)
        others = ("relay", "inf-1", "inf-2")
        swarm.wait_until(lambda: len({digest(n) for n in others}) == 1, BOUND, poll=1.0)
        for name in others:
            swarm.kill(name, signal.SIGTERM)
        for name in others:
            assert ledger_totals(swarm.procs[name].data_dir) == reference, name
