"""Held-out evaluation (issue 40, item 5): the draw no worker trains on, which versions are scored,
what the scores say, where they are kept and shown; then a real trainer node with its evaluation
process, and a task source the evaluation process cannot load."""

from __future__ import annotations

import sqlite3

import pytest
import trio

from node.rl.tasks import load_taskset, parse_taskset
from node.trainer.evaluation import EvalBook, EvalRecord, eval_summary, format_eval, next_version, thin
from node.trainer.spool import open_spool


def test_the_reversal_sets_evaluation_tasks_are_none_of_its_prompts():
    ts = load_taskset("synthetic")
    tasks = ts.evaluation(256)
    assert ts.held_out and len(tasks) == 256
    prompts = {t.prompt for t in ts.tasks}
    assert not prompts & {t.prompt for t in tasks}  # no draw of the set can ask a worker for one of them
    assert len({t.prompt for t in tasks}) == 256 and all(t.answer == t.prompt[4:-1][::-1] for t in tasks)
    assert [t.prompt for t in ts.evaluation(16)] == [t.prompt for t in tasks[:16]]  # a fixed draw


def test_a_reversal_set_holding_a_prompt_the_evaluation_would_draw_gets_another_in_its_place():
    first = load_taskset("synthetic").evaluation(3)
    line = '{"id": "x", "kind": "synthetic", "prompt": "%s", "answer": "%s", "metadata": {"task": "reverse"}}'
    own = parse_taskset((line % (first[1].prompt, first[1].answer)).encode(), "own.jsonl")
    got = [t.prompt for t in own.evaluation(3)]
    assert first[1].prompt not in got and got[0] == first[0].prompt and got[1] == first[2].prompt


def test_another_task_file_evaluates_on_its_first_tasks_and_says_they_are_not_held_out():
    ts = load_taskset("math")
    assert not ts.held_out and ts.evaluation(4) == list(ts.tasks[:4])


def test_the_base_is_scored_first_then_the_newest_due_version_on_disk():
    assert next_version(latest=0, every=5, done=[], available=[0]) == 0
    assert next_version(latest=12, every=5, done=[], available=[0, 9, 10, 11, 12]) == 0
    assert next_version(latest=12, every=5, done=[0], available=[0, 5, 9, 10, 11, 12]) == 10
    assert next_version(latest=12, every=5, done=[0, 10], available=[0, 5, 9, 10, 11, 12]) == 5  # passed over, still there
    assert next_version(latest=12, every=5, done=[0, 10], available=[9, 10, 11, 12]) is None  # v5's folder is gone
    assert next_version(latest=9, every=5, done=[0, 5], available=[10]) is None  # not published yet
    assert next_version(latest=12, every=0, done=[], available=[0, 10]) is None  # off


def test_a_version_that_failed_is_passed_over_and_a_result_clears_the_error():
    book = EvalBook(every=2, tasks=8)
    book.start(0)
    book.on_failure(0, "v0: model folder not found")
    assert book.running is None and book.error and book.next(latest=4, available=[0, 2, 4]) == 4
    book.start(4)
    book.on_result(EvalRecord(4, 0.5, 8, 0.1))
    assert book.error == "" and book.next(latest=4, available=[0, 2, 4]) == 2
    assert book.status()["points"] == [[4, 0.5]] and book.status()["base"] is None


def test_the_summary_gives_the_base_the_last_the_best_and_the_change():
    recs = [EvalRecord(10, 0.3, 64, 1.0), EvalRecord(0, 0.1, 64, 1.0), EvalRecord(20, 0.25, 64, 1.0)]
    assert eval_summary(recs) == {"base": 0.1, "last": [20, 0.25], "best": [10, 0.3], "change": 0.15, "ratio": 2.5}
    assert eval_summary([EvalRecord(0, 0.0, 64, 1.0), EvalRecord(5, 0.2, 64, 1.0)])["ratio"] is None
    assert eval_summary([])["last"] is None


def test_a_long_run_is_thinned_for_status_keeping_the_base_and_the_last():
    recs = [EvalRecord(v, v / 1000, 8, 0.0) for v in range(0, 5000, 5)]
    got = thin(recs, 100)
    assert len(got) == 100 and got[0].version == 0 and got[-1].version == 4995
    assert [r.version for r in got] == sorted({r.version for r in got})
    book = EvalBook(5, 8, recs)
    assert len(book.status()["points"]) == 100 and book.status()["last"] == [4995, 4.995]


def test_the_line_for_people_says_what_was_measured():
    book = EvalBook(5, 64, [EvalRecord(0, 0.1, 64, 1.0), EvalRecord(10, 0.3, 64, 1.0), EvalRecord(15, 0.25, 64, 1.0)])
    book.held_out = True
    line = format_eval(book.status())
    assert line == ("evaluation (greedy, 64 tasks, held-out, every 5 versions): base v0 0.100, v15 0.250 "
                    "(+0.150, 2.50x); best v10 0.300")
    assert format_eval(EvalBook(0, 64).status()) == "held-out evaluation: off ([trainer] eval_every = 0)"
    assert format_eval(EvalBook(5, 64).status()).endswith(": no version scored yet")


def test_scores_are_kept_in_the_spool_and_a_lost_version_drops_its_own(tmp_path):
    path = tmp_path / "spool.sqlite"
    with open_spool(path) as spool:
        spool.record_eval(EvalRecord(0, 0.125, 64, 2.5))
        spool.record_eval(EvalRecord(5, 0.25, 64, 1.5))
        with pytest.raises(ValueError):
            spool.record_eval(EvalRecord(10, float("nan"), 64, 1.0))
    with open_spool(path) as spool:  # a restart
        assert spool.evals() == [EvalRecord(0, 0.125, 64, 2.5), EvalRecord(5, 0.25, 64, 1.5)]
        spool.recover(4)  # saved step 4: version 5 will be made again
        assert spool.evals() == [EvalRecord(0, 0.125, 64, 2.5)]


def test_a_spool_written_before_scores_were_kept_reads_as_none(tmp_path):
    from node.trainer.spool import Spool

    db = sqlite3.connect(tmp_path / "old.sqlite")
    db.execute("CREATE TABLE steps (step INTEGER PRIMARY KEY)")
    assert Spool(db).evals() == []


def test_bad_evaluation_settings_are_refused_with_one_line(tmp_path):
    from node.config import ConfigError, RunConfig

    for table, words in (({"eval_every": -1}, "eval_every"), ({"eval_tasks": 0}, "eval_tasks"),
                         ({"eval_device": "tpu"}, "eval_device")):
        run = RunConfig(name="t")
        run.tables["trainer"] = table
        with pytest.raises(ConfigError, match=words) as e:
            run.section("trainer")
        assert "\n" not in str(e.value)


async def test_a_trainer_scores_the_base_and_a_later_version_and_keeps_the_scores_across_a_restart(tmp_path, capsys):
    """A real trainer node with its evaluation process: v0 and v2 are scored (every 2 versions), v1
    is not; status, metrics and ``trainer-steps --eval`` show them, and a restart still has them."""
    import json

    from swarmtest import node_config, open_nodes
    from test_trainer_cli import run as cli
    from test_trainer_loop import honest, make_run, submit
    from waiting import wait_for

    def configs():
        run = make_run(tmp_path)
        run.tables["trainer"].update(eval_every=2, eval_tasks=8)
        return [node_config(tmp_path, "trainer", "trainer", run=run), node_config(tmp_path, "client", "relay", run=run)]

    async with open_nodes(configs()) as (tnode, client):
        trainer = tnode.trainer
        for version in (1, 2):  # two batches of 8 samples make a step
            for seed in (2 * version, 2 * version + 1):
                ack = await submit(client, tnode.peer_id, honest(client, trainer, step=seed, seed=seed))
                assert ack.accepted, ack.reason
            await wait_for(lambda: trainer.published == version, what=f"v{version} published")
        # generous: the evaluation process starts torch at a low CPU priority, last on a busy machine
        ev = await wait_for(lambda: (e := trainer.status()["eval"])["last"] and e["last"][0] == 2 and e,
                            timeout=600, what="v2 scored")
        assert [v for v, _ in ev["points"]] == [0, 2] and ev["base"] is not None
        assert ev["held_out"] is True and ev["tasks"] == 8 and ev["every"] == 2 and ev["error"] == ""
        assert all(0.0 <= s <= 1.0 for _, s in ev["points"])
        metrics = tnode.metrics.render().decode()
        assert "\nswarm_trainer_eval_version 2.0" in metrics and "\nswarm_trainer_eval_score " in metrics
    async with open_nodes(configs()[:1]) as (tnode,):
        assert tnode.trainer.status()["eval"]["points"] == ev["points"]  # from the spool, before any new score
    assert cli(["trainer-steps", "--data-dir", str(tmp_path / "trainer"), "--eval", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [[r["version"], round(r["score"], 4)] for r in rows] == ev["points"] and rows[0]["tasks"] == 8
    assert cli(["trainer-steps", "--data-dir", str(tmp_path / "trainer")]) == 0
    assert f"held-out score: base (v0) {ev['base']:.4f}, v2" in capsys.readouterr().out


def test_the_reward_png_draws_the_held_out_scores_beside_the_reward():
    import struct
    import zlib

    from node.trainer.plot import EVAL_LINE, LINE, render_curve

    def pixels(data: bytes) -> bytes:
        return zlib.decompress(data[41:41 + struct.unpack(">I", data[33:37])[0]])

    both = pixels(render_curve([(1, 0.1), (2, 0.3)], [(0, 0.05), (2, 0.6)]))
    assert bytes(LINE) in both and bytes(EVAL_LINE) in both
    assert bytes(EVAL_LINE) not in pixels(render_curve([(1, 0.1), (2, 0.3)]))


def test_the_loop_figures_carry_the_trainers_evaluation():
    from node.app.loopfigures import loop_figures

    book = EvalBook(5, 64, [EvalRecord(0, 0.1, 64, 1.0), EvalRecord(5, 0.2, 64, 1.0)])
    f = loop_figures({"t": ("trainer", {"trainer": {"step": 7, "eval": book.status()}})}, seconds=10.0)
    assert f["eval"]["points"] == [[0, 0.1], [5, 0.2]] and f["eval"]["change"] == 0.1


async def test_a_task_source_the_trainer_cannot_load_turns_evaluation_off_with_its_reason(tmp_path):
    """A run whose task file is not on the trainer's machine: the evaluation process says why, the
    loop ends (training goes on without it) and status shows the reason."""
    from dataclasses import asdict

    from node.rl.config import RLConfig
    from node.trainer.evaluator import serve_evaluation

    async def never(_):
        raise AssertionError("nothing can be scored")

    book = EvalBook(every=1, tasks=4)
    rl = asdict(RLConfig(taskset=str(tmp_path / "missing.jsonl"), taskset_sha256="0" * 64))
    settings = {"rl": rl, "tasks": 4, "device": "cpu", "threads": 1}
    with trio.fail_after(120):
        await serve_evaluation(book, settings, tmp_path, latest=lambda: 0, record=never, wait=never)
    assert "missing.jsonl" in book.status()["error"] and book.status()["last"] is None
    assert format_eval(book.status()).endswith("missing.jsonl: No such file or directory")
