"""A hostile libp2p host for attacking real nodes on loopback (import as `hostile`).

:class:`Hostile` is a real py-libp2p host (Noise, Yamux, gossipsub: what any peer of the swarm
runs) with a fresh identity, plus the moves of issue 14's attacks: raw streams held open on any
protocol, signed messages published on a gossip topic at a pace, raw frames written on a stream.
It carries no attack logic of its own beyond the bytes it is told to send: the tests say what is
sent and what must then hold. Everything it opens is closed when its ``async with`` ends.

Status over libp2p (``call_status``) is how tests look at a node from the outside, the way
``swarm-node status --connect`` does.
"""

from __future__ import annotations

import functools
import struct
import sys
import traceback
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from node.identity import Identity
from node.net.host import SwarmHost, open_swarm_host
from node.status import call_status
from node.wire import Message, encode, seal

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
# py-libp2p's gossipsub drops a peer's messages past 10/s per topic: attacks publish just under it,
# so that what the node does with each message is tested, not py-libp2p's rate limit.
GOSSIP_PACE = 9.0


@dataclass
class Hostile:
    host: SwarmHost
    identity: Identity
    nursery: trio.Nursery
    streams: list = field(default_factory=list)  # streams the target accepted (held open)
    failed: int = 0  # streams the target refused or reset

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    async def connect(self, addr: str) -> str:
        return await self.host.connect(addr)

    async def status(self, addr: str) -> dict:
        """The status of the node at ``addr`` over libp2p (as ``swarm-node status --connect``)."""
        return await call_status(self.host, addr)

    def hold_streams(self, target: str, protocol: str, n: int, payload: bytes = b"") -> None:
        """Open ``n`` streams to ``target`` on ``protocol``, write ``payload`` on each, then hold them
        open without another byte until the target cuts them or this host closes."""

        async def one() -> None:
            try:
                stream = await self.host.open_stream(target, protocol)
                self.streams.append(stream)
                if payload:
                    await stream.write(payload)
                await trio.sleep_forever()
            except Exception:  # noqa: BLE001 — refused and reset streams are what the target should do
                self.failed += 1

        for _ in range(n):
            self.nursery.start_soon(one)

    async def send_raw(self, target: str, protocol: str, data: bytes) -> bytes:
        """One stream: write ``data``, read what comes back until the target ends the stream (b"" if it
        resets it)."""
        got = b""
        try:
            stream = await self.host.open_stream(target, protocol)
            await stream.write(data)
            with trio.move_on_after(30):
                while chunk := await stream.read(65536):
                    got += chunk
        except Exception:  # noqa: BLE001 — a reset is an answer too
            pass
        return got

    async def join_topic(self, topic: str, addr: str) -> None:
        """Subscribe to ``topic`` and wait until the node at ``addr`` has us in its mesh."""
        from waiting import wait_for

        subscription = await self.host.pubsub.subscribe(topic)
        self.nursery.start_soon(self._discard, subscription)  # what the mesh sends us is not read
        await self.connect(addr)
        await wait_for(lambda: self.host.mesh_size(topic) >= 1, what=f"{self.peer_id[-8:]} in the mesh of {topic}")

    @staticmethod
    async def _discard(subscription) -> None:
        while True:
            await subscription.get()

    async def publish_signed(self, topic: str, items: list[tuple[Identity, str, Message | bytes]],
                             pace: float = GOSSIP_PACE) -> None:
        """Publish each ``(signer, domain, payload)`` sealed by its signer, ``pace`` messages a second."""
        for signer, domain, payload in items:
            await self.host.pubsub.publish(topic, encode(seal(signer, domain, payload)))
            await trio.sleep(1 / pace)  # the attack's pace, not a wait for a result

    async def publish_raw(self, topic: str, datas: list[bytes], pace: float = GOSSIP_PACE) -> None:
        for data in datas:
            await self.host.pubsub.publish(topic, data)
            await trio.sleep(1 / pace)


def frame(length: int, body: bytes) -> bytes:
    """A frame header announcing ``length`` bytes, followed by ``body`` (which may be shorter)."""
    return struct.pack(">I", length) + body


@asynccontextmanager
async def open_hostile(identity: Identity | None = None):
    """A :class:`Hostile` with a fresh identity (or ``identity``), listening on loopback."""
    identity = identity or Identity.generate()
    async with open_swarm_host(identity, LOOPBACK) as host, trio.open_nursery() as nursery:
        yield Hostile(host, identity, nursery)
        nursery.cancel_scope.cancel()


def leaf_errors(error: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaf_errors(inner)]
    return [error]


def explained(test):
    """For async tests: on failure, print each leaf exception's traceback, then re-raise unchanged.

    trio's nurseries inside py-libp2p's nest exception groups deeper than the 10 levels pytest
    prints, so a failed assertion in a nursery shows only its wrapping groups; this shows the cause."""

    @functools.wraps(test)
    async def run(*args, **kwargs):
        try:
            return await test(*args, **kwargs)
        except BaseExceptionGroup as group:
            for leaf in leaf_errors(group):
                traceback.print_exception(leaf, file=sys.stderr)
            raise

    return run
