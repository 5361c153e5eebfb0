"""The validators the trainer hands batches to: a restarted validator gets batches at once, and each
change of the set is logged with its reason (issue 45: a restarted validator ready after 7.4 s got
no batch for ~33 s, and no log line said why)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from node.config import RunConfig
from node.rl.config import GRPOConfig
from node.trainer.config import TrainerConfig, TrainerSections
from node.trainer.roster import Roster
from node.trainer.service import Trainer
from node.trainer.spool import open_spool
from node.trainer.testing import FakeMembership, fake_context, fake_wiring

V1, V2 = "12D3KooWvalidatorOne11", "12D3KooWvalidatorTwo22"


@pytest.fixture
def trainer(tmp_path):
    """A trainer whose gate gives each of two validators two batches at a time; ``connected`` is the
    set of validators its host holds a connection to."""
    connected = {V1, V2}
    node = fake_context(RunConfig(name="test", validators=[V1, V2]), is_connected=lambda p: p in connected)
    policy = SimpleNamespace(step=5, vocab_size=100, device="cpu")
    tcfg = TrainerConfig(max_verify_per_validator=2, verify_timeout_s=30.0)
    wiring = {**fake_wiring(), "membership": FakeMembership({V1: "validator", V2: "validator"})}
    with open_spool(tmp_path / "spool.sqlite") as spool:
        t = Trainer(node, policy, spool, TrainerSections(grpo=GRPOConfig(), trainer=tcfg), clock=lambda: 0.0, **wiring)
        t.connected = connected
        yield t


def test_a_validator_killed_and_restarted_gets_batches_at_once_not_after_the_verify_timeout(trainer):
    for i in range(8):
        trainer.gate.add(bytes([i]) * 32, 5, 100)
    for batch_id, _ in trainer.gate_pass(0.0):
        trainer.gate.sent(batch_id, 0.0)
    held_by_v2 = {b for b, g in trainer.gate.batches.items() if g.validator == V2}
    assert len(held_by_v2) == 2 and trainer.gate_pass(1.0) == []  # both shares full
    # V2 is killed with -9: its connection closes and its queue is gone with the process.
    trainer.connected.discard(V2)
    handed = trainer.gate_pass(2.0)
    assert {b for b, _ in handed} == held_by_v2  # V2's batches are handed on (V2's share is free)
    # Back (a new process, the same peer id): the batch it had is its again, at once.
    trainer.connected.add(V2)
    for batch_id, v in handed:
        trainer.gate.send_failed(batch_id)  # the dials to the dead process failed
    again = trainer.gate_pass(10.0)
    assert any(v == V2 for _, v in again), again


def test_changes_of_the_set_are_logged_with_their_reason(trainer, caplog):
    caplog.set_level(logging.INFO, logger="node.trainer")
    trainer.gate_pass(0.0)
    del trainer.membership.alive[V2]
    trainer.gate_pass(1.0)
    trainer.membership.alive[V2] = "validator"
    trainer.gate_pass(2.0)
    lines = [r.getMessage() for r in caplog.records if "validator" in r.getMessage()]
    assert f"trainer: validator {V1[-8:]} added (record seen)" in lines
    assert f"trainer: validator {V2[-8:]} removed (no record)" in lines  # the fake keeps no member table
    assert lines.count(f"trainer: validator {V2[-8:]} added (record seen)") == 2


def test_a_removal_names_the_member_state():
    r = Roster()
    states = {"a": "alive", "b": "alive", "c": "alive", "d": "alive"}
    r.update(["a", "b", "c", "d"], states.get)
    states.update(a="suspect", b="dead", c="left")
    del states["d"]
    assert r.update([], states.get) == ["validator a removed (suspected)", "validator b removed (dead)",
                                        "validator c removed (left)", "validator d removed (no record)"]
    assert r.update([], states.get) == [] and r.changes == 8
