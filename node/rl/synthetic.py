"""The synthetic demo task: reverse a string of digits.

Prompt ``"rev 4821="``, answer ``"1284"``, then eos. Why this task: it needs the model to attend back
over the prompt in a position-dependent way (not a bag-of-tokens trick), its reward is graded (each
correct digit in place counts), so even a weak policy sees signal in most groups, and a ~0.1M
parameter model can get good at it. The reward is computed by :func:`reversal_reward`.

Generated deterministically from a seed (tasks are data, not code: :func:`write_taskset` produced the
packaged ``node/data/synthetic.jsonl``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPT_PREFIX = "rev "
PROMPT_SUFFIX = "="
MIN_DIGITS, MAX_DIGITS = 3, 6


def reversal_prompt(digits: str) -> str:
    return f"{PROMPT_PREFIX}{digits}{PROMPT_SUFFIX}"


def make_reversal_tasks(count: int, seed: int, min_digits: int = MIN_DIGITS, max_digits: int = MAX_DIGITS) -> list[dict]:
    """``count`` task records (JSONL-shaped dicts) from ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = rng.randint(min_digits, max_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        out.append({
            "id": f"rev-{seed}-{i}",
            "kind": "synthetic",
            "prompt": reversal_prompt(digits),
            "answer": digits[::-1],
            "metadata": {"task": "reverse", "digits": n},
        })
    return out


EVAL_SEED = 2**31 - 1  # the held-out reversals' seed (the packaged set was made with seed 1)


def held_out_reversals(count: int, exclude: set[str], seed: int = EVAL_SEED) -> list[dict]:
    """``count`` reversal task records whose prompts are none of ``exclude`` (a set's own prompts), from
    ``seed``: an evaluation draw no worker can be asked to train on. Ids ``eval-<seed>-<i>``, so they
    never clash with a set's ``rev-`` ids. Bounded: 1.1 M digit strings exist and a set holds at most
    node/rl/tasks.py's MAX_TASKS, so each task takes a few tries at most."""
    rng = random.Random(seed)
    out: list[dict] = []
    seen = set(exclude)
    for _ in range(100 * count + 1000):
        if len(out) == count:
            break
        n = rng.randint(MIN_DIGITS, MAX_DIGITS)
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        prompt = reversal_prompt(digits)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"id": f"eval-{seed}-{len(out)}", "kind": "synthetic", "prompt": prompt, "answer": digits[::-1],
                    "metadata": {"task": "reverse", "digits": n}})
    return out


def reversal_reward(completion: str, answer: str) -> float:
    """Graded reward in [0, 1]: digits in the right place / max(len(completion), len(answer)).

    Dividing by the longer length punishes both missing and extra characters, so only the exact
    answer scores 1.
    """
    text = completion.strip()
    if not answer:
        return 0.0
    hits = sum(1 for a, b in zip(text, answer) if a == b)
    return hits / max(len(text), len(answer))


def write_taskset(path: Path, count: int = 2000, seed: int = 1) -> Path:
    """Write a reversal task set as JSONL (how node/data/synthetic.jsonl was made: count=2000, seed=1)."""
    path = Path(path)
    with path.open("w") as f:
        for rec in make_reversal_tasks(count, seed):
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    return path
