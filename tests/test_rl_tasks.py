"""Task sets, the deterministic draw, rewards helpers and the synthetic task."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from node.rl.config import RLConfig
from node.rl.spec import budget_instruction, length_penalty, with_length_penalty
from node.rl.synthetic import make_reversal_tasks, reversal_reward, write_taskset
from node.rl.spec import step_key
from node.rl.tasks import (
    KINDS,
    TaskFormatError,
    draw_index,
    draw_task,
    load_taskset,
    parse_taskset,
)


def line(**kw):
    return json.dumps(kw).encode() + b"\n"


def test_packaged_sets_load_and_have_their_kind():
    for kind in KINDS:
        ts = load_taskset(kind)
        assert len(ts) > 0
        assert {t.kind for t in ts.tasks} == {kind}
        assert len(ts.digest) == 32


def test_packaged_synthetic_set_is_what_its_generator_writes(tmp_path):
    path = write_taskset(tmp_path / "s.jsonl", 2000, 1)
    assert load_taskset(str(path)).digest == load_taskset("synthetic").digest


@pytest.mark.parametrize("data, needle", [
    (b"{not json}\n", "not JSON"),
    (b"[1, 2]\n", "JSON object"),
    (line(id="a", kind="poetry", prompt="p", answer="x"), "kind"),
    (line(id="", kind="math", prompt="p", answer="x"), "id"),
    (line(id="a", kind="math", prompt="", answer="x"), "prompt"),
    (line(id="a", kind="math", prompt="p"), "answer"),
    (line(id="a", kind="code", prompt="p"), "tests"),
    # Code tests the harness (node/rl/harness.py) cannot judge in the node are refused at load.
    (line(id="a", kind="code", prompt="p", tests="print('hi')\n"), "line 1: unsupported"),
    (line(id="a", kind="code", prompt="p", tests="assert f(1) == 2\nassert f(2) < 6\n"), "line 2: unsupported"),
    (line(id="a", kind="code", prompt="p", tests="assert f(x) == 2\n"), "unsupported"),
    (line(id="a", kind="code", prompt="p", tests="assert f(2) == g(3)\n"), "unsupported"),
    (line(id="a", kind="code", prompt="p", tests="assert sorted(f(3)) == [1]\n"), "unsupported"),
    (line(id="a", kind="code", prompt="p", tests="assert f(*[1]) == 1\n"), "unsupported"),
    (line(id="a", kind="code", prompt="p", tests="import os\nassert f(1) == 1\n"), "line 1: unsupported"),
    (line(id="a", kind="code", prompt="p", tests="assert f(1) ==\n"), "do not parse"),
    (line(id="a", kind="code", prompt="p", tests="# only a comment\n"), "no assert"),
    (line(id="a", kind="math", prompt="p", answer="1", metadata=[1]), "metadata"),
    (line(id="a", kind="math", prompt="p", answer="1") + line(id="a", kind="math", prompt="q", answer="2"), "duplicate"),
    (b"\n\n", "no tasks"),
])
def test_malformed_task_files_are_rejected_with_the_line(data, needle):
    with pytest.raises(TaskFormatError) as e:
        parse_taskset(data, "f.jsonl")
    assert needle in str(e.value)


def test_missing_file_and_bad_utf8_are_clear_errors(tmp_path):
    with pytest.raises(TaskFormatError):
        load_taskset(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe\n")
    with pytest.raises(TaskFormatError):
        load_taskset(str(bad))


def _key(run="run", peer="peerA", root=b"r" * 32, step=5):
    return step_key(run, peer, root, step)


def test_draw_is_deterministic_and_depends_on_every_input():
    ts = load_taskset("synthetic")
    a = [draw_task(ts, _key(), i).id for i in range(16)]
    assert a == [draw_task(ts, _key(), i).id for i in range(16)]
    assert a != [draw_task(ts, _key(peer="peerB"), i).id for i in range(16)]
    assert a != [draw_task(ts, _key(step=6), i).id for i in range(16)]
    assert a != [draw_task(ts, _key(run="other"), i).id for i in range(16)]
    assert a != [draw_task(ts, _key(root=b"s" * 32), i).id for i in range(16)]
    other = parse_taskset(b"".join(line(id=t.id, kind=t.kind, prompt=t.prompt, answer=t.answer)
                                   for t in reversed(ts.tasks)), "reordered")
    assert a != [draw_task(other, _key(), i).id for i in range(16)]  # the set's digest is an input


def test_draw_spreads_over_the_whole_set():
    counts = Counter(draw_index(b"x" * 32, 10, _key(step=step), i) for step in range(50) for i in range(40))
    assert set(counts) == set(range(10))
    assert max(counts.values()) < 2 * min(counts.values())


def test_draw_rejects_bad_arguments():
    with pytest.raises(ValueError):
        draw_index(b"x" * 32, 0, _key(), 0)
    with pytest.raises(ValueError):
        draw_index(b"x" * 32, 5, _key(), -1)
    with pytest.raises(ValueError):
        draw_index(b"x" * 32, 5, b"short", 0)
    with pytest.raises(ValueError):
        step_key("run", "p", b"r" * 32, -1)


def test_reversal_reward_is_graded_and_exact_only_for_the_answer():
    assert reversal_reward("4321", "4321") == 1.0
    assert reversal_reward(" 4321\n", "4321") == 1.0
    assert reversal_reward("4301", "4321") == 0.75
    assert reversal_reward("43", "4321") == 0.5
    assert reversal_reward("432100", "4321") == pytest.approx(4 / 6)
    assert reversal_reward("", "4321") == 0.0
    assert reversal_reward("abc", "") == 0.0


def test_reversal_tasks_are_well_formed():
    for t in make_reversal_tasks(50, seed=3):
        digits = t["prompt"][len("rev "):-1]
        assert t["answer"] == digits[::-1] and digits.isdigit() and 3 <= len(digits) <= 6


def test_length_reward():
    assert length_penalty(100, 100) == 0.0
    assert length_penalty(150, 100) == 0.5 and length_penalty(50, 100) == 0.5
    assert with_length_penalty(1.0, 150, 100, RLConfig(length_alpha=0.2)).reward == pytest.approx(0.9)
    assert with_length_penalty(1.0, 150, 0, RLConfig(length_alpha=0.2)).reward == 1.0  # no budget: off
    assert "100" in budget_instruction(100)
    with pytest.raises(ValueError):
        length_penalty(3, 0)


def test_code_tests_parse_into_checks_the_node_judges():
    from node.rl.harness import EQUAL, FALSY, TRUTHY, parse_tests

    checks = parse_tests("assert f(2, k='x') == [1, (2, 3)]\nassert 5 == f(-1)\nassert g(4)\nassert not g(7)\n")
    assert [(c.call, c.expect, c.value) for c in checks] == [
        ("f(2, k='x')", EQUAL, [1, (2, 3)]), ("f(-1)", EQUAL, 5), ("g(4)", TRUTHY, None), ("g(7)", FALSY, None)]
    assert checks[0].holds([1, (2, 3)]) and not checks[0].holds([1, [2, 3]])
    assert checks[2].holds(1) and not checks[3].holds(True)
