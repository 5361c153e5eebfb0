"""reasoning-gym as a task source (issue 40, item 2): tasks generated from the draw, regenerated and
re-scored by a validator; the answer format and its extraction; the run pins the version, the
generator table and task files' bytes; bad input is one line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from node.app.cli import main
from node.config import ConfigError, NodeConfig, RunConfig
from node.engines.model import create_tiny_model
from node.engines.torch_engine import TorchEngine
from node.identity import Identity
from node.rl import gym
from node.rl.config import RLConfig
from node.rl.spec import OFFLINE_ROOT, code_limits, draw_step, render_prompt, score_many, step_key
from node.rl.tasks import TaskFormatError, load_run_tasks
from node.roles.core import check_code_sandbox
from node.validator import testing as T
from node.validator.pipeline import BatchRules, CheckModel, judge_batch
from node.validator.tasks import RunTasks

TABLE = {"basic_arithmetic": {"weight": 3, "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
         "leg_counting": {"min_animals": 1, "max_animals": 2}}


def gym_rl(**kw) -> RLConfig:
    return RLConfig(taskset="reasoning-gym", reasoning_gym=TABLE, group_size=2, prompts_per_batch=2, max_new_tokens=6, **kw)


def test_tasks_come_from_the_draw_and_a_second_node_regenerates_them():
    a, b = load_run_tasks(gym_rl()), load_run_tasks(gym_rl())
    key = step_key("run", "peer", OFFLINE_ROOT, 3)
    drawn = [a.draw(key, i) for i in range(40)]
    again = [b.draw(key, i) for i in range(40)]
    assert [(t.id, t.prompt, t.answer) for t in drawn] == [(t.id, t.prompt, t.answer) for t in again]
    assert len({t.id for t in drawn}) == 40
    names = [t.metadata["generator"] for t in drawn]
    assert names.count("basic_arithmetic") > names.count("leg_counting") > 0  # weights 3 : 1
    other_key = step_key("run", "peer", OFFLINE_ROOT, 4)
    assert a.draw(other_key, 0).id != drawn[0].id
    assert all(t.metadata["seed"] < gym.SEED_SPACE for t in drawn)
    assert all(t.metadata["seed"] >= gym.SEED_SPACE for t in a.evaluation(8))  # held out from every draw


def test_the_identity_hashes_version_and_options():
    base = load_run_tasks(gym_rl()).digest
    changed = dict(TABLE, leg_counting={"min_animals": 1, "max_animals": 3})
    assert load_run_tasks(RLConfig(taskset="reasoning-gym", reasoning_gym=changed)).digest != base
    gens = gym.parse_generators(TABLE)
    assert gym.GymTasks(gens, "0.1.24").digest != gym.GymTasks(gens, "0.1.25").digest


@pytest.mark.parametrize("completion, expected", [
    ("<answer>42</answer>", "42"),
    ("so it is\n<answer> 42 </answer>", "42"),
    ("42", None),
    ("<answer>41</answer> no, <answer>42</answer>", None),  # two answers: none
    ("<answer>42", None),
    ("</answer>42<answer>", None),
    ("<answer></answer>", None),
    ("<answer>" + "9" * (gym.MAX_ANSWER_CHARS + 1) + "</answer>", None),
])
def test_answer_extraction(completion, expected):
    assert gym.extract_answer(completion) == expected


def test_the_generator_scorer_judges_the_tagged_answer():
    rl = gym_rl()
    source = load_run_tasks(rl)
    task = source.task(source.generators[0], 7)
    jobs = [(task, f"<answer>{task.answer}</answer>", 5, 0), (task, task.answer, 5, 0),
            (task, "<answer>not a number</answer>", 5, 0)]
    assert [s.task_reward for s in score_many(jobs, rl, code_limits(rl))] == [1.0, 0.0, 0.0]


def test_a_format_reward_pays_for_the_tag_only_when_the_run_sets_it():
    for share, expected in ((0.0, [1.0, 0.0, 0.0]), (0.25, [1.0, 0.25, 0.0])):
        rl = gym_rl(format_reward=share)
        source = load_run_tasks(rl)
        task = source.task(source.generators[0], 7)
        jobs = [(task, f"<answer>{task.answer}</answer>", 5, 0), (task, "<answer>wrong</answer>", 5, 0),
                (task, f"{task.answer}", 5, 0)]
        assert [s.task_reward for s in score_many(jobs, rl, code_limits(rl))] == expected


@pytest.mark.parametrize("completion, expected", [
    ("42", "42"),  # stopped at its end of turn: the whole completion is the answer
    (" 42 </answer> and more", "42"),
    ("", None),
    ("42 <answer>43</answer>", None),  # a second answer: none
])
def test_a_prefilled_answer_is_read_up_to_its_close_or_its_end(completion, expected):
    assert gym.extract_answer(gym.prefilled(completion)) == expected


def test_answer_prefill_puts_the_tag_in_the_prompt_and_scores_the_bare_answer():
    from node.engines.model import build_tokenizer

    rl = gym_rl(answer_prefill=True)
    source = load_run_tasks(rl)
    task = source.task(source.generators[0], 7)
    assert render_prompt(build_tokenizer(), task, 0, rl) == f"{gym.PREFILL_INSTRUCTION}\n\n{task.prompt}\n{gym.ANSWER_OPEN}"
    jobs = [(task, task.answer, 5, 0), (task, f"{task.answer}</answer>", 5, 0), (task, "wrong", 5, 0)]
    assert [s.task_reward for s in score_many(jobs, rl, code_limits(rl))] == [1.0, 1.0, 0.0]
    assert [s.task_reward for s in score_many(jobs, gym_rl(), code_limits(rl))] == [0.0, 0.0, 0.0]


def test_answer_prefill_needs_reasoning_gym():
    with pytest.raises(ValueError, match="answer_prefill"):
        RLConfig(answer_prefill=True).validate()


def test_the_answer_format_is_in_the_system_prompt():
    task = load_run_tasks(gym_rl()).draw(step_key("r", "p", OFFLINE_ROOT, 0), 0)
    from node.engines.model import build_tokenizer

    assert render_prompt(build_tokenizer(), task, 0, gym_rl()) == f"{gym.ANSWER_INSTRUCTION}\n\n{task.prompt}"


def test_a_validator_regenerates_and_rescores_gym_batches(tmp_path):
    engine = TorchEngine("cpu")
    engine.load(create_tiny_model(tmp_path / "m"))
    rules = BatchRules(run="gym", taskset="reasoning-gym", temperature=1.0, top_p=1.0, max_new_tokens=6,
                       group_size=2, prompts_per_batch=2, async_level=2)
    tasks = RunTasks(gym_rl())
    worker = Identity.from_seed(bytes(range(32)))
    model = CheckModel(engine.model, engine.tokenizer, 0)
    honest = T.make_batch(engine, worker, rules, tasks, step=0, policy_version=0)
    key = step_key("gym", worker.peer_id, T.ROOT, 0)
    assert [s.task_id for s in honest.batch.samples][::2] == [tasks.draw(key, i).task_id for i in range(2)]
    assert judge_batch(honest.batch, rules, current_version=0, tasks=tasks, model=model, policy_root=T.ROOT).accepted
    drawn = draw_step(tasks.taskset, tasks.rl, "gym", worker.peer_id, T.ROOT, 0)
    assert [t.id for t in drawn.tasks] == [tasks.draw(key, i).task_id for i in range(2)]


@pytest.mark.parametrize("table, says", [
    ({"no_such_generator": {}}, "no such reasoning-gym generator"),
    ({"countdown": {}}, "not on the audited list"),
    ({"basic_arithmetic": {"min_terms": "two"}}, "basic_arithmetic: bad options"),
    ({"basic_arithmetic": {"bogus": 1}}, "basic_arithmetic: bad options"),
    ({"basic_arithmetic": {"weight": 0}}, "weight: a positive number"),
    ({"basic_arithmetic": {"seed": 3}}, "come from the draw"),
    ({}, "name at least one generator"),
])
def test_bad_generator_tables_are_one_line(table, says):
    with pytest.raises(TaskFormatError) as e:
        load_run_tasks(RLConfig(taskset="reasoning-gym", reasoning_gym=table))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_node_with_another_reasoning_gym_version_refuses(tmp_path):
    cfg = NodeConfig(role="validator", run=RunConfig(name="g", tables={"rl": {
        "taskset": "reasoning-gym", "reasoning_gym_version": "0.1.24", "reasoning_gym": TABLE}}))
    with pytest.raises(ConfigError, match=r"reasoning-gym 0\.1\.24, but 0\.1\.25 is installed"):
        check_code_sandbox(cfg)


def test_rl_local_refuses_bad_gym_input_with_one_line_and_exit_2(capsys):
    for args in (["--gym", "nope"], ["--gym", "basic_arithmetic:min_terms=x"], ["--gym", "basic_arithmetic:bad"]):
        assert main(["rl-local", "--taskset", "reasoning-gym", "--steps", "1", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
    assert main(["rl-local", "--gym", "basic_arithmetic", "--steps", "1"]) == 2  # --gym without the gym taskset


def test_a_task_file_is_pinned_by_its_sha256(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"id": "a", "kind": "math", "prompt": "1+1?", "answer": "2"}\n')
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(TaskFormatError, match=f'taskset_sha256 = "{sha}"'):
        load_run_tasks(RLConfig(taskset=str(path)))
    assert load_run_tasks(RLConfig(taskset=str(path), taskset_sha256=sha)).digest.hex() == sha
    path.write_bytes(b'{"id": "a", "kind": "math", "prompt": "1+1?", "answer": "3"}\n')
    with pytest.raises(TaskFormatError, match="every node needs the run's file"):
        load_run_tasks(RLConfig(taskset=str(path), taskset_sha256=sha))
    cfg = NodeConfig(role="inference", run=RunConfig(name="g", tables={"rl": {"taskset": str(path), "taskset_sha256": sha}}))
    with pytest.raises(ConfigError, match="is not the run's taskset_sha256"):
        check_code_sandbox(cfg)
