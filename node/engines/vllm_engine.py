"""vLLM engine (GPU): same interface as the torch engine, for real model sizes.

NOT RUN on the machines this project was built on (no GPU, no vllm): it is written against vLLM's
documented offline API (``vllm.LLM``, ``SamplingParams``, ``TokensPrompt``) and, for hidden states
and weight swaps, against the V0 engine's in-process model (``llm.llm_engine.model_executor.
driver_worker.model_runner.model``), the route INTELLECT-2's TOPLOC integration took. Treat it as
a starting point to validate on a GPU box, not as tested code. Module import never needs vllm.

Settings, following INTELLECT-2:

* ``VLLM_USE_V1=0`` and ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the model must live in this process
  for the hook (V1 runs it in a separate engine-core process).
* ``disable_async_output_proc=True``: with async output processing the captured states drift by one
  step under CUDA-graph padding (the off-by-one INTELLECT-2 reported).
* Final hidden states are captured by a forward *pre*-hook on the model's ``logits_processor``: its
  input is (lm_head, hidden_states, sampling_metadata); ``hidden_states`` are the outputs of the final
  norm for every scheduled token, and ``sampling_metadata.selected_token_indices`` picks the positions
  that produce the next token of each sequence — exactly the "decode positions" of
  ``node.proofs.capture`` (prefill's last position, then one per decode step).
* Each of the ``n`` samples of a prompt is submitted as its own request with ``n=1`` and its own seed
  (``sampling.sequence_seed``), so a sequence's randomness does not depend on its batch-mates. vLLM's
  sampler is not our Gumbel-max sampler, so a validator cannot replay vLLM's exact draws; it checks
  the log-probabilities instead.
* Log-probs: vLLM V0 returns log-softmax of the processed logits (after temperature and top-p); with
  top_p = 1 that equals our convention log softmax(logits / T).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .base import FINISH_LENGTH, FINISH_STOP, Sample
from .sampling import sequence_seed


def vllm_available() -> bool:
    """vllm importable and a CUDA device present: the only case the vLLM engine is chosen."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


class _StepRecorder:
    """Pre-hook on the logits processor: per sequence id, the final states that produced each token."""

    def __init__(self) -> None:
        self.states: dict[int, list] = {}  # seq_id -> [(H,) tensor on CPU]
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.prefix: dict[int, tuple[int, ...]] = {}  # seq_id -> output tokens before the latest step

    def __call__(self, _module, args):
        _lm_head, hidden, meta = args[0], args[1], args[2]
        # one device->host copy per step, in the model's dtype (bf16 bits are what TOPLOC proves)
        picked = hidden.index_select(0, meta.selected_token_indices).cpu()  # (num sampled, H)
        row = 0
        for group in meta.seq_groups:
            for seq_id in group.seq_ids:
                data = group.seq_data[seq_id]
                self.prompts.setdefault(seq_id, tuple(data.prompt_token_ids))
                self.prefix[seq_id] = tuple(data.output_token_ids)
                self.states.setdefault(seq_id, []).append(picked[row])
                row += 1


class VLLMEngine:
    """Engine on vLLM's offline ``LLM`` (one GPU)."""

    name = "vllm"

    def __init__(self, cfg=None):
        self.cfg = cfg
        self.llm = None
        self.path: Path | None = None
        self._tokenizer = None

    # -- loading ---------------------------------------------------------------------------

    def load(self, path: Path) -> None:
        os.environ.setdefault("VLLM_USE_V1", "0")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        from .model import load_tokenizer

        dtype = getattr(self.cfg, "dtype", "auto") or "auto"
        util = getattr(self.cfg, "gpu_memory_utilization", 0.85)
        self.llm = LLM(model=str(path), tokenizer=str(path), dtype=dtype, gpu_memory_utilization=util,
                       disable_async_output_proc=True, enable_prefix_caching=False, seed=0)
        self._tokenizer = load_tokenizer(path)
        self.path = Path(path)

    def _model(self):
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    def swap_weights(self, path: Path) -> None:
        """Stream the new safetensors into the running model (``model.load_weights``), no restart."""
        if self.llm is None:
            raise RuntimeError("swap_weights before load")
        from safetensors.torch import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors file")

        def tensors():
            for f in files:
                with safe_open(str(f), framework="pt") as fh:
                    for key in fh.keys():  # noqa: SIM118 - safe_open handles are not dicts
                        yield key, fh.get_tensor(key)

        self._model().load_weights(tensors())
        if hasattr(self.llm.llm_engine, "reset_prefix_cache"):  # cached KV of old weights must not be reused
            self.llm.llm_engine.reset_prefix_cache()
        self.path = Path(path)

    @property
    def tokenizer(self):
        return self._tokenizer

    # -- generation ------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int, capture_hidden: bool = True) -> list[list[Sample]]:
        if self.llm is None:
            raise RuntimeError("generate before load")
        if not prompts or n < 1 or max_new_tokens < 1 or any(len(p) == 0 for p in prompts):
            raise ValueError("need non-empty prompts, n >= 1 and max_new_tokens >= 1")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]
        seeds = [sequence_seed(seed, i, j) for i, j in rows]
        reqs = [TokensPrompt(prompt_token_ids=list(prompts[i])) for i, _ in rows]
        params = [SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                 seed=s % (2**31), logprobs=0, skip_special_tokens=True) for s in seeds]
        recorder = _StepRecorder() if capture_hidden else None
        handle = self._model().logits_processor.register_forward_pre_hook(recorder) if recorder else None
        try:
            outs = self.llm.generate(reqs, params, use_tqdm=False)
        finally:
            if handle is not None:
                handle.remove()
        eos = self._tokenizer.eos_token_id
        hidden_by_key = _states_by_prompt(recorder) if recorder else {}
        groups: list[list[Sample]] = [[] for _ in prompts]
        for (i, j), s, out in zip(rows, seeds, outs):
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            lps = [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
                   for t, d in zip(ids, comp.logprobs or [])]
            hidden = None
            if recorder is not None:
                hidden = _take_states(hidden_by_key, tuple(prompts[i]), ids)
            groups[i].append(Sample(
                prompt_index=i, sample_index=j, seed=s, prompt_ids=list(prompts[i]), completion_ids=ids,
                logprobs=lps, finish_reason=FINISH_STOP if ids and ids[-1] == eos else FINISH_LENGTH,
                hidden=hidden, text=comp.text,
            ))
        return groups


def _states_by_prompt(rec: _StepRecorder) -> dict[tuple, list]:
    """(prompt ids, output tokens before the last step) -> recorded state lists of such sequences."""
    out: dict[tuple, list] = {}
    for seq_id, states in sorted(rec.states.items()):
        out.setdefault((rec.prompts[seq_id], rec.prefix[seq_id]), []).append(states)
    return out


def _take_states(by_key: dict, prompt: tuple[int, ...], completion: Sequence[int]):
    """Pop the recorded sequence that generated ``completion`` after ``prompt``, stacked to (T, H).

    vLLM does not expose which internal sequence id served which request, so sequences are matched by
    prompt and by the tokens they had produced before their last step (all but the last token).
    Two sequences with the same key ran on identical inputs, so their states are interchangeable.
    """
    import torch

    pool = by_key.get((prompt, tuple(completion[:-1])), [])
    for k, states in enumerate(pool):
        if len(states) == len(completion):
            pool.pop(k)
            return torch.stack(states)
    return None
