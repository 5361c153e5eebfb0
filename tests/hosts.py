"""Libp2p hosts on loopback for the tests of node/net/host.py and node/net/patches/ (import as `hosts`)."""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from node.identity import Identity
from node.net.host import open_swarm_host
from node.wire import read_frame, write_frame

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
ECHO = "/test/echo/1"


async def echo(stream) -> None:
    await write_frame(stream, await read_frame(stream))
    await stream.close()


@asynccontextmanager
async def connected_hosts(protocol: str | None = None, handler=None):
    """Two hosts on loopback, ``a`` connected to ``b`` (``b`` serving ``handler`` on ``protocol``)."""
    async with open_swarm_host(Identity.generate(), LOOPBACK) as a, open_swarm_host(Identity.generate(), LOOPBACK) as b:
        if handler is not None:
            b.set_handler(protocol, handler)
        await a.connect(b.listen_addrs()[0])
        yield a, b


def frame_sink(frames: int, got: list):
    """A handler that reads ``frames`` frames into ``got``, then answers b"k" and closes."""
    async def sink(stream) -> None:
        for _ in range(frames):
            got.append(await read_frame(stream))
        await stream.write(b"k")
        await stream.close()
    return sink


class StepCount(trio.abc.Instrument):
    """Counts the scheduler steps of the tasks named ``name``."""

    def __init__(self, name: str) -> None:
        self.name, self.n = name, 0

    def before_task_step(self, task) -> None:
        self.n += task.name == self.name


def mib_sink():
    """(1 MiB payload, the bytearray it is read into, a handler reading it then answering b"k")."""
    payload = bytes(range(256)) * 4096
    got = bytearray()

    async def sink(stream) -> None:
        while len(got) < len(payload):
            got.extend(await stream.read(len(payload)))
        await stream.write(b"k")

    return payload, got, sink
