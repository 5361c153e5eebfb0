"""Real processes: trainer + 2 validators + an honest and a cheating inference node; kill -9 a validator.

Once per cheating mode of the inference role (fake rewards, perturbed model, cherry-picked tasks,
early exit).

The survivor takes over the dead validator's share (the trainer re-assigns after ``verify_timeout_s``
by rendezvous ranking), the cheat's batches are rejected with a reason and it is penalised in the
ledger, and every batch the trainer acknowledged ends in exactly one state: none lost, none trained
twice. Slow: six Python processes that each import torch.
"""

from __future__ import annotations

import signal
import time

import pytest

from node.ledger.store import open_ledger_store
from node.app.localswarm import LocalSwarm
from node.app.commands.penalties import collect

pytestmark = pytest.mark.slow

RUN = """
[run]
name = "mp-validator"
trainers = ["{trainer}"]
validators = ["{v1}", "{v2}"]

[rl]
group_size = 4
prompts_per_batch = 2
max_new_tokens = 8

[grpo]
min_batch_samples = 8

[trainer]
verify_timeout_s = 15.0
init_warmup_steps = 0

[shards]
announce_interval = 1.0
progress = false

[validator]
ban_threshold = 1000
"""
CHEAT = '\n[worker]\ncheat = "{cheat}"\n'
PROOF_REASONS = {"proof_exponent", "proof_mantissa_mean", "proof_mantissa_median"}
# The inference role's cheating modes (node/rollouts/config.py CHEATS) and the reasons they must get.
CHEATS = {
    "fake-rewards": {"reward_mismatch"},
    "perturbed-model": PROOF_REASONS | {"logprob_mismatch", "sampling_mismatch"},
    "cherry-pick": {"wrong_task"},
    "drop-groups": {"bad_groups"},
    # The replay refuses the pasted program before it is scored (issue 42: scoring comes last).
    "early-exit": {"reward_mismatch", "sampling_mismatch"},
    "free-sandbox": PROOF_REASONS | {"proof_count"},
    # Right answers written in and re-proved: only the sampling replay can tell (issue 42 hole 1).
    "pasted-answers": {"sampling_mismatch"},
    # Junk under a fresh key per batch: refused on its proofs, each key penalised, not the node's own.
    "sybil-flood": PROOF_REASONS | {"proof_count"},
}
FRESH_KEYS = {"sybil-flood"}  # cheats whose batches are signed by keys other than the node's


def section(swarm: LocalSwarm, name: str, key: str) -> dict:
    return swarm.status(name).get(key) or {}


def judged(swarm: LocalSwarm, name: str) -> int:
    v = section(swarm, name, "validator").get("verdicts", {})
    return v.get("accepted", 0) + v.get("rejected", 0)


@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_validator_killed_mid_run_the_other_takes_over(tmp_path, cheat):
    with LocalSwarm(tmp_path, log_level="warning") as swarm:
        ids = {n: swarm.peer_id(n) for n in ("trainer", "v1", "v2")}
        honest_run = swarm.write_run_file(RUN.format(**ids))
        cheat_run = tmp_path / "cheat.toml"
        cheat_run.write_text(RUN.format(**ids) + CHEAT.format(cheat=cheat))

        swarm.start("trainer", "trainer", wait=120)
        swarm.wait_until(lambda: section(swarm, "trainer", "trainer").get("published") == 0, timeout=180)
        swarm.start("v1", "validator", wait=120)
        swarm.start("v2", "validator", wait=120)
        swarm.start("honest", "inference", wait=120)
        swarm.run_file = cheat_run
        swarm.start("cheat", "inference", wait=120)
        swarm.run_file = honest_run

        # Both validators get a share (rendezvous hashing over the live ones).
        swarm.wait_until(lambda: judged(swarm, "v1") >= 1 and judged(swarm, "v2") >= 1, timeout=300)
        # Kill it while it holds batches (validators judge in well under a second now, so a kill at
        # a random moment mostly finds it idle and the takeover of its share goes untested).
        swarm.wait_until(lambda: section(swarm, "trainer", "trainer").get("gate", {}).get("per_validator", {})
                         .get(ids["v1"], 0) >= 2, timeout=300)
        swarm.kill("v1", signal.SIGKILL)
        killed_at, killed_wall = time.monotonic(), time.time()
        # What the dead one still holds, from a trainer status written after the kill (and after any
        # verdict it sent just before dying has landed): a status from before the kill may list batches
        # it judged in its last second. Those it holds now can only come back by the trainer's timeout.
        swarm.wait_until(lambda: swarm.status("trainer").get("time", 0) > killed_wall + 2, timeout=60)
        gate = section(swarm, "trainer", "trainer").get("gate", {})
        held_by_dead = gate.get("per_validator", {}).get(ids["v1"], 0) + gate.get("timeouts", 0)
        before = judged(swarm, "v2")
        # The survivor keeps judging: new batches, and those the dead one held once the trainer times out.
        swarm.wait_until(lambda: judged(swarm, "v2") >= before + 4, timeout=300)

        # Stop generating, then every acknowledged batch must be decided: none lost between validators.
        swarm.kill("honest", signal.SIGTERM)
        swarm.kill("cheat", signal.SIGTERM)
        swarm.wait_until(lambda: section(swarm, "trainer", "trainer")["batches"]["gated"] == 0, timeout=240)
        trainer = section(swarm, "trainer", "trainer")
        gate = trainer["gate"]
        print(f"batches at v1 when killed: {held_by_dead}; trainer timeouts {gate['timeouts']}, "
              f"reassignments {gate['reassignments']}; decided in {time.monotonic() - killed_at:.0f}s")
        if held_by_dead:
            assert gate["timeouts"] + gate["reassignments"] >= 1, gate
        b = trainer["batches"]
        # Each acknowledged batch is in exactly one state (gated/ready/trained/rejected): none twice.
        # Refusals at intake that are the worker's fault (e.g. "stale") are spooled as rejected too,
        # so only rejections after intake (expired while queued, or a failed verdict) count here.
        after_intake = sum(n for r, n in trainer["rejected_by_reason"].items() if r == "expired" or r.startswith("verdict:"))
        assert b["gated"] + b["ready"] + b["trained"] + after_intake == trainer["intake"]["accepted"], trainer
        assert trainer["gate"]["verdicts"].get("failed", 0) >= 1, trainer["gate"]
        assert trainer["gate"]["verdicts"].get("passed", 0) >= 1, trainer["gate"]

        # The cheat's batches fail on its kind of cheating, whichever validator judged them: once one
        # fails, its fresh key leaves the new-identity pool (issue 42) and the trainer takes no more
        # of its batches, so the survivor may never see one.
        failed_on = {r.split(":", 1)[1] for r in trainer["rejected_by_reason"] if r.startswith("verdict:")}
        assert failed_on & CHEATS[cheat], trainer["rejected_by_reason"]
        with open_ledger_store(tmp_path / "v2", read_only=True) as store:
            report = collect(store, time.time())
        cheat_id = swarm.peer_id("cheat")
        honest_id = swarm.peer_id("honest")
        penalised = {p["peer"] for p in report["penalties"] if p["reason"] in CHEATS[cheat]}
        if cheat in FRESH_KEYS:  # the flood's keys pay, and each failed one leaves the fresh-identity pool
            assert penalised - {cheat_id, honest_id}, report
            assert trainer["quota"]["barred"] >= 1, trainer["quota"]
        else:
            assert cheat_id in penalised, report
        assert not any(p["peer"] == honest_id for p in report["penalties"]), report
