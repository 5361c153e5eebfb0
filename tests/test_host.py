"""The libp2p host over real loopback sockets: what node/net/host.py adds to py-libp2p holds (a ping
that survives a cut round trip, cached addresses, a widened receive window, every patch installed)."""

from __future__ import annotations

import trio
from hosts import LOOPBACK, connected_hosts

from node.identity import Identity
from node.net.host import open_swarm_host, widen_receive_window


async def test_a_ping_cut_short_does_not_break_the_next_one():
    """A probe timeout cancels a ping mid-flight; the next ping to that peer must still work
    (py-libp2p's PingService kept the cut stream and raised TypeError on every later ping)."""
    from libp2p.host.ping import ID as PING_PROTOCOL

    async with connected_hosts() as (a, b):
        answered = b.host.get_mux().handlers[PING_PROTOCOL]
        read = trio.Event()

        async def silent(stream) -> None:  # reads the ping, never answers
            await stream.read(32)
            read.set()
            await trio.sleep_forever()

        b.set_handler(PING_PROTOCOL, silent)
        async with trio.open_nursery() as nursery:
            async def cut_short() -> None:
                with trio.CancelScope() as scope:
                    cancel_scopes.append(scope)
                    await a.ping(b.peer_id)

            cancel_scopes: list[trio.CancelScope] = []
            nursery.start_soon(cut_short)
            await read.wait()  # the ping is in flight: cancel it there, as a probe timeout does
            cancel_scopes[0].cancel()
        assert b.peer_id not in a._ping_streams  # the cut stream, with its echo still due, is not kept
        b.set_handler(PING_PROTOCOL, answered)
        assert await a.ping(b.peer_id) >= 0


async def test_pings_to_a_peer_share_one_stream_and_survive_its_close():
    """An idle node's SWIM probe is one ping a second: each on a fresh stream cost a stream open, a
    protocol negotiation and a handler task on both sides. The kept stream carries the next ping;
    one the peer closed meanwhile (its idle limit) costs one failed try and a fresh stream, not a
    failed ping (a missed probe would start a suspicion of a live peer)."""
    from libp2p.host.ping import ID as PING_PROTOCOL

    async with connected_hosts() as (a, b):
        opened: list[object] = []
        close_now = trio.Event()

        async def echo_pings(stream) -> None:  # the protocol: echo 32 bytes until closed
            opened.append(stream)
            while True:
                try:
                    data = await stream.read(32)
                except Exception:  # noqa: BLE001 — py-libp2p reports the other side's close as StreamEOF
                    return
                if not data:
                    break
                await stream.write(data)
                if close_now.is_set():  # the peer's idle limit, right after answering
                    break
            await stream.close()

        b.set_handler(PING_PROTOCOL, echo_pings)
        for _ in range(5):
            assert await a.ping(b.peer_id) >= 0
        assert len(opened) == 1
        close_now.set()
        assert await a.ping(b.peer_id) >= 0  # answered, then the handler closes the kept stream
        assert await a.ping(b.peer_id) >= 0  # the kept one fails at once; a fresh stream answers
        assert len(opened) == 2
        a.forget_ping_streams(set())  # disconnected peers' streams are dropped
        assert a._ping_streams == {}


async def test_our_addresses_are_read_from_the_sockets_once_per_ttl(autojump_clock, monkeypatch):
    from node.net.host import ADDRS_TTL

    async with open_swarm_host(Identity.generate(), LOOPBACK) as a:
        await trio.sleep(ADDRS_TTL)  # what start-up cached has expired
        calls = []
        for name in ("get_addrs", "get_transport_addrs"):
            real = getattr(a.host, name)
            monkeypatch.setattr(a.host, name, lambda real=real, name=name: calls.append(name) or real())
        listen, transport = a.listen_addrs(), a.transport_addrs()
        for _ in range(20):
            assert a.listen_addrs() == listen and a.transport_addrs() == transport
        assert calls.count("get_addrs") == 1 and calls.count("get_transport_addrs") == 2  # one inside get_addrs
        assert listen == [f"{t}/p2p/{a.peer_id}" for t in transport]
        await trio.sleep(ADDRS_TTL)
        a.listen_addrs()
        assert calls.count("get_addrs") == 2


async def test_a_widened_window_lets_the_peer_send_that_much_before_it_waits_for_credit():
    """A Yamux stream's window stays at 256 KiB on a slow link, so a downloader credited its peer
    for every 128 KiB block it read. Widened once, the peer writes up to the new window while we
    read nothing, and every byte arrives."""
    payload = bytes(range(256)) * (3 << 12)  # 3 MiB: twelve of the default windows
    written = trio.Event()

    async def sender(stream) -> None:
        await stream.write(payload)
        written.set()
        await stream.read(1)  # until the reader is done

    async with connected_hosts("/test/sender/1", sender) as (a, b):
        stream = await a.open_stream(b.peer_id, "/test/sender/1")
        await widen_receive_window(stream, 4 << 20)
        with trio.fail_after(30):  # a guard only: without the grant the write never completes
            await written.wait()
            got = bytearray()
            while len(got) < len(payload):
                got.extend(await stream.read(1 << 20))
        await stream.write(b"k")
    assert got == payload


async def test_a_host_installs_every_patch_of_the_package():
    """install_all's list of patches is kept by hand: one left out of it would never run."""
    from node.net.patches import PATCHES
    from node.net.patches.patch import Patch

    defined = {p for p in Patch.__subclasses__() if p.__module__.startswith("node.net.patches.")}
    assert defined == set(PATCHES)
    async with open_swarm_host(Identity.generate(), LOOPBACK):
        assert all(p.__dict__.get("_installed") for p in PATCHES)


async def test_remote_ip_is_the_address_our_connection_to_the_peer_comes_from():
    """What the fresh-identity pool counts origins by (node/net/origins.py): read from the socket."""
    async with connected_hosts() as (a, b):
        assert a.remote_ip(b.peer_id) == "127.0.0.1" and b.remote_ip(a.peer_id) == "127.0.0.1"
        assert a.remote_ip(Identity.generate().peer_id) is None  # no connection, no address
