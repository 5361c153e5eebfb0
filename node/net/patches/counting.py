"""The patches that count bytes: py-libp2p keeps no such count, so the first host wraps
``TrioTCPStream.read/write`` and ``NetStream.read/write`` once, adding to :mod:`node.counters`."""

from __future__ import annotations

from ...wire import Gather
from ...counters import StreamBytes, TcpBytes
from .patch import Patch


class CountTcpBytes(Patch):
    """Add every TCP read and write of libp2p to :class:`~node.counters.TcpBytes`."""

    @classmethod
    def _patch(cls) -> None:
        from libp2p.io.trio import TrioTCPStream

        def count(stream, direction: str, n: int) -> None:
            setattr(TcpBytes, direction, getattr(TcpBytes, direction) + n)
            TcpBytes.calls[direction] += 1

        _count_io(TrioTCPStream, count)


def _count_io(stream_cls, count) -> None:
    """Wrap ``stream_cls.write`` and ``.read`` so each call reports ``count(stream, "sent"|"received", n)``."""
    write, read = stream_cls.write, stream_cls.read

    async def counted_write(self, data: bytes | Gather) -> None:
        await write(self, data)
        count(self, "sent", data.nbytes if isinstance(data, Gather) else len(data))

    async def counted_read(self, n: int | None = None) -> bytes:
        data = await read(self, n)
        count(self, "received", len(data))
        return data

    stream_cls.write, stream_cls.read = counted_write, counted_read


class CountStreamBytes(Patch):
    """Add every libp2p stream's reads and writes to :class:`~node.counters.StreamBytes`, by protocol."""

    @classmethod
    def _patch(cls) -> None:
        from libp2p.network.stream.net_stream import NetStream

        def count(stream, direction: str, n: int) -> None:
            by_protocol = getattr(StreamBytes, direction)
            key = str(stream.get_protocol() or "negotiating")
            by_protocol[key] = by_protocol.get(key, 0) + n

        _count_io(NetStream, count)
