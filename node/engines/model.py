"""The embedded default model: a tiny Qwen2-shaped causal LM with a locally built tokenizer.

Why: the demo and the tests must run anywhere, offline, in minutes on two CPU cores. So the node
ships no weights; it *creates* a model of a real architecture (transformers' ``Qwen2Config``, the
same code path a 0.5B Qwen2 checkpoint takes) with random weights and a character-level tokenizer
built from a fixed alphabet, and saves both as an ordinary Hugging Face folder (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``). Everything downstream (engines,
trainer, proofs, shards) only ever sees "a Hugging Face folder", so any local HF model folder works in
its place.

No chat template: prompts are plain text and a completion ends with the ``<eos>`` token.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)  # ids 0, 1, 2
# Printable ASCII plus newline: enough for the synthetic, math and code task sets we package.
ALPHABET = tuple(chr(c) for c in range(32, 127)) + ("\n",)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the embedded model. Defaults: ~0.45M parameters, learns the synthetic task on a CPU.

    Why 128 wide: at 64 the warmed-up model's greedy accuracy barely moves under RL (sampled reward
    rises only by sharpening towards it); at 128 RL raises the greedy accuracy itself (measured in
    the ML report: greedy 0.29 -> 0.54 in 200 GRPO steps after a 30-step warm-up).
    """

    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # grouped-query attention, as in Qwen2
    max_position_embeddings: int = 256


# Qwen2's pre-tokenizer split (transformers' models/qwen2/tokenization_qwen2.py, PRETOKENIZE_REGEX).
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the one ByteLevel pre-tokenizers use (" " -> "Ġ",
    "\n" -> "Ċ", printable ASCII unchanged)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build_tokenizer():
    """Character-level tokenizer (one token per character of ``ALPHABET``) wrapped for transformers.

    Built as the pipeline Qwen2's tokenizer class has, so that the checkpoint is portable (issue
    19): transformers 5's ``AutoTokenizer`` picks the tokenizer class from the model type
    (``qwen2`` -> ``Qwen2Tokenizer``), which keeps only the vocabulary of ``tokenizer.json`` and
    rebuilds its own pipeline around it — NFC, Qwen2's split, ByteLevel, BPE with no unknown token.
    A character-level WordLevel vocabulary then lost every space and newline. So the vocabulary
    here is byte-level (each alphabet character as ByteLevel spells it) for a BPE with no merges:
    every character is one token whichever class loads the folder, with the ids the old WordLevel
    tokenizer gave (special tokens 0-2, then the alphabet in order). Characters outside the
    alphabet are dropped, as Qwen2's class drops them, rather than mapped to ``<unk>``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = byte_level_chars()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(chars[ord(c)] for c in ALPHABET))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, continuing_subword_prefix="",
                                end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, pad_token=PAD, unk_token=UNK, model_max_length=4096
    )


def build_tiny_model(vocab_size: int, eos_id: int, pad_id: int, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0):
    """A randomly initialised Qwen2ForCausalLM (float32) of ``spec``'s shape, seeded."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    return model


def save_model_folder(model, tokenizer, path: Path) -> Path:
    """Write an ordinary HF folder (safetensors weights + tokenizer files)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    portable_tokenizer_config(path)
    return path


def portable_tokenizer_config(path: Path) -> None:
    """Name the tokenizer class as every transformers version knows it: transformers 5 writes
    ``TokenizersBackend``, which 4.x cannot load (``Tokenizer class TokenizersBackend does not
    exist``); ``PreTrainedTokenizerFast`` is the same class in 5 and the tokenizer.json loader in 4."""
    import json

    config = Path(path) / "tokenizer_config.json"
    if not config.is_file():
        return
    data = json.loads(config.read_text())
    if data.get("tokenizer_class") == "TokenizersBackend":
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
        config.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def create_tiny_model(path: Path, *, seed: int = 0, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Create the random-init tiny default model at ``path`` (no download) and return the path."""
    tok = build_tokenizer()
    model = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, spec, seed)
    return save_model_folder(model, tok, path)


def is_model_folder(path: Path) -> bool:
    """True when ``path`` looks like a loadable HF folder (config + weights)."""
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


class ModelFolderError(ValueError):
    """A model path does not name a usable local folder (the operator's input: one line, exit 2)."""


# org/name, as the Hugging Face hub spells a repository id
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_folder(path: Path | str, *, weights: bool = True) -> Path:
    """``path`` as a model folder, or ModelFolderError saying what is wrong. A hub id (``org/name``)
    is explained: the node never downloads, so transformers would only answer with its own error."""
    p = Path(path).expanduser()
    if not p.is_dir():
        hint = ""
        if _HUB_ID.fullmatch(str(path)):
            hint = (f" ({str(path)!r} looks like a Hugging Face hub id: nodes never download; fetch it first, "
                    f"e.g. `hf download {path} --local-dir models/{p.name}`, and name that folder)")
        raise ModelFolderError(f"model folder not found: {p}{hint}")
    if weights and not is_model_folder(p):
        raise ModelFolderError(f"{p} is not a model folder: it needs config.json and *.safetensors weights")
    return p


_TURN_PROBE = "x"  # assistant content rendered to find what the template closes a turn with


def end_of_turn_token(tokenizer) -> str | None:
    """The special token ``tokenizer``'s chat template closes an assistant turn with (ChatML's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``), or None: no template, or no special token right after
    the turn. The model was tuned to stop there, so that token ends a completion: the tokenizer
    loader makes it the eos token (:func:`load_tokenizer`), the one stop token
    engines generate to and validators' termination check knows."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": _TURN_PROBE}],
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render a plain turn has no end of turn to find
        return None
    at = text.rfind(_TURN_PROBE)
    ids = tokenizer(text[at + len(_TURN_PROBE):], add_special_tokens=False)["input_ids"] if at >= 0 else []
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return tokenizer.convert_ids_to_tokens(ids[0]) if ids and ids[0] in special else None


def load_tokenizer(path: Path):
    """The tokenizer of a local HF folder, exactly as its ``tokenizer.json`` defines it.

    Why not plain ``AutoTokenizer``: transformers 5 picks the tokenizer class from the model type
    (``qwen2`` -> ``Qwen2Tokenizer``), which replaces the pipeline of ``tokenizer.json`` with its
    own. The embedded model's tokenizer is built to survive that (:func:`build_tokenizer`), but
    checkpoints made before it, and other folders, may not be: loading ``tokenizer.json`` through
    ``PreTrainedTokenizerFast`` keeps whatever the folder's author serialised. Folders with no
    ``tokenizer.json`` (slow tokenizers only) fall back to ``AutoTokenizer``. Pad defaults to eos.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = check_model_folder(path, weights=False)
    if (p / "tokenizer.json").is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    turn_end = end_of_turn_token(tok)
    if turn_end is not None and turn_end != tok.eos_token:
        tok.eos_token = turn_end  # generation stops where the chat template ends a turn (the model's own stop)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# transformers 5 builds a model on the meta device with process-wide patches in place, so two
# from_pretrained calls in different threads break each other: measured 87 of 90 concurrent loads
# of the tiny model failing ("Cannot copy out of meta tensor", lm_head left missing). Nodes load in
# worker threads (trio.to_thread), and several nodes or a validator's cache may load at once.
_LOAD_LOCK = threading.Lock()


def load_model(path: Path, *, device: str = "cpu", dtype=None):
    """A causal LM from a local HF folder, in eval mode, on ``device`` (never downloads)."""
    from transformers import AutoModelForCausalLM

    path = check_model_folder(path)
    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return model.to(device).eval()
