"""The loop's figures (node/app/loopfigures.py) from hand-made statuses: pure, no swarm."""

from __future__ import annotations

from node.app.loopfigures import format_figures, loop_figures, reward_ratio


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
