"""The inference role: the core (node/roles/core.py), then the inference service
(node/inference/service.py), which follows checkpoints through the core's shards and finds
trainers through its membership. With ``[worker] cheat`` set, the role hands the service the
cheating generator and outbox of node/adversary/ instead of the honest ones."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import trio

from ..adversary.outbox import make_outbox
from ..context import NodeContext
from ..inference.config import InferenceSections
from ..inference.service import InferenceService, Makers, serve_inference
from .core import CoreNode, start_core


@dataclass
class InferenceNode(CoreNode):
    inference: InferenceService


def cheating_generator(**kwargs):
    """node/adversary/generator.py's generator for ``worker.cheat``, imported when the service
    calls it (in a worker thread: it loads torch)."""
    from ..adversary.generator import make_generator

    return make_generator(**kwargs)


def makers_for(cheat: str) -> Makers:
    """The honest generator and outbox, or the ones that cheat the way ``cheat`` says."""
    return Makers(generator=cheating_generator, outbox=partial(make_outbox, cheat)) if cheat else Makers()


async def start(nursery: trio.Nursery, node: NodeContext) -> InferenceNode:
    """The inference role: the core, then the generator fed by the core's shards and membership."""
    core = await start_core(nursery, node)
    sections = core.sections.pick(InferenceSections)
    makers = makers_for(sections.worker.cheat)
    inference = await nursery.start(serve_inference, node, sections, core.shards, core.membership, makers)
    return InferenceNode(**vars(core), inference=inference)
