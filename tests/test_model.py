"""The embedded default model: a real HF folder, a local character tokenizer, no downloads."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from node.engines.model import (
    ALPHABET,
    EOS,
    PAD,
    TinyModelSpec,
    build_tokenizer,
    create_tiny_model,
    is_model_folder,
    load_model,
    load_tokenizer,
)
from node.rl.warmup import create_default_model

SMALL = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("m") / "tiny", spec=SMALL)


def test_tokenizer_round_trips_every_character_including_newline():
    tok = build_tokenizer()
    text = "".join(ALPHABET)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok.eos_token == EOS and tok.pad_token == PAD and tok.eos_token_id != tok.pad_token_id


def test_folder_is_an_ordinary_hf_model_folder(folder):
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["hidden_size"] == SMALL.hidden_size
    assert is_model_folder(folder)


def test_loaded_tokenizer_keeps_the_character_pre_tokenizer(folder):
    # AutoTokenizer would swap in Qwen2's byte-level pre-tokenizer and drop "\n" (see load_tokenizer).
    tok = load_tokenizer(folder)
    ids = tok("rev 12\n3=", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "rev 12\n3="
    assert len(ids) == 9


def test_loaded_model_matches_saved_weights_and_runs(folder):
    m1, m2 = load_model(folder), load_model(folder)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a, b = m1(input_ids=ids).logits, m2(input_ids=ids).logits
    assert a.shape == (1, 4, len(build_tokenizer()))
    assert torch.equal(a, b)


def test_concurrent_loads_in_threads_all_succeed(folder):
    # CI: two inference nodes in one process loaded v0 at the same moment and both failed ("Cannot
    # copy out of meta tensor"); unlocked, 87 of 90 such loads failed here.
    import threading

    results: list = []

    def load() -> None:
        try:
            results.append(load_model(folder))
        except Exception as e:  # collected: a failure in a thread must fail the test
            results.append(e)

    for _ in range(3):
        threads = [threading.Thread(target=load) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 9 and not [r for r in results if isinstance(r, Exception)]
    assert all(torch.equal(r.lm_head.weight, results[0].lm_head.weight) for r in results)


def test_model_creation_is_seeded(tmp_path):
    a = create_tiny_model(tmp_path / "a", seed=3, spec=SMALL)
    b = create_tiny_model(tmp_path / "b", seed=3, spec=SMALL)
    c = create_tiny_model(tmp_path / "c", seed=4, spec=SMALL)
    wa, wb, wc = ((p / "model.safetensors").read_bytes() for p in (a, b, c))
    assert wa == wb and wa != wc


def test_default_model_warm_up_lowers_the_loss(tmp_path):
    path, stats = create_default_model(tmp_path / "d", warmup_steps=8, spec=SMALL)
    assert is_model_folder(path)
    assert stats.steps == 8 and stats.last_loss < stats.first_loss
