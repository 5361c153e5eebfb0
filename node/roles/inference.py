"""The inference role: the core (node/roles/core.py), then the inference service
(node/inference/service.py), which follows checkpoints through the core's shards and finds
trainers through its membership."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from ..context import NodeContext
from ..inference.service import InferenceService, serve_inference
from .core import CoreNode, start_core


@dataclass
class InferenceNode(CoreNode):
    inference: InferenceService


async def start(nursery: trio.Nursery, node: NodeContext) -> InferenceNode:
    """The inference role: the core, then the generator fed by the core's shards and membership."""
    core = await start_core(nursery, node)
    inference = await nursery.start(serve_inference, node, core.shards, core.membership)
    return InferenceNode(**vars(core), inference=inference)
