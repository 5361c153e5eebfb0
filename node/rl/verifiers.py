"""Verifiers: a completion's text -> a task reward in [0, 1].

Every verifier assumes the completion is hostile: a permissionless worker's rewards become the
gradient, so anything that scores without solving the task is a hack RL will find (issue 13; the
tables of tests/test_reward_hacks.py list the attacks and the reward each must get).

* synthetic: the graded digit-reversal score (``node.rl.synthetic.reversal_reward``): matching
  digits in place over the longer of answer and completion, so only the exact answer scores 1;
  repeating it, echoing the prompt or padding the output all score less.
* math: exactly what is accepted —

  - a completion of at most ``MAX_COMPLETION_CHARS`` characters (longer: 0, never truncated, so no
    second answer can hide past the cut);
  - if it contains ``\\boxed`` anywhere: exactly one ``\\boxed{...}``, braces balanced; its
    content is the answer. Two boxes (even equal ones, or nested), an unclosed box or ``\\boxed``
    without a brace: 0;
  - otherwise exactly one ``####`` marker (GSM8K style); the rest of its line is the answer. Two
    markers or none: 0. No other fallback (no "answer:" line, no "last number in the text"):
    either would reward listing numbers;
  - the answer is at most ``MAX_ANSWER_CHARS`` characters and has no whitespace between two digits
    (``4 2`` reads as two answers, not 42);
  - it equals the reference exactly after normalisation (``$``, ``\\(``, ``\\text{}``,
    ``\\left``/``\\right``, spaces, a trailing period, case), or numerically: integers, decimals,
    fractions ``a/b`` and ``\\frac{a}{b}``, percentages, thousands separators only in groups of
    three (``1,024``; ``1,2,3`` is a list, not 123), compared as exact rationals with a 1e-6
    relative tolerance for decimals. No symbolic equivalence: that needs a CAS (sympy), which the
    node does not depend on — "x+1" and "1+x" differ.
* code: the candidate is run in the sandbox by a harness that reports the values of the task's
  test calls; the node compares them with the expected values, which never enter the sandbox
  (node/rl/harness.py: what that stops, and why exit status means nothing). 1 when every check
  holds within the limits, else 0. A crash, hang, early exit, fork bomb or memory blow-up is 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from .harness import harness_program, judge_report, new_nonce, parse_tests
from .sandbox import DEFAULT_LIMITS, Limits, run_python
from .synthetic import reversal_reward
from .tasks import Task

MAX_COMPLETION_CHARS = 200_000  # longer completions score 0 (never truncated: a cut could hide a second answer)
MAX_ANSWER_CHARS = 256  # a math answer longer than this is not an answer
REL_TOL = 1e-6

_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####[ \t]*(.+)")
_SPACED_DIGITS = re.compile(r"\d\s+\d")
_GROUPED = re.compile(r"(?<![\d,])\d{1,3}(?:,\d{3})+(?![\d,])")  # 1,024 and 1,000,000: thousands separators
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def _boxed_contents(text: str) -> str | None:
    """Contents of the one ``\\boxed{...}`` (braces balanced); None when there are several, or it is
    unclosed or has no brace. Counting first keeps this linear however many boxes are opened."""
    if text.count("\\boxed") != 1:
        return None
    m = _BOXED.search(text)
    if m is None:
        return None
    depth, i = 1, m.end()
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[m.end():i - 1] if depth == 0 else None


def extract_math_answer(text: str) -> str | None:
    """The one final answer of a math completion, or None (module docstring: exactly what counts)."""
    if len(text) > MAX_COMPLETION_CHARS:
        return None
    if "\\boxed" in text:
        found = _boxed_contents(text)
    elif text.count("####") == 1:
        m = _HASHES.search(text)
        found = m.group(1) if m else None
    else:
        return None
    if found is None:
        return None
    found = found.strip()
    if not found or len(found) > MAX_ANSWER_CHARS or _SPACED_DIGITS.search(found):
        return None
    return found


def normalize_answer(s: str) -> str:
    """Strip formatting that does not change a value: $, \\(, \\), spaces, trailing period, \\text{}, \\left/\\right."""
    s = s.strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("$", "").replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".").lower()


def parse_number(s: str) -> Fraction | None:
    """A normalised answer as an exact rational, or None if it is not a plain number."""
    if "," in s:  # only as thousands separators: "1,2,3" is a list, not 123
        s = _GROUPED.sub(lambda m: m.group(0).replace(",", ""), s)
        if "," in s:
            return None
    pct = s.endswith("%")
    if pct:
        s = s[:-1]
    m = re.fullmatch(r"\(?(-?\d*\.?\d+)\)?(?:/\(?(-?\d*\.?\d+)\)?)?", s)
    if not m:
        return None
    try:
        value = Fraction(m.group(1))
        if m.group(2) is not None:
            den = Fraction(m.group(2))
            if den == 0:
                return None
            value /= den
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if pct else value


def math_equal(candidate: str, reference: str) -> bool:
    """Exact after normalisation, or numerically equal (exact rationals; 1e-6 relative for decimals)."""
    a, b = normalize_answer(candidate), normalize_answer(reference)
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    if x is None or y is None:
        return False
    if x == y:
        return True
    return abs(x - y) <= REL_TOL * max(abs(x), abs(y))


def math_reward(completion: str, answer: str) -> float:
    found = extract_math_answer(completion)
    return 1.0 if found is not None and math_equal(found, answer) else 0.0


def extract_code(completion: str) -> str:
    """The program in a completion: the last fenced Python block; else, when the prompt opened the
    fence itself (our code prompts end with "```python"), the text before the closing fence; else
    the whole completion."""
    blocks = _CODE_BLOCK.findall(completion)
    if blocks:
        return blocks[-1]
    return completion.split("```", 1)[0]


@dataclass(frozen=True)
class CodeVerdict:
    reward: float
    reason: str  # "passed" | "failed" (the report shows a check failing) | "timeout" | "error: ..." (no report)
    isolation: str
    detail: str = ""  # which check failed, or why no report came back


def code_verdict(completion: str, tests: str, limits: Limits = DEFAULT_LIMITS) -> CodeVerdict:
    """Run the candidate under the harness in the sandbox; reward 1 only when the node, comparing the
    reported values with the expected ones itself, finds every check holding (node/rl/harness.py).

    ``tests`` must be of the harness's shape (task files are checked when they load); anything else
    raises :class:`node.rl.harness.TestFormatError` — our bug, not the candidate's.
    """
    checks = parse_tests(tests)
    if len(completion) > MAX_COMPLETION_CHARS:
        return CodeVerdict(0.0, "error: completion too long", "not run")
    nonce = new_nonce()
    res = run_python(harness_program(extract_code(completion), checks, nonce), limits)
    if res.timed_out:
        return CodeVerdict(0.0, "timeout", res.isolation)
    outcome = judge_report(res.stdout, nonce, checks)
    if outcome.passed:
        return CodeVerdict(1.0, "passed", res.isolation)
    if outcome.reported:
        return CodeVerdict(0.0, "failed", res.isolation, outcome.detail)
    return CodeVerdict(0.0, f"error: {outcome.detail}", res.isolation, res.stderr[-200:])


def code_reward(completion: str, tests: str, limits: Limits = DEFAULT_LIMITS) -> float:
    return code_verdict(completion, tests, limits).reward


def task_reward(task: Task, completion: str, code_limits: Limits = DEFAULT_LIMITS) -> float:
    """The reward of ``completion`` for ``task`` (dispatch on the task kind)."""
    if task.kind == "synthetic":
        return reversal_reward(completion, task.answer or "")
    if task.kind == "math":
        return math_reward(completion, task.answer or "")
    if task.kind == "code":
        return code_reward(completion, task.tests or "", code_limits)
    raise ValueError(f"unknown task kind {task.kind!r}")
