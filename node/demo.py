"""``make demo``: a local swarm on loopback with a live table, until Ctrl-C or ``--duration``.

One relay (the bootstrap peer), a trainer, a validator and one inference node (more with
``--extra``), each a real ``swarm-node`` process with its own data dir under ``--data-root``.
The run file names the trainer and validator as the run's trusted peers.
"""

from __future__ import annotations

import shutil
import signal
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from .localswarm import LocalSwarm

RUN_TEMPLATE = """\
# Written by `swarm-node demo`.
[run]
name = "demo"
trainers = ["{trainer}"]
validators = ["{validator}"]
"""


def build_table(swarm: LocalSwarm, started: float) -> Group:
    table = Table(title=f"swarm-node demo — {time.monotonic() - started:.0f}s (Ctrl-C to stop)")
    for col in ("node", "role", "pid", "peer id", "sees alive", "suspect", "dead", "left", "conns"):
        table.add_column(col)
    for name, proc in swarm.procs.items():
        status = swarm.status(name)  # a stopped node leaves its last status behind
        member = status.get("membership", {})
        counts = member.get("counts", {})
        table.add_row(
            name,
            proc.role,
            str(proc.pid) if proc.alive() else "[red]exited[/]",
            status.get("peer_id", "…")[-12:],
            str(counts.get("alive", "-")),
            str(counts.get("suspect", "-")),
            str(counts.get("dead", "-")),
            str(counts.get("left", "-")),
            str(member.get("connections", "-")),
        )
    return Group(table)


def run_demo(args) -> int:
    console = Console()
    root = args.data_root
    if root.exists():
        shutil.rmtree(root)
    names = [("relay", "relay"), ("trainer", "trainer"), ("validator", "validator"), ("inference-1", "inference")]
    names += [(f"inference-{i + 2}", "inference") for i in range(args.extra)]
    stop = False

    def on_signal(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with LocalSwarm(root, log_level=args.log_level) as swarm:
        swarm.write_run_file(RUN_TEMPLATE.format(trainer=swarm.peer_id("trainer"), validator=swarm.peer_id("validator")))
        console.print(f"starting {len(names)} nodes on 127.0.0.1 (data in {root}/, logs in {root}/<node>/node.log)")
        for name, role in names:
            swarm.start(name, role)
        started = time.monotonic()
        with Live(build_table(swarm, started), console=console, refresh_per_second=2) as live:
            while not stop and (not args.duration or time.monotonic() - started < args.duration):
                time.sleep(0.5)
                live.update(build_table(swarm, started))
        console.print("stopping nodes (each leaves the swarm with a signed goodbye)…")
    console.print(build_table(swarm, started))
    return 0
