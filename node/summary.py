"""The one-line summary a running node logs every ``summary_interval`` seconds, and the warning
when its run has no live trainer (pure: a status snapshot and the time go in, lines come out).

A long-running role that logs nothing for minutes looks the same as a hung one (issue 19: an
inference node with no trainer in its run was silent for 13 minutes). The summary is built from
the same snapshot ``swarm-node status`` shows (node/status.py), so it needs nothing new from the
services: peers, the version held, steps or batches, accepted/refused with reasons, tokens/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NO_TRAINER_GRACE = 30.0  # seconds after start before a missing trainer is worth a warning (joining takes a few)


def live_trainers(snapshot: dict, trainers: list[str]) -> int:
    """Members alive as trainers whose peer id the run lists (the node itself included)."""
    listed = set(trainers)
    rows = (snapshot.get("membership") or {}).get("members") or []
    alive = {r["peer_id"] for r in rows if r.get("role") == "trainer" and r.get("state") == "alive"
             and r.get("peer_id") in listed}
    if snapshot.get("role") == "trainer" and snapshot.get("peer_id") in listed:
        alive.add(snapshot["peer_id"])
    return len(alive)


def _reasons(counts: dict | None) -> str:
    counts = {k: v for k, v in (counts or {}).items() if v}
    return ",".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"


def summary_fields(snapshot: dict) -> dict:
    """The figures of one summary line, by role (keys stay the same from line to line)."""
    member = snapshot.get("membership") or {}
    counts = member.get("counts") or {}
    out: dict = {"peers": member.get("connections", 0), "alive": counts.get("alive", 0)}
    held = (snapshot.get("shards") or {}).get("held") or []
    out["version"] = max(held) if held else None
    trainer, inference, validator = (snapshot.get(k) for k in ("trainer", "inference", "validator"))
    if trainer:
        intake = trainer.get("intake") or {}
        last = trainer.get("last_step") or {}
        reward = trainer.get("reward") or []
        out.update(version=trainer.get("step"), steps=trainer.get("step"),
                   accepted=intake.get("accepted", 0),
                   refused=_reasons({k: v for k, v in intake.items() if k != "accepted"}),
                   rejected=_reasons(trainer.get("rejected_by_reason")),
                   reward=reward[-1][1] if reward else None, tokens_per_s=last.get("tokens_per_s"))
    if inference:
        batches = inference.get("batches") or {}
        out.update(version=inference.get("policy_version"), steps=inference.get("steps"),
                   sent=batches.get("sent", 0), accepted=batches.get("accepted", 0),
                   refused=_reasons(batches.get("refused")), dropped=_reasons(batches.get("dropped")),
                   reward=inference.get("mean_reward"), tokens_per_s=inference.get("tokens_per_s"))
    if validator:
        verdicts = validator.get("verdicts") or {}
        out.update(checked=sum(verdicts.values()), verdicts=_reasons(verdicts),
                   reasons=_reasons(validator.get("reasons")), queue=validator.get("queue"),
                   tokens_per_s=validator.get("tokens_per_s"))
    if snapshot.get("role") == "relay":
        relay = snapshot.get("relay") or {}
        out.update(reservations=relay.get("reservations"), circuits=relay.get("circuits_active"))
    return out


def summary_line(snapshot: dict) -> str:
    fields = summary_fields(snapshot)
    return "summary " + " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items())


@dataclass
class SummaryClock:
    """When to log the summary and the no-trainer warning. ``due(now, snapshot)`` returns the
    lines to log now as (level, text): the summary every ``interval`` seconds, and, for a node
    whose run has no live trainer for longer than ``grace`` seconds, a warning (again at each
    summary while it lasts, and once when a trainer is back)."""

    interval: float
    trainers: list[str]
    started: float
    grace: float = NO_TRAINER_GRACE
    _next: float | None = None
    _warned: bool = False

    def next_at(self) -> float:
        """When the next summary is due (inf when summaries are off): the node takes a snapshot
        then even if it writes status.json less often."""
        if self.interval <= 0:
            return math.inf
        return self.started + self.interval if self._next is None else self._next

    def due(self, now: float, snapshot: dict) -> list[tuple[str, str]]:
        if self.interval <= 0:
            return []
        out: list[tuple[str, str]] = []
        if self._next is None:
            self._next = self.started + self.interval
        live = live_trainers(snapshot, self.trainers)
        summary_now = now >= self._next
        if live == 0 and now - self.started >= self.grace and (summary_now or not self._warned):
            why = ("the run lists no trainer (run.trainers is empty)" if not self.trainers else
                   f"none of the run's {len(self.trainers)} trainer(s) is alive among this node's members")
            out.append(("warning", f"no live trainer: {why}; no new checkpoints will come and rollouts cannot be submitted"))
            self._warned = True
        elif live and self._warned:
            out.append(("info", f"a trainer is live again ({live})"))
            self._warned = False
        if summary_now:
            out.append(("info", summary_line(snapshot)))
            self._next = now + self.interval
        return out
