"""Prompts as the model expects them (issue 40, item 1): a tokenizer with a chat template gets every
task rendered through it, the same bytes for the generator, the validator and rl-local; a worker that
renders otherwise is rejected; the template's end of turn is the stop token everywhere.

A tiny chat template on the embedded tokenizer stands in for a real instruct model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from node.engines.model import build_tiny_model, build_tokenizer, load_tokenizer, save_model_folder
from node.engines.torch_engine import TorchEngine
from node.identity import Identity
from node.rl.config import RLConfig
from node.rl.rollout import build_groups
from node.engines.model import end_of_turn_token
from node.rl.spec import OFFLINE_ROOT, code_limits, draw_step, prompt_ids, render_prompt, step_key
from node.rl.tasks import load_taskset
from node.validator import testing as T
from node.validator.pipeline import BatchReason, BatchRules, CheckModel, judge_batch
from node.validator.tasks import RunTasks

# ChatML-like, spelled with the embedded alphabet; a turn ends with the token named by ``end``.
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}END\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
RULES = BatchRules(run="chat", taskset="synthetic", temperature=1.0, top_p=1.0, max_new_tokens=6,
                   group_size=2, prompts_per_batch=2, async_level=2)


def chat_model(folder: Path, end: str = "<eos>") -> Path:
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE.replace("END", end)
    return save_model_folder(build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id), tok, folder)


def rl(**kw) -> RLConfig:
    return RLConfig(group_size=RULES.group_size, prompts_per_batch=RULES.prompts_per_batch,
                    max_new_tokens=RULES.max_new_tokens, **kw)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = TorchEngine("cpu")
    e.load(chat_model(Path(tmp_path_factory.mktemp("chat"))))
    return e


def test_a_task_goes_through_the_chat_template_with_the_run_system_prompt(engine):
    task = load_taskset("synthetic").tasks[0]
    text = render_prompt(engine.tokenizer, task, 0, rl(system_prompt="Reverse it."))
    assert text == f"<|system|>Reverse it.<eos>\n<|user|>{task.prompt}<eos>\n<|assistant|>"
    ids = prompt_ids(engine.tokenizer, task, 0, rl(system_prompt="Reverse it."))
    assert ids.count(engine.tokenizer.eos_token_id) == 2  # the template's special tokens, one id each
    assert render_prompt(engine.tokenizer, task, 0, rl()) == f"<|user|>{task.prompt}<eos>\n<|assistant|>"


def test_without_a_template_or_with_it_turned_off_the_prompt_is_raw(engine, tmp_path):
    task = load_taskset("synthetic").tasks[0]
    plain = build_tokenizer()
    assert prompt_ids(plain, task, 0, rl()) == plain(task.prompt, add_special_tokens=False)["input_ids"]
    assert render_prompt(engine.tokenizer, task, 0, rl(chat_template="none")) == task.prompt
    assert render_prompt(plain, task, 0, rl(system_prompt="S")) == f"S\n\n{task.prompt}"


def test_generator_validator_and_rl_local_render_the_same_tokens(engine):
    cfg = rl(system_prompt="Reverse the digits.")
    taskset = load_taskset("synthetic")
    drawn = draw_step(taskset, cfg, "chat", "peer", OFFLINE_ROOT, 5)
    built = build_groups(engine, drawn, cfg, code_limits(cfg), capture_hidden=False)  # generator and rl-local
    tasks = RunTasks(cfg, taskset)  # validator
    key = step_key("chat", "peer", OFFLINE_ROOT, 5)
    for i, group in enumerate(built.groups):
        assert group.prompt_ids == tasks.prompt_ids(tasks.draw(key, i), engine.tokenizer)
        assert group.prompt_ids[-len("<|assistant|>"):] == engine.tokenizer("<|assistant|>", add_special_tokens=False)["input_ids"]


def test_a_worker_that_renders_otherwise_is_rejected_with_a_reason(engine):
    worker = Identity.from_seed(bytes(range(32)))
    run_tasks = RunTasks(rl(system_prompt="Reverse the digits."))
    model = CheckModel(engine.model, engine.tokenizer, 0)
    honest = T.make_batch(engine, worker, RULES, run_tasks, step=0, policy_version=0)
    assert judge_batch(honest.batch, RULES, current_version=0, tasks=run_tasks, model=model, policy_root=T.ROOT).accepted
    for other in (rl(chat_template="none", system_prompt="Reverse the digits."), rl(system_prompt="Be brief.")):
        cheat = T.make_batch(engine, worker, RULES, RunTasks(other), step=1, policy_version=0)
        j = judge_batch(cheat.batch, RULES, current_version=0, tasks=run_tasks, model=model, policy_root=T.ROOT)
        assert not j.accepted and set(j.reasons) == {BatchReason.WRONG_PROMPT.value}, j.details


def test_the_end_of_turn_token_is_the_stop_token_for_engines_and_validators(tmp_path):
    assert end_of_turn_token(build_tokenizer()) is None  # no template: eos as before
    folder = chat_model(tmp_path / "m", end="<unk>")
    tok = load_tokenizer(folder)
    assert end_of_turn_token(tok) == "<unk>" and tok.eos_token == "<unk>"
    engine = TorchEngine("cpu")
    engine.load(folder)
    assert engine.tokenizer.eos_token_id == tok.convert_tokens_to_ids("<unk>")
    assert CheckModel(engine.model, tok, 0).eos_ids == {tok.convert_tokens_to_ids("<unk>")}
    # A folder whose template ends turns with its eos keeps it.
    assert load_tokenizer(chat_model(tmp_path / "same")).eos_token == "<eos>"
