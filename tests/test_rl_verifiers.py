"""Verifiers: math answers, and code run in the sandbox (hostile programs included)."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from waiting import wait_until

from node.rl.sandbox import Limits, run_python
from node.rl.tasks import Task
from node.rl.verifiers import (
    code_verdict,
    extract_code,
    extract_math_answer,
    math_equal,
    math_reward,
    task_reward,
)

FAST = Limits(wall_s=3.0, cpu_s=2, memory_mb=256, output_kb=16)
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


# -- math ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("so the result is \\boxed{42}.", "42"),
    ("so \\boxed{x^{2}}", "x^{2}"),  # nested braces
    ("\\boxed{\\frac{7}{8}} and later \\boxed{x^{2}}", None),  # two answers: none
    ("#### 1,024", "1,024"),
    ("The answer is: 12 apples", None),  # only a box or one #### line counts
    ("first 3 then 5 then 7.", None),  # no "last number" fallback: it would pay for listing numbers
    ("no numbers here", None),
])
def test_math_answer_extraction(text, want):
    assert extract_math_answer(text) == want


@pytest.mark.parametrize("a, b", [
    ("42", "42"), ("42.0", "42"), ("1,024", "1024"), ("\\frac{7}{8}", "7/8"), ("0.875", "7/8"),
    ("$12$", "12"), ("12.", "12"), ("50%", "0.5"), ("-5", "-5"), ("\\text{ 9 }", "9"),
    ("0.3333333333", "1/3"), ("X + 1", "x+1"),
])
def test_math_equal(a, b):
    assert math_equal(a, b)


@pytest.mark.parametrize("a, b", [("41", "42"), ("7/9", "7/8"), ("0.33", "1/3"), ("1/0", "0"), ("x+1", "1+x"), ("", "3")])
def test_math_not_equal(a, b):
    assert not math_equal(a, b)


def test_math_reward_correct_wrong_malformed():
    assert math_reward("thinking... \\boxed{72}", "72") == 1.0
    assert math_reward("thinking... \\boxed{71}", "72") == 0.0
    assert math_reward("\\boxed{72", "72") == 0.0  # unclosed box: no answer (no fallback to the last number)
    assert math_reward("I don't know", "72") == 0.0
    assert math_reward("", "72") == 0.0


# -- code ----------------------------------------------------------------------------------------


def test_extract_code():
    assert extract_code("blah\n```python\ndef f():\n    return 1\n```\nbye") == "def f():\n    return 1\n"
    assert extract_code("def f():\n    return 2\n```\ntrailing") == "def f():\n    return 2\n"
    assert extract_code("x = 1") == "x = 1"


def test_correct_code_passes_and_wrong_code_fails():
    assert code_verdict("def add(a, b):\n    return a + b\n", TESTS, FAST).reward == 1.0
    v = code_verdict("def add(a, b):\n    return a - b\n", TESTS, FAST)
    assert v.reward == 0.0 and v.reason == "failed"
    assert code_verdict("def add(a, b) return", TESTS, FAST).reward == 0.0  # syntax error


def test_code_that_loops_forever_is_killed_at_the_wall_limit():
    t0 = time.monotonic()
    v = code_verdict("def add(a, b):\n    while True:\n        pass\n", TESTS, FAST)
    assert v.reward == 0.0
    assert time.monotonic() - t0 < FAST.wall_s + 5


def test_code_that_sleeps_is_killed():
    v = code_verdict("import time\ntime.sleep(60)\n", TESTS, Limits(wall_s=1.0, cpu_s=1))
    assert v.reward == 0.0 and v.reason == "timeout"


def test_unbounded_allocation_fails_cleanly():
    r = run_python("x = bytearray(8 * 1024**3)\nprint('allocated')", FAST)
    assert not r.ok and "allocated" not in r.stdout
    v = code_verdict("blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))\n", TESTS, FAST)
    assert v.reward == 0.0


def test_output_flood_is_capped():
    r = run_python("import sys\nsys.stdout.write('x' * 10**7)\nsys.stdout.flush()", FAST)
    assert not r.ok
    assert len(r.stdout) <= FAST.output_kb * 1024


def test_fork_bomb_gets_zero_and_leaves_nothing_behind():
    bomb = textwrap.dedent("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    v = code_verdict(bomb, TESTS, Limits(wall_s=2.0, cpu_s=2, memory_mb=256))
    assert v.reward == 0.0
    # A surviving fork bomb never goes away, so waiting for "none left" cannot pass by being early.
    wait_until(lambda: not [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).endswith("main.py")],
               timeout=30, what="no fork-bomb process left")


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


# The detached-grandchild, /proc, data-dir and unprivileged-uid cases live in tests/test_rl_sandbox.py.


def test_network_is_unreachable():
    code = "import socket\ns = socket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')"
    r = run_python(code, FAST)
    assert "connected" not in r.stdout and not r.ok


def test_writes_outside_its_directory_are_refused(tmp_path):
    target = tmp_path / "owned-by-the-node.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('pwned')", FAST)
    assert not r.ok and not target.exists()


def test_task_reward_dispatch():
    code = Task("c", "code", "p", tests=TESTS)
    assert task_reward(code, "```python\ndef add(a, b):\n    return a + b\n```", FAST) == 1.0
    assert task_reward(Task("m", "math", "p", answer="7"), "\\boxed{7}") == 1.0
    assert task_reward(Task("s", "synthetic", "rev 12=", answer="21"), "21") == 1.0
