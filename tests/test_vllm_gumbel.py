"""The vLLM engine's sampler (node/engines/vllm_gumbel.py), without vLLM: the processor's state
follows vLLM's batch updates and its rows are exactly the torch engine's draws.

The same processor inside a real vLLM: tests/vllm_real/test_vllm_cpu_engine.py."""

from __future__ import annotations

import enum
from types import SimpleNamespace as NS

import pytest
import torch

from node.engines.sampling import sample_tokens, sequence_seed
from node.engines.vllm_gumbel import EXTRA_KEY, GumbelDraws, draw_args, parse_draw

V = 50


class Move(enum.Enum):  # vLLM's MoveDirectionality, by name
    UNIDIRECTIONAL = 1
    SWAP = 2


def params(seed=None, temperature=1.0, top_p=1.0):
    return NS(extra_args=None if seed is None else draw_args(seed, temperature, top_p))


def torch_draw(logits_row, seed, step, temperature, top_p) -> int:
    tok, _ = sample_tokens(logits_row[None], torch.tensor([seed]), step, temperature, top_p)
    return int(tok[0])


def test_each_row_is_the_torch_engines_draw_at_its_own_step_and_others_are_untouched():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 0.5  # flat enough that the noise decides
    seeds = [sequence_seed(5, i, 0) for i in range(4)]
    outs = [[1, 2, 3], [], [7], [4, 4]]  # each request's tokens so far: its decode step is their count
    draws = GumbelDraws()
    draws.update([], [(0, params(seeds[0]), [9], outs[0]), (1, params(seeds[1], 0.7, 0.9), [9], outs[1]),
                      (2, params(), [9], outs[2]), (3, params(seeds[3]), [9], outs[3])], [])
    before = logits.clone()
    out = draws.apply(logits)
    assert torch.equal(out[2], before[2])  # no extra_args: vLLM's own sampling, untouched
    for row, (temperature, top_p) in ((0, (1.0, 1.0)), (1, (0.7, 0.9)), (3, (1.0, 1.0))):
        want = torch_draw(before[row], seeds[row], len(outs[row]), temperature, top_p)
        assert out[row].argmax().item() == want and out[row][want] == 0
        assert torch.isinf(out[row]).sum() == V - 1
    # the step is read live: one more token, another draw (with these seeds and logits it differs)
    outs[0].append(5)
    again = draws.apply(before.clone())
    assert again[0].argmax().item() == torch_draw(before[0], seeds[0], 4, 1.0, 1.0)
    assert torch_draw(before[0], seeds[0], 4, 1.0, 1.0) != torch_draw(before[0], seeds[0], 3, 1.0, 1.0)


def test_the_slots_follow_removals_additions_moves_and_swaps():
    draws = GumbelDraws()
    draws.update([], [(0, params(10), [], []), (1, params(11), [], []), (2, params(12), [], [])], [])
    draws.update([1], [], [(2, 1, Move.UNIDIRECTIONAL)])  # 1 left; 2 condensed into its slot
    assert {k: d.seed for k, d in draws.slots.items()} == {0: 10, 1: 12}
    draws.update([], [(2, params(13), [], [])], [(0, 1, Move.SWAP)])
    assert {k: d.seed for k, d in draws.slots.items()} == {0: 12, 1: 10, 2: 13}
    draws.update([], [(0, params(), [], [])], [])  # a request without our rule takes slot 0
    assert {k: d.seed for k, d in draws.slots.items()} == {1: 10, 2: 13}
    logits = torch.zeros(2, V)  # fewer rows than slots held: only existing rows are drawn
    assert set(draws.choose(logits)) == {1}


@pytest.mark.parametrize("bad", [[1, 1.0], [-1, 1.0, 1.0], [1 << 63, 1.0, 1.0], [1, 0.0, 1.0], [1, 1.0, 1.5],
                                 [1, 1.0, 0.0], "x", [1, "hot", 1.0]])
def test_a_malformed_entry_is_refused(bad):
    with pytest.raises(ValueError, match=EXTRA_KEY):
        parse_draw({EXTRA_KEY: bad})
    assert parse_draw({"other": 1}) is None and parse_draw(None) is None


def test_both_engines_are_replayed_by_default():
    from node.rl.config import InferenceConfig
    from node.validator.pipeline import BatchRules

    assert InferenceConfig().replayed_engines() == ("torch", "vllm")
    rules = BatchRules(run="r", taskset="synthetic", temperature=1.0, top_p=1.0, max_new_tokens=8, group_size=2,
                       prompts_per_batch=1, async_level=1)
    assert rules.replays("vllm") and rules.replays("torch")
