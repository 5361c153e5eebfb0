"""Scorers on untrusted text are bounded (issue 40, item 3): a completion crafted to make a scorer
hang or allocate scores 0 and costs at most the bound; the honest calls beside it are unaffected.

The crafted answers go to real reasoning-gym 0.1.25 scorers that parse the answer (puzzle24 hands it
to sympy's ``parse_expr``, string_insertion to ``eval``): the families the bound exists for. The run
may not use those generators at all (node/rl/gym.py ``AUDITED``); the bound is tested on them
because they are the scorers a completion can make misbehave.
"""

from __future__ import annotations

import os
import signal

import reasoning_gym

from node.rl import bounded
from node.rl.bounded import Bound, Call, score_bounded


def gym_call(generator: str, seed: int, answer: str) -> Call:
    return Call("reasoning-gym", {"generator": generator, "options": {}, "seed": seed, "answer": answer})


def oracle(generator: str, seed: int) -> str:
    return reasoning_gym.create_dataset(generator, size=1, seed=seed)[0]["answer"]


def test_a_completion_that_makes_the_scorer_hang_scores_0_within_the_time_bound():
    right = oracle("puzzle24", 3)
    calls = [gym_call("puzzle24", 3, right), gym_call("puzzle24", 3, "9**9**9**9"), gym_call("puzzle24", 3, right)]
    out = score_bounded(calls, Bound(time_s=3.0, memory_mb=256))
    assert [(o.score, o.reason) for o in out] == [(1.0, "ok"), (0.0, "timeout"), (1.0, "ok")]


def test_a_completion_that_makes_the_scorer_allocate_scores_0_within_the_memory_bound():
    # string_insertion evals the answer as a list of characters: 0.1 when it spells the oracle.
    right = oracle("string_insertion", 5)
    small = f"(bytearray(1000) and None) or list({right!r})"
    huge = f"(bytearray(int(2e9)) and None) or list({right!r})"  # 2 GB before the same list
    out = score_bounded([gym_call("string_insertion", 5, small), gym_call("string_insertion", 5, huge)],
                        Bound(time_s=30.0, memory_mb=256))
    assert [o.score for o in out] == [0.1, 0.0]


def test_a_scorer_that_kills_its_process_scores_0_and_the_next_call_is_answered():
    right = oracle("string_insertion", 5)
    kill = "__import__('os').kill(__import__('os').getpid(), 9)"
    out = score_bounded([gym_call("string_insertion", 5, kill), gym_call("string_insertion", 5, right)], Bound())
    assert [(o.score, o.reason) for o in out] == [(0.0, "crashed"), (1.0, "ok")]


def test_a_dead_scoring_server_is_replaced():
    right = oracle("chain_sum", 1)
    assert score_bounded([gym_call("chain_sum", 1, right)], Bound())[0].score == 1.0
    proc = bounded._SERVER._proc
    os.kill(proc.pid, signal.SIGKILL)  # the server this test process started
    proc.wait()
    assert score_bounded([gym_call("chain_sum", 1, right)], Bound())[0].score == 1.0
    assert bounded._SERVER._proc.pid != proc.pid


def test_every_answer_of_a_batch_is_read_however_the_pipe_delivers_them():
    """The server's answers can arrive together: each of a batch of honest calls scores, none is
    left unread in a buffer and reported as a crash."""
    calls = [gym_call("chain_sum", s, oracle("chain_sum", s)) for s in range(20)]
    assert [(o.score, o.reason) for o in score_bounded(calls, Bound())] == [(1.0, "ok")] * 20
