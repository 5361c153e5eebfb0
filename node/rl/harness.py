"""Code-task tests the node can trust: parsed in the node, evaluated in the sandbox, judged in the node.

Why: the first harness ran the candidate followed by the task's ``assert`` lines and took exit
status 0 as "passed" (issue 13). The candidate runs first, in the same process, so it decided the
verdict: ``import os; os._exit(0)`` passed every task, and so did an exit from ``sys.excepthook`` or
``atexit`` after a failing assert, re-running the program with ``python -O`` (asserts compiled
away), emptying the program file and re-running it, or returning an object whose ``__eq__`` says
yes. RL would have taught the model to exit early.

How this works:

1. **At task-load time, in the node** (:func:`parse_tests`): every line of a task's ``tests`` must be
   one of ``assert f(<literals>) == <literal>``, ``assert f(<literals>)`` or
   ``assert not f(<literals>)`` (the literal may stand on either side of ``==``; ``f`` is a plain
   name, its arguments Python literals). Each becomes a :class:`Check`: the call's source and what
   its value must be (equal to a literal the node parsed with ``ast.literal_eval``, truthy, or
   falsy). Anything else is a :class:`TestFormatError` that names the line, so a task file with
   tests this harness cannot judge does not load. The restriction is the point: the sandbox only
   ever evaluates candidate calls on constant arguments; a comparison evaluated there (``f(x) < 3``)
   would again be the candidate's to decide.
2. **In the sandbox** (:func:`harness_program`, run by ``node.rl.sandbox.run_python``): a fixed
   harness runs the candidate's source with ``exec`` in a fresh namespace, evaluates each call, and
   reports, per call, the value's ``repr`` when the value is plain data (exact types ``int``,
   ``float``, ``complex``, ``str``, ``bytes``, ``bool``, ``None`` and lists, tuples, sets, dicts of
   them: no subclass, so no ``__eq__`` of the candidate's), or that it raised (any
   ``BaseException``, ``SystemExit`` and ``KeyboardInterrupt`` included) or was not plain. The
   expected values never enter the sandbox. The candidate's own output goes to /dev/null (fd 1 is
   redirected before it runs); the harness writes one report line, tagged with a random per-run
   nonce, to a copy of the original stdout, then leaves with ``os._exit(0)`` (no atexit handlers).
3. **In the node** (:func:`judge_report`): exactly one line must carry the nonce and decode as a
   complete report (one entry per check), and every value, parsed back with ``ast.literal_eval``,
   must be what its check wants — compared here, on plain data.

What that stops: any exit, crash or kill before the report (no report: 0); hooks on exit or
exceptions (the exit status is not read); a disabled ``assert`` (there is none to disable);
tampering with the program file (it was read at start; no report comes from an empty one);
"passed" printed on stdout (not a report line; and candidate output never reaches stdout); a second
report line next to the real one (two tagged lines: 0); always-equal or always-true objects (not
plain data; comparison happens in the node); patched builtins, ``json`` or ``sys.exit`` (the
harness bound what it uses before the candidate ran, and the worst a patch can do is spoil the
report).

What it does not claim: the nonce is not secret from code that reads the program file or
inspects the harness's memory at run time; it only stops output written in advance (by the model)
from being taken for a report. Such code could forge a report — but to score it would have to
forge the *expected* values, which never enter the sandbox: knowing them is solving the task (or
memorising its tests, which a lookup-table solution can do just as well). Bare
``assert f(...)`` tests are passed by a function that always returns ``True``: pair them with
``assert not f(...)`` (the packaged tasks do).
"""

from __future__ import annotations

import ast
import json
import secrets
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

MAX_CHECKS = 256  # assert lines per task
MAX_RESULT_CHARS = 16_384  # repr of one call's value; longer is a failed check
NONCE_BYTES = 16
EQUAL, TRUTHY, FALSY = "equal", "truthy", "falsy"
SUPPORTED = "assert f(<literals>) == <literal>, assert f(<literals>) or assert not f(<literals>)"


class TestFormatError(ValueError):
    """A task's tests are not of the shape this harness can judge; the message names the line."""

    __test__ = False  # not a pytest test class


@dataclass(frozen=True)
class Check:
    """One assert line: evaluate ``call`` against the candidate; its value must satisfy ``expect``."""

    call: str  # source of ``name(literal, ...)``
    expect: str  # EQUAL | TRUTHY | FALSY
    value: Any = None  # the expected value (EQUAL only), parsed in the node

    def holds(self, got: Any) -> bool:
        if self.expect == EQUAL:
            return bool(got == self.value)  # both plain data from ast.literal_eval: no candidate __eq__
        return bool(got) if self.expect == TRUTHY else not bool(got)


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _is_call(node: ast.AST) -> bool:
    """``name(literal, ..., key=literal)``: the only expression the sandbox evaluates."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return False
    args = list(node.args) + [k.value for k in node.keywords]
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return False
    return all(_literal(a)[0] for a in args)


def _check_of(stmt: ast.stmt) -> Check | None:
    if not isinstance(stmt, ast.Assert):
        return None
    test = stmt.test
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        left, right = test.left, test.comparators[0]
        for call, lit in ((left, right), (right, left)):
            ok, value = _literal(lit)
            if ok and _is_call(call):
                return Check(ast.unparse(call), EQUAL, value)
        return None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _is_call(test.operand):
        return Check(ast.unparse(test.operand), FALSY)
    if _is_call(test):
        return Check(ast.unparse(test), TRUTHY)
    return None


@lru_cache(maxsize=4096)
def parse_tests(tests: str) -> tuple[Check, ...]:
    """The checks of a code task's ``tests``; :class:`TestFormatError` on any line of another shape."""
    try:
        module = ast.parse(tests)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise TestFormatError(f"tests do not parse as Python ({e})") from None
    checks = []
    for stmt in module.body:
        check = _check_of(stmt)
        if check is None:
            raise TestFormatError(f"tests line {stmt.lineno}: unsupported statement; use {SUPPORTED}")
        checks.append(check)
    if not checks:
        raise TestFormatError("tests: no assert lines")
    if len(checks) > MAX_CHECKS:
        raise TestFormatError(f"tests: more than {MAX_CHECKS} assert lines")
    return tuple(checks)


# The sandbox side. Everything it uses is bound (as default arguments) before the candidate runs.
_HARNESS = r'''
import builtins as _b, json as _json, os as _os, sys as _sys


def _plain(v, depth=0, _type=type, _all=_b.all, _atoms=(int, float, complex, str, bytes, bool, type(None)),
           _seqs=(list, tuple, set, frozenset)):
    t = _type(v)
    if t in _atoms:
        return True
    if depth > 32:
        return False
    if t in _seqs:
        return _all(_plain(x, depth + 1) for x in v)
    if t is dict:
        return _all(_plain(k, depth + 1) and _plain(x, depth + 1) for k, x in v.items())
    return False


def _name(e, _type=type, _str=str):
    try:
        return _str(_type(e).__name__)[:64]
    except BaseException:
        return "?"


def _main(source, calls, nonce, max_chars, _exec=exec, _eval=eval, _compile=compile, _repr=repr, _len=len,
          _dumps=_json.dumps, _write=_os.write, _exit=_os._exit, _dup=_os.dup, _dup2=_os.dup2, _open=_os.open):
    out = _dup(1)
    _dup2(_open(_os.devnull, _os.O_WRONLY), 1)  # the candidate's output goes nowhere
    ns = {"__name__": "__main__", "__file__": "main.py", "__builtins__": _b}
    results = []
    try:
        _exec(_compile(source, "<candidate>", "exec"), ns)
        loaded = "ok"
    except BaseException as e:
        loaded = _name(e)
    if loaded == "ok":
        for call in calls:
            try:
                v = _eval(_compile(call, "<test>", "eval"), ns)
            except BaseException as e:
                results.append(["raised", _name(e)])
                continue
            try:
                if not _plain(v):
                    results.append(["not_plain", _name(v)])
                    continue
                r = _repr(v)
                results.append(["ok", r] if _len(r) <= max_chars else ["too_large", ""])
            except BaseException as e:
                results.append(["raised", _name(e)])
    data = (nonce + " " + _dumps({"loaded": loaded, "results": results}) + "\n").encode("ascii")
    while data:
        data = data[_write(out, data):]
    _exit(0)
'''


def new_nonce() -> str:
    """A fresh report tag: random, so output written before the run cannot carry it."""
    return secrets.token_hex(NONCE_BYTES)


def harness_program(candidate: str, checks: tuple[Check, ...], nonce: str) -> str:
    """The program the sandbox runs: the fixed harness, given the candidate's source and the calls."""
    calls = [c.call for c in checks]
    return _HARNESS + f"\n_main({candidate!r}, {calls!r}, {nonce!r}, {MAX_RESULT_CHARS})\n"


@dataclass(frozen=True)
class Outcome:
    passed: bool
    detail: str  # why not, when not
    reported: bool  # a well-formed report came back (False: the run ended before reporting)


def judge_report(stdout: str, nonce: str, checks: tuple[Check, ...]) -> Outcome:
    """Did the run's one report show every check holding? Decided here, on plain data."""
    tag = nonce + " "
    lines = [line for line in stdout.splitlines() if line.startswith(tag)]
    if len(lines) != 1:
        return Outcome(False, "no report" if not lines else f"{len(lines)} reports", False)
    try:
        report = json.loads(lines[0][len(tag):])
    except (ValueError, RecursionError):
        return Outcome(False, "unreadable report", False)
    if not isinstance(report, dict) or not isinstance(report.get("loaded"), str) \
            or not isinstance(report.get("results"), list):
        return Outcome(False, "malformed report", False)
    if report["loaded"] != "ok":
        return Outcome(False, f"candidate raised {report['loaded'][:64]}", True)
    results = report["results"]
    if len(results) != len(checks) or not all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r) for r in results):
        return Outcome(False, "malformed report", False)
    for n, (check, (status, text)) in enumerate(zip(checks, results), 1):
        if status != "ok":
            return Outcome(False, f"check {n}: {status} {text[:64]}".rstrip(), True)
        ok, got = _literal_text(text)
        if not ok or not check.holds(got):
            return Outcome(False, f"check {n}: wrong value", True)
    return Outcome(True, "", True)


def _literal_text(text: str) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
