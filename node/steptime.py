"""Where a step's time goes: each role's per-phase timings, and the swarm-wide table built from them.

How this works (issue 40, "step time visible"). Every role times its own phases and keeps the sums
in a :class:`PhaseTimes` (pure: the seconds come in, measured by the service around the work):

* inference node, per rollout batch: ``generate`` (sampling with hidden-state capture), ``score``
  (the verifiers), ``proofs`` (TOPLOC), ``assemble`` (the draw, the batch, its signature); per
  checkpoint version: ``load`` (the new weights into the engine; not the first load, which is the
  process's start-up);
* any node that downloads checkpoints (inference, validator, relay), per version: ``transfer``
  (from the manifest fetch to the last piece checked and synced);
* validator, per batch: ``verify`` (the rules, the prefill, the proof, log-prob and sampling
  checks) and ``rescore`` (the verifiers again); per version: ``load`` (not the first);
* trainer, per step: ``train`` (the GRPO update), ``save`` (model folder, training state, spool),
  ``publish`` (pieces, manifest, announcement).

Each role puts ``PhaseTimes.status()`` under ``phases_s`` in its status section (the shards
service in ``shards``); :func:`step_time_rows` adds them up over the nodes of a swarm and scales
per-batch phases by the batches a trainer step takes, so the table reads "one trainer step costs
this many seconds of generation, of verification, ...": what a user needs to estimate another
model or machine. Pure: statuses in, rows out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

# (phase, role whose status holds it, the unit one figure is per), in the order work flows through a step.
PHASES: tuple[tuple[str, str, str], ...] = (
    ("generate", "inference", "batch"),
    ("score", "inference", "batch"),
    ("proofs", "inference", "batch"),
    ("assemble", "inference", "batch"),
    ("transfer", "shards", "version"),
    ("load", "inference", "version"),
    ("load", "validator", "version"),
    ("verify", "validator", "batch"),
    ("rescore", "validator", "batch"),
    ("train", "trainer", "step"),
    ("save", "trainer", "step"),
    ("publish", "trainer", "step"),
)
PHASE_NAMES = frozenset(p for p, _, _ in PHASES)


@dataclass
class PhaseTimes:
    """Seconds spent per phase of one role, and how many units (batches, steps, versions) they
    covered. ``on_add(phase, seconds)`` is told of each (e.g. a Prometheus histogram's observe)."""

    on_add: Callable[[str, float], None] | None = None
    totals: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        if phase not in PHASE_NAMES:  # ours to fix: the table would not know where to put it
            raise ValueError(f"unknown phase {phase!r}")
        seconds = max(0.0, seconds)
        self.totals[phase] = self.totals.get(phase, 0.0) + seconds
        self.counts[phase] = self.counts.get(phase, 0) + 1
        if self.on_add is not None:
            self.on_add(phase, seconds)

    def status(self) -> dict[str, dict]:
        """{phase: {"mean_s", "n", "total_s"}} (the total lets several nodes be averaged exactly)."""
        return {p: {"mean_s": round(self.totals[p] / n, 4), "n": n, "total_s": round(self.totals[p], 3)}
                for p, n in self.counts.items()}


@dataclass(frozen=True)
class Row:
    phase: str
    role: str  # "shards": every node that downloads checkpoints
    unit: str  # batch | step | version
    mean_s: float  # mean seconds per unit, over every node of the role
    n: int  # units measured
    nodes: int  # nodes that measured it
    per_step_s: float | None  # seconds of this phase one trainer step costs (None: no step yet)


def _sections(statuses: dict[str, tuple[str, dict]], role: str) -> list[dict]:
    if role == "shards":
        return [(st.get("shards") or {}).get("phases_s") or {} for _, st in statuses.values()]
    return [(st.get(role) or {}).get("phases_s") or {} for r, st in statuses.values() if r == role]


def batches_per_step(statuses: dict[str, tuple[str, dict]]) -> float | None:
    """Mean rollout batches a trainer step took (over every trainer; None before a step)."""
    batches = steps = 0
    for role, st in statuses.values():
        t = (st.get("trainer") or {}) if role == "trainer" else {}
        batches += t.get("step_batches", 0)
        steps += ((t.get("phases_s") or {}).get("train") or {}).get("n", 0)
    return batches / steps if steps else None


def step_time_rows(statuses: dict[str, tuple[str, dict]]) -> list[Row]:
    """One row per phase some node measured, in :data:`PHASES` order (``statuses``: {name: (role,
    status dict)} as the nodes' ``status.json`` hold them). Per-batch phases cost
    :func:`batches_per_step` times their mean a step; per-step and per-version ones, their mean
    (a version per step; on each node that follows it). Before a trainer step, no row has a
    share of one."""
    per_batch = batches_per_step(statuses)
    rows = []
    for phase, role, unit in PHASES:
        figures = [s[phase] for s in _sections(statuses, role) if phase in s]
        n = sum(f["n"] for f in figures)
        if not n:
            continue
        mean = sum(f["total_s"] for f in figures) / n
        scale = None if per_batch is None else per_batch if unit == "batch" else 1.0
        rows.append(Row(phase, role, unit, mean, n, len(figures), None if scale is None else mean * scale))
    return rows


def trainer_step_wall_s(statuses: dict[str, tuple[str, dict]]) -> float | None:
    """Wall seconds between a trainer's steps (its last ten, as its status says; None before two)."""
    for role, st in statuses.values():
        per_min = (st.get("trainer") or {}).get("steps_per_min") if role == "trainer" else None
        if per_min:
            return 60.0 / per_min
    return None


def step_time_figures(statuses: dict[str, tuple[str, dict]]) -> dict:
    """Everything the table shows, JSON-ready (the demo's figures.json, bench/step_time.py --json):
    ``rows`` (:func:`step_time_rows` as dicts), ``batches_per_step``, ``per_step_s`` (the rows'
    work summed: None before a trainer step) and ``step_wall_s`` (:func:`trainer_step_wall_s`)."""
    rows = step_time_rows(statuses)
    per_batch = batches_per_step(statuses)
    return {"rows": [dataclasses.asdict(r) for r in rows], "batches_per_step": per_batch,
            "per_step_s": None if per_batch is None else sum(r.per_step_s for r in rows),
            "step_wall_s": trainer_step_wall_s(statuses)}


def format_step_time(f: dict) -> str:
    """:func:`step_time_figures` as a table: the demo's closing summary and bench/step_time.py print it."""
    rows, total = f["rows"], f["per_step_s"]
    if not rows:
        return "(no phase timed yet)"
    lines = [f"{'phase':<10}{'role':<11}{'mean s':>9}  {'per':<8}{'n':>6}{'s / step':>10}{'share':>8}"]
    for r in rows:
        per_step = r["per_step_s"]
        share = f"{100 * per_step / total:.0f} %" if per_step is not None and total else "-"
        role = "(each)" if r["role"] == "shards" else r["role"]
        lines.append(f"{r['phase']:<10}{role:<11}{r['mean_s']:>9.3f}  {r['unit']:<8}{r['n']:>6}"
                     f"{'-' if per_step is None else f'{per_step:.2f}':>10}{share:>8}")
    if total is None:
        lines.append("no trainer step yet: the means above, no share of a step")
    else:
        wall = f["step_wall_s"]
        lines.append(f"per trainer step: {total:.2f} s of work over all roles, {f['batches_per_step']:.2f} batches a step")
        lines.append(("" if wall is None else f"a step every {wall:.1f} s of wall time; ")
                     + "transfer and load: on each node that follows")
    return "\n".join(lines)
