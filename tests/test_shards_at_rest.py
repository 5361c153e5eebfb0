"""Checkpoints on disk are checked before they are trusted (issue 14, item 7 and the non-finite check).

A node started on a data dir that holds a complete version (what a restart does: the store is opened
again) re-hashes it in the background; these tests start one on a copy of a seeder's store with
bytes flipped in a safetensors file or in the manifest, on real libp2p hosts on loopback.
"""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import trio
from safetensors.numpy import save_file

from node.identity import Identity
from node.net.host import open_swarm_host
from node.shards.finite import non_finite_in, non_finite_in_folder
from node.shards.protocol import NOT_HELD, PROTOCOL, Bitfield, Hello, Reject, Request, read_shards_message
from node.shards.service import ShardsService
from node.shards.store import pieces_of
from node.shards.testing import open_shards_swarm, safetensors_bytes, same_files, write_checkpoint
from node.wire import write_frame
from waiting import wait_for

MiB = 1 << 20
FAST = dict(announce_interval=0.5, request_timeout=2.0, progress=False)
SMALL = dict(piece_size=64 * 1024, block_size=16 * 1024, **FAST)


def held_recheck() -> type[ShardsService]:
    """A shards service whose start-up re-check waits for ``release`` before hashing anything."""

    class Held(ShardsService):
        release = trio.Event()

        async def _before_recheck_chunk(self, vs) -> None:
            await self.release.wait()

    return Held


def flip(path: Path, offset: int, n: int = 4) -> None:
    raw = bytearray(path.read_bytes())
    for i in range(offset, offset + n):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def piece_at(manifest, name: str, offset: int) -> int:
    """The piece holding byte ``offset`` of file ``name`` (files are one byte string, sorted by name)."""
    start = 0
    for f in manifest.files:
        if f.name == name:
            return (start + offset) // manifest.piece_size
        start += f.size
    raise KeyError(name)


def copy_store(src_data: Path, dst_data: Path) -> Path:
    """The seeder's checkpoints, as if ``dst_data`` were its data dir restarted."""
    shutil.copytree(src_data / "checkpoints", dst_data / "checkpoints")
    return dst_data / "checkpoints"


async def ask_for_piece(identity: Identity, addr: str, root: bytes, piece: int) -> tuple[set[int], object]:
    """A raw client: the pieces the node advertises for ``root`` and its answer to a request for ``piece``."""
    async with open_swarm_host(identity, ["/ip4/127.0.0.1/tcp/0"]) as host:
        await host.connect(addr)
        peer = addr.rsplit("/p2p/", 1)[1]
        stream = await host.open_stream(peer, PROTOCOL)
        await write_frame(stream, Hello(root=root, bitfield=b""))
        first = await read_shards_message(stream)
        assert isinstance(first, Bitfield), first
        await write_frame(stream, Request(piece=piece, offset=0, length=16 * 1024))
        answer = await read_shards_message(stream)
        await stream.reset()
        return pieces_of(first.bitfield, 1 << 14), answer


@asynccontextmanager
async def published_copy(tmp_path: Path, size: int, seed: int, version: int):
    """A trainer that published ``version`` of a fresh checkpoint, and a copy of its store at
    ``tmp_path / "r"`` (to damage before a relay opens it): (swarm, trainer node, trainers, source,
    signed manifest, copied store)."""
    trainer = Identity.generate()
    tr = [trainer.peer_id]
    src = write_checkpoint(tmp_path / "ckpt", size, seed=seed)
    with trio.fail_after(120):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer", **SMALL)
            signed = await t.shards.publish(src, version)
            yield swarm, t, tr, src, signed, copy_store(tmp_path / "t", tmp_path / "r")


async def test_damaged_piece_is_not_served_and_is_fetched_again(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="node.shards")
    async with published_copy(tmp_path, 2 * MiB, 11, 1) as (swarm, t, tr, src, signed, store):
        flip(store / "1" / "model-00000.safetensors", 300_000)
        damaged = piece_at(signed.manifest, "model-00000.safetensors", 300_000)
        Held = held_recheck()
        r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", service_class=Held, **SMALL)
        svc = r.shards
        # Started while nothing is re-verified yet: nothing of the version is held or served.
        vs = svc.serving[signed.root]
        assert svc.versions_held() == [] and svc.path_of(1) is None and svc.latest() is None
        assert svc.status()["rechecking"] == [1] and vs.verified == set()
        advertised, answer = await ask_for_piece(Identity.generate(), r.host.listen_addrs()[0], signed.root, 0)
        assert advertised == set() and isinstance(answer, Reject) and answer.reason == NOT_HELD
        Held.release.set()
        await wait_for(lambda: svc.downloads.get(1) is not None, what="re-fetch of the damaged piece started")
        assert vs.verified == set(range(signed.manifest.num_pieces)) - {damaged}
        assert svc.versions_held() == [] and svc.path_of(1) is None
        assert "1 of 32 pieces on disk failed their re-check" in caplog.text
        advertised, answer = await ask_for_piece(Identity.generate(), r.host.listen_addrs()[0], signed.root, damaged)
        assert damaged not in advertised and damaged + 1 in advertised
        assert isinstance(answer, Reject) and answer.reason == NOT_HELD
        await r.host.connect(t.host.listen_addrs()[0])
        path = await svc.wait_version(1)
        assert same_files(src, path)  # byte-identical to what the trainer published
        assert svc.receipts() == {(t.peer_id, signed.root.hex()): signed.manifest.piece_length(damaged)}
        assert svc.versions_held() == [1] and svc.status()["rechecking"] == []


async def test_intact_version_is_held_once_rechecked(tmp_path: Path) -> None:
    async with published_copy(tmp_path, 1 * MiB, 12, 4) as (swarm, t, tr, src, signed, store):
        r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", recheck_rate=4 * MiB, **SMALL)
        assert await r.shards.wait_newer(None) == 4  # no peer needed: nothing was damaged
        assert same_files(src, r.shards.path_of(4)) and r.shards.receipts() == {}


async def test_flipped_manifest_is_dropped_and_fetched_again(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="node.shards")
    async with published_copy(tmp_path, 1 * MiB, 13, 2) as (swarm, t, tr, src, signed, store):
        manifest = store / "2" / ".shards" / "manifest"
        flip(manifest, manifest.stat().st_size // 2)
        r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", **SMALL)
        svc = r.shards
        assert svc.versions_held() == [] and svc.status()["held"] == [] and svc.path_of(2) is None
        assert signed.root not in svc.serving
        lines = [m for m in caplog.messages if "dropped from the versions held" in m]
        assert len(lines) == 1 and "v2" in lines[0] and "fetching it again" in lines[0]
        await r.host.connect(t.host.listen_addrs()[0])
        path = await svc.wait_version(2)
        assert same_files(src, path) and svc.versions_held() == [2]
        assert svc.store.saved_manifest(2).root == signed.root


def nan_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A real model folder (safetensors of float32 weights) with one NaN in one tensor."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "test"}')
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((256, 512)).astype(np.float32)
    w[17, 3] = np.nan
    save_file({"embed.weight": rng.standard_normal((64, 512)).astype(np.float32), "lm_head.weight": w},
              str(folder / "model.safetensors"))
    return folder


def test_non_finite_values_are_found_in_every_float_dtype() -> None:
    for dtype, bad in (("F32", b"\x00\x00\x80\x7f"), ("F32", b"\x01\x00\xc0\xff"), ("F16", b"\x00\x7c"),
                       ("BF16", b"\xc0\x7f"), ("F64", b"\x00" * 6 + b"\xf0\x7f")):
        clean = safetensors_bytes(4096, b"\x00" * 64, dtype=dtype)
        dirty = safetensors_bytes(4096, b"\x00" * 64 + bad, dtype=dtype)
        assert non_finite_in(clean) == [], dtype
        assert non_finite_in(dirty) == [f"data ({dtype}) holds NaN or infinity"], dtype
    assert non_finite_in(safetensors_bytes(4096, b"\xff" * 64, dtype="U8")) == []  # integers are always finite
    assert "not a safetensors file" in non_finite_in(b"\xff" * 64)[0]


async def test_downloaders_refuse_a_trainer_signed_checkpoint_with_nan(tmp_path: Path, caplog) -> None:
    """Defence in depth: the trainer's key signed it (a bug, or a stolen key), the swarm still refuses it."""
    caplog.set_level(logging.INFO, logger="node.shards")
    trainer = Identity.generate()
    tr = [trainer.peer_id]
    bad = nan_checkpoint(tmp_path / "nan")
    assert non_finite_in_folder(bad) == ["model.safetensors: lm_head.weight (F32) holds NaN or infinity"]
    with trio.fail_after(120):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer", **SMALL)
            r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", **SMALL)
            await r.host.connect(t.host.listen_addrs()[0])
            topic = t.topic("checkpoints")
            await wait_for(lambda: t.host.mesh_size(topic) == 1, what="relay in the trainer's announce mesh")
            signed = await t.shards.publish(bad, 1)  # the shards layer signs what it is given
            await wait_for(lambda: r.metrics.rejections().get("shards/non-finite-checkpoint"), what="refusal")
            svc = r.shards
            await wait_for(lambda: 1 not in svc.downloads, what="download ended")
            assert svc.versions_held() == [] and svc.path_of(1) is None and signed.root not in svc.serving
            assert not (tmp_path / "r" / "checkpoints" / "1").exists()  # not kept on disk either
            [line] = [m for m in caplog.messages if "refused" in m]
            assert "v1" in line and "lm_head.weight" in line and "not loaded, served or fetched again" in line
            svc.fetch(1, signed.root, t.peer_id)  # announced again: not fetched again
            assert 1 not in svc.downloads
            # The trainer's own store holds it (it published it); restarted, it drops it too.
            copy_store(tmp_path / "t", tmp_path / "t2")
            t2 = await swarm.add(tmp_path / "t2", trainers=tr, role="relay", **SMALL)
            await wait_for(lambda: t2.metrics.rejections().get("shards/non-finite-checkpoint"), what="refused at re-check")
            assert t2.shards.versions_held() == [] and not (tmp_path / "t2" / "checkpoints" / "1").exists()
            # A finite version after it is fetched as usual.
            good = write_checkpoint(tmp_path / "good", 1 * MiB, seed=3)
            await t.shards.publish(good, 2)
            assert same_files(good, await svc.wait_version(2))


def files_open_under(folder: Path) -> list[str]:
    """This process's descriptors that point into ``folder``."""
    fds = Path("/proc/self/fd")
    found = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed while listing (the listing's own descriptor)
        if target.startswith(str(folder)):
            found.append(target)
    return found


@pytest.mark.parametrize("state,line", [("complete", "cannot open it"), ("partial", "cannot resume it")])
async def test_a_version_on_disk_that_cannot_be_opened_is_skipped_and_closed(
        tmp_path: Path, caplog, state: str, line: str) -> None:
    # A restart on a damaged data dir (a model file replaced by a directory here; a full disk that
    # cannot create a lost file is the same) used to end the node at start and keep the files it
    # had opened: the version is now left out, its files closed, the node up.
    caplog.set_level(logging.INFO, logger="node.shards")
    async with published_copy(tmp_path, 1 * MiB, 14, 3) as (swarm, t, tr, src, signed, store):
        last = store / "3" / "model-00001.safetensors"
        last.unlink()
        last.mkdir()
        if state == "partial":
            (store / "3" / ".shards" / "COMPLETE").unlink()
        r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", **SMALL)
        svc = r.shards
        assert svc.versions_held() == [] and signed.root not in svc.serving
        assert svc.status()["rechecking"] == []
        assert files_open_under(store / "3") == []
        lines = [m for m in caplog.messages if line in m]
        assert len(lines) == 1 and "v3" in lines[0], caplog.messages
