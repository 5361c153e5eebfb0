"""What every service of a running node receives: its config, identity, host, data dir, metrics.

Services are ``async def serve_<name>(node: NodeContext, *, task_status=trio.TASK_STATUS_IGNORED)``
started with ``await nursery.start(...)``; they call ``task_status.started()`` once ready and run
until cancelled. A service that wants to appear in ``swarm-node status`` registers a function
returning a JSON-able value in ``node.status``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import NodeConfig
from .host import SwarmHost
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
    # Named handles that services expose to each other (e.g. "ledger" -> the ledger API object,
    # "store" -> the shard piece store). Set by a service before task_status.started().
    services: dict[str, Any] = field(default_factory=dict)
    started_at: float = 0.0  # trio.current_time() when the node started
    # The one owner of peer penalties: components report remote faults here (node/peers/).
    peers: Peers | None = None

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
