"""Held-out evaluation of published versions: which version to score next, and what the scores say. Pure.

How this works (issue 40, item 5). The trainer scores the base model (version 0) and every
``[trainer] eval_every``-th version it publishes on one fixed draw of ``eval_tasks`` evaluation
tasks (the task source's ``evaluation(count)``: reasoning-gym seeds from 2**62 up, which no step key
reaches; for the digit-reversal set, digit strings none of its prompts hold; for another task file
its first tasks, which workers do draw: shown as not held out). Completions are greedy (temperature
0), so the score moves only when answers improve, not when sampling merely sharpens (node/rl/loop.py
``greedy_score``). The scoring runs in a separate process at the lowest CPU priority
(node/trainer/evaluator.py): training never waits for it.

:class:`EvalBook` holds the results (persisted in the trainer's spool beside its step records, so
they survive a restart) and decides what to score next: the base first, then the newest due
version not yet scored whose folder is still on disk. A slow evaluation (a real model on a CPU)
therefore skips versions rather than falling ever further behind; versions passed over are scored
later while their folders last.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

STATUS_POINTS = 100  # evaluation points in status (longer runs are thinned to this many, base and last kept)


@dataclass(frozen=True)
class EvalRecord:
    """One version's held-out score."""

    version: int
    score: float  # mean task reward of greedy completions on the evaluation tasks
    tasks: int  # how many evaluation tasks
    seconds: float  # wall time of the evaluation (load, generate, score)


def is_due(version: int, every: int) -> bool:
    """Whether ``version`` is one the run evaluates: the base and every ``every``-th (0: none)."""
    return every > 0 and version % every == 0


def next_version(latest: int, every: int, done: Iterable[int], available: Iterable[int]) -> int | None:
    """The version to score next, of those ``available`` (model folders on disk) up to ``latest``
    (the newest published): the base (0) first, then the newest due one not in ``done``; None when
    there is none."""
    done = set(done)
    due = {v for v in available if v <= latest and is_due(v, every) and v not in done}
    if not due:
        return None
    return 0 if 0 in due else max(due)


def thin(records: list[EvalRecord], most: int) -> list[EvalRecord]:
    """At most ``most`` (>= 2) of ``records`` (sorted by version), evenly spaced, first and last kept."""
    if len(records) <= most:
        return list(records)
    step = (len(records) - 1) / (most - 1)
    return [records[round(i * step)] for i in range(most)]


def eval_summary(records: Iterable[EvalRecord]) -> dict:
    """``base`` (version 0's score, or None), ``last`` and ``best`` (``[version, score]``), ``change``
    (last - base) and ``ratio`` (last / base; None for a base of 0)."""
    rs = sorted(records, key=lambda r: r.version)
    if not rs:
        return {"base": None, "last": None, "best": None, "change": None, "ratio": None}
    base = rs[0].score if rs[0].version == 0 else None
    last = rs[-1]
    best = max(rs, key=lambda r: (r.score, -r.version))
    return {
        "base": None if base is None else round(base, 4),
        "last": [last.version, round(last.score, 4)],
        "best": [best.version, round(best.score, 4)],
        "change": None if base is None else round(last.score - base, 4),
        "ratio": round(last.score / base, 3) if base else None,
    }


def format_eval(ev: dict | str | None) -> str:
    """One line for people (the demo's summary, ``trainer-steps``) from status' ``eval`` section."""
    if not isinstance(ev, dict):
        return f"held-out evaluation: {ev or 'not reported'}"
    kind = "held-out" if ev.get("held_out") else "NOT held out (a task file's first tasks)"
    head = f"evaluation (greedy, {ev.get('tasks')} tasks, {kind}, every {ev.get('every')} versions)"
    if ev.get("error") and not ev.get("last"):
        return f"{head}: {ev['error']}"
    if not ev.get("last"):
        return f"{head}: no version scored yet"
    last_v, last_s = ev["last"]
    base = ev.get("base")
    line = f"{head}: " + (f"base v0 {base:.3f}, " if base is not None else "base not scored, ")
    line += f"v{last_v} {last_s:.3f}"
    if ev.get("change") is not None:
        line += f" ({ev['change']:+.3f}" + (f", {ev['ratio']:.2f}x" if ev.get("ratio") is not None else "") + ")"
    best_v, best_s = ev["best"]
    if best_v != last_v:
        line += f"; best v{best_v} {best_s:.3f}"
    return line


class EvalBook:
    """The trainer's evaluation results and what is under way (see the module docstring)."""

    def __init__(self, every: int, tasks: int, records: Iterable[EvalRecord] = ()) -> None:
        self.every = every
        self.tasks = tasks
        self.records: dict[int, EvalRecord] = {r.version: r for r in records}
        self.passed: set[int] = set()  # versions that could not be scored (folder gone, load failed)
        self.running: int | None = None
        self.held_out: bool | None = None  # known once the evaluation process has loaded the tasks
        self.error = ""  # the last failure, "" once a version scores again

    def next(self, latest: int, available: Iterable[int]) -> int | None:
        return next_version(latest, self.every, set(self.records) | self.passed, available)

    def start(self, version: int) -> None:
        self.running = version

    def on_result(self, record: EvalRecord) -> None:
        self.records[record.version] = record
        self.running = None
        self.error = ""

    def on_failure(self, version: int | None, error: str) -> None:
        """``version`` (None: the evaluation as a whole) could not be scored, because of ``error``."""
        if version is not None:
            self.passed.add(version)
        self.running = None
        self.error = error

    def ordered(self) -> list[EvalRecord]:
        return [self.records[v] for v in sorted(self.records)]

    def status(self) -> dict | str:
        if self.every <= 0:
            return "off ([trainer] eval_every = 0)"
        ordered = self.ordered()
        return {
            "every": self.every,
            "tasks": self.tasks,
            "held_out": self.held_out,
            **eval_summary(ordered),
            "points": [[r.version, round(r.score, 4)] for r in thin(ordered, STATUS_POINTS)],
            "running": self.running,
            "error": self.error,
        }
