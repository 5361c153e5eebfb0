"""Verifiers: a completion's text -> a task reward in [0, 1].

* synthetic: the graded digit-reversal score (``node.rl.synthetic.reversal_reward``).
* math: extract the final answer (``\\boxed{...}``, then "answer: ...", "#### ...", then the last
  number in the text) and compare it with the reference: exact after normalisation, else numerically
  (integers, decimals, fractions ``a/b`` and ``\\frac{a}{b}``, percentages, thousands separators)
  with exact rational comparison and a 1e-6 relative tolerance for decimals. No symbolic
  equivalence: that needs a CAS (sympy), which the node does not depend on — "x+1" and "1+x" differ.
* code: run the candidate followed by the task's tests (assert statements) in the sandbox; 1 when the
  program exits 0 within the limits, else 0. A crash, hang, fork bomb or memory blow-up is 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from .sandbox import DEFAULT_LIMITS, Limits, run_python
from .synthetic import reversal_reward
from .tasks import Task

MAX_COMPLETION_CHARS = 200_000  # longer completions are scored on their first part only
REL_TOL = 1e-6

_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_LINE = re.compile(r"(?:final answer|answer)\s*(?:is)?\s*[:=]?\s*(.+)", re.IGNORECASE)
_HASHES = re.compile(r"####\s*(.+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*-?\d+)?%?|-?\.\d+%?")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def _boxed_contents(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}``, braces balanced."""
    last = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            last = text[m.end():i - 1]
    return last


def extract_math_answer(text: str) -> str | None:
    """The final answer of a math completion, or None when there is none to find."""
    text = text[:MAX_COMPLETION_CHARS]
    boxed = _boxed_contents(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASHES, _ANSWER_LINE):
        found = pattern.findall(text)
        if found:
            return found[-1].strip().splitlines()[0].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


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
    s = s.replace(",", "")
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
    text = completion[:MAX_COMPLETION_CHARS]
    blocks = _CODE_BLOCK.findall(text)
    if blocks:
        return blocks[-1]
    return text.split("```", 1)[0]


@dataclass(frozen=True)
class CodeVerdict:
    reward: float
    reason: str  # "passed" | "failed" | "timeout" | "error: ..."
    isolation: str


def code_verdict(completion: str, tests: str, limits: Limits = DEFAULT_LIMITS) -> CodeVerdict:
    """Run candidate + tests in the sandbox; reward 1 only on a clean exit within the limits."""
    program = extract_code(completion) + "\n\n# --- tests ---\n" + tests + "\n"
    res = run_python(program, limits)
    if res.timed_out:
        return CodeVerdict(0.0, "timeout", res.isolation)
    if res.returncode == 0:
        return CodeVerdict(1.0, "passed", res.isolation)
    if res.returncode is None:
        return CodeVerdict(0.0, "error: " + res.stderr[-200:], res.isolation)
    return CodeVerdict(0.0, "failed", res.isolation)


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
