"""Checkpoint deltas between real hosts on loopback: a holder of v1 gets v2 as a delta, a newcomer
gets it whole, a corrupt delta is caught by the full hashes and costs only a fallback."""

from __future__ import annotations

from pathlib import Path

import trio

from node.identity import Identity
from node.shards.delta import encode_delta
from node.shards.deltasync import DELTA_SOURCE, DeltaSync, _read_files
from node.shards.protocol import SOURCE
from node.shards.service import ShardsService
from node.shards.testing import bf16_values, next_step, open_shards_swarm, same_files, write_bf16_checkpoint
from test_shards_swarm import FAST, connect_all
from waiting import wait_for

N = 1 << 20  # bf16 values per checkpoint: a 2 MiB weight file


def weights(seed: int):
    return bf16_values(N, seed)


def two_versions(tmp_path: Path, seed: int) -> tuple[Path, Path]:
    """v1 from ``seed`` and v2 one training step after it (a few values one ulp off)."""
    w1 = weights(seed)
    return (write_bf16_checkpoint(tmp_path / "v1", w1, 1),
            write_bf16_checkpoint(tmp_path / "v2", next_step(w1, seed + 1), 2))


def received(node, root: bytes) -> int:
    return sum(n for (_, r), n in node.shards.receipts().items() if r == root.hex())


async def test_holder_of_v1_gets_v2_as_a_delta_newcomer_gets_it_whole(tmp_path: Path) -> None:
    trainer = Identity.generate()
    tr = [trainer.peer_id]
    v1, v2 = two_versions(tmp_path, 1)
    with trio.fail_after(90):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer", **FAST)
            r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", **FAST)
            await connect_all([t, r])
            s1 = await t.shards.publish(v1, 1)
            assert t.shards.deltas.published_offer(1) is None  # nothing older to diff against
            await r.shards.wait_version(1)
            s2 = await t.shards.publish(v2, 2)
            base, delta_root = t.shards.deltas.published_offer(2)
            assert base == 1
            dsize = t.shards.serving[delta_root].manifest.total_size
            assert dsize < 0.05 * s2.manifest.total_size
            assert same_files(v2, await r.shards.wait_version(2))
            # it fetched the delta's bytes, not the full version's
            assert received(r, delta_root) == dsize
            assert received(r, s2.root) == 0
            assert r.shards.deltas.rebuilt == {2: dsize}
            # ...and serves both: the delta to others holding v1, v2 to everyone
            assert delta_root in r.shards.serving and s2.root in r.shards.serving

            # A newcomer that holds nothing hears the re-announcement and fetches v2 whole.
            n = await swarm.add(tmp_path / "n", trainers=tr, role="inference", **FAST)
            await connect_all([t, r, n])
            assert same_files(v2, await n.shards.wait_version(2))
            assert received(n, s2.root) == s2.manifest.total_size
            assert received(n, delta_root) == 0 and received(n, s1.root) == 0
            assert n.shards.deltas.rebuilt == {}


class CorruptDeltas(DeltaSync):
    """A publisher whose delta decodes fine but was built from bytes one bit off the real v2."""

    def encode(self, base, base_names, target, target_names):
        t = _read_files(target, target_names)
        blob = bytearray(t["model.safetensors"])
        blob[-1] ^= 0x01
        t["model.safetensors"] = bytes(blob)
        return encode_delta(_read_files(base, base_names), t, self.cfg.delta_codec)


async def test_corrupt_delta_is_caught_and_costs_only_the_bad_pieces(tmp_path: Path) -> None:
    trainer = Identity.generate()
    tr = [trainer.peer_id]
    v1, v2 = two_versions(tmp_path, 3)
    corrupt = type("CorruptTrainer", (ShardsService,), {"deltas_class": CorruptDeltas})
    with trio.fail_after(90):
        async with open_shards_swarm() as swarm:
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer",
                                service_class=corrupt, **FAST)
            r = await swarm.add(tmp_path / "r", trainers=tr, role="relay", **FAST)
            await connect_all([t, r])
            await t.shards.publish(v1, 1)
            await r.shards.wait_version(1)
            s2 = await t.shards.publish(v2, 2)
            _, delta_root = t.shards.deltas.published_offer(2)
            assert same_files(v2, await r.shards.wait_version(2))  # never a wrong byte
            assert r.metrics.rejections().get(f"{SOURCE}/bad-delta", 0) == 1
            now = trio.current_time()
            # the signer of the bad delta is scored down for deltas, still trusted for full pieces
            assert r.shards.node.peers.is_banned(t.peer_id, DELTA_SOURCE, now)
            assert not r.shards.is_banned(t.peer_id, now)
            # only the piece holding the flipped byte came as a full piece; the rest was rebuilt
            full = received(r, s2.root)
            assert 0 < full <= s2.manifest.piece_size
            assert delta_root not in r.shards.serving and r.shards.deltas.rebuilt == {}


async def test_peer_serving_bad_delta_pieces_is_banned_and_the_delta_still_rebuilds(tmp_path: Path) -> None:
    """Delta pieces go through the same picker and hash checks as full ones: a relay that flips
    bytes of the delta is banned, and the delta is completed from honest peers."""
    from test_shards_swarm import SMALL, FlipBytes, liar

    trainer = Identity.generate()
    tr = [trainer.peer_id]
    w1 = weights(7)
    v1 = write_bf16_checkpoint(tmp_path / "v1", w1, 1)
    v2 = write_bf16_checkpoint(tmp_path / "v2", next_step(w1, 8, fraction=0.2), 2)
    with trio.fail_after(120):
        async with open_shards_swarm() as swarm:
            # The honest trainer is slow, the liar fast: the downloader will ask the liar plenty.
            t = await swarm.add(tmp_path / "t", identity=trainer, trainers=tr, role="trainer",
                                upload_rate=256 * 1024, **SMALL)
            flip = await swarm.add(tmp_path / "flip", trainers=tr, role="relay", service_class=liar(FlipBytes), **SMALL)
            await connect_all([t, flip])
            s1 = await t.shards.publish(v1, 1)
            await flip.shards.wait_version(1)
            await t.shards.publish(v2, 2)
            await flip.shards.wait_version(2)  # it rebuilt v2 from the delta and serves the delta (flipped)
            _, delta_root = t.shards.deltas.published_offer(2)
            assert delta_root in flip.shards.serving
            assert t.shards.serving[delta_root].manifest.num_pieces >= 3
            d = await swarm.add(tmp_path / "d", trainers=tr, role="relay", **SMALL)
            await d.shards.seed(v1, s1)  # holds v1 already (copied out of band)
            # The liar first: with the trainer there too, its super-seeder (ordinary seed once the
            # liar held every piece) could hand d the whole delta before d asks the liar anything.
            await connect_all([flip, d])
            await wait_for(lambda: d.shards.is_banned(flip.peer_id, trio.current_time()), what="liar banned")
            await connect_all([t, d])
            assert same_files(v2, await d.shards.wait_version(2))
            assert d.shards.deltas.rebuilt == {2: t.shards.serving[delta_root].manifest.total_size}
            assert d.shards.is_banned(flip.peer_id, trio.current_time())
            assert d.metrics.rejections().get(f"{SOURCE}/bad-piece", 0) >= 1
            assert flip.peer_id not in {p for p, r in d.shards.receipts() if r == delta_root.hex()}
