"""Bring your own model (issue 40, item 4): ``swarm-node init-model --from-gguf FILE --out DIR``.

The GGUF file is written here with the ``gguf`` package: a two-layer Llama with the embedded
tokenizer's vocabulary and a chat template (no network, no 93 MB wheel).
"""

from __future__ import annotations

import json

from pathlib import Path

import numpy as np
import pytest

from node.app.cli import main
from node.engines.model import build_tokenizer, load_tokenizer
from node.engines.torch_engine import TorchEngine
from node.rl.config import RLConfig
from node.rl.spec import render_prompt
from node.rl.tasks import load_taskset

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_gguf(path: Path, *, tokenizer: bool = True) -> Path:
    import gguf

    tok = build_tokenizer()
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    vocab, hidden, ffn, layers, heads, kv_heads = len(tokens), 32, 64, 2, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3 if i < 3 else 1 for i in range(vocab)])  # <pad> <eos> <unk> are control tokens
        w.add_token_merges([])
        w.add_token_scores([0.0] * vocab)
        w.add_eos_token_id(tok.eos_token_id)
        w.add_bos_token_id(tok.eos_token_id)
        w.add_pad_token_id(tok.pad_token_id)
        w.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(0)
    kv = kv_heads * (hidden // heads)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv, hidden),
                   f"blk.{i}.attn_v.weight": (kv, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                   f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, ffn)}
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_file_becomes_a_model_folder_the_node_runs(tmp_path, capsys):
    src = write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "models" / "tiny"
    assert main(["init-model", "--from-gguf", str(src), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    engine = TorchEngine("cpu")
    engine.load(out)
    assert type(engine.model).__name__ == "LlamaForCausalLM"
    task = load_taskset("synthetic").tasks[0]
    assert render_prompt(engine.tokenizer, task, 0, RLConfig()) == f"<|user|>{task.prompt}<eos><|assistant|>"
    ids = engine.tokenizer(task.prompt, add_special_tokens=False)["input_ids"]
    assert ids == build_tokenizer()(task.prompt, add_special_tokens=False)["input_ids"]  # the vocabulary survived
    (sample,) = engine.generate([ids], n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=1)[0]
    assert 1 <= len(sample.completion_ids) <= 4
    assert load_tokenizer(out).eos_token == "<eos>"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())  # a trainer can save it again
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]  # no temporary folder left beside it


@pytest.mark.parametrize("make, says", [
    (lambda p: p.write_bytes(b"PK\x03\x04 not a gguf"), "not a GGUF file"),
    (lambda p: write_gguf(p, tokenizer=False), "no tokenizer transformers can read"),
    (lambda p: None, "No such file"),
])
def test_bad_gguf_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, make, says):
    src = tmp_path / "in" / "model.gguf"
    src.parent.mkdir()
    make(src)
    out = tmp_path / "out" / "m"
    assert main(["init-model", "--from-gguf", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_an_existing_folder_is_kept_unless_forced(tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep").write_text("x")
    src = write_gguf(tmp_path / "tiny.gguf")
    assert main(["init-model", "--from-gguf", str(src), "--out", str(out)]) == 2
    assert (out / "keep").exists()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00broken")
    assert main(["init-model", "--from-gguf", str(bad), "--out", str(out), "--force"]) == 2
    assert (out / "keep").exists()  # a failed conversion does not cost the folder it would replace
    assert main(["init-model", "--from-gguf", str(src), "--out", str(out), "--force"]) == 0
    assert not (out / "keep").exists() and (out / "config.json").is_file()


def test_rl_local_refuses_a_model_folder_without_a_tokenizer(tmp_path, capsys):
    src = write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "m"
    assert main(["init-model", "--from-gguf", str(src), "--out", str(out)]) == 0
    (out / "tokenizer.json").unlink()
    capsys.readouterr()
    assert main(["rl-local", "--model", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer in the model folder" in err and err.count("\n") == 1, err


def test_a_trainer_starts_from_a_gguf_file_named_in_the_run(tmp_path):
    """``[run] model = "x.gguf"``: version 0 is the converted model; no converted copy is left behind."""
    from node.rl.config import GRPOConfig
    from node.trainer.config import TrainerConfig
    from node.trainer.policy import Policy

    src = write_gguf(tmp_path / "tiny.gguf")
    policy, created = Policy.open(tmp_path / "trainer", str(src), GRPOConfig(), TrainerConfig())
    assert created and type(policy.model).__name__ == "LlamaForCausalLM" and policy.tokenizer.eos_token == "<eos>"
    assert not (tmp_path / "trainer" / "init.tmp").exists()
