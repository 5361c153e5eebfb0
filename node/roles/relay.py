"""The relay role: the core (node/roles/core.py) with the Circuit Relay v2 HOP service in place of
the relay client; nothing on top."""

from __future__ import annotations

import trio

from ..context import NodeContext
from ..reach.relay import serve_relay_hop
from .core import CoreNode, start_core


async def start(nursery: trio.Nursery, node: NodeContext) -> CoreNode:
    return await start_core(nursery, node, serve_relay_hop)
