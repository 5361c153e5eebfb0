"""A published checkpoint loads with plain AutoTokenizer / AutoModelForCausalLM and encodes
exactly as the node's own tokenizer (issue 19: transformers 5 dropped every space, 4.x could not
load the tokenizer class at all)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from node.engines.model import (  # noqa: E402
    ALPHABET,
    SPECIAL_TOKENS,
    TinyModelSpec,
    build_tiny_model,
    build_tokenizer,
    create_tiny_model,
    load_model,
    load_tokenizer,
)
from node.rl.tasks import load_taskset  # noqa: E402

SMALL = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
TEXTS = ["rev 123=", "Reverse the digits: 12345\nAnswer: 54321", "".join(ALPHABET), "  two  spaces\n\n",
         "a<eos>b", "caf\u00e9 \u00fc"]  # the last: characters outside the alphabet


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", spec=SMALL)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_plain_auto_tokenizer_encodes_exactly_as_the_node(folder):
    auto = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ours, built = load_tokenizer(folder), build_tokenizer()
    prompts = [t.prompt for t in load_taskset("synthetic").tasks[:50]]
    for text in TEXTS + prompts:
        assert ids(auto, text) == ids(ours, text) == ids(built, text), (type(auto).__name__, text)
    for text in TEXTS[:5]:
        assert auto.decode(ids(auto, text)) == text  # spaces and newlines survive
    assert auto.eos_token_id == ours.eos_token_id and auto.pad_token_id == ours.pad_token_id
    assert len(auto) == len(ours)


def test_ids_are_those_of_the_character_tokenizer(folder):
    """Same ids as the WordLevel tokenizer this replaced: special tokens 0-2, then the alphabet in
    order, so models trained before the change read the new tokenizer's ids the same way."""
    tok = build_tokenizer()
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert ids(tok, "".join(ALPHABET)) == list(range(3, 3 + len(ALPHABET)))


def test_the_folder_names_a_tokenizer_class_every_version_has(folder):
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_plain_auto_model_gives_the_nodes_logits(folder):
    auto = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    ours = load_model(folder)
    x = torch.tensor([ids(build_tokenizer(), "rev 123=")])
    with torch.no_grad():
        assert torch.equal(auto(input_ids=x).logits, ours(input_ids=x).logits)


def test_a_trainer_checkpoint_written_from_a_gathered_state_is_portable_too(tmp_path):
    from node.trainer.checkpoints import write_model_folder

    tok = build_tokenizer()
    model = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, SMALL)
    path = write_model_folder(tmp_path, 1, model, tok, state_dict=model.state_dict())
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert ids(auto, "rev 1 2=") == ids(tok, "rev 1 2=")
