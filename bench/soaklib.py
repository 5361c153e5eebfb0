"""The pure half of bench/soak.py: its seeded fault schedule and its accounting (no I/O, no clock).

How this works: :func:`make_schedule` turns a seed, a duration and the starting node names into
the list of faults the soak injects, one every ``GAP_S`` (30-90 s), in rounds of a seeded order that each cover every
kind once (kill -9 once per role, the trainer included); a node is
not hit again until ``SETTLE_S`` after its last fault ended, a node is (re)started only while a relay
other than itself is not cut off (it joins through the relays alone), and the last fault ends
``QUIET_TAIL_S`` before the run does so that the ledger replicas have time to agree. The rest are small functions over what
the soak sampled: acked batches against what the trainer's spool did with them
(:func:`account`), when each node was back to work after its fault (:func:`recovery_s`), the slope
of a resource series after warm-up (:func:`slope_per_hour`), errors and tracebacks of the node
logs by kind (:func:`count_errors`).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass

GAP_S = (30.0, 90.0)  # seconds between two faults (issue 45)
PARTITION_S = (30.0, 120.0)  # how long a partition lasts before it heals
SIGSTOP_S = 60.0  # a validator silent this long
DISK_FULL_S = 45.0  # a node's data disk full this long
HOSTILE_S = 30.0  # a burst of hostile traffic lasts this long
SETTLE_S = 60.0  # a node is left alone this long after its fault ends, so that its recovery is its own
QUIET_TAIL_S = 120.0  # no fault holds in the run's last this many seconds: 60 s for the digests, and slack
FIRST_EVENT_S = 60.0  # the swarm's first steps before anything breaks (model loads, first checkpoint)

# What the soak can do to a node. Each kill-9 names the role it targets, so that every role is hit.
KILL9, SIGTERM, PARTITION, PARTITION_GROUP, RELAY_REPLACE, SILENCE, DISK_FULL, LATE_JOIN, HOSTILE = (
    "kill9", "sigterm", "partition", "partition-group", "relay-replace", "sigstop-validator", "disk-full",
    "late-join", "hostile-burst")
KINDS = (KILL9, SIGTERM, PARTITION, PARTITION_GROUP, RELAY_REPLACE, SILENCE, DISK_FULL, LATE_JOIN, HOSTILE)
ROLES = ("relay", "trainer", "validator", "inference")


@dataclass(frozen=True)
class Event:
    at: float  # seconds after the swarm is up
    kind: str
    targets: tuple[str, ...]  # the nodes it hits; for relay-replace (gone, new); late-join the new node
    hold: float = 0.0  # seconds the fault lasts (partition, SIGSTOP, disk full, hostile burst); 0: at once

    def describe(self) -> str:
        hold = f" for {self.hold:.0f} s" if self.hold else ""
        return f"t={self.at:6.0f}s {self.kind:<17} {','.join(self.targets)}{hold}"


def role_of(name: str) -> str:
    """A soak node's role from its name (``relay-2``, ``inference-4``, ``trainer``...)."""
    return name.rsplit("-", 1)[0] if name[-1].isdigit() and "-" in name else name


def make_schedule(seed: int, seconds: float, nodes: list[str], *, disk_node: str | None = None,
                  can_partition: bool = True) -> list[Event]:
    """The faults of a soak of ``seconds`` over ``nodes`` (names as :func:`role_of` reads them).

    ``disk_node``: the node whose data dir is a small tmpfs (None: no disk-full events);
    ``can_partition``: whether partitions can be made here (network namespaces). Deterministic
    for a seed."""
    rng = random.Random(seed)
    live = list(nodes)
    busy: dict[str, float] = {}  # node -> when its current fault ends
    cut: dict[str, float] = {}  # node -> when its partition heals
    relays = sum(role_of(n) == "relay" for n in nodes)
    late = sum(role_of(n) == "inference" for n in nodes)
    kinds = [k for k in KINDS if (can_partition or k not in (PARTITION, PARTITION_GROUP))
             and (disk_node is not None or k != DISK_FULL)]
    round_ = [(KILL9, r) for r in ROLES] + [(k, None) for k in kinds if k != KILL9]
    todo: list[tuple[str, str | None]] = []
    events: list[Event] = []
    t, misses = FIRST_EVENT_S, 0
    while True:
        if not todo:  # rounds in a seeded order, each of every kind (and of kill -9 once per role)
            todo = rng.sample(round_, len(round_))
        kind, role = todo.pop(0)
        free = [n for n in live if busy.get(n, 0.0) <= t]

        def pick(r: str) -> str | None:
            pool = [n for n in free if role_of(n) == r]
            return rng.choice(pool) if pool else None

        def joinable(name: str | None) -> bool:
            """Whether ``name`` (None: nobody picked; "": a new node) can be started now: it joins
            through the live relays alone (bench/soak.py), so one other than itself must not be
            cut off, or its recovery would time the partition's heal (seed 2's relay-7: 62.5 s)."""
            return name is not None and any(role_of(n) == "relay" and n != name and cut.get(n, 0.0) <= t
                                            for n in live)

        hold, targets = 0.0, ()
        if kind in (KILL9, SIGTERM):
            name = pick(role or rng.choice(ROLES))
            targets = (name,) if joinable(name) else ()
        elif kind == PARTITION:
            hold = round(rng.uniform(*PARTITION_S))
            name = rng.choice(free) if free else None
            targets = (name,) if name else ()
        elif kind == PARTITION_GROUP:  # two nodes cut off together: they still see each other
            hold = round(rng.uniform(*PARTITION_S))
            targets = tuple(rng.sample(free, 2)) if len(free) >= 2 else ()
        elif kind == SILENCE:
            hold = SIGSTOP_S
            name = pick("validator")
            targets = (name,) if name else ()
        elif kind == DISK_FULL:
            hold = DISK_FULL_S
            targets = (disk_node,) if disk_node in free else ()
        elif kind == RELAY_REPLACE:
            gone = pick("relay")
            if joinable(gone):
                relays += 1
                targets = (gone, f"relay-{relays}")
        elif kind == LATE_JOIN and joinable(""):
            late += 1
            targets = (f"inference-{late}",)
        elif kind == HOSTILE:
            hold = HOSTILE_S
            name = pick("trainer")
            targets = (name,) if name else ()
        if t + hold > seconds - QUIET_TAIL_S:
            break
        if not targets:  # nobody to hit now: the next kind, at the same time (at most a round of them)
            misses += 1
            if misses < len(round_):
                continue
        else:
            events.append(Event(t, kind, targets, hold))
            if kind == RELAY_REPLACE:
                live.remove(targets[0])
                live.append(targets[1])
                busy[targets[1]] = t + SETTLE_S
            elif kind == LATE_JOIN:
                live.append(targets[0])
                busy[targets[0]] = t + SETTLE_S
            else:
                for n in targets:
                    busy[n] = t + hold + SETTLE_S
                    if kind in (PARTITION, PARTITION_GROUP):
                        cut[n] = t + hold
        t, misses = t + round(rng.uniform(*GAP_S)), 0
    return events


# ---------------------------------------------------------------------------------- accounting


class AckTally:
    """Batches each worker saw acknowledged, summed over its processes: a worker's status counts
    from 0 again after a restart, so the highest count seen per (worker, pid) is added up. A process
    killed with -9 may have acked batches after its last sampled status: the sum is a lower bound."""

    def __init__(self) -> None:
        self._high: dict[tuple[str, int], int] = {}

    def observe(self, worker: str, pid: int, accepted: int) -> None:
        key = (worker, pid)
        self._high[key] = max(self._high.get(key, 0), accepted)

    def acked(self, worker: str) -> int:
        return sum(v for (w, _), v in self._high.items() if w == worker)


@dataclass(frozen=True)
class SpoolRow:
    worker: str  # peer id
    state: str  # gated, ready, trained, rejected (node/trainer/spool.py)
    reason: str
    acked: bool  # acknowledged (accepted_step set) rather than refused at intake


def account(acked_by: dict[str, int], rows: dict[bytes, SpoolRow]) -> dict[str, dict]:
    """Per worker (peer id): what it saw acked against what the trainer's spool did with the batches it
    acked: trained, rejected after the ack (by reason; "expired" is the trainer's delay), still
    pending; ``lost``: acked by the worker's count but in no state of the spool."""
    out: dict[str, dict] = {}
    for worker in sorted(set(acked_by) | {r.worker for r in rows.values() if r.acked}):
        mine = [r for r in rows.values() if r.worker == worker and r.acked]
        rejected = Counter(r.reason for r in mine if r.state == "rejected")
        row = {"acked": acked_by.get(worker, 0), "spooled": len(mine),
               "trained": sum(r.state == "trained" for r in mine),
               "rejected": sum(rejected.values()) - rejected.get("expired", 0),
               "expired": rejected.get("expired", 0),
               "pending": sum(r.state in ("gated", "ready") for r in mine),
               "rejected_by_reason": dict(rejected)}
        row["lost"] = max(0, row["acked"] - row["spooled"])
        out[worker] = row
    return out


def recovery_s(samples: list[tuple[float, int, float, float | None]], pid_before: int,
               back_at: float) -> float | None:
    """Seconds from ``back_at`` (restart, heal, SIGCONT) until the node's progress counter moved.

    ``samples``: (time, pid, counter, last_at) of the node, in time order; ``last_at`` is when the
    node's own status says it last made progress (None: it does not say). The counter of the first
    sample at or after ``back_at`` is the baseline (0 when the pid changed: a new process counts
    from 0); None if it never moved again. It moved between the sample that saw the move and the
    one before: the node's ``last_at``, kept inside those two, says when (samples are seconds apart,
    more on a busy machine, and a recovery must not grow by them)."""
    baseline, before = None, back_at
    for t, pid, value, last_at in samples:
        if t < back_at:
            continue
        if baseline is None:
            baseline = 0.0 if pid != pid_before else value
        if value > baseline:
            return (t if last_at is None else min(t, max(last_at, before))) - back_at
        before = t
    return None


def slope_per_hour(points: list[tuple[float, float]], warmup_s: float) -> float | None:
    """Least-squares slope of (seconds, value) points after ``warmup_s``, per hour; None under 3 points."""
    pts = [(t, v) for t, v in points if t >= warmup_s]
    if len(pts) < 3:
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    if var == 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in pts) / var * 3600.0


def replication_lag(writer: list[tuple[float, int]], replica: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """How far one replica trails a writing author, at each of its samples: (time, seconds).

    ``writer``: (time, seq) of the author's own head; ``replica``: (time, seq) of that author's head
    as the replica holds it. The lag at a replica sample is the age of the oldest entry it is
    missing: the time since the writer first reported a head past the replica's (0 when the replica
    holds everything the writer had reported by then). Sampling can overstate it by one writer
    sample interval; it never hides a replica that stays behind."""
    out = []
    for t, seq in replica:
        past = [wt for wt, wseq in writer if wt <= t and wseq > seq]
        out.append((t, t - min(past) if past else 0.0))
    return out


_ERROR = re.compile(r"^\S+ (ERRO|CRIT) \S+ ([\w.]+): (.*)$")
_LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d")  # node/log.py's text lines begin with the time
_VARIABLE = (  # what differs between two lines of one kind: peer ids, addresses, hashes, numbers
    (re.compile(r"\b12D3KooW[1-9A-HJ-NP-Za-km-z]+"), "<peer>"),
    (re.compile(r"\b\d+\.\d+\.\d+\.\d+(:\d+)?"), "<addr>"),
    (re.compile(r"\b0x[0-9a-f]+\b|\b[0-9a-f]{8,}\b"), "<hex>"),
    (re.compile(r"\b\d+(\.\d+)?\b"), "N"),
)


def _blanked(message: str) -> str:
    for pattern, name in _VARIABLE:
        message = pattern.sub(name, message)
    return message


def _exception_type(text: str) -> str | None:
    """``KeyError`` of the line ``KeyError: 'x'`` that ends a traceback (None for any other line)."""
    name = text.split(":", 1)[0].strip()
    return name if re.fullmatch(r"[A-Za-z_][\w.]*(\[[\w.,]*\])?", name) and not _LOG_LINE.match(text) else None


def count_errors(lines: list[str]) -> Counter:
    """ERROR lines and tracebacks of a node log, by kind: ``ERROR <logger>: <message, peers, addresses
    and numbers blanked>``
    (cut to 80 characters) and ``traceback <type>`` (the type a traceback ends with; an exception
    group as ``traceback ExceptionGroup[<leaf types>]``; ``(cut off)`` when the log goes on
    without one, as a killed process leaves it)."""
    kinds: Counter = Counter()
    state, types = None, []  # None, "tb" (a plain traceback) or "group"; the exception types of a group
    for line in lines + [""]:  # "": the end closes an open traceback
        inside = line.startswith((" ", "\t")) and bool(line.strip())
        if state == "group":
            if inside:
                content = line.split("|", 1)[1] if "|" in line else ""
                if content[:1] == " " and content[1:2] not in (" ", "") and not content.strip().startswith("Traceback"):
                    types.append(_exception_type(content) or "?")
                continue
            name = f"{types[0]}[{','.join(sorted(set(types[1:])))}]" if types else None
            kinds[f"traceback {name or '(cut off)'}"] += 1
            state = None
        elif state == "tb":
            if inside:
                continue
            name = _exception_type(line) if line else None
            kinds[f"traceback {name or '(cut off)'}"] += 1
            state = None
            if name:
                continue  # the line was the exception's own
        if line.startswith("Traceback (most recent call last)"):
            state = "tb"
        elif line.lstrip().startswith("+ Exception Group Traceback"):
            state, types = "group", []
        elif m := _ERROR.match(line):
            kinds[f"ERROR {m.group(2)}: {_blanked(m.group(3))[:80]}"] += 1
    return kinds


# ---------------------------------------------------------------------------------- overlaps

_DESCRIBED = re.compile(r"^t=\s*\d+s (\S+)\s+(\S+)")  # Event.describe(): "t=   865s kill9    validator-2"


def targets_of(rec: dict) -> tuple[str, ...]:
    """The nodes an event record hit: its ``targets``, or (reports written before they were kept) the
    ones its description names."""
    if rec.get("targets"):
        return tuple(rec["targets"])
    m = _DESCRIBED.match(rec.get("event", ""))
    return tuple(m.group(2).split(",")) if m else (rec["node"],)


def disturbed(rec: dict, end: float) -> tuple[float, float]:
    """When an event disturbed the swarm: from its start until its node was back at work (its hold's
    end plus its recovery; ``end``, the run's end, when it never recovered)."""
    back = rec.get("back_at", rec["at"])
    took = rec.get("recovery_s")
    return rec["at"], (end if took is None and "back_at" in rec and "recovery_s" in rec else back + (took or 0.0))


def overlaps(records: list[dict], end: float, trainer: str = "trainer") -> list[list[str]]:
    """Per event record, the other faults inside its recovery window (from ``back_at`` until it was back,
    or ``end`` when it never was) that hit the same node or the trainer: such a recovery timed
    another fault, not the protocol's waits. Each named as ``"<kind> <node> t=<start>"``."""
    out = []
    for i, rec in enumerate(records):
        flags = []
        if "back_at" in rec:
            took = rec.get("recovery_s")
            lo, hi = rec["back_at"], end if took is None else rec["back_at"] + took
            mine = {rec["node"], trainer}
            for j, other in enumerate(records):
                if j == i:
                    continue
                hit = mine & set(targets_of(other))
                start, stop = disturbed(other, end)
                if hit and start <= hi and stop >= lo:
                    flags.append(f"{other['kind']} {','.join(sorted(hit))} t={other['at']:.0f}")
        out.append(flags)
    return out
