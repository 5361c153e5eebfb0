"""Test helpers: real nodes in one trio run over loopback sockets (import as `swarmtest`)."""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from node.config import NodeConfig, RunConfig
from node.roles.core import run_node

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def node_config(tmp_path, name: str, role: str = "relay", bootstrap=(), run: RunConfig | None = None, **tables) -> NodeConfig:
    run = run or RunConfig(name="test")
    if tables:
        run.tables.update(tables)
    return NodeConfig(
        role=role,
        listen=list(LOOPBACK),
        bootstrap=list(bootstrap),
        data_dir=str(tmp_path / name),
        log_level="warning",
        run=run,
    )


@asynccontextmanager
async def open_nodes(configs):
    """Start nodes one after another (each bootstraps from the first); yields their NodeContexts."""
    async with trio.open_nursery() as nursery:
        nodes = []
        for cfg in configs:
            if nodes and not cfg.bootstrap:
                cfg.bootstrap = [nodes[0].host.listen_addrs()[0]]
            nodes.append(await nursery.start(lambda task_status, c=cfg: run_node(c, task_status=task_status, handle_signals=False)))
        yield nodes
        nursery.cancel_scope.cancel()
