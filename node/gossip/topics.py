"""Checked gossip topics: nothing reaches a handler, or is forwarded, before it passes its check.

``open_checked_topic`` installs a gossipsub topic validator that runs the owner's ``check``
function (size, envelope, signature, schema, run). A message that fails is refused by py-libp2p's
validation step, so it is neither delivered nor relayed, its forwarder loses gossipsub score (P4),
and the reason is counted in ``swarm_rejected_total{source=<topic>, reason=...}``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..context import NodeContext
from ..wire import RemoteProtocolError

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_CHECKED = 256  # validated messages awaiting delivery, per topic
_UNCHECKED = object()


@dataclass
class Delivery(Generic[T]):
    """A checked message and the peer that forwarded it to us (not necessarily its author)."""

    value: T
    forwarder: str
    size: int


class CheckedTopic(Generic[T]):
    def __init__(self, node: NodeContext, topic: str, check: Callable[[bytes], T], subscription,
                 checked: dict[bytes, T] | None = None) -> None:
        self.node = node
        self.topic = topic
        self._check = check
        self._subscription = subscription
        self._checked = checked if checked is not None else {}

    async def publish(self, data: bytes) -> None:
        await self.node.host.pubsub.publish(self.topic, data)
        self.node.metrics.messages_out.labels(topic=self.topic).inc()
        self.node.metrics.bytes_out.labels(topic=self.topic).inc(len(data))

    async def __aiter__(self) -> AsyncIterator[Delivery[T]]:
        while True:
            msg = await self._subscription.get()
            # The validator's result for these exact bytes, else a check of our own: what is
            # delivered never depends on py-libp2p having run the validator first.
            value = self._checked.pop(msg.data, _UNCHECKED)
            if value is _UNCHECKED:
                try:
                    value = self._check(msg.data)
                except RemoteProtocolError:
                    continue  # counted by the validator already
            forwarder = _peer_str(msg.from_id)
            self.node.metrics.messages_in.labels(topic=self.topic).inc()
            self.node.metrics.bytes_in.labels(topic=self.topic).inc(len(msg.data))
            yield Delivery(value, forwarder, len(msg.data))


def _peer_str(raw: bytes) -> str:
    from libp2p.peer.id import ID

    try:
        return ID(raw).to_base58()
    except Exception:
        return "?"


@asynccontextmanager
async def open_checked_topic(
    node: NodeContext, topic: str, check: Callable[[bytes], T]
) -> AsyncIterator[CheckedTopic[T]]:
    """Subscribe to ``topic`` with ``check`` as its validator; unsubscribe on exit."""

    checked: dict[bytes, object] = {}  # validated, not yet delivered (delivery pops it)

    def validator(forwarder, msg) -> bool:
        try:
            value = check(msg.data)
            if len(checked) >= MAX_CHECKED:  # deliveries dropped by a full subscription queue
                checked.pop(next(iter(checked)))
            checked[msg.data] = value
            return True
        except RemoteProtocolError as e:
            node.metrics.reject(topic, e.reason)
            log.info("rejected gossip", extra={"topic": topic, "reason": e.reason, "peer": str(forwarder)})
            return False

    pubsub = node.host.pubsub
    pubsub.set_topic_validator(topic, validator, False)
    subscription = await pubsub.subscribe(topic)
    try:
        yield CheckedTopic(node, topic, check, subscription, checked)
    finally:
        pubsub.remove_topic_validator(topic)
