"""The loop's figures (node/app/loopfigures.py) from hand-made statuses: pure, no swarm."""

from __future__ import annotations

from rich.text import Text

from node.app.demo import describe, health_cell, ledger_text, read_ledger
from node.app.loopfigures import (StallWatch, cheater_keys, format_figures, format_ledger_totals, judged_samples,
                                  loop_figures, reward_ratio)
from node.config import RunConfig, write_run_record
from node.identity import Identity
from node.ledger.chain import Ledger
from node.ledger.entries import GENESIS, Penalty, RolloutsJudged, entry_to_json, make_entry
from node.ledger.store import open_ledger_store


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


# -- a cheater's work apart from the honest swarm's (demo --cheat) -----------------------------------

TRAINER_ID = Identity.from_seed(b"T" * 32)
VALIDATOR_ID = Identity.from_seed(b"V" * 32)
HONEST_ID = Identity.from_seed(b"H" * 32)
CHEATER_ID = Identity.from_seed(b"C" * 32)
FLOOD = [Identity.from_seed(bytes([i]) * 32) for i in range(5)]  # sybil-flood: a fresh key per batch
NAMES = {TRAINER_ID.peer_id: "t", VALIDATOR_ID.peer_id: "v", HONEST_ID.peer_id: "i1", CHEATER_ID.peer_id: "cheater"}


def ledger_of_a_flood():
    """A real ledger replica (totals) and its export (entries) after a sybil-flood: the trainer trained
    the honest worker's samples, rejected the cheater's and each flood key's on their proofs, and the
    validator penalised each flood key."""
    ledger = Ledger("run", [TRAINER_ID.peer_id], [VALIDATOR_ID.peer_id], 0)
    chains = {TRAINER_ID.peer_id: (TRAINER_ID, [0, GENESIS]), VALIDATOR_ID.peer_id: (VALIDATOR_ID, [0, GENESIS])}
    entries, signed = [], []

    def add(author, body):
        identity, head = chains[author.peer_id]
        se = make_entry(identity, "run", head[0] + 1, head[1], 0, body)
        head[:] = [se.seq, se.hash]
        ledger.apply(ledger.check(se, 0))
        entries.append(entry_to_json(se))
        signed.append(se)

    def judged(worker, samples, reason=""):
        add(TRAINER_ID, RolloutsJudged(worker=worker.peer_id, step=1, accepted=not reason, samples=samples, tokens=10,
                                       batch_hash=len(entries).to_bytes(32, "big"), reason=reason))

    judged(HONEST_ID, 192)
    judged(HONEST_ID, 16, "verdict:proof_exponent")  # an honest batch past the float tolerance: honest waste
    judged(CHEATER_ID, 8, "verdict:reward")
    for key in FLOOD:
        judged(key, 16, "verdict:proof_exponent")
        add(VALIDATOR_ID, Penalty(peer=key.peer_id, reason="verdict", points=10))
    return ledger.totals(), entries, signed


def test_the_cheaters_rejected_samples_are_not_counted_as_honest_losses():
    totals, entries, _ = ledger_of_a_flood()
    keys = cheater_keys(totals, NAMES, "cheater")
    assert keys == {CHEATER_ID.peer_id} | {k.peer_id for k in FLOOD}  # its own key and every key of no demo node
    judged = judged_samples(entries, keys, {TRAINER_ID.peer_id})
    assert judged == {"verdict:proof_exponent": 80, "verdict:reward": 8}
    s = statuses()
    s["t"][1]["trainer"]["sample_outcomes"] = {"trained": 192, "expired": 32, "verdict:proof_exponent": 96,
                                               "verdict:reward": 8}
    s["i1"][1]["inference"]["samples"] = 400
    f = loop_figures(s, seconds=60.0, cheater_judged=judged)
    assert f["lost_fraction"] == {"expired": 0.08, "trainer:stale": 0.08, "verdict:proof_exponent": 0.04,
                                  "worker:stale": 0.08}  # only the honest batch's 16 of 400
    assert f["trained_fraction"] == 0.48
    assert f["cheater"] == {"name": "cheater", "kind": "fake-rewards", "samples": 999, "trained": 0,
                            "rejected": {"verdict:proof_exponent": 80, "verdict:reward": 8}}
    text = format_figures(f)
    assert "lost, by reason: expired 8.0 %, trainer:stale 8.0 %, verdict:proof_exponent 4.0 %, worker:stale 8.0 %" in text
    assert ("the cheater (fake-rewards, not counted above): 999 samples generated; trained 0; "
            "rejected by the trainer: verdict:proof_exponent 80, verdict:reward 8") in text


def test_a_cheaters_trained_samples_are_not_honest_work_trained():
    s = statuses()
    f = loop_figures(s, seconds=60.0, cheater_judged={"trained": 32})
    assert f["trained_fraction"] == 0.5 and f["cheater"]["trained"] == 32  # 160 of the 192 were honest
    assert loop_figures(s, seconds=60.0)["cheater"] is None  # no ledger read: nothing to set apart


def test_the_ledger_table_puts_the_floods_keys_in_one_row():
    totals, _, _ = ledger_of_a_flood()
    stranger = Identity.from_seed(b"S" * 32).peer_id  # a key of no demo node with samples accepted: shown alone
    totals[stranger] = {**totals[HONEST_ID.peer_id]}
    text = format_ledger_totals(totals, NAMES)
    lines = text.splitlines()
    assert lines[0].split() == ["peer", "entries", "ckpts", "accepted", "rejected", "tokens", "verdicts", "failed",
                                "served", "penalty", "bans"]
    flood = next(line for line in lines if line.startswith("5 other keys*"))
    assert flood.split()[-7:-3] == ["80", "0", "0", "0"]  # rejected, tokens, verdicts, failed: summed over the keys
    assert flood.split()[-2] == "50"  # the penalty points summed over the 5 keys
    assert lines[-1] == "* 5 keys of no node of this swarm, each penalised with nothing accepted, summed in one row"
    assert sum(1 for line in lines if stranger[:8] in line) == 1 and any(line.startswith("i1 ") for line in lines)
    assert len(lines) == 1 + 4 + 1 + 1 + 1  # header, t v i1 cheater, the stranger, the flood's row, its note
    assert "other keys" not in format_ledger_totals({HONEST_ID.peer_id: totals[HONEST_ID.peer_id]}, NAMES)


def test_the_demo_reads_the_trainers_ledger_database_and_names_its_nodes(tmp_path):
    """The demo's summary reads the trainer's replica with `swarm-node ledger` (--json and export) after the stop."""
    totals, entries, signed = ledger_of_a_flood()
    write_run_record(tmp_path, RunConfig(name="run", trainers=[TRAINER_ID.peer_id], validators=[VALIDATOR_ID.peer_id]))
    with open_ledger_store(tmp_path) as store:
        store.bind_run("run")
        store.commit(signed)
    ledger = read_ledger(tmp_path)
    assert ledger[0]["totals"] == totals
    assert sorted(ledger[1], key=lambda e: e["hash"]) == sorted(entries, key=lambda e: e["hash"])
    text = ledger_text(ledger, NAMES)
    assert "\n5 other keys*" in text and "\ncheater " in text
    assert f"\n{len(entries)} entries from 2 authors; digest {ledger[0]['digest'][:16]}" in text
    missing = read_ledger(tmp_path / "no-node-here")  # why it could not be read, in the summary's place
    assert isinstance(missing, str) and missing.startswith("swarm-node ledger: error:")
