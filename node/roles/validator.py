"""The validator role: the core (node/roles/core.py), then the validator.

A validator checks rollout batches that trainers forward to it against checkpoints it gets from
the core's shards, signs verdicts, and records them and any penalties in the core's ledger
(node/validator/service.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from ..context import NodeContext
from ..validator.config import ValidatorSections
from ..validator.service import ValidatorService, serve_validator
from .core import CoreNode, start_core


@dataclass
class ValidatorNode(CoreNode):
    validator: ValidatorService


async def start(nursery: trio.Nursery, node: NodeContext) -> ValidatorNode:
    core = await start_core(nursery, node)
    validator = await nursery.start(serve_validator, node, core.sections.pick(ValidatorSections), core.shards,
                                    core.ledger)
    return ValidatorNode(**vars(core), validator=validator)
