"""The loop's figures (node/app/loopfigures.py) from hand-made statuses: pure, no swarm."""

from __future__ import annotations

from rich.text import Text

from node.app.demo import describe, health_cell
from node.app.loopfigures import StallWatch, format_figures, loop_figures, reward_ratio


def statuses():
    honest = {"inference": {"samples": 320, "paced_s": 4.0,
                            "sample_outcomes": {"accepted": 256, "dropped/stale": 32, "refused/stale": 32}}}
    cheat = {"inference": {"samples": 999, "cheat": "fake-rewards", "sample_outcomes": {"refused/banned": 999}}}
    trainer = {"trainer": {"step": 10, "idle_fraction": 0.05, "sample_outcomes": {"trained": 192, "expired": 32},
                           "step_time_s": {"wait": 1.0, "train": 15.0, "save": 3.0, "publish": 1.0},
                           "sample_life_s": {"generated_to_acked": 0.5, "acked_to_verified": 1.0, "verified_to_trained": 0.2}}}
    validator = {"validator": {"utilisation": 0.8}}
    return {"i1": ("inference", honest), "cheater": ("inference", cheat), "t": ("trainer", trainer),
            "v": ("validator", validator)}


def test_honest_samples_and_where_they_went():
    f = loop_figures(statuses(), seconds=60.0)
    assert f["honest_samples"] == 320  # the cheater's samples are not honest work
    assert f["trained_fraction"] == 0.6
    assert f["lost_fraction"] == {"expired": 0.1, "trainer:stale": 0.1, "worker:stale": 0.1}
    assert f["in_pipeline_fraction"] == 0.1  # 320 - 192 trained - 96 lost
    assert f["trained_of_decided"] == round(192 / 288, 4)
    assert f["steps_per_minute"] == 10.0 and f["trainer_idle_fraction"] == 0.05 and f["validator_utilisation"] == 0.8
    text = format_figures(f)
    assert "trained: 60.0 %" in text and "train 15.0 s (75 %)" in text and "acked to verified 1.00" in text


def test_reward_ratio_needs_twenty_steps():
    assert reward_ratio([[i, 0.1] for i in range(19)]) is None
    curve = [[i, 0.1] for i in range(10)] + [[i, 0.3] for i in range(10, 20)]
    first, last, times = reward_ratio(curve)
    assert (round(first, 3), round(last, 3), round(times, 2)) == (0.1, 0.3, 3.0)


def health(state: str, cause: str = "") -> dict:
    return {"health": {"state": state, "cause": cause}}


def test_the_demo_table_shows_each_nodes_health_and_a_stalls_cause():
    def plain(status):
        return Text.from_markup(health_cell(status)).plain

    assert plain(health("ok", "stepping")) == "ok" and plain({}) == "-"  # "-": a node that wrote no status yet
    cell = health_cell(health("stalled", "no step for 95 s: 155 batches [wait] for a verdict"))
    assert cell.startswith("[red]") and plain(health("stalled", "no step for 95 s: 155 batches [wait] for a verdict")) \
        == "stalled: no step for 95 s: 155 batches [wait] for a verdict"  # the cause's brackets are not markup
    assert len(plain(health("stalled", "x" * 500))) <= 80  # bounded in a table cell


def test_stalls_seen_while_the_demo_ran_are_summed_up_with_the_longest_and_its_cause():
    watch = StallWatch()
    timeline = [(0, "starting", ""), (10, "ok", ""), (20, "stalled", "no step for 90 s: waiting for verdicts"),
                (50, "stalled", "no step for 120 s: waiting for verdicts"), (60, "ok", ""),
                (70, "stalled", "no step for 90 s: no batches"), (80, "ok", "")]
    for t, state, cause in timeline:
        watch.observe({"t": ("trainer", health(state, cause)), "v": ("validator", health("ok"))}, float(t))
    watch.observe({"t": ("trainer", health("stalled", "c")), "v": ("validator", health("stalled", "d"))}, 95.0)
    stalls = watch.summary(100.0)  # still stalled at the stop: counted up to it
    assert stalls == {"t": {"stalls": 3, "longest_s": 40.0, "cause": "no step for 120 s: waiting for verdicts"},
                      "v": {"stalls": 1, "longest_s": 5.0, "cause": "d"}}
    f = loop_figures(statuses(), seconds=60.0, stalls=stalls)
    text = format_figures(f)
    assert "stalls: t 3 (longest 40 s: no step for 120 s: waiting for verdicts)" in text and "v 1 (longest 5 s: d)" in text
    assert "stalls: none" in format_figures(loop_figures(statuses(), seconds=60.0, stalls={}))


def test_the_demo_table_says_when_a_worker_holds_its_next_step_for_the_step_window():
    def rollouts(inference):
        return Text.from_markup(describe("inference", {"inference": inference})[1]).plain

    assert "held: step window" in rollouts({"step_window": {"held": True, "counted": 7}})
    assert "held" not in rollouts({"step_window": {"held": False, "counted": 7}}) and "held" not in rollouts({})


def test_the_summary_says_the_last_steps_off_policy_figures():
    s = statuses()
    assert loop_figures(s, seconds=60.0)["off_policy"] is None  # no step with figures yet: no line
    s["t"][1]["trainer"].update(loss="dppo-tv", max_off_policy_steps=8, last_step={
        "masked_frac": 0.064, "mismatch_kl": 0.016, "mismatch_kl_same_version": 0.0001,
        "off_policy_steps": {"mean": 1.9, "max": 4}})
    text = format_figures(loop_figures(s, seconds=60.0))
    assert ("last step: loss dppo-tv, off-policy 1.9 mean / 4 max (bound 8), masked 6.4 %, "
            "mismatch KL 0.016 (same version 0.0001)") in text
