"""The torch/transformers engine: batched sampling on CPU or one GPU, any HF causal LM folder.

How this works: all ``len(prompts) * n`` sequences run as one batch. Prompts are left-padded so the
last prompt token of every row sits in the same column; position ids count real tokens only, so
padding changes nothing. One prefill call fills the KV cache, then one decode call per new token.
Tokens come from :func:`sampling.sample_tokens` (per-sequence seeded Gumbel-max: a sequence's tokens
do not depend on its batch-mates). Rows that produced eos keep running (feeding pad) until every row is
done or ``max_new_tokens`` is reached; their extra outputs are discarded.

Final hidden states are recorded by the proofs module's hook (``node.proofs.capture``) around the
same forward calls, so the engine never computes them twice.

Two decode paths, the same tokens (tests/test_engine.py checks it on CPU):

* ``dynamic``: transformers' DynamicCache grows by one position per step; the capture hook records
  the final-norm output of every forward call. Shapes change every step, so nothing can be
  captured into a graph; on a GPU each step is bound by kernel-launch overhead.
* ``static``: one StaticCache of fixed shape (rows x prompt + max_new_tokens, rounded up to
  ``STATIC_ROUND`` so that prompts of similar lengths share it), a fixed-shape attention mask over
  the whole cache, and an explicit decode step (decoder -> final-norm states -> LM head) that
  returns the (B, H) states TOPLOC proves with the logits. ``compiled`` additionally wraps that
  step in ``torch.compile(mode="reduce-overhead")``, which records it as a CUDA graph (GPU only;
  transformers' StaticCache marks its tensors as static addresses for exactly this).
  ``auto`` is ``compiled`` on CUDA and ``dynamic`` on CPU. Only decoders whose logits are the LM
  head of the final-norm output take these paths (Llama/Qwen/Mistral families); others fall back
  to ``dynamic``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from .model import load_model, load_tokenizer
from .base import FINISH_LENGTH, FINISH_STOP, Sample
from .sampling import sample_tokens, sequence_seed

log = logging.getLogger(__name__)

DECODE_MODES = ("auto", "dynamic", "static", "compiled")
STATIC_ROUND = 64  # static cache length is rounded up to a multiple of this (fewer distinct shapes)
MAX_STATIC_SHAPES = 4  # static caches (and compiled steps) kept per engine, least recent dropped
# model types whose logits are lm_head(final norm output): the static path computes them that way
STATIC_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})


def pick_device(requested: str = "auto") -> str:
    """"auto" -> "cuda" when available, else "cpu"."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


class TorchEngine:
    """Engine on plain PyTorch + transformers (always available)."""

    name = "torch"

    def __init__(self, device: str = "auto", dtype: torch.dtype | None = None, decode: str = "auto"):
        if decode not in DECODE_MODES:
            raise ValueError(f"decode: one of {', '.join(DECODE_MODES)}, got {decode!r}")
        self.device = pick_device(device)
        self.dtype = dtype
        self.decode = decode
        self.model = None
        self._tokenizer = None
        self.path: Path | None = None
        self._static: dict[tuple, tuple] = {}  # (rows, cache len) -> (StaticCache, step fn), insertion = recency

    def decode_mode(self) -> str:
        """The path :meth:`generate` takes for the loaded model: "dynamic", "static" or "compiled"."""
        mode = self.decode
        if mode == "auto":
            mode = "compiled" if self.device.startswith("cuda") else "dynamic"
        if mode != "dynamic" and not _static_capable(self.model):
            return "dynamic"
        if mode == "compiled" and not self.device.startswith("cuda"):
            return "static"  # graphs are a GPU affair; the static cache alone still works on CPU
        return mode

    # -- loading ---------------------------------------------------------------------------

    def load(self, path: Path) -> None:
        self._static.clear()
        self.model = load_model(path, device=self.device, dtype=self.dtype)
        self._tokenizer = load_tokenizer(path)
        self.path = Path(path)

    def swap_weights(self, path: Path) -> None:
        """Copy a new checkpoint's tensors into the loaded model in place.

        Refuses (ValueError) a checkpoint whose tensor names or shapes differ: a new architecture
        needs ``load``. Uses safetensors directly so no second model is built in memory.
        """
        if self.model is None:
            raise RuntimeError("swap_weights before load")
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors file")
        incoming: dict[str, torch.Tensor] = {}
        for f in files:
            incoming.update(load_file(str(f)))
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        # Tied embeddings are saved once; every parameter must still be covered.
        missing = [k for k, p in self.model.state_dict().items() if k not in incoming and not _is_tied(self.model, k)]
        unexpected = [k for k in incoming if k not in params]
        if missing or unexpected:
            raise ValueError(f"{path}: weights do not match the loaded architecture "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        with torch.no_grad():
            for name, tensor in incoming.items():
                target = params[name]
                if target.shape != tensor.shape:
                    raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self.path = Path(path)

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def dtype_name(self) -> str:
        if self.model is None:
            raise RuntimeError("dtype_name before load")
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    # -- generation ------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
        capture_hidden: bool = True,
    ) -> list[list[Sample]]:
        if self.model is None:
            raise RuntimeError("generate before load")
        if not prompts or n < 1 or max_new_tokens < 1:
            raise ValueError("need at least one prompt, n >= 1 and max_new_tokens >= 1")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        tok = self._tokenizer
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]
        seeds = [sequence_seed(seed, i, j) for i, j in rows]
        B, L = len(rows), max(len(p) for p in prompts)
        dev = self.device

        input_ids = torch.full((B, L), pad, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for r, (i, _) in enumerate(rows):
            p = list(prompts[i])
            input_ids[r, L - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, L - len(p):] = 1
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        seed_t = torch.tensor(seeds, dtype=torch.int64, device=dev)

        tokens = torch.empty((B, max_new_tokens), dtype=torch.long, device=dev)
        logps = torch.empty((B, max_new_tokens), dtype=torch.float32, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=dev)

        if self.decode_mode() != "dynamic":
            args = (input_ids, mask, positions, seed_t, max_new_tokens, temperature, top_p, eos, pad, capture_hidden)
            try:
                tokens, logps, lengths, hidden, _ = self._decode_static(*args)
            except Exception as e:  # noqa: BLE001 - torch.compile/graph failures have no common type
                if self.decode_mode() != "compiled":
                    raise
                # Our environment's fault, not the caller's: keep generating without graphs. The
                # sampling is seeded per sequence, so redoing the call gives the same samples.
                log.warning("torch engine: compiled decode failed (%s: %s); using the static cache without "
                            "CUDA graphs from now on", type(e).__name__, str(e)[:200])
                self.decode = "static"
                self._static.clear()
                tokens, logps, lengths, hidden, _ = self._decode_static(*args)
            return self._samples(prompts, rows, seeds, tokens, logps, lengths, hidden)

        from transformers import DynamicCache

        kv = {_cache_kwarg(self.model): DynamicCache()}
        with _maybe_capture(self.model, capture_hidden) as cap:
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                             use_cache=True, **kv, **_last_logits_only(self.model))
            logits = out.logits[:, -1, :]  # (B, V)
            next_pos = positions[:, -1] + 1  # (B,)
            steps = 0
            for t in range(max_new_tokens):
                tok_t, lengths = _take_token(logits, seed_t, t, temperature, top_p, eos, pad, done, tokens, logps, lengths)
                steps = t + 1
                if bool(done.all()) or t + 1 == max_new_tokens:
                    break
                mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=dev)], dim=1)
                out = self.model(input_ids=tok_t[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                                 use_cache=True, **kv)
                logits = out.logits[:, -1, :]
                next_pos = next_pos + 1
            hidden = _generated_hidden(cap, B, steps) if cap is not None else None  # (B, steps, H)
        return self._samples(prompts, rows, seeds, tokens, logps, lengths, hidden)

    def _samples(self, prompts, rows, seeds, tokens, logps, lengths, hidden) -> list[list[Sample]]:
        """Per-prompt groups of :class:`Sample` from the (B, steps) outputs of either decode path."""
        tok = self._tokenizer
        eos = tok.eos_token_id
        tokens_c, logps_c, lengths_c = tokens.cpu(), logps.cpu(), lengths.cpu()
        groups: list[list[Sample]] = [[] for _ in prompts]
        for r, (i, j) in enumerate(rows):
            k = int(lengths_c[r])
            ids = tokens_c[r, :k].tolist()
            finish = FINISH_STOP if ids and ids[-1] == eos else FINISH_LENGTH
            groups[i].append(Sample(
                prompt_index=i, sample_index=j, seed=seeds[r], prompt_ids=list(prompts[i]),
                completion_ids=ids, logprobs=logps_c[r, :k].tolist(), finish_reason=finish,
                hidden=None if hidden is None else hidden[r, :k].cpu(),  # model dtype kept (bf16 bits matter to TOPLOC)
                text=tok.decode(ids, skip_special_tokens=True),
            ))
        return groups

    def _static_step(self, rows: int, length: int):
        """(StaticCache, decode step) for ``rows`` x ``length``, kept for reuse (bounded, LRU)."""
        key = (rows, length)
        if key in self._static:
            entry = self._static.pop(key)
            self._static[key] = entry  # most recent last
            entry[0].reset()
            return entry
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=length)
        decoder, head = self.model.get_decoder(), self.model.get_output_embeddings()
        kw = _cache_kwarg(decoder)

        def step(input_ids, position_ids, mask):
            """(B, S) tokens -> (final-norm states of the last position (B, H), logits (B, V))."""
            out = decoder(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                          **{kw: cache})
            h = out.last_hidden_state[:, -1]
            return h, head(h)

        fn = step
        if self.decode_mode() == "compiled":
            fn = torch.compile(step, mode="reduce-overhead", dynamic=False, fullgraph=False)
        while len(self._static) >= MAX_STATIC_SHAPES:
            self._static.pop(next(iter(self._static)))
        self._static[key] = (cache, step, fn)
        return self._static[key]

    def _decode_static(self, input_ids, mask, positions, seed_t, max_new_tokens, temperature, top_p, eos, pad,
                       capture_hidden):
        """The static-cache path of :meth:`generate` (see the module docstring); same outputs as dynamic."""
        B, L = input_ids.shape
        dev = input_ids.device
        length = -(-(L + max_new_tokens) // STATIC_ROUND) * STATIC_ROUND
        _cache, prefill, step = self._static_step(B, length)
        compiled = step is not prefill
        full = torch.zeros((B, length), dtype=mask.dtype, device=dev)  # fixed shape: one graph for every step
        full[:, :L] = mask
        tokens = torch.empty((B, max_new_tokens), dtype=torch.long, device=dev)
        logps = torch.empty((B, max_new_tokens), dtype=torch.float32, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=dev)
        states = []  # (B, H) per generated token
        h, logits = prefill(input_ids, positions, full)  # the prefill is never compiled (one shape per prompt set)
        next_pos = positions[:, -1] + 1
        steps = 0
        for t in range(max_new_tokens):
            if capture_hidden:
                states.append(h.clone())  # a graph replay overwrites its outputs
            tok_t, lengths = _take_token(logits, seed_t, t, temperature, top_p, eos, pad, done, tokens, logps, lengths)
            steps = t + 1
            if bool(done.all()) or t + 1 == max_new_tokens:
                break
            full[:, L + t] = 1
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            h, logits = step(tok_t[:, None], next_pos[:, None], full)
            next_pos = next_pos + 1
        hidden = torch.stack(states, dim=1) if capture_hidden else None  # (B, steps, H)
        return tokens[:, :steps], logps[:, :steps], lengths, hidden, steps


def _take_token(logits, seed_t, t, temperature, top_p, eos, pad, done, tokens, logps, lengths):
    """Sample token ``t`` of every row (our seeded sampler), pad rows already done, and write it into
    ``tokens``/``logps``; marks rows ending here in ``done`` (in place) and returns (token, lengths).
    One step shared by both decode paths, so they cannot drift apart."""
    tok_t, lp_t = sample_tokens(logits, seed_t, t, temperature, top_p)
    tok_t = torch.where(done, torch.full_like(tok_t, pad), tok_t)
    tokens[:, t], logps[:, t] = tok_t, lp_t
    newly = (~done) & (tok_t == eos)
    lengths = torch.where(newly, torch.full_like(lengths, t + 1), lengths)
    done |= newly
    return tok_t, lengths


def _static_capable(model) -> bool:
    """The static path computes logits as lm_head(final-norm states): true for these decoder families."""
    cfg = getattr(model, "config", None)
    return (cfg is not None and getattr(cfg, "model_type", "") in STATIC_MODEL_TYPES
            and model.get_output_embeddings() is not None and not getattr(cfg, "final_logit_softcapping", None))


def _cache_kwarg(model) -> str:
    """Name of the KV-cache argument: transformers >= 5.2x calls it ``cache``, older ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _last_logits_only(model) -> dict:
    """Ask the prefill for the last position's logits only, where the model supports it."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _is_tied(model, key: str) -> bool:
    """True for the output projection when the model ties it to the input embedding."""
    return bool(getattr(model.config, "tie_word_embeddings", False)) and key.endswith("lm_head.weight")


class _NoCapture:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _maybe_capture(model, enabled: bool):
    """The proofs module's final-hidden-state hook, or a no-op when capture is off."""
    if not enabled:
        return _NoCapture()
    from ..proofs.capture import capture_final_hidden

    return capture_final_hidden(model)


def _generated_hidden(cap, batch: int, steps: int) -> torch.Tensor:
    """(B, steps, H): the final hidden state that produced each generated token.

    Token 0 comes from the prefill's last position, token t > 0 from decode call t - 1: the
    "decode position" convention of ``node.proofs.capture`` (one captured step per forward call).
    """
    states = cap.stacked()
    if states.shape[0] != batch or states.shape[1] != steps:
        raise RuntimeError(f"captured {tuple(states.shape[:2])} states for ({batch}, {steps}) tokens")
    return states
