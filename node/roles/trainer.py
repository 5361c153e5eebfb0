"""The trainer role: the core (node/roles/core.py), then the trainer, which publishes each new
version through the core's shards, advertises it in membership and records its work in the ledger.
Batches offered before the trainer takes them are answered ``not-ready`` (node/trainer/readiness.py):
the core's membership announces the node while the model is still loading."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from ..context import NodeContext
from ..rollouts.schema import ROLLOUTS_PROTOCOL
from ..trainer.config import TrainerSections
from ..trainer.readiness import not_ready_handler
from ..trainer.service import Trainer, serve_trainer
from .core import CoreNode, start_core
from .sections import RunSections


@dataclass
class TrainerNode(CoreNode):
    trainer: Trainer


async def start(nursery: trio.Nursery, node: NodeContext) -> TrainerNode:
    sections = RunSections.of(node.run)
    # Before the core: its membership record goes out long before the trainer can take batches.
    node.host.set_handler(ROLLOUTS_PROTOCOL, not_ready_handler(node, sections.trainer, sections.streams))
    core = await start_core(nursery, node)
    trainer = await nursery.start(serve_trainer, node, core.sections.pick(TrainerSections), core.shards,
                                  core.membership, core.ledger)
    return TrainerNode(**vars(core), trainer=trainer)
