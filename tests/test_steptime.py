"""node/steptime.py: each role's phase timings and the swarm-wide "where a step's time goes" table."""

from __future__ import annotations

import pytest

from node.steptime import (
    PhaseTimes,
    Row,
    batches_per_step,
    format_step_time,
    step_time_figures,
    step_time_rows,
    trainer_step_wall_s,
)


def times(**phases: list[float]) -> dict:
    """A role's ``phases_s`` as a PhaseTimes that saw these seconds."""
    p = PhaseTimes()
    for phase, seconds in phases.items():
        for s in seconds:
            p.add(phase, s)
    return p.status()


def test_phase_times_keep_means_and_counts_and_tell_the_observer():
    seen = []
    p = PhaseTimes(on_add=lambda phase, s: seen.append((phase, s)))
    p.add("generate", 2.0)
    p.add("generate", 4.0)
    p.add("proofs", 0.5)
    p.add("score", -0.001)  # a remainder computed from two clocks may dip below zero: it counts as none
    assert p.status() == {"generate": {"mean_s": 3.0, "n": 2, "total_s": 6.0},
                          "proofs": {"mean_s": 0.5, "n": 1, "total_s": 0.5},
                          "score": {"mean_s": 0.0, "n": 1, "total_s": 0.0}}
    assert seen == [("generate", 2.0), ("generate", 4.0), ("proofs", 0.5), ("score", 0.0)]


def test_an_unknown_phase_is_our_bug():
    with pytest.raises(ValueError, match="unknown phase 'decode'"):
        PhaseTimes().add("decode", 1.0)


def swarm() -> dict[str, tuple[str, dict]]:
    trainer = {"trainer": {"phases_s": times(train=[3.0, 5.0], save=[1.0, 1.0], publish=[0.5, 0.5]),
                           "step_batches": 6, "steps_per_min": 6.0}}
    return {
        "relay": ("relay", {"shards": {"phases_s": times(transfer=[1.0])}}),
        "trainer": ("trainer", trainer),
        "validator": ("validator", {"validator": {"phases_s": times(verify=[1.0, 1.0, 1.0], rescore=[0.1, 0.1, 0.1],
                                                                    load=[0.4])},
                                    "shards": {"phases_s": times(transfer=[2.0])}}),
        "inference-1": ("inference", {"inference": {"phases_s": times(generate=[10.0], score=[0.2], proofs=[1.0],
                                                                      load=[0.6, 0.2])},
                                      "shards": {"phases_s": times(transfer=[3.0, 3.0])}}),
        "inference-2": ("inference", {"inference": {"phases_s": times(generate=[4.0, 4.0, 4.0], score=[0.2, 0.2, 0.2],
                                                                      proofs=[1.0, 1.0, 1.0])}}),
    }


def test_rows_average_over_the_nodes_of_a_role_and_scale_batches_to_a_trainer_step():
    statuses = swarm()
    assert batches_per_step(statuses) == 3.0  # 6 batches over the trainer's 2 steps
    rows = {(r.phase, r.role): r for r in step_time_rows(statuses)}
    gen = rows[("generate", "inference")]
    # Weighted by batches, not by node: (10 + 3 * 4) / 4 batches, on two nodes; three batches a step.
    assert (gen.mean_s, gen.n, gen.nodes, gen.unit) == (5.5, 4, 2, "batch") and gen.per_step_s == 16.5
    transfer = rows[("transfer", "shards")]
    assert (transfer.mean_s, transfer.n, transfer.nodes) == (2.25, 4, 3) and transfer.per_step_s == 2.25
    assert rows[("load", "inference")].per_step_s == pytest.approx(0.4)  # a version a step
    assert rows[("load", "validator")].mean_s == pytest.approx(0.4)
    assert rows[("verify", "validator")].per_step_s == pytest.approx(3.0)
    assert rows[("train", "trainer")] == Row("train", "trainer", "step", 4.0, 2, 1, 4.0)
    # In the order work flows through a step; phases nobody timed (assemble) are left out.
    assert [r.phase for r in step_time_rows(statuses)] == [
        "generate", "score", "proofs", "transfer", "load", "load", "verify", "rescore", "train", "save", "publish"]
    assert trainer_step_wall_s(statuses) == 10.0


def test_before_a_trainer_step_rows_have_means_but_no_share_of_a_step():
    statuses = {"inference-1": ("inference", {"inference": {"phases_s": times(generate=[2.0])}}),
                "trainer": ("trainer", {"trainer": {"phases_s": {}, "step_batches": 0}})}
    assert batches_per_step(statuses) is None and trainer_step_wall_s(statuses) is None
    [row] = step_time_rows(statuses)
    assert row.mean_s == 2.0 and row.per_step_s is None
    figures = step_time_figures(statuses)
    assert figures["per_step_s"] is None and figures["rows"][0]["mean_s"] == 2.0
    text = format_step_time(figures).splitlines()
    assert text[1].split() == ["generate", "inference", "2.000", "batch", "1", "-", "-"]
    assert text[-1] == "no trainer step yet: the means above, no share of a step"
    transfer_only = {"relay": ("relay", {"shards": {"phases_s": times(transfer=[1.0])}})}
    assert [r.per_step_s for r in step_time_rows(transfer_only)] == [None]  # not a share of a step that never was
    assert step_time_rows({"relay": ("relay", {})}) == []
    assert format_step_time(step_time_figures({"relay": ("relay", {})})) == "(no phase timed yet)"


def test_the_table_gives_each_phase_its_share_of_a_step():
    statuses = swarm()
    figures = step_time_figures(statuses)
    total = sum(r.per_step_s for r in step_time_rows(statuses))
    assert figures["per_step_s"] == total and figures["batches_per_step"] == 3.0 and figures["step_wall_s"] == 10.0
    text = format_step_time(figures).splitlines()
    assert text[0].split() == ["phase", "role", "mean", "s", "per", "n", "s", "/", "step", "share"]
    generate = next(line for line in text if line.startswith("generate"))
    assert generate.split() == ["generate", "inference", "5.500", "batch", "4", "16.50", f"{100 * 16.5 / total:.0f}", "%"]
    assert next(line for line in text if line.startswith("transfer")).split()[1] == "(each)"
    assert text[-2:] == [f"per trainer step: {total:.2f} s of work over all roles, 3.00 batches a step",
                         "a step every 10.0 s of wall time; transfer and load: on each node that follows"]
