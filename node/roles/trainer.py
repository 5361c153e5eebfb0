"""The trainer role: the core (node/roles/core.py), then the trainer, which publishes each new
version through the core's shards, advertises it in membership and records its work in the ledger."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from ..context import NodeContext
from ..trainer.config import TrainerSections
from ..trainer.service import Trainer, serve_trainer
from .core import CoreNode, start_core


@dataclass
class TrainerNode(CoreNode):
    trainer: Trainer


async def start(nursery: trio.Nursery, node: NodeContext) -> TrainerNode:
    core = await start_core(nursery, node)
    trainer = await nursery.start(serve_trainer, node, core.sections.pick(TrainerSections), core.shards,
                                  core.membership, core.ledger)
    return TrainerNode(**vars(core), trainer=trainer)
