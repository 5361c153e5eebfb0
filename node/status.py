"""Status of a running node, for people: ``<data dir>/status.json`` and ``/swarm/status/1.0.0``.

The node writes its status (all ``node.status`` providers) to status.json by write-then-rename,
each second while someone reads it and every ten seconds otherwise (node/status_files.py says
how a reader asks), so ``swarm-node status`` can read it without talking to the node, and answers
the status protocol so ``swarm-node status --connect ADDR`` can ask any reachable peer. Member
tables are public information already (they travel on gossip); nothing secret is in status.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import trio

from .atomic import write_atomic
from .context import NodeContext
from .fds import Rarely, out_of_files
from .health import ProgressWatch, State
from .memgrowth import MemoryGrowth
from .summary import NO_TRAINER_GRACE, SummaryClock
from .status_files import IDLE_EVERY, NODE_FILE, STATUS_FILE, watched  # noqa: F401  (NODE_FILE re-exported)
from .net.budget import StreamLimits, StreamsConfig
from .net.reqres import RequestResponse, messages
from .wire import Message, RemoteProtocolError, bounded, read_message, register, write_frame

log = logging.getLogger(__name__)

STATUS_PROTOCOL = "/swarm/status/1.0.0"
MAX_STATUS = 2 * 1024 * 1024
STATUS_EVERY = 1.0  # while watched (status_files.watched); IDLE_EVERY otherwise
# How often the want file is looked at: a reader of a stale status waits up to this long (it was
# a second: `swarm-node status` took 1.0 s instead of 0.26). A look is a stat and a wake-up.
WANT_CHECK_EVERY = 0.25
# A status this small is written in the event loop (no fsync: open, write, rename). Handing it to a
# worker thread cost more than the write: 8 % of an idle relay's CPU at N=25 (py-spy --gil), for
# the thread's wake-up and the result's way back into trio.
INLINE_WRITE = 64 * 1024
TOP_TASK_NAMES = 20  # coroutine names listed in status "task_names", most tasks first
MAX_STATUS_REQUESTS = 16  # served at once, all peers
MAX_STATUS_PER_PEER = 2  # ... of which one peer may hold (a person asks once at a time)
MAX_REQUEST = 1024
STATUS_TIMEOUT = 5.0  # seconds to write the answer to a peer that does not read it
STATUS_LIMITS = StreamLimits(MAX_STATUS_REQUESTS, MAX_STATUS_PER_PEER, frame_cap=MAX_REQUEST,
                             buffer_bytes=MAX_STATUS_REQUESTS * MAX_REQUEST, buffer_per_peer=MAX_STATUS_PER_PEER * MAX_REQUEST)


@register
@dataclass(frozen=True)
class StatusRequest(Message):
    TYPE: ClassVar[str] = "status.request"


@register
@dataclass(frozen=True)
class StatusResponse(Message):
    TYPE: ClassVar[str] = "status.response"
    json: str = bounded(max_len=MAX_STATUS)


def live_tasks() -> list[trio.lowlevel.Task]:
    """Tasks alive in this trio run, from the root task down: a leak shows as growth (bench/soak.py
    samples their count over hours)."""
    todo, out = [trio.lowlevel.current_root_task()], []
    while todo:
        task = todo.pop()
        out.append(task)
        todo.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return out


def trio_tasks() -> int:
    return len(live_tasks())


def tasks_by_name(names: Iterable[str], top: int = TOP_TASK_NAMES) -> dict[str, int]:
    """How many live tasks run each coroutine, the ``top`` most common first: the task that a leak
    leaves behind is the name whose count grows with the hours (issue 45)."""
    return dict(Counter(names).most_common(top))


def snapshot(node: NodeContext, *, stopped: bool = False) -> dict:
    tasks = live_tasks()  # one walk, a few hundred tasks: ~0.1 ms
    out = {
        "peer_id": node.peer_id,
        "role": node.config.role,
        "run": node.run.name,
        "time": time.time(),
        "uptime_s": round(trio.current_time() - node.started_at, 1),
        "addrs": node.host.listen_addrs(),
        "traffic": node.metrics.totals(),
        "handler_errors": {f"{p}/{e}": n for (p, e), n in node.host.handler_errors.counts.items()},
        "tasks": len(tasks),
        "task_names": tasks_by_name(t.name for t in tasks),
        "streams": {p: inbound.budget.snapshot() for p, inbound in node.host.inbound.items()},
        # Who the run file names, so a page can say "trainer 12D3…" instead of a bare peer id.
        "run_roles": {**{p: "validator" for p in node.run.validators}, **{p: "trainer" for p in node.run.trainers}},
    }
    if stopped:
        out["stopped"] = True
    for name, provider in node.status.items():
        try:
            out[name] = provider()
        except Exception as e:  # a broken provider must not take status down
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return with_health(node.health, out, trio.current_time())


def with_health(watch: ProgressWatch, snap: dict, now: float) -> dict:
    """``snap`` with its judged ``health`` first among the sections (node/health.py); a change of
    state is logged once, so a stall is in the log as well as on the page."""
    before = watch.state
    health = watch.observe(snap, now)
    # A trainer logs its own stalls (node/trainer/progress.py); one warning, not two.
    if health.state is not before and before is not None and "stalled" not in (snap.get("trainer") or {}):
        level = logging.WARNING if health.state is State.STALLED else logging.INFO
        log.log(level, "health: %s: %s", health.state.value, health.cause)
    head = {k: snap[k] for k in ("peer_id", "role", "run") if k in snap}
    return {**head, "health": health.as_dict(), **{k: v for k, v in snap.items() if k != "health"}}


# A busy node refuses more status streams ("busy") instead of queueing them: a person asks again.
STATUS: RequestResponse = RequestResponse(STATUS_PROTOCOL, messages(StatusRequest, max_size=MAX_REQUEST),
                                          messages(StatusResponse, max_size=MAX_STATUS + 1024), STATUS_TIMEOUT,
                                          limits=STATUS_LIMITS, wait_for_slot=False)


def status_handler(node: NodeContext, streams: StreamsConfig):
    """``/swarm/status/1.0.0``: one StatusRequest in, one StatusResponse out, under the protocol's
    per-peer and total budget (node/net/budget.py; ``streams``, the run's): one peer holding its
    streams silent is cut and struck, and never takes the slots of everyone else."""

    async def answer(peer: str, req: StatusRequest) -> StatusResponse:
        return StatusResponse(json=json.dumps(snapshot(node)))

    return STATUS.handler(answer, streams=streams, peers=node.peers, metrics=node.metrics)


async def serve_status(node: NodeContext, streams: StreamsConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    handle = status_handler(node, streams)
    node.host.set_handler(STATUS_PROTOCOL, handle)
    info = {"peer_id": node.peer_id, "role": node.config.role, "addrs": node.host.listen_addrs(), "pid": os.getpid()}
    write_atomic(node.data_dir / NODE_FILE, json.dumps(info).encode(), durable=False)
    if tracemalloc.is_tracing():  # PYTHONTRACEMALLOC=1 (node/memgrowth.py): an operator asked what grows
        growth = MemoryGrowth()
        node.status["memory_growth"] = lambda: growth.observe(trio.current_time())
    task_status.started()
    path = node.data_dir / STATUS_FILE
    interval = node.config.summary_interval
    summary = SummaryClock(interval, list(node.run.trainers), trio.current_time(), grace=min(NO_TRAINER_GRACE, interval))
    next_write, last_write = -math.inf, -math.inf
    starved = Rarely()  # out of descriptors: said once a minute while it lasts
    try:
        while True:
            now = trio.current_time()
            if now >= next_write or (now - last_write >= STATUS_EVERY and watched(node.data_dir, time.time())):
                last_write = now
                snap = snapshot(node)  # in the trio thread: providers read trio's clock
                data = json.dumps(snap).encode()
                try:
                    if len(data) <= INLINE_WRITE:
                        write_atomic(path, data, durable=False)
                    else:
                        await trio.to_thread.run_sync(lambda: write_atomic(path, data, durable=False))
                except OSError as e:  # out of descriptors (issue 42) or a full disk (issue 45) ended the node here; next turn
                    if not (out_of_files(e) or e.errno in (errno.ENOSPC, errno.EDQUOT)):
                        raise
                    if starved.due(now):
                        log.warning("status: cannot write %s (%s); the last one stays", path.name, e)
                # The no-trainer warning rides on the snapshots: at most IDLE_EVERY late.
                for level, line in summary.due(trio.current_time(), snap):
                    getattr(log, level)(line)
                next_write = min(now + IDLE_EVERY, summary.next_at())
            await trio.sleep(WANT_CHECK_EVERY)
    finally:
        with trio.CancelScope(shield=True):
            try:
                final = snapshot(node, stopped=True)
                write_atomic(path, json.dumps(final).encode(), durable=False)
                (node.data_dir / NODE_FILE).unlink(missing_ok=True)
            except OSError:
                pass


async def call_status(host, addr: str) -> dict:
    """Ask the node at ``addr`` for its status (client side of the status protocol)."""
    peer = await host.connect(addr)
    stream = await host.open_stream(peer, STATUS_PROTOCOL)
    try:
        await write_frame(stream, StatusRequest())
        resp = await read_message(stream, MAX_STATUS + 1024)
        if not isinstance(resp, StatusResponse):
            raise RemoteProtocolError("wrong-type", "expected status.response")
        try:
            return json.loads(resp.json)
        except ValueError:
            raise RemoteProtocolError("malformed", "status is not JSON") from None
    finally:
        await stream.close()
