"""Start a node: identity, host, core services, then the role's own services, in one nursery.

Every role runs the same core (status, membership; later shard seeding and the ledger replica) and
adds its services on top (see ``node/roles/<role>.py``). SIGINT/SIGTERM cancel the nursery: each
service's ``finally`` runs (membership publishes a signed goodbye), streams close and the host stops,
within a few seconds.
"""

from __future__ import annotations

import importlib
import logging
import signal
from collections.abc import Awaitable, Callable

import trio

from ..config import NodeConfig
from ..context import NodeContext
from ..gossip.service import serve_membership
from ..host import open_swarm_host
from ..identity import load_or_create_identity
from ..ledger.sync import serve_ledger
from ..peers import serve_peers
from ..relay import serve_relay_client, serve_relay_hop
from ..shards.service import serve_shards
from ..status import serve_status

log = logging.getLogger("node")

Service = Callable[..., Awaitable[None]]

# Services every role runs, in start order: peers first (everyone reports faults to it), the ledger
# before shards, which credits bytes in it.
CORE_SERVICES: list[Service] = [serve_peers, serve_status, serve_membership, serve_ledger, serve_shards]

# Each role module exposes SERVICES: the services it adds on top of the core.
ROLE_MODULES = {
    "trainer": "node.roles.trainer",
    "inference": "node.roles.inference",
    "relay": "node.roles.relay",
    "validator": "node.roles.validator",
}
SHUTDOWN_GRACE = 5.0  # seconds for services to finish after a signal before we force the exit


def role_services(role: str) -> list[Service]:
    """The relay hop service on relays, the relay client (accept relayed connections, reserve when
    behind NAT) everywhere else, then the role's own services."""
    relay = serve_relay_hop if role == "relay" else serve_relay_client
    return [relay] + list(importlib.import_module(ROLE_MODULES[role]).SERVICES)


async def run_node(
    config: NodeConfig,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
    handle_signals: bool = True,
) -> None:
    """Run a node until cancelled or signalled. ``task_status.started(node)`` once all services run."""
    data_dir = config.resolved_data_dir()
    data_dir.mkdir(parents=True, exist_ok=True)
    identity, created = load_or_create_identity(data_dir)
    if created:
        log.info("created identity", extra={"peer": identity.peer_id, "dir": str(data_dir)})
    async with open_swarm_host(identity, config.listen) as host:
        node = NodeContext(config, identity, host, data_dir, started_at=trio.current_time())
        stop_metrics = start_metrics(node)
        try:
            async with trio.open_nursery() as nursery:
                if handle_signals:
                    nursery.start_soon(_watch_signals, nursery.cancel_scope)
                for service in CORE_SERVICES + role_services(config.role):
                    await nursery.start(service, node)
                log.info(
                    "node ready",
                    extra={"role": config.role, "peer": node.peer_id, "addrs": ",".join(host.listen_addrs())},
                )
                task_status.started(node)
        finally:
            stop_metrics()
            log.info("node stopped", extra={"peer": node.peer_id})


async def _watch_signals(cancel_scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("shutting down", extra={"signal": signal.Signals(signum).name})
            cancel_scope.cancel()
            return


def start_metrics(node: NodeContext) -> Callable[[], None]:
    """Serve Prometheus metrics on 127.0.0.1:<metrics_port> when asked to; returns a stopper."""
    port = node.config.metrics_port
    if not port:
        return lambda: None
    from prometheus_client import start_http_server

    server, thread = start_http_server(port, addr="127.0.0.1", registry=node.metrics.registry)
    log.info("metrics", extra={"url": f"http://127.0.0.1:{port}/metrics"})

    def stop() -> None:
        server.shutdown()
        thread.join(timeout=2)

    return stop
