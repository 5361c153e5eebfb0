"""Is this node making progress? A judgement of its status snapshots: a state and one line of cause.

How this works: the page, ``swarm-node status`` and the demo all read ``/status.json`` (or the
status file), which carries a ``health`` section built here, so all three say the same thing.
:class:`ProgressWatch` is fed every snapshot with the time (``observe(status, now)``); it keeps,
bounded, when each of the role's progress counters last moved (trainer: its step; validator: its
verdicts; inference: batches the trainer acked) and a thinned history of them, from which it
derives what a person asks first: seconds since the last step, steps (verdicts, batches) per
minute. :func:`judge` then turns the snapshot and those figures into a :class:`Health`:

    STARTING  no progress yet since the role started, and not for long (model loading, first rollouts)
    OK        progress within the last ``STALL_S`` seconds, or nothing waiting on this node
    STALLED   no progress for ``STALL_S`` seconds while work waits; the cause says where it waits
    STOPPED   the node's last status, written as it stopped

The cause is the line a person needs (issue 39: a trainer sat at step 22 for six minutes with 155
batches waiting for verdicts and its page looked healthy). A trainer judges its own stalls and
their cause (node/trainer/progress.py); this module relays that, and judges the validator and
inference roles (and a trainer too old to say) from their counters. Pure: snapshots and times go
in, no clock is read here.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

# The liveness bound: no gap of more than 90 s between trainer steps after the first.
STALL_S = 90.0
# A validator or worker is stalled after STALL_S or this many of its usual gaps, whichever is longer:
# one batch of a large model on a busy CPU may take longer than STALL_S and still be progress.
SLOW_GAPS = 3.0
# Before its first progress a node is "starting" this long (a model loads, the first checkpoint is
# fetched, the first rollouts are generated on a busy CPU), then stalled like any other.
FIRST_PROGRESS_S = 300.0
RATE_WINDOW_S = 300.0  # per-minute rates are averaged over at most this long...
MIN_RATE_SPAN_S = 30.0  # ...and shown only once this long has been watched
MAX_SAMPLES = 64  # history kept per node: one sample per RATE_WINDOW_S / MAX_SAMPLES seconds at most
SAMPLE_EVERY = RATE_WINDOW_S / MAX_SAMPLES
MAX_REASONS = 3  # refusal reasons named in a cause, most frequent first
MAX_GAPS = 9  # recent gaps between moves kept per counter (their median is its usual gap)


class State(str, enum.Enum):
    STARTING = "starting"
    OK = "ok"
    STALLED = "stalled"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Health:
    state: State
    cause: str
    figures: dict[str, str] = field(default_factory=dict)  # label -> value with its unit, for people
    progress: dict[str, float | int | None] = field(default_factory=dict)  # the same, as numbers

    def as_dict(self) -> dict:
        return {"state": self.state.value, "cause": self.cause, "figures": self.figures, "progress": self.progress}


def progress_counters(status: dict) -> dict[str, int]:
    """The counters whose movement is progress, by role (absent sections: none)."""
    out: dict[str, int] = {}
    if isinstance(trainer := status.get("trainer"), dict):
        out["step"] = int(trainer.get("step") or 0)
    if isinstance(validator := status.get("validator"), dict):
        verdicts = validator.get("verdicts") or {}
        out["verdicts"] = int(verdicts.get("accepted", 0)) + int(verdicts.get("rejected", 0))
    if isinstance(inference := status.get("inference"), dict):
        batches = inference.get("batches") or {}
        out["acked"] = int(batches.get("accepted", 0))
        out["refused"] = sum((batches.get("refused") or {}).values())
    return out


class ProgressWatch:
    """When each progress counter last moved, and its rate per minute, from successive snapshots."""

    def __init__(self) -> None:
        self.first: dict[str, int] = {}  # counter -> its value when first seen
        self.moved_at: dict[str, float] = {}  # counter -> time it was last seen to change
        self.last: dict[str, int] = {}
        self.gaps: dict[str, deque[float]] = {}  # counter -> seconds per unit of its recent moves
        self.samples: deque[tuple[float, dict[str, int]]] = deque(maxlen=MAX_SAMPLES + 1)
        self.state: State | None = None  # the last judgement's state (for logging its changes)

    def observe(self, status: dict, now: float) -> Health:
        """Record this snapshot's counters at ``now`` and judge it."""
        counters = progress_counters(status)
        for name, value in counters.items():
            if name not in self.first:
                self.first[name] = value
                self.moved_at[name] = now  # moved at most now: its real last change is unknown
            elif value != self.last[name]:
                if self.last[name] != self.first[name]:  # a gap between two seen moves, not since start
                    gaps = self.gaps.setdefault(name, deque(maxlen=MAX_GAPS))
                    gaps.append((now - self.moved_at[name]) / max(1, abs(value - self.last[name])))
                self.moved_at[name] = now
            self.last[name] = value
        if not self.samples or now - self.samples[-1][0] >= SAMPLE_EVERY:
            self.samples.append((now, counters))
        while len(self.samples) > 1 and now - self.samples[1][0] >= RATE_WINDOW_S:
            self.samples.popleft()
        health = judge(status, self.figures(now))
        self.state = health.state
        return health

    def figures(self, now: float) -> dict[str, float | int | None]:
        """Per counter: ``<name>`` (value), ``<name>_since_s`` (seconds since it moved, or since it was
        first seen), ``<name>_moved`` (whether it moved since then), ``<name>_per_min`` and
        ``<name>_gap_s`` (the median of its recent gaps between moves, per unit; None before two)."""
        out: dict[str, float | int | None] = {}
        for name, value in self.last.items():
            out[name] = value
            out[f"{name}_since_s"] = round(now - self.moved_at[name], 1)
            out[f"{name}_moved"] = value != self.first[name]
            out[f"{name}_per_min"] = self.rate(name, now)
            gaps = sorted(self.gaps.get(name, ()))
            out[f"{name}_gap_s"] = round(gaps[len(gaps) // 2], 1) if gaps else None
        return out

    def rate(self, name: str, now: float) -> float | None:
        old = next(((t, c[name]) for t, c in self.samples if name in c), None)
        if old is None or now - old[0] < MIN_RATE_SPAN_S:
            return None
        return round(60.0 * (self.last[name] - old[1]) / (now - old[0]), 2)


# ------------------------------------------------------------------------------ judgement


def judge(status: dict, seen: dict) -> Health:
    """The health of the node whose snapshot is ``status``; ``seen`` holds :meth:`ProgressWatch.figures`."""
    if isinstance(status.get("trainer"), dict):
        health = _trainer(status["trainer"], seen)
    elif isinstance(status.get("validator"), dict):
        health = _validator(status["validator"], seen)
    elif isinstance(status.get("inference"), dict):
        health = _inference(status["inference"], seen)
    else:
        health = _other(status)
    if status.get("stopped"):
        return Health(State.STOPPED, "the node stopped; this is its last status", health.figures, health.progress)
    return health


def _stalled_or_starting(moved: bool, since: float, usual_gap: float | None = None) -> State | None:
    """STARTING before the first move (for a while), STALLED after ``stall_after(usual_gap)`` seconds
    without one, else None."""
    if not moved:
        return State.STARTING if since <= FIRST_PROGRESS_S else State.STALLED
    return State.STALLED if since > stall_after(usual_gap) else None


def stall_after(usual_gap: float | None) -> float:
    """Seconds without progress that make a stall: STALL_S, or SLOW_GAPS usual gaps when longer
    (the gaps between earlier moves, so a stall never stretches its own bound)."""
    return max(STALL_S, SLOW_GAPS * usual_gap) if usual_gap else STALL_S


def _trainer(t: dict, seen: dict) -> Health:
    """A trainer judges its own stalls (node/trainer/progress.py: ``stalled``, ``seconds_since_step``,
    ``steps_per_min``, ``last_step_at``); this relays them. A trainer status without them (an older
    peer asked with ``--connect``) is judged from the watched step counter, without a cause."""
    own = "stalled" in t
    step, loss = t.get("step", 0), (t.get("last_step") or {}).get("loss")
    since = t.get("seconds_since_step", 0.0) if own else seen.get("step_since_s", 0.0)
    rate = t.get("steps_per_min") if own else seen.get("step_per_min")
    stepped = t.get("last_step_at") is not None if own else bool(seen.get("step_moved"))
    batches = t.get("batches") or {}
    gate = t.get("gate") if isinstance(t.get("gate"), dict) else {}
    waiting, ready = batches.get("gated", 0), batches.get("ready", 0)
    backlog = sum((gate.get("per_validator") or {}).values())
    in_hand, needed = (list(t.get("samples_in_hand") or [0, 0]) + [0, 0])[:2]
    progress = {"step": step, "since_step_s": since, "steps_per_min": rate, "loss": loss,
                "waiting_for_verdicts": waiting, "validator_backlog": backlog, "ready": ready}
    figures = {"step": str(step), "since the last step": since_text(stepped, since), "steps per minute": per_min(rate),
               "loss": "-" if loss is None else f"{loss:.4g}", "batches waiting for a verdict": str(waiting),
               "at validators now": str(backlog), "samples in hand": f"{in_hand} (a step needs {needed})"}
    when = f"no step for {seconds(since)}" if stepped else f"no step in the {seconds(since)} since the trainer started"
    if t.get("publish_error"):
        return Health(State.STALLED, f"publishing checkpoints fails: {t['publish_error']}", figures, progress)
    if own and t["stalled"]:
        return Health(State.STALLED, f"{when}; {t['stalled']}", figures, progress)
    state = None if own else _stalled_or_starting(stepped, since)
    if state is State.STALLED:
        return Health(state, f"{when} ({n_batches(waiting)} wait for a verdict, {ready} verified)", figures, progress)
    if not stepped:
        if not (t.get("intake") or {}).get("accepted"):
            return Health(State.STARTING, "no rollouts received yet: is an inference node running and connected?",
                          figures, progress)
        return Health(State.STARTING, f"no step yet: {n_batches(waiting)} wait for a verdict, {in_hand} of {needed} "
                      "samples a step needs in hand", figures, progress)
    return Health(State.OK, f"training: step {step}, the last {seconds(since)} ago", figures, progress)


def _validator(v: dict, seen: dict) -> Health:
    backlog, since, rate = v.get("queue", 0), seen.get("verdicts_since_s", 0.0), seen.get("verdicts_per_min")
    verdicts = v.get("verdicts") or {}
    refused = {k: n for k, n in verdicts.items() if k not in ("accepted", "rejected") and n}
    progress = {"backlog": backlog, "verdicts": seen.get("verdicts", 0), "since_verdict_s": since,
                "verdicts_per_min": rate}
    figures = {"backlog": f"{backlog} of {v.get('queue_max', '?')} batches", "verdicts": str(seen.get("verdicts", 0)),
               "verdicts per minute": per_min(rate), "since the last verdict": since_text(seen.get("verdicts_moved"), since),
               "not judged": top(refused) or "none"}
    if not v.get("validator_of_run", True):
        return Health(State.STALLED, "not in the run file's validators: trainers refuse its verdicts", figures, progress)
    if not backlog and not v.get("checking"):
        state = State.OK if seen.get("verdicts_moved") or verdicts.get("accepted") or verdicts.get("rejected") else State.STARTING
        return Health(state, "idle: no batch waiting for a verdict" + (f" (refused: {top(refused)})" if refused else ""),
                      figures, progress)
    state = _stalled_or_starting(bool(seen.get("verdicts_moved")), since, seen.get("verdicts_gap_s"))
    if state is None:
        rate_text = "" if rate is None else f", {rate:g} verdicts a minute"
        return Health(State.OK, f"checking: a batch, {backlog} more queued{rate_text}", figures, progress)
    return Health(state, f"no verdict for {seconds(since)} with {n_batches(backlog)} queued"
                  + (f" (checking {v['checking']})" if v.get("checking") else ""), figures, progress)


def _inference(i: dict, seen: dict) -> Health:
    b = i.get("batches") or {}
    refused, dropped = b.get("refused") or {}, b.get("dropped") or {}
    since, rate = seen.get("acked_since_s", 0.0), seen.get("acked_per_min")
    progress = {"sent": b.get("sent", 0), "acked": b.get("accepted", 0), "refused": sum(refused.values()),
                "since_ack_s": since, "acked_per_min": rate}
    figures = {"batches sent": str(b.get("sent", 0)), "acked": str(b.get("accepted", 0)),
               "refused": top(refused) or "none", "dropped": top(dropped) or "none",
               "acked per minute": per_min(rate), "since the last ack": since_text(seen.get("acked_moved"), since),
               "policy version": str(i.get("policy_version", "-"))}
    state = _stalled_or_starting(bool(seen.get("acked_moved")), since, seen.get("acked_gap_s"))
    if state is None:
        return Health(State.OK, f"generating: {n_batches(b.get('accepted', 0))} acked, the last {seconds(since)} ago",
                      figures, progress)
    if not i.get("trainers_alive"):
        cause = "no trainer alive in the member table"
    elif i.get("waiting_for_checkpoint"):
        cause = f"waiting for checkpoint {i['waiting_for_checkpoint']}"
    elif seen.get("refused_moved") and seen.get("refused_since_s", since) < since:
        cause = f"the trainer refuses its batches: {top(refused)}"
    elif b.get("queued"):
        cause = f"{n_batches(b['queued'])} queued, none acked"
    else:
        cause = "no batch generated" + (f" ({(i.get('errors') or {}).get('step')} step errors)"
                                        if (i.get("errors") or {}).get("step") else "")
    when = "no batch acked yet" if not seen.get("acked_moved") else f"no batch acked for {seconds(since)}"
    return Health(state, f"{when}; {cause}", figures, progress)


def _other(status: dict) -> Health:
    member = status.get("membership") or {}
    alive = sum(1 for r in member.get("members") or [] if r.get("state") == "alive")
    figures = {"connections": str(member.get("connections", "-")), "members alive": str(alive)}
    if member and not alive:
        return Health(State.STARTING, "no other member known alive yet", figures, {"members_alive": alive})
    return Health(State.OK, f"{status.get('role', 'node')}: {alive} members alive", figures, {"members_alive": alive})


# ------------------------------------------------------------------------------ text


def seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def n_batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"


def since_text(moved: bool | None, since: float) -> str:
    return seconds(since) if moved else f"none yet ({seconds(since)} watched)"


def per_min(rate: float | None) -> str:
    return "- (watching)" if rate is None else f"{rate:g}"


def top(counts: dict[str, int]) -> str:
    """The most frequent reasons, e.g. ``step_ahead ×228, expired ×3``."""
    items = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} ×{n}" for k, n in items[:MAX_REASONS]) + (" …" if len(items) > MAX_REASONS else "")


def health_line(status: dict) -> str | None:
    """For ``swarm-node status``: ``health: stalled: <cause>`` and, indented below, the figures
    (``step 22, since the last step 6.0 min, ...``); None when the status carries no health."""
    h = status.get("health")
    if not isinstance(h, dict):
        return None
    figures = ", ".join(f"{k} {v}" for k, v in (h.get("figures") or {}).items())
    return f"health: {h.get('state')}: {h.get('cause')}" + (f"\n  {figures}" if figures else "")
