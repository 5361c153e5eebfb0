"""Ledger benchmark: ingest rate vs raw Ed25519 verification; sync time vs a raw libp2p stream copy.

    .venv/bin/python bench/ledger.py [--ingest 20000] [--sync 100000]

1. Entries verified and stored per second: the node's real ingest path (parse + schema + canonical
   form + Ed25519 signature + chain rules + SQLite commit per batch of 512, as sync does), beside
   ``cryptography``'s raw Ed25519 verification rate over the same entries' signed bytes, in the
   same run. The ratio says how much of the bound the rest of the pipeline costs.
2. Time for a fresh node to sync N entries from one peer over /swarm/ledger/1.0.0 (two hosts in this
   process on loopback), beside the time to copy the same number of bytes over one libp2p stream
   between the same two hosts, and beside N / (the ingest rate of 1.): sync must verify every
   entry, so the byte copy is a floor it cannot approach on CPU-bound machines.

The machine is shared and noisy: compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from node.config import NodeConfig, RunConfig
from node.context import NodeContext
from node.net.host import open_swarm_host
from node.identity import Identity
from node.ledger.config import LedgerConfig
from node.ledger.entries import (
    DOMAIN,
    GENESIS,
    CheckpointPublished,
    ReceiptItem,
    Receipts,
    RolloutsJudged,
    make_entry,
)
from node.ledger.store import open_ledger_store
from node.ledger.service import LedgerService, serve_ledger
from node.wire import Envelope, decode_as
from quick import parse_args  # bench/, the script's own folder

RUN = "bench"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TRAINER = Identity.from_seed(b"B" * 32)
WORKERS = [Identity.from_seed(bytes([i]) * 32) for i in range(1, 9)]
BATCH = 512
CHECKPOINT = 32 << 20  # bytes of each published checkpoint (and of each receipt: one whole download)


def make_history(n: int) -> list:
    """n entries as a run writes them, one training step after another: the trainer publishes
    checkpoint v, then judges each of eight workers' batches, and each worker writes its receipt for
    downloading v. So every worker has trained rollouts (standing) before its first receipt, and one
    receipt per checkpoint stays within the allowance published checkpoints give (node/ledger/chain.py,
    Sybil bounds), as a real downloader's do."""
    heads = {a.peer_id: (0, GENESIS) for a in [TRAINER] + WORKERS}
    out = []

    def add(author: Identity, body) -> None:
        seq, prev = heads[author.peer_id]
        se = make_entry(author, RUN, seq + 1, prev, 1_000_000 + len(out), body)
        heads[author.peer_id] = (se.seq, se.hash)
        out.append(se)

    for version in itertools.count():
        manifest = version.to_bytes(32, "big")
        add(TRAINER, CheckpointPublished(version=version, manifest_id=manifest, total_bytes=CHECKPOINT))
        for w in WORKERS:
            add(TRAINER, RolloutsJudged(worker=w.peer_id, step=version, accepted=True, samples=16, tokens=4096,
                                        batch_hash=len(out).to_bytes(32, "big")))
            add(w, Receipts(items=(ReceiptItem(peer=TRAINER.peer_id, manifest_id=manifest, nbytes=CHECKPOINT,
                                               pieces=CHECKPOINT >> 20),)))
        if len(out) >= n:
            return out[:n]


def run_config() -> RunConfig:
    return RunConfig(name=RUN, trainers=[TRAINER.peer_id],
                     tables={"ledger": {"sync_interval": 3600.0, "sync_timeout": 3600.0}})


async def bench_ingest(entries: list) -> tuple[float, float]:
    """(entries/s through LedgerService.ingest, raw Ed25519 verifications/s)."""
    raws = [se.raw for se in entries]
    # baseline: raw verification of exactly the bytes the ledger verifies
    jobs = []
    for raw in raws:
        env = decode_as(Envelope, raw)
        jobs.append((Ed25519PublicKey.from_public_bytes(env.public_key), env.signature,
                     Envelope.signed_bytes(DOMAIN, env.payload)))
    t0 = time.perf_counter()
    for key, sig, data in jobs:
        key.verify(sig, data)
    raw_rate = len(jobs) / (time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as tmp:
        config = NodeConfig(data_dir=tmp, run=run_config())
        node = NodeContext(config, Identity.generate(), host=None, data_dir=Path(tmp))
        with open_ledger_store(Path(tmp)) as store:
            store.bind_run(RUN)
            service = LedgerService(node, store, LedgerConfig())
            t0 = time.perf_counter()
            for i in range(0, len(raws), BATCH):
                report = await service.ingest(raws[i:i + BATCH], "bench")
                assert report.accepted == len(raws[i:i + BATCH]), report
            rate = len(raws) / (time.perf_counter() - t0)
            assert store.count() == len(raws)
    return rate, raw_rate


async def bench_sync(entries: list) -> tuple[float, float, int]:
    """(seconds to sync all entries, seconds to copy the same bytes over one stream, bytes)."""
    nbytes = sum(len(se.raw) + 4 for se in entries)  # + frame length prefixes, as sync sends them
    with tempfile.TemporaryDirectory() as tmp:
        seed_dir, fresh_dir = Path(tmp) / "seed", Path(tmp) / "fresh"
        seed_dir.mkdir()
        with open_ledger_store(seed_dir) as store:
            store.bind_run(RUN)
            store.commit(entries)
        async with open_swarm_host(Identity.generate(), LOOPBACK) as h1, open_swarm_host(Identity.generate(), LOOPBACK) as h2:
            n1 = NodeContext(NodeConfig(data_dir=str(seed_dir), run=run_config()), h1.identity, h1, seed_dir)
            n2 = NodeContext(NodeConfig(data_dir=str(fresh_dir), run=run_config()), h2.identity, h2, fresh_dir)
            async with trio.open_nursery() as nursery:
                seed = await nursery.start(serve_ledger, n1)
                fresh = await nursery.start(serve_ledger, n2)
                peer = await h2.connect(h1.listen_addrs()[0])
                t0 = time.perf_counter()
                while len(fresh.ledger) < len(entries):
                    await fresh.sync_with(peer)
                sync_s = time.perf_counter() - t0
                assert fresh.digest() == seed.digest()

                # baseline: the same number of bytes through one stream between the same hosts
                done = trio.Event()

                async def sink(stream):
                    got = 0
                    while got < nbytes:
                        chunk = await stream.read(65536)
                        if not chunk:
                            break
                        got += len(chunk)
                    await stream.write(b"k")
                    done.set()

                h1.set_handler("/bench/copy/1", sink)
                stream = await h2.open_stream(h1.peer_id, "/bench/copy/1")
                block = b"\x00" * 65536
                t0 = time.perf_counter()
                sent = 0
                while sent < nbytes:
                    chunk = block[: min(len(block), nbytes - sent)]
                    await stream.write(chunk)
                    sent += len(chunk)
                await stream.read(1)
                await done.wait()
                copy_s = time.perf_counter() - t0
                await stream.close()
                nursery.cancel_scope.cancel()
    return sync_s, copy_s, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ingest", type=int, default=20_000, help="entries for the ingest benchmark")
    parser.add_argument("--sync", type=int, default=100_000, help="entries for the sync benchmark")
    args = parse_args(parser, {"ingest": 2000, "sync": 2000})

    t0 = time.perf_counter()
    entries = make_history(max(args.ingest, args.sync))
    print(f"made {len(entries)} signed entries in {time.perf_counter() - t0:.1f} s "
          f"(mean {sum(len(e.raw) for e in entries) / len(entries):.0f} bytes)")

    rate, raw_rate = trio.run(bench_ingest, entries[: args.ingest])
    print(f"ingest ({args.ingest} entries, batches of {BATCH}):")
    print(f"  ledger verify+check+store   {rate:10.0f} entries/s")
    print(f"  raw Ed25519 verify          {raw_rate:10.0f} verifications/s  (cryptography, same bytes)")
    print(f"  ratio ledger / raw verify   {rate / raw_rate:10.2f}")

    sync_s, copy_s, nbytes = trio.run(bench_sync, entries[: args.sync])
    print(f"sync ({args.sync} entries, {nbytes / 2**20:.1f} MiB, one peer, loopback):")
    print(f"  ledger anti-entropy sync    {sync_s:10.2f} s   ({args.sync / sync_s:.0f} entries/s)")
    print(f"  raw copy over one stream    {copy_s:10.2f} s   ({nbytes / copy_s / 2**20:.0f} MiB/s)")
    print(f"  ingest-bound time           {args.sync / rate:10.2f} s   (entries / measured ingest rate)")
    # Sync has to verify every entry, so the copy is a floor it cannot reach; the second ratio shows
    # what the protocol (round trips, framing, the serving side in the same process) adds on top.
    print(f"  ratio sync / ingest-bound   {sync_s / (args.sync / rate):10.2f}")
    print(f"  ratio sync / raw copy       {sync_s / copy_s:10.1f}")


if __name__ == "__main__":
    main()
