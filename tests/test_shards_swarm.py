"""In-process swarms on loopback: honest downloads, lying and silent peers, resume."""

from __future__ import annotations

import struct
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from node.identity import Identity
from node.net.host import is_relayed
from node.reach.relay import circuit_addr, connect_addr, serve_relay_client, serve_relay_hop
from node.shards.protocol import PROTOCOL, RELAYED, Data, Have, Hello, Reject, read_shards_message
from node.shards.server import ServerSession
from node.shards.service import ShardsService
from node.wire import encode, write_frame
from node.shards.testing import open_shards_swarm, same_files, write_checkpoint
from test_soak_disk_full import open_files
from waiting import wait_for

MiB = 1 << 20
FAST = dict(announce_interval=0.5, request_timeout=2.0, progress=False)


async def connect_all(nodes) -> None:
    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :]:
            await a.host.connect(b.host.listen_addrs()[0])


async def test_relay_fetches_published_version(tmp_path: Path) -> None:
    trainer = Identity.generate()
    src = write_checkpoint(tmp_path / "ckpt", 5 * MiB + 123, seed=1)
    with trio.fail_after(60):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=[trainer.peer_id], role="trainer", **FAST)
            r = await swarm.add(tmp_path / "r", trainers=[trainer.peer_id], role="relay", **FAST)
            await connect_all([t, r])
            signed = await t.shards.publish(src, 7)
            path = await r.shards.wait_version(7)
            assert same_files(src, path)
            receipts = r.shards.receipts()
            assert receipts == {(t.peer_id, signed.root.hex()): signed.manifest.total_size}
            assert r.shards.status()["held"] == [7]
            m = signed.manifest
            assert r.ledger.received == {(t.peer_id, signed.root): [m.total_size, m.num_pieces]}


async def test_followers_are_told_of_newer_versions(tmp_path: Path) -> None:
    """``wait_announced`` and ``wait_newer`` return once a newer version is announced / complete."""
    trainer = Identity.generate()
    with trio.fail_after(60):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=[trainer.peer_id], role="trainer", **FAST)
            r = await swarm.add(tmp_path / "r", trainers=[trainer.peer_id], role="inference", **FAST)
            await connect_all([t, r])
            told = {}

            async def follow() -> None:
                told["announced"] = await r.shards.wait_announced(1)
                told["complete"] = await r.shards.wait_newer(1)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow)
                await t.shards.publish(write_checkpoint(tmp_path / "v1", MiB, seed=1), 1)
                await t.shards.publish(write_checkpoint(tmp_path / "v2", MiB, seed=2), 2)
            assert told == {"announced": 2, "complete": 2}
            assert await r.shards.wait_newer(None) == 2  # already held: at once


class FlipBytes(ServerSession):
    asked: set[int] = set()  # request lengths seen: whole pieces (picker) as well as blocks

    def reply_to(self, req):
        FlipBytes.asked.add(req.length)
        reply = super().reply_to(req)
        if isinstance(reply, Data):
            return Data(piece=reply.piece, offset=reply.offset, data=bytes([reply.data[0] ^ 0xFF]) + reply.data[1:])
        return reply


class WrongLength(ServerSession):
    def reply_to(self, req):
        reply = super().reply_to(req)
        if isinstance(reply, Data):
            return Data(piece=reply.piece, offset=reply.offset, data=reply.data[:-1])
        return reply


class Silent(ServerSession):
    def reply_to(self, req):
        return None  # accepts requests, never answers


class DiesMidFrame(ServerSession):
    async def _serve_queue(self):
        """Answers the first request with half a frame and closes: a peer killed mid-send."""
        while not self.queue:
            self.wakeup = trio.Event()
            await self.wakeup.wait()
        req = self.queue.popleft()
        body = encode(Data(piece=req.piece, offset=req.offset, data=self.vs.read_block(req.piece, req.offset, req.length)))
        await self.stream.write(struct.pack(">I", len(body)) + body[: len(body) // 2])
        await self.stream.close()


def liar(session_class):
    return type(f"Liar{session_class.__name__}", (ShardsService,), {"server_session_class": session_class})


SMALL = dict(piece_size=64 * 1024, block_size=16 * 1024, **FAST)


async def test_liars_are_banned_and_download_is_correct(tmp_path: Path) -> None:
    trainer = Identity.generate()
    tr = [trainer.peer_id]
    src = write_checkpoint(tmp_path / "ckpt", 8 * MiB, seed=2)
    FlipBytes.asked.clear()
    with trio.fail_after(90):
        async with open_shards_swarm() as swarm:
            async def node(name, **kw):
                return await swarm.add(tmp_path / name, trainers=tr, **kw)

            # Honest peers are slow (capped upload), liars fast: they will be asked for plenty.
            t = await node("t", identity=trainer, role="trainer", upload_rate=2 * MiB, **SMALL)
            honest = await node("h", role="relay", fetch="none", upload_rate=2 * MiB, **SMALL)
            flip = await node("flip", role="relay", fetch="none", service_class=liar(FlipBytes), **SMALL)
            short = await node("short", role="relay", fetch="none", service_class=liar(WrongLength), **SMALL)
            signed = await t.shards.publish(src, 1)
            for n in (honest, flip, short):
                await n.shards.seed(src, signed)
            # Every peer is connected before the download starts. Joining it as announced, the
            # downloader met the liars last (connects run one after another), ~0.4 s before it
            # finished: whether the flipper was caught twice in that time was luck.
            d = await node("d", role="inference", fetch="none", **SMALL)
            await connect_all([t, honest, flip, short, d])
            svc = d.shards
            svc.fetch(1, signed.root, t.peer_id)
            path = await svc.wait_version(1)
            assert same_files(src, path)
            now = trio.current_time()
            assert svc.is_banned(flip.peer_id, now)
            assert svc.is_banned(short.peer_id, now)
            assert not svc.is_banned(honest.peer_id, now) and not svc.is_banned(t.peer_id, now)
            credited = {peer for peer, _ in svc.receipts()}
            assert flip.peer_id not in credited and short.peer_id not in credited
            assert sum(svc.receipts().values()) == signed.manifest.total_size
            rejected = d.metrics.rejections()
            assert rejected.get("shards/bad-piece", 0) >= 1 and rejected.get("shards/wrong-length", 0) == 1
            # The fast liar was asked for whole pieces too (one request for a piece's 4 blocks).
            assert SMALL["piece_size"] in FlipBytes.asked


@asynccontextmanager
async def download_beside(tmp_path: Path, session_class, size: int, seed: int, **cfg):
    """A downloader fetching from the trainer (capped at 1 MiB/s) and a seed playing ``session_class``.

    Returns the downloader's node and the odd peer once the download is complete and checked."""
    trainer = Identity.generate()
    tr = [trainer.peer_id]
    src = write_checkpoint(tmp_path / "ckpt", size, seed=seed)
    async with open_shards_swarm() as swarm:
        t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer", upload_rate=1 * MiB, **cfg)
        odd = await swarm.add(tmp_path / "odd", trainers=tr, fetch="none", service_class=liar(session_class), **cfg)
        signed = await t.shards.publish(src, 1)
        await odd.shards.seed(src, signed)
        d = await swarm.add(tmp_path / "d", trainers=tr, **cfg)
        await connect_all([t, odd, d])
        assert same_files(src, await d.shards.wait_version(1))
        yield d, odd


async def test_silent_peer_is_dropped_and_download_completes(tmp_path: Path) -> None:
    # 8 MiB at 1 MiB/s from the only honest peer: ~8 s, well past the 3 timeouts of 1 s that drop.
    with trio.fail_after(90):
        async with download_beside(tmp_path, Silent, 8 * MiB, 3, **dict(SMALL, request_timeout=1.0)) as (d, silent):
            svc = d.shards
            # Dropped and backed off from, never banned: it may only have been starved of CPU.
            assert not svc.is_banned(silent.peer_id, trio.current_time())
            assert d.metrics.rejections().get("shards/unresponsive", 0) >= 1
            assert silent.peer_id not in {peer for peer, _ in svc.receipts()}


async def test_peer_that_dies_mid_frame_is_not_banned(tmp_path: Path) -> None:
    # CI: a downloader killed mid-send was banned for 10 minutes by everyone it was serving, so
    # after its restart (same key) nobody fetched the pieces only it held.
    with trio.fail_after(60):
        async with download_beside(tmp_path, DiesMidFrame, 2 * MiB, 4, **SMALL) as (d, dies):
            assert d.metrics.rejections().get("shards/truncated", 0) >= 1
            assert not d.shards.is_banned(dies.peer_id, trio.current_time())


async def test_relay_serves_pieces_while_still_downloading(tmp_path: Path) -> None:
    """trainer -> relay -> downloader, the downloader not connected to the trainer: it gets every
    byte through the relay, and its first piece arrives before the relay has the whole version."""
    trainer = Identity.generate()
    tr = [trainer.peer_id]
    src = write_checkpoint(tmp_path / "ckpt", 6 * MiB, seed=4)
    with trio.fail_after(90):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer", upload_rate=2 * MiB, **FAST)
            r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", **FAST)
            d = await swarm.add(tmp_path / "d", trainers=tr, role="inference", **FAST)
            await t.host.connect(r.host.listen_addrs()[0])
            await d.host.connect(r.host.listen_addrs()[0])
            signed = await t.shards.publish(src, 3)
            svc = d.shards
            first_piece_at = relay_done_at = None
            async with trio.open_nursery() as nursery:
                async def relay_done():
                    nonlocal relay_done_at
                    await r.shards.wait_version(3)
                    relay_done_at = trio.current_time()

                nursery.start_soon(relay_done)
                while first_piece_at is None:
                    dl = svc.downloads.get(3)
                    if dl is not None and dl.vs.verified:
                        first_piece_at = trio.current_time()
                    await trio.sleep(0.01)
                path = await svc.wait_version(3)
            assert same_files(src, path)
            assert first_piece_at < relay_done_at
            assert {p for p, _ in svc.receipts()} == {r.peer_id}
            assert sum(svc.receipts().values()) == signed.manifest.total_size


async def test_inference_fetches_newest_relay_fetches_all(tmp_path: Path) -> None:
    trainer = Identity.generate()
    tr = [trainer.peer_id]
    with trio.fail_after(90):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer", upload_rate=2 * MiB, **FAST)
            d = await swarm.add(tmp_path / "d", trainers=tr, role="inference", **FAST)
            r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", **FAST)
            await connect_all([t, d, r])
            topic = t.topic("checkpoints")
            await wait_for(lambda: t.host.mesh_size(topic) == 2, what="both followers in the trainer's announce mesh")
            await t.shards.publish(write_checkpoint(tmp_path / "v1", 4 * MiB, seed=1), 1)
            while 1 not in d.shards.downloads:  # version 1 is on its way to d ...
                await trio.sleep(0.05)
            await t.shards.publish(write_checkpoint(tmp_path / "v2", 1 * MiB, seed=2), 2)
            await d.shards.wait_version(2)
            await r.shards.wait_version(1)
            await r.shards.wait_version(2)
            assert d.shards.versions_held() == [2]  # ... and abandoned for version 2
            assert 1 not in d.shards.downloads
            assert r.shards.versions_held() == [1, 2]


async def test_a_peer_sending_garbage_to_the_server_is_banned_past_the_threshold(tmp_path: Path) -> None:
    """Garbage on /swarm/shards/1.0.0 counts strikes in the peer table; the [shards] garbage_strikes-th
    bans the sender (its next stream is refused), while a stream cut mid-frame is never counted."""
    from node.net.host import open_swarm_host
    from node.shards.protocol import BANNED, PROTOCOL, Reject, read_shards_message
    from node.shards.service import GARBAGE_SOURCE

    trainer, mallory = Identity.generate(), Identity.generate()
    with trio.fail_after(90):
        async with open_shards_swarm() as swarm:
            s = await swarm.add(tmp_path / "s", trainers=[trainer.peer_id], role="relay", garbage_strikes=3, **FAST)
            svc, addr = s.shards, s.host.listen_addrs()[0]
            async with open_swarm_host(mallory, ["/ip4/127.0.0.1/tcp/0"]) as host:
                await host.connect(addr)

                async def send(raw: bytes, answer: bool = True):
                    stream = await host.open_stream(s.peer_id, PROTOCOL)
                    try:
                        await stream.write(raw)
                        return await read_shards_message(stream) if answer else None
                    except Exception:  # noqa: BLE001 — the server resets the stream after garbage (or a ban)
                        return None
                    finally:
                        await stream.reset()

                def strikes() -> int:
                    return int(s.metrics.rejections().get("shards/malformed", 0))

                await send(struct.pack(">I", 100) + b"\x00" * 10, answer=False)  # cut mid-frame: it left, no strike
                rejections = s.metrics.rejections
                await wait_for(lambda: rejections().get("shards/truncated") or rejections().get("shards/stream-error"),
                               what="cut stream seen")
                for n in (1, 2):
                    await send(struct.pack(">I", 3) + b"\xc1\xc1\xc1")  # not msgpack
                    await wait_for(lambda: strikes() == n, what=f"garbage {n} counted")
                assert not svc.is_banned(mallory.peer_id, trio.current_time())  # below the threshold
                # ...yet each piece of garbage already cost it gossip score (a weight of -10 once paid +10).
                assert s.peers.app_score(mallory.peer_id) < 0
                await send(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
                await wait_for(lambda: svc.is_banned(mallory.peer_id, trio.current_time()), what="ban")
                assert mallory.peer_id in svc.status()["banned"]
                assert GARBAGE_SOURCE in s.peers.table.bans(trio.current_time())[mallory.peer_id]
                await wait_for(lambda: mallory.peer_id not in s.host.connected_peers(), what="cut off")
                await host.connect(addr)
                # Its next stream is refused before anything on it is read (the reset may beat the Reject).
                answer = await send(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
                assert answer is None or (isinstance(answer, Reject) and answer.reason == BANNED), answer
                assert strikes() == 3


class CountsHaves(ServerSession):
    """Records the Have messages its downloader sends."""

    haves: dict[str, int] = {}  # serving node's peer id -> Haves received

    async def _next_message(self):
        msg = await super()._next_message()
        if isinstance(msg, Have):
            me = self.owner.host.peer_id
            CountsHaves.haves[me] = CountsHaves.haves.get(me, 0) + 1
        return msg


async def test_downloaders_send_haves_only_to_a_super_seeder(tmp_path: Path) -> None:
    """A Have per piece per peer is wasted on a server that is not super-seeding (it drops them):
    the server's Bitfield says whether it wants them, and only the publisher's does."""
    trainer = Identity.generate()
    src = write_checkpoint(tmp_path / "ckpt", 3 * MiB, seed=4)
    counting = type("CountingService", (ShardsService,), {"server_session_class": CountsHaves})
    CountsHaves.haves = {}
    tr = [trainer.peer_id]
    with trio.fail_after(60):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer",
                                service_class=counting, **FAST)
            r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", service_class=counting, **FAST)
            await connect_all([t, r])
            signed = await t.shards.publish(src, 1)
            await r.shards.wait_version(1)
            d = await swarm.add(tmp_path / "d", trainers=tr, role="inference", fetch="none", **FAST)
            await connect_all([d, t, r])
            d.shards.fetch(1, signed.root, t.peer_id)
            assert same_files(src, await d.shards.wait_version(1))
            assert CountsHaves.haves.get(t.peer_id, 0) >= signed.manifest.num_pieces  # r's and d's, super-seeding
            assert CountsHaves.haves.get(r.peer_id, 0) == 0  # d sent none to the plain relay


async def test_a_verified_piece_is_not_announced_to_peers_known_to_hold_it(tmp_path: Path) -> None:
    """Have suppression: a peer that told us it holds a piece is not told we now have it too."""
    from types import SimpleNamespace

    from node.shards.picker import Picker
    from node.shards.testing import open_shards_node

    async with open_shards_node(tmp_path / "a", trainers=[Identity.generate().peer_id], **FAST) as a:
        svc = a.shards
        root = b"\x01" * 32
        vs = SimpleNamespace(version=3, signed=SimpleNamespace(root=root))
        picker = Picker([1 << 18] * 4)
        picker.on_bitfield("holder", {2})
        svc.downloads[3] = SimpleNamespace(root=root, picker=picker)
        told = []

        def session(peer):
            return SimpleNamespace(peer=peer, push_have=lambda piece: told.append((peer, piece)))

        svc.server_sessions[root] = [session("holder"), session("other")]  # iterated like the set
        svc.on_piece_verified(vs, 2)
        svc.on_piece_verified(vs, 1)
        del svc.downloads[3], svc.server_sessions[root]
    assert sorted(told) == [("holder", 1), ("other", 1), ("other", 2)]


async def test_the_service_offers_every_member_its_sessions_see(tmp_path: Path) -> None:
    """The sessions are typed against node/shards/session_api.py, not the service: the real service
    must still have each member, with the same parameters (a fake in a test would not notice)."""
    import inspect

    from node.shards.session_api import DeltaOwner, SessionOwner
    from node.shards.testing import open_shards_node

    members = {n: m for cls in (SessionOwner, DeltaOwner) for n, m in vars(cls).items() if not n.startswith("_")}
    assert len(members) == 18  # public_members gave way to members and dials (DialBook)
    async with open_shards_node(tmp_path / "a", trainers=[Identity.generate().peer_id], **FAST) as a:
        svc = a.shards
        for name, member in members.items():
            assert hasattr(svc, name), name
            if inspect.isfunction(member):
                assert list(inspect.signature(getattr(svc, name)).parameters) == \
                    list(inspect.signature(member).parameters)[1:], name
        assert svc.host is a.host


async def test_a_write_the_kernel_holds_up_does_not_stop_the_event_loop(tmp_path: Path, monkeypatch) -> None:
    """A ``pwrite`` of a large piece that waits in the kernel (dirty-page throttling, a slow disk)
    waits in the writer thread: the downloader's event loop goes on meanwhile. Before, the write ran
    in the event loop, so nothing in the node (nor this test) ran until it returned: the write below
    timed out."""
    import threading

    from node.shards.client import THREAD_WRITE_BYTES
    from node.shards.store import VersionStore

    trainer = Identity.generate()
    tr = [trainer.peer_id]
    src = write_checkpoint(tmp_path / "ckpt", 2 * MiB, seed=5)
    entered, release, released = threading.Event(), threading.Event(), []
    real = VersionStore._pwrite

    def held_up(self, start, data, writeback):
        if (tmp_path / "r") in self.folder.parents and not entered.is_set():
            entered.set()
            released.append(release.wait(timeout=20))  # False: nobody in the event loop ran to release it
        real(self, start, data, writeback)

    monkeypatch.setattr(VersionStore, "_pwrite", held_up)
    with trio.fail_after(90):
        async with open_shards_swarm() as swarm:
            large = dict(FAST, piece_size=THREAD_WRITE_BYTES)
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer", **large)
            r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", **large)
            await connect_all([t, r])
            await t.shards.publish(src, 1)
            await wait_for(entered.is_set, what="the first piece write")
            release.set()
            assert same_files(src, await r.shards.wait_version(1))
    assert released == [True]


@pytest.mark.parametrize("piece_kib", [64, 512])  # written in the event loop / in the writer thread
async def test_a_failing_disk_stops_the_download_not_the_node(tmp_path: Path, monkeypatch, piece_kib) -> None:
    """Disk full mid-download: an error saying so, no piece counted as held, the node stays up, and
    the version is fetched again (resumed) at a later announcement once writes succeed."""
    import errno

    from node.shards.client import THREAD_WRITE_BYTES
    from node.shards.store import VersionStore

    cfg = dict(FAST, piece_size=piece_kib << 10, block_size=16 << 10)
    assert (cfg["piece_size"] >= THREAD_WRITE_BYTES) == (piece_kib == 512)

    trainer = Identity.generate()
    tr = [trainer.peer_id]
    src = write_checkpoint(tmp_path / "ckpt", 2 * MiB, seed=6)
    real = VersionStore._pwrite
    full = [True]

    def disk_full(self, start, data, writeback):
        if (tmp_path / "r") in self.folder.parents and full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, start, data, writeback)

    monkeypatch.setattr(VersionStore, "_pwrite", disk_full)
    with trio.fail_after(90):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer", **cfg)
            r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", **cfg)
            await connect_all([t, r])
            logged = []
            monkeypatch.setattr("node.shards.service.log.error", lambda msg, *a: logged.append(msg % a))
            await t.shards.publish(src, 1)
            await wait_for(lambda: logged, what="the write error logged")
            assert "No space left on device" in logged[0] and "download stopped" in logged[0]
            assert r.shards.path_of(1) is None and r.shards.status()["held"] == []
            full[0] = False
            assert same_files(src, await r.shards.wait_version(1))
            # The retry went on with the stopped download's store, not a second one: each file open once.
            files = [f for f in open_files().values() if f.startswith(str(tmp_path / "r"))]
            assert files and len(files) == len(set(files)), sorted(files)


async def reached_over_a_circuit(swarm, services: trio.Nursery, tmp_path: Path, **relay_shards):
    """A relay (its HOP service in ``services``), a trainer reachable only through its reservation on
    the relay, and a downloader connected to the relay directly and to the trainer over that circuit
    alone; returns (relay, HOP service, trainer, downloader)."""
    trainer = Identity.generate()
    tr = [trainer.peer_id]
    r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", **FAST | relay_shards)
    hop = await services.start(lambda task_status: serve_relay_hop(r.context, task_status=task_status))
    r_addr = r.host.listen_addrs()[0]
    t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer", **FAST)
    d = await swarm.add(tmp_path / "d", trainers=tr, role="inference", **FAST)
    await t.host.connect(r_addr)
    await services.start(lambda task_status: serve_relay_client(t.context, relays=[r_addr], hole_punch=False,
                                                                task_status=task_status))
    await d.host.connect(r_addr)
    assert await connect_addr(d.host, circuit_addr(r_addr, t.peer_id)) == t.peer_id
    assert t.peer_id not in d.host.direct_peers() and d.host.is_connected(t.peer_id)
    return r, hop, t, d


async def test_pieces_never_ride_a_relay_circuit(tmp_path: Path) -> None:
    """A private trainer reachable only through a relay circuit (its reservation on the relay) and a
    downloader connected to it over that circuit: the downloader opens no transfer session over the
    circuit, which would spend the relay's bandwidth and its per-circuit byte limit; it gets every
    byte from the relay, directly. A session asked over a circuit anyway is refused (the NAT test
    once saw a home node fetch 3 MB of pieces from another through the relay)."""
    src = write_checkpoint(tmp_path / "ckpt", 6 * MiB, seed=5)
    with trio.fail_after(90):
        async with open_shards_swarm() as swarm, trio.open_nursery() as services:
            r, hop, t, d = await reached_over_a_circuit(swarm, services, tmp_path)
            signed = await t.shards.publish(src, 3)
            path = await d.shards.wait_version(3)
            assert same_files(src, path)
            assert {p for p, _ in d.shards.receipts()} == {r.peer_id}
            assert sum(d.shards.receipts().values()) == signed.manifest.total_size
            # The circuit carried handshakes, gossip and membership only: less than one piece.
            assert hop.status()["circuit_bytes"] < signed.manifest.piece_size

            # Asked over the circuit, the trainer refuses to start a transfer session.
            stream = await d.host.open_stream(t.peer_id, PROTOCOL)
            assert is_relayed(stream.muxed_conn)
            await write_frame(stream, Hello(root=signed.root, bitfield=d.shards.serving[signed.root].bitfield()))
            reply = await read_shards_message(stream)
            assert isinstance(reply, Reject) and reply.reason == RELAYED
            services.cancel_scope.cancel()
