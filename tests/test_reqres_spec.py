"""A request/response protocol as one value (node/net/reqres.py ``RequestResponse``): its server and
its client meet through it on in-memory streams under trio's MockClock, and the loop's three
protocols (node/rollouts/protocols.py) are what their servers and clients used before."""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio
from test_budget import _Named, lim, pair

from node.metrics import Metrics
from node.net.budget import limits
from node.net.reqres import CallFailure, FailureKind, RequestResponse, messages, raw
from node.peers import Peers
from node.rollouts.ack import ACK_CODEC
from node.rollouts.protocols import MAX_BATCH_FRAME, ROLLOUTS, VERDICTS, VERIFY
from node.rollouts.schema import (MAX_BATCH_BYTES, ROLLOUTS_PROTOCOL, VERDICTS_PROTOCOL, VERIFY_PROTOCOL,
                                  RolloutAck)
from node.wire import MAX_FRAME, LocalProtocolError

ECHO = RequestResponse("/echo", raw(100), raw(100), timeout=5.0, limits=lim(), source="echo")


class WiredHost:
    """A host whose streams go straight to ``handle`` (a server's stream handler) in ``nursery``."""

    def __init__(self, nursery: trio.Nursery, handle, me: str = "client") -> None:
        self.nursery, self.handle, self.me = nursery, handle, me
        self.opened: list[tuple[str, str]] = []

    async def open_stream(self, peer: str, protocol: str):
        self.opened.append((peer, protocol))
        client, server = pair(self.me)
        self.nursery.start_soon(self.handle, _Named(server, self.me))
        return client


async def test_a_protocol_value_serves_and_calls(autojump_clock):
    seen = []

    async def answer(peer: str, data: bytes) -> bytes:
        seen.append((peer, data))
        return b"re:" + data

    async with trio.open_nursery() as nursery:
        host = WiredHost(nursery, ECHO.handler(answer, metrics=Metrics()))
        assert await ECHO.call(host, "server", b"hi") == b"re:hi"
    assert seen == [("client", b"hi")] and host.opened == [("server", "/echo")]


async def test_a_reply_the_protocol_cannot_read_is_garbage_reported_under_its_source(autojump_clock):
    peers = Peers(None, Metrics())

    async def answer(peer: str, data: bytes) -> bytes:
        return b"x" * 101  # over the reply codec's 100 bytes

    async with trio.open_nursery() as nursery:
        host = WiredHost(nursery, ECHO.handler(answer))
        with pytest.raises(CallFailure) as e:
            await ECHO.call(host, "server", b"hi", peers=peers)
    assert e.value.kind is FailureKind.GARBAGE and e.value.reason == "oversized"
    assert peers.table.peers["server"].last == "echo/oversized"


async def test_the_protocols_timeout_bounds_a_call_unless_the_caller_gives_one(autojump_clock):
    async def answer(peer: str, data: bytes) -> bytes:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        host = WiredHost(nursery, ECHO.handler(answer))
        for timeout, expected in ((None, ECHO.timeout), (2.0, 2.0)):
            start = trio.current_time()
            with pytest.raises(CallFailure) as e:
                await ECHO.call(host, "server", b"hi", timeout)
            assert e.value.kind is FailureKind.TIMEOUT and trio.current_time() - start == expected
        nursery.cancel_scope.cancel()


def test_a_protocol_states_a_budget_its_codec_fits():
    with pytest.raises(ValueError, match="frame cap 100 below the codec's 200"):
        RequestResponse("/p", raw(200), None, 1.0, limits=lim())
    with pytest.raises(ValueError, match="without limits or max_inflight"):
        RequestResponse("/p", raw(200), None, 1.0).budget()
    assert RequestResponse("/p", raw(200), None, 1.0, max_inflight=8).budget() == limits(8, 200)
    assert RequestResponse("/p", messages(RolloutAck), None, 1.0).source == "/p"


async def test_a_protocol_only_served_here_is_never_called():
    with pytest.raises(LocalProtocolError):
        await RequestResponse("/p", raw(10), None, 1.0).call(None, "peer", b"x")


def test_the_loops_protocols_keep_their_wire():
    """What the servers and clients of the loop used before they shared these values."""
    assert [p.protocol for p in (ROLLOUTS, VERIFY, VERDICTS)] == [ROLLOUTS_PROTOCOL, VERIFY_PROTOCOL, VERDICTS_PROTOCOL]
    assert all(p.reply is ACK_CODEC for p in (ROLLOUTS, VERIFY, VERDICTS))
    assert ROLLOUTS.request.max_size == MAX_BATCH_FRAME == min(MAX_FRAME, MAX_BATCH_BYTES)
    assert (ROLLOUTS.source, VERIFY.source, VERDICTS.source) == ("rollouts", VERIFY_PROTOCOL, "verdicts")
    assert VERIFY.budget() == limits(16, MAX_FRAME, per_peer=12)
    assert VERDICTS.budget() == limits(16, 1024 * 1024) and VERDICTS.per_stream == 256
    assert {p.timeout for p in (ROLLOUTS, VERIFY, VERDICTS)} == {30.0}
    # The trainer sizes its intake from [trainer]; the spec keeps everything else.
    served = replace(ROLLOUTS, limits=limits(64, MAX_BATCH_FRAME, per_peer=8))
    assert served.budget().streams_per_peer == 8 and served.request is ROLLOUTS.request
