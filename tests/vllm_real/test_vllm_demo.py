"""``swarm-node demo --engine vllm`` on loopback: relay, trainer, torch validator, a torch inference
node and a vLLM one (its CPU build), each a real process. The vLLM node's batches are verified by
the torch validator and trained, none is rejected, and the reward rises.

In the vLLM venv only (``make vllm-test``), after tests/vllm_real/test_vllm_cpu_engine.py has
closed its engine (one vLLM at a time on two cores). About 6 minutes: the vLLM node needs 2-3 of
them to start its engine beside four busy nodes, then generates for the rest.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from node.refusals import Refusal
from node.validator.policy import BENIGN

pytest.importorskip("vllm", reason="vLLM is not installed here: `make vllm-test` runs these in .vllm-venv")

DURATION_S = 330


def workers_fault(reason: str) -> bool:
    """Whether a trainer's rejection reason (its spool's ``rejected_by_reason`` key) is one the worker
    answers for: a verdict's by the validator's BENIGN set, an intake refusal's by node/refusals.py."""
    if reason.startswith("verdict:"):
        return reason.removeprefix("verdict:") not in BENIGN
    try:
        return Refusal(reason).fault
    except ValueError:  # a reason outside the table counts as the sender's fault (refusals.py)
        return True


def read_status(root, node: str) -> dict:
    return json.loads((root / node / "status.json").read_text())


def test_the_vllm_nodes_batches_are_verified_and_trained_and_the_reward_rises(tmp_path):
    root = tmp_path / "demo"
    demo = subprocess.Popen([sys.executable, "-m", "node", "demo", "--engine", "vllm", "--duration", str(DURATION_S),
                             "--data-root", str(root), "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = demo.communicate(timeout=DURATION_S + 400)
    finally:
        if demo.poll() is None:  # the demo stops its nodes on SIGINT (each leaves with a goodbye)
            demo.send_signal(signal.SIGINT)
            try:
                demo.wait(timeout=120)
            except subprocess.TimeoutExpired:
                demo.kill()
                demo.wait()
    assert demo.returncode == 0, out[-3000:]
    vllm_node = read_status(root, "inference-2")["inference"]
    torch_node = read_status(root, "inference-1")["inference"]
    assert vllm_node["engine"] == "vllm" and torch_node["engine"] == "torch"
    assert vllm_node["errors"] == {"step": 0, "load": 0} and vllm_node["weight_swaps"] >= 5
    # Its own refusals likewise: a batch that went stale while the machine was starved (make vllm-test
    # at load 17 refused one of 30) is lost work, not a cheat; a refusal the worker answers for fails.
    refused = vllm_node["batches"]["refused"]
    assert vllm_node["batches"]["accepted"] >= 20, vllm_node["batches"]
    assert not {r: n for r, n in refused.items() if workers_fault(r)}, vllm_node["batches"]
    trainer_status = read_status(root, "trainer")["trainer"]
    trainer = trainer_status["batches"]
    # A batch may go stale at intake or while it waits for its verdict on a fast machine (a step every
    # 2 s): lost, not refused as a cheat. Any rejection the worker answers for fails the test, with its reason.
    reasons = trainer_status["rejected_by_reason"]
    assert not {r: n for r, n in reasons.items() if workers_fault(r)}, (reasons, trainer)
    assert trainer["trained"] >= vllm_node["batches"]["accepted"], trainer
    curve = json.loads((root / "reward.json").read_text())  # [step, mean reward] per training step
    first, last = [sum(r for _, r in part) / len(part) for part in (curve[:10], curve[-10:])]
    assert len(curve) >= 30 and last > first, (first, last)
