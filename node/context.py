"""What every service of a running node receives: its config, identity, host, data dir, metrics.

Services are ``async def serve_<name>(node: NodeContext, <dependencies>, *, task_status=...)``
started with ``await nursery.start(...)`` by a role's composition (node/roles/); they hand their API
back through ``task_status.started(api)`` once ready and run until cancelled. The APIs a service
needs from others are explicit typed arguments: nothing is looked up by name at run time. A service
that wants to appear in ``swarm-node status`` registers a function returning a JSON-able value in
``node.status``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import NodeConfig
from .health import ProgressWatch
from .net.host import SwarmHost
from .identity import Identity
from .metrics import Metrics
from .peers import Peers


@dataclass
class NodeContext:
    config: NodeConfig
    identity: Identity
    host: SwarmHost
    data_dir: Path
    metrics: Metrics = field(default_factory=Metrics)
    status: dict[str, Callable[[], Any]] = field(default_factory=dict)
    started_at: float = 0.0  # trio.current_time() when the node started
    # The one owner of peer penalties: components report remote faults here (node/peers/).
    peers: Peers | None = None
    # Progress seen in this node's status snapshots, judged into its "health" section (node/health.py).
    health: ProgressWatch = field(default_factory=ProgressWatch)

    def __post_init__(self) -> None:
        if self.peers is None:
            self.peers = Peers(self.host, self.metrics)

    @property
    def run(self):
        return self.config.run

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def topic(self, name: str) -> str:
        """Gossip topic of this run, e.g. topic("members") -> "/swarm/<run>/members/1"."""
        return f"/swarm/{self.config.run.name}/{name}/1"


@dataclass
class RunningNode:
    """What a started node hands back: its context (subclasses add the APIs its services handed
    back, e.g. ``node.shards``); the context's parts are readable directly (``node.host``)."""

    context: NodeContext

    @property
    def config(self) -> NodeConfig:
        return self.context.config

    @property
    def identity(self) -> Identity:
        return self.context.identity

    @property
    def host(self) -> SwarmHost:
        return self.context.host

    @property
    def data_dir(self) -> Path:
        return self.context.data_dir

    @property
    def metrics(self) -> Metrics:
        return self.context.metrics

    @property
    def status(self) -> dict[str, Callable[[], Any]]:
        return self.context.status

    @property
    def peers(self) -> Peers:
        return self.context.peers

    @property
    def peer_id(self) -> str:
        return self.context.peer_id

    def topic(self, name: str) -> str:
        return self.context.topic(name)
