"""A node's judged health (node/health.py): status dicts and times in, ok/starting/stalled and a
cause out. Pure tests on status dicts shaped as the services write them, then the judgement of a
real trainer's status in a small in-process swarm whose validator never answers (issue 39: a trainer
sat at step 22 for six minutes with 155 batches waiting for verdicts and its page looked healthy)."""

from __future__ import annotations

import logging
import re

import pytest
from rich.console import Console

from node.app.status_view import render_status
from node.health import FIRST_PROGRESS_S, MAX_SAMPLES, SLOW_GAPS, STALL_S, ProgressWatch, State, health_line, stall_after
from node.status import with_health


def trainer(step: int, gated: int = 0, backlog: int = 0, ready: int = 0, live: int = 1, accepted: int = 10,
            loss: float | None = 0.0123) -> dict:
    """A trainer's status without its own stall judgement (as an older peer sends it)."""
    return {"trainer": {
        "step": step, "publish_error": "", "intake": {"accepted": accepted} if accepted else {},
        "batches": {"gated": gated, "ready": ready, "trained": 3, "rejected": 0, "no_signal": 0},
        "samples_in_hand": [5, 16],
        "gate": {"live_validators": live, "validators": 1, "per_validator": {"12D3KooWval": backlog} if backlog else {}},
        "last_step": {"step": step, "loss": loss} if loss is not None else None,
    }}


def judging_trainer(step: int, since: float, stalled: str = "", stepped: bool = True, per_min: float | None = 1.5,
                    **kw) -> dict:
    """... and with it (node/trainer/progress.py's fields)."""
    status = trainer(step, **kw)
    status["trainer"].update(seconds_since_step=since, steps_per_min=per_min, stalled=stalled,
                             last_step_at=1.7e9 if stepped else None)
    return status


def validator(queue: int, accepted: int, rejected: int = 0, of_run: bool = True, **refused) -> dict:
    return {"validator": {"validator_of_run": of_run, "queue": queue, "queue_max": 64, "checking": "ab12" if queue else None,
                          "verdicts": {"accepted": accepted, "rejected": rejected, **refused}}}


def inference(sent: int, acked: int, refused: dict | None = None, trainers: int = 1, waiting=None) -> dict:
    return {"inference": {"policy_version": 3, "trainers_alive": trainers, "waiting_for_checkpoint": waiting,
                          "batches": {"queued": 0, "sent": sent, "accepted": acked, "refused": refused or {}, "dropped": {}}}}


def watch_over(states: list[tuple[float, dict]]) -> tuple[ProgressWatch, object]:
    watch, health = ProgressWatch(), None
    for now, status in states:
        health = watch.observe(status, now)
    return watch, health


def test_a_trainer_that_says_it_is_stalled_is_shown_stalled_with_its_own_cause_and_figures():
    """Issue 39's stall: step 22, then six minutes without one while 155 batches wait for a verdict.
    The trainer judges its own stalls (node/trainer/progress.py); health shows its cause and figures
    whatever this node's watch saw (one judgement, not two)."""
    cause = "waiting for verdicts: 155 batches with validators (0 of 16 samples ready)"
    status = judging_trainer(22, 360.0, cause, per_min=0.15, gated=155, backlog=40)
    _, h = watch_over([(0.0, status)])
    assert h.state is State.STALLED and h.cause == "no step for 6.0 min; " + cause
    assert h.figures["step"] == "22" and h.figures["since the last step"] == "6.0 min"
    assert h.figures["steps per minute"] == "0.15" and h.figures["loss"] == "0.0123"
    assert h.figures["batches waiting for a verdict"] == "155" and h.figures["at validators now"] == "40"
    assert h.progress["since_step_s"] == 360.0 and h.progress["validator_backlog"] == 40
    _, h = watch_over([(0.0, judging_trainer(22, 10.0)), (FIRST_PROGRESS_S * 2, judging_trainer(22, 10.0))])
    assert h.state is State.OK and h.cause == "training: step 22, the last 10 s ago"  # its word, not our watch's


def test_a_trainer_before_its_first_step_is_starting_and_says_what_it_waits_for():
    _, h = watch_over([(0.0, judging_trainer(0, 40.0, stepped=False, per_min=None, accepted=0))])
    assert h.state is State.STARTING and h.cause == "no rollouts received yet: is an inference node running and connected?"
    assert h.figures["since the last step"] == "none yet (40 s watched)" and h.figures["steps per minute"] == "- (watching)"
    _, h = watch_over([(0.0, judging_trainer(22, 40.0, stepped=False, per_min=None, gated=3))])
    assert h.state is State.STARTING and h.cause == "no step yet: 3 batches wait for a verdict, 5 of 16 samples a step needs in hand"
    h = watch_over([(0.0, judging_trainer(22, 95.0, "no batches: none queued", stepped=False))])[1]
    assert h.state is State.STALLED and h.cause == "no step in the 95 s since the trainer started; no batches: none queued"


def test_an_older_trainer_status_is_judged_from_its_watched_step():
    """Without the trainer's own fields: stalled STALL_S after the step last moved, starting before
    it moved for FIRST_PROGRESS_S."""
    moving = [(0.0, trainer(21)), (10.0, trainer(22, gated=155, backlog=40))]
    assert watch_over(moving)[1].state is State.OK
    assert watch_over([*moving, (10.0 + STALL_S, trainer(22, gated=155))])[1].state is State.OK  # exactly STALL_S
    h = watch_over([*moving, (10.0 + STALL_S + 1, trainer(22, gated=155))])[1]
    assert h.state is State.STALLED and h.cause == "no step for 91 s (155 batches wait for a verdict, 0 verified)"
    idle = trainer(22, accepted=0)
    assert watch_over([(0.0, idle), (FIRST_PROGRESS_S, idle)])[1].state is State.STARTING
    h = watch_over([(0.0, idle), (FIRST_PROGRESS_S + 1, idle)])[1]
    assert h.state is State.STALLED and h.cause == "no step in the 5.0 min since the trainer started (0 batches wait for a verdict, 0 verified)"


def test_steps_per_minute_come_from_the_watched_history():
    states = [(10.0 * i, trainer(i // 3)) for i in range(31)]  # a step every 30 s for 300 s
    watch, h = watch_over(states[:3])
    assert h.progress["steps_per_min"] is None and h.figures["steps per minute"] == "- (watching)"  # 20 s watched
    watch, h = watch_over(states)
    assert h.progress["steps_per_min"] == 2.0 and h.figures["steps per minute"] == "2"
    assert len(watch.samples) <= MAX_SAMPLES + 1


def test_the_history_stays_bounded_however_often_status_is_read():
    watch = ProgressWatch()
    for i in range(10_000):
        watch.observe(trainer(i // 100), i * 0.25)
    assert len(watch.samples) <= MAX_SAMPLES + 1
    assert watch.figures(2499.75)["step_per_min"] == pytest.approx(2.4, abs=0.05)  # a step per 100 reads of 0.25 s


def test_a_validator_with_a_backlog_and_no_verdict_is_stalled_an_idle_one_is_ok():
    _, h = watch_over([(0.0, validator(3, 10)), (20.0, validator(3, 12))])
    assert h.state is State.OK and h.figures["backlog"] == "3 of 64 batches"
    assert h.cause == "checking: a batch, 3 more queued"  # no rate before MIN_RATE_SPAN_S watched
    _, h = watch_over([(0.0, validator(3, 10)), (60.0, validator(3, 12))])
    assert h.cause == "checking: a batch, 3 more queued, 2 verdicts a minute"
    _, h = watch_over([(0.0, validator(3, 10)), (30.0, validator(3, 12)), (31.0 + STALL_S, validator(3, 12))])
    assert h.state is State.STALLED and h.cause == "no verdict for 91 s with 3 batches queued (checking ab12)"
    _, h = watch_over([(0.0, validator(0, 10)), (500.0, validator(0, 10, **{"unjudged:no-checkpoint": 4}))])
    assert h.state is State.OK and h.cause == "idle: no batch waiting for a verdict (refused: unjudged:no-checkpoint ×4)"
    _, h = watch_over([(0.0, validator(0, 0))])
    assert h.state is State.STARTING
    _, h = watch_over([(0.0, validator(0, 0, of_run=False))])
    assert h.state is State.STALLED and "not in the run file's validators" in h.cause


def test_a_worker_whose_batches_are_refused_is_stalled_with_the_reasons():
    """The worker of issue 39 saw its batches answered step_ahead; its health says so."""
    states = [(0.0, inference(5, 5)), (10.0, inference(6, 6)),
              (50.0, inference(40, 6, {"step-ahead": 34})), (10.0 + STALL_S + 1, inference(60, 6, {"step-ahead": 54}))]
    _, h = watch_over(states[:2])
    assert h.state is State.OK and h.figures["acked"] == "6"
    _, h = watch_over(states)
    assert h.state is State.STALLED
    assert h.cause == "no batch acked for 91 s; the trainer refuses its batches: step-ahead ×54"
    assert h.figures["refused"] == "step-ahead ×54" and h.figures["batches sent"] == "60"
    _, h = watch_over([(0.0, inference(0, 0, trainers=0)), (FIRST_PROGRESS_S + 1, inference(0, 0, trainers=0))])
    assert h.state is State.STALLED and h.cause == "no batch acked yet; no trainer alive in the member table"


def test_a_relay_is_ok_once_it_sees_a_member_and_a_stopped_node_says_so():
    members = {"role": "relay", "membership": {"connections": 2, "members": [{"peer_id": "a", "state": "alive"}]}}
    assert watch_over([(0.0, members)])[1].state is State.OK
    assert watch_over([(0.0, {"role": "relay", "membership": {"members": []}})])[1].state is State.STARTING
    assert watch_over([(0.0, {**members, "stopped": True})])[1].state is State.STOPPED


def test_a_snapshot_carries_its_health_first_and_a_stall_is_logged_once(caplog):
    """A validator's stall is logged once by status; a trainer's is logged by the trainer itself."""
    watch = ProgressWatch()
    head = {"peer_id": "p", "role": "validator", "run": "r", "streams": {}}
    with caplog.at_level(logging.INFO, logger="node.status"):
        out = with_health(watch, {**head, **validator(3, 10)}, 0.0)
        assert list(out)[:4] == ["peer_id", "role", "run", "health"] and out["health"]["state"] == "starting"
        for now in (10.0, 50.0, 102.0, 200.0):
            out = with_health(watch, {**head, **validator(3, 11)}, now)
    assert out["health"]["state"] == "stalled"
    stalls = [r for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stalls) == 1 and stalls[0].levelno == logging.WARNING
    assert stalls[0].getMessage() == "health: stalled: no verdict for 92 s with 3 batches queued (checking ab12)"
    caplog.clear()
    watch, head = ProgressWatch(), {**head, "role": "trainer"}
    cause = "waiting for verdicts: 2 batches with validators (0 of 16 samples ready)"
    with caplog.at_level(logging.INFO, logger="node.status"):
        with_health(watch, {**head, **judging_trainer(3, 10.0)}, 0.0)
        out = with_health(watch, {**head, **judging_trainer(3, 100.0, cause)}, 100.0)
    assert out["health"]["cause"] == "no step for 100 s; " + cause and not caplog.records


def test_swarm_node_status_prints_the_health_line_under_the_node_line():
    snap = with_health(ProgressWatch(), {"peer_id": "p", "role": "validator", "run": "r", **validator(0, 3)}, 0.0)
    console = Console(record=True, width=300)
    render_status(snap, console)
    lines = console.export_text().splitlines()
    assert lines[2:4] == health_line(snap).splitlines()
    assert lines[2] == "health: ok: idle: no batch waiting for a verdict"
    assert lines[3].startswith("  backlog 0 of 64 batches, verdicts 3, verdicts per minute - (watching),")
    assert not any(line.strip() == "health" for line in lines)  # not printed again as a section


async def test_a_real_trainer_whose_validator_never_answers_is_judged_stalled_waiting_for_verdicts(tmp_path):
    """A trainer in a real node, a validator that takes its batch and never sends a verdict, and a
    worker: the trainer's own status, judged at the times given, is starting, then stalled with the
    batch waiting for a verdict at that validator (the figures come from the trainer's real fields)."""
    from swarmtest import node_config, open_nodes
    from test_trainer_loop import honest, make_run, submit
    from waiting import wait_for

    from node.identity import load_or_create_identity
    from node.rollouts.schema import VERIFY_PROTOCOL, RolloutAck, open_batch
    from node.status import snapshot
    from node.wire import read_frame, write_frame

    val_id, _ = load_or_create_identity(tmp_path / "validator")
    run = make_run(tmp_path, validators=[val_id.peer_id])
    run.tables["trainer"]["verify_timeout_s"] = 3600.0  # the silent validator keeps the batch
    cfgs = [node_config(tmp_path, "trainer", "trainer", run=run), node_config(tmp_path, "validator", "relay", run=run),
            node_config(tmp_path, "client", "relay", run=run)]
    async with open_nodes(cfgs) as (tnode, vnode, client):
        trainer, taken = tnode.trainer, []

        async def silent_validator(stream):
            signed = open_batch(await read_frame(stream, 8 * 1024 * 1024), "test")
            await write_frame(stream, RolloutAck(batch_id=signed.batch_id, accepted=True))
            taken.append(signed.batch_id)
            await stream.close()

        vnode.host.set_handler(VERIFY_PROTOCOL, silent_validator)
        await wait_for(lambda: vnode.peer_id in trainer.live_validators(), what="validator alive")
        assert (await submit(client, tnode.peer_id, honest(client, trainer, step=0, seed=1))).accepted
        await wait_for(lambda: taken, what="the batch handed to the validator")
        watch = ProgressWatch()
        first = with_health(watch, snapshot(tnode.context), 0.0)["health"]
        clock = trainer.clock
        trainer.clock = lambda: clock() + STALL_S + 1  # the trainer judges its stalls on its own clock
        try:
            later = with_health(watch, snapshot(tnode.context), STALL_S + 1)["health"]
        finally:
            trainer.clock = clock
    assert first["state"] == "starting" and first["figures"]["batches waiting for a verdict"] == "1"
    assert first["cause"] == "no step yet: 1 batch wait for a verdict, 0 of 16 samples a step needs in hand"
    assert later["state"] == "stalled" and later["figures"]["at validators now"] == "1"
    assert re.fullmatch(r"no step in the [\d.]+ (s|min) since the trainer started; waiting for verdicts: 1 batches with "
                        r"validators \(0 of 16 samples ready\)", later["cause"]), later["cause"]


def test_a_slow_worker_is_stalled_only_after_several_of_its_usual_gaps():
    """A worker that sends a batch every 100 s (a large model on a busy CPU) is not stalled 101 s
    after its last ack, as a trainer would be; it is after SLOW_GAPS of its gaps without one."""
    states = [(100.0 * i, inference(i, i)) for i in range(5)]  # an ack every 100 s, the last at 400
    gap = 100.0
    assert watch_over(states)[0].figures(400.0)["acked_gap_s"] == gap
    assert stall_after(gap) == SLOW_GAPS * gap > STALL_S
    _, h = watch_over([*states, (400.0 + STALL_S + 11, inference(4, 4))])
    assert h.state is State.OK
    _, h = watch_over([*states, (400.0 + SLOW_GAPS * gap + 1, inference(4, 4))])
    assert h.state is State.STALLED and h.cause.startswith("no batch acked for")
