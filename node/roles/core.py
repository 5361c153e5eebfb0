"""Start a node: identity, host, core services, then the role's own services, in one nursery.

Every role runs the same core and adds its services on top, in one composition function per role
(``start`` in ``node/roles/<role>.py``). A service hands its API back through
``task_status.started(api)``; the composition passes it on to the services that need it as typed
arguments, so the start order is the dependency order and what a role needs is visible in its
file. SIGINT/SIGTERM cancel the nursery: each service's ``finally`` runs (membership publishes a
signed goodbye), streams close and the host stops, within a few seconds.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import trio

from ..config import ConfigError, NodeConfig
from ..context import NodeContext, RunningNode
from ..gossip.service import Membership, serve_membership
from ..net.host import PING_PROTOCOL, open_swarm_host
from ..identity import load_or_create_identity
from ..ledger.service import LedgerService, serve_ledger
from ..net.reqres import ping_handler
from ..peers import serve_peers
from ..peers.departed import serve_forgetting
from ..heap import serve_heap_trim
from ..net.ports import check_port_free
from ..reach.dialback import ReachabilityService, serve_dialback
from ..reach.relay import RelayClient, RelayHop, serve_relay_client
from ..rl.sandbox import require_isolation
from ..rl.tasks import TaskFormatError, load_run_tasks, runs_code
from ..shards.config import ShardsSections
from ..shards.service import ShardsService, serve_shards
from ..status import serve_status
from ..web import serve_web
from .sections import RunSections

log = logging.getLogger("node")

# Each role module exposes ``start(nursery, node) -> CoreNode`` (or a subclass with its own APIs).
ROLE_MODULES = {
    "trainer": "node.roles.trainer",
    "inference": "node.roles.inference",
    "relay": "node.roles.relay",
    "validator": "node.roles.validator",
}
# Roles that score completions (the generator its own, the validator the workers'): on a task set
# with code tasks they run model-written code, on a validator code from untrusted workers.
SCORING_ROLES = ("inference", "validator")
TORCH_ROLES = ("trainer", "validator", "inference")
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
SHUTDOWN_GRACE = 5.0  # seconds for services to finish after a signal before we force the exit


@dataclass
class CoreNode(RunningNode):
    """A started node: the run's typed sections and the APIs of the core services every role runs
    (roles add their own)."""

    sections: RunSections
    ledger: LedgerService
    shards: ShardsService
    relay: RelayClient | RelayHop
    membership: Membership
    reachability: ReachabilityService


async def start_core(
    nursery: trio.Nursery,
    node: NodeContext,
    serve_relay: Callable[..., Awaitable[None]] | None = None,
) -> CoreNode:
    """Start the core services in dependency order: the peer table's edge (every component reports
    remote faults to ``node.peers``); status; the ledger; shards, which credit the
    bytes they verify in the ledger; the relay side (``serve_relay_client``: accept relayed
    connections and reserve on the run's ``relay_via`` relays, handed in here, or on those dial-back
    picks when behind NAT; the relay role hands in the HOP service as ``serve_relay`` instead);
    membership, whose record advertises the relay's circuit addresses and the versions held;
    dial-back (node/reach/dialback.py), which answers peers asking whether they are reachable and,
    off the relay role, finds our own reachability and reserves relay slots when we are private;
    and, when ``http_port`` is set, the web status page (node/web.py), which reads the ledger's
    totals. The run's sections are built here, once; the roles hand each service the ones it reads."""
    sections = RunSections.of(node.run)
    await nursery.start(serve_peers, node)
    nursery.start_soon(serve_forgetting, node.host)  # peers gone for good leave py-libp2p's peer store
    nursery.start_soon(serve_heap_trim)  # freed C memory goes back to the system (node/heap.py)
    # libp2p ping under a per-peer budget (node/net/reqres.py) instead of py-libp2p's unbounded handler
    node.host.set_handler(PING_PROTOCOL, ping_handler(PING_PROTOCOL, streams=sections.streams,
                                                      peers=node.peers, metrics=node.metrics))
    await nursery.start(serve_status, node, sections.streams)
    ledger = await nursery.start(serve_ledger, node, sections.ledger, sections.streams)
    shards = await nursery.start(serve_shards, node, sections.pick(ShardsSections), ledger)
    relay = await nursery.start(serve_relay or partial(serve_relay_client, relays=node.config.relay_via), node)
    membership = await nursery.start(serve_membership, node, sections.membership, sections.streams, relay, shards)
    shards.use_members(membership)  # late: membership's record lists what shards holds, so it starts after
    reachability = await nursery.start(serve_dialback, node, sections.streams, relay, membership)
    if node.config.http_port:  # the web status page reads status providers at each request
        await nursery.start(serve_web, node, ledger)
    return CoreNode(node, sections, ledger, shards, relay, membership, reachability)


def check_code_sandbox(config: NodeConfig) -> None:
    """Refuse to start a node that would run untrusted code without the sandbox: raises
    ``SandboxUnavailable`` (which says how to fix it) rather than score code with less isolation."""
    if config.role not in SCORING_ROLES:
        return
    rl = RunSections.of(config.run).rl
    try:
        taskset = load_run_tasks(rl)
    except TaskFormatError as e:
        raise ConfigError(f"run.rl.taskset: {e}") from None
    if runs_code(taskset):
        require_isolation(f"the {config.role} role runs code-task completions (task set {rl.taskset!r} has code tasks)",
                          instead="run a task set without code tasks ([rl] taskset)")


def default_torch_threads(cpus: int | None) -> int:
    """Torch's intra-op threads when the environment sets none: half the CPUs (at least one).

    Torch's own default, one per core, is for a process that has the machine to itself. The
    smallest swarm runs a trainer, a validator and an inference node on one machine, and on two
    busy cores their OpenMP pools spun against each other: a validator took 6-10 s per batch that
    took 0.6 s with one thread each, and the trainer fell behind (issue 39). Half leaves room for
    a second torch process; ``OMP_NUM_THREADS`` still decides when it is set (the demo sets 1)."""
    return max(1, (cpus or 1) // 2)


def set_torch_threads(role: str, environ=os.environ) -> None:
    """Apply :func:`default_torch_threads` for a role that runs torch, unless the environment chose."""
    if role not in TORCH_ROLES or any(environ.get(k) for k in THREAD_ENV):
        return
    import torch

    torch.set_num_threads(default_torch_threads(os.cpu_count()))


async def run_node(
    config: NodeConfig,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
    handle_signals: bool = True,
    start: Callable[[trio.Nursery, NodeContext], Awaitable[CoreNode]] | None = None,
) -> None:
    """Run a node until cancelled or signalled. ``task_status.started(node)`` once all services run,
    with the :class:`CoreNode` (or the role's subclass of it) their APIs were handed back in.
    ``start`` replaces the role's composition (``swarm-node publish`` runs the core alone under a
    trainer's key). A node that fails before it is ready raises without logging "node stopped"."""
    check_code_sandbox(config)
    set_torch_threads(config.role)
    data_dir = config.resolved_data_dir()
    data_dir.mkdir(parents=True, exist_ok=True)
    identity, created = load_or_create_identity(data_dir)
    if created:
        log.info("created identity", extra={"peer": identity.peer_id, "dir": str(data_dir)})
    async with open_swarm_host(identity, config.listen) as host:
        node = NodeContext(config, identity, host, data_dir, started_at=trio.current_time())
        stop_metrics = start_metrics(node)
        ready = False
        try:
            async with trio.open_nursery() as nursery:
                if handle_signals:
                    nursery.start_soon(_watch_signals, nursery.cancel_scope)
                start = start or importlib.import_module(ROLE_MODULES[config.role]).start
                started = await start(nursery, node)
                log.info(
                    "node ready",
                    extra={"role": config.role, "peer": node.peer_id, "addrs": ",".join(host.listen_addrs())},
                )
                ready = True
                task_status.started(started)
        finally:
            stop_metrics()
            if ready:
                log.info("node stopped", extra={"peer": node.peer_id})


async def _watch_signals(cancel_scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("shutting down", extra={"signal": signal.Signals(signum).name})
            cancel_scope.cancel()
            return


def start_metrics(node: NodeContext) -> Callable[[], None]:
    """Serve Prometheus metrics on <metrics_listen>:<metrics_port> when asked to; returns a stopper."""
    port, addr = node.config.metrics_port, node.config.metrics_listen
    if not port:
        return lambda: None
    from prometheus_client import start_http_server

    check_port_free(addr, port, "--metrics-port")
    server, thread = start_http_server(port, addr=addr, registry=node.metrics.registry)
    log.info("metrics", extra={"url": f"http://{addr}:{port}/metrics"})

    def stop() -> None:
        server.shutdown()
        thread.join(timeout=2)

    return stop
