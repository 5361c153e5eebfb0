"""Ledger benchmark: ingest rate vs raw Ed25519 verification; sync time vs a raw libp2p stream copy; a long run's size.

    .venv/bin/python bench/ledger.py [--ingest 20000] [--sync 100000] [--scale] [--workers 1000] [--days 7]
                                     [--cut-every 1000000] [--keep-versions 16] [--keep-steps 64]
    .venv/bin/python bench/ledger.py --memory DATA_DIR
    .venv/bin/python bench/ledger.py --cut DATA_DIR [--keep-steps 64] [--keep-versions 16]
    .venv/bin/python bench/ledger.py --catch-up 20000 [--below 0.9]

1. Entries verified and stored per second: the node's real ingest path (parse + schema + canonical
   form + Ed25519 signature + chain rules + SQLite commit per batch of 512, as sync does), beside
   ``cryptography``'s raw Ed25519 verification rate over the same entries' signed bytes, in the
   same run. The ratio says how much of the bound the rest of the pipeline costs.
2. Time for a fresh node to sync N entries from one peer over /swarm/ledger/1.1.0 (two hosts in this
   process on loopback), beside the time to copy the same number of bytes over one libp2p stream
   between the same two hosts, and beside N / (the ingest rate of 1.): sync must verify every
   entry, so the byte copy is a floor it cannot approach on CPU-bound machines.

3. ``--scale`` (issue 46 item 4): the ledger of a long run, at the demo's rates (:data:`PROFILES`,
   read from node/app/demo.py's run files and its measured runs in docs/benchmarks.md), for
   ``--workers`` workers over ``--days``, beside the same at ``--baseline-workers``. A sample of
   the run's real signed entries (``--sample`` of them, at most one simulated hour) goes through the
   node's real ingest path into a real SQLite file; the sample's measured bytes per entry (on the
   wire as sync sends them, in the file, in the replica's memory) and its verify-and-apply rate are
   then extrapolated linearly to the whole run, and the output says so. Catch-up for a new node is
   the sync bytes over a ``--link-mbit`` link plus the CPU to verify and apply every entry, beside
   the issue's goal (60 s on 100 Mbit/s whatever the history). The same with trainer-signed cuts
   (node/ledger/cut.py) every ``--cut-every`` entries keeping each worker's ``--keep-steps`` newest
   draw steps and ``--keep-versions`` checkpoint versions open: the sample's replica is cut with
   everything open, with the batches closed and with everything closed (real signed cuts; the closed
   one's integers widened to the run's length, the open parts per batch and per version scaled to the
   windows), a replica holds its cut and at most two periods of entries, and a new node fetches and
   loads the cut (its load rate measured) and at most one period of entries. Both ratios to the goal
   are printed last: today's sync, then from a cut.

4. ``--memory DATA_DIR`` (issue 45: RSS grew with the ledger during an hour-long soak): a node's
   own ``ledger.sqlite`` (copied to a temporary dir first; the data dir is only read) loaded into a
   fresh replica as the node does on start, under tracemalloc. Prints the replica's bytes per entry
   beside the baseline of the entries themselves (their canonical signed bytes, as stored and synced),
   the parts of the replica by structure (deep ``sys.getsizeof`` walks; shared objects counted once, in
   the first part that reaches them), and what that costs per hour at the database's own entry rate
   (entries / the span of their timestamps) beside the issue's goal of 5 MB per hour per node.

5. ``--cut DATA_DIR`` (issue 46 item 4): a node's own ``ledger.sqlite`` (copied first, as 4.) cut
   where half and where nine tenths of its entries (by time stamp) are below, as a trainer would cut
   it (node/ledger/cut.py; signed by a stand-in trainer key, the run's is not ours). For each cut: its
   signed size beside the entries' bytes below it, that a replica holding the whole database finds it
   right, the time to open and load it, and whether a new node from the cut plus the entries above it
   (checked by the chain rules as sync would) reaches the state of the whole database's replica
   rebased on the cut, and the whole database's own totals (peers whose totals differ: credit the
   cut's windows closed). The ratio cut / entries below it is printed last.

6. ``--catch-up N`` (issue 46 item 4, with the running service): a new node catches up N entries
   (as 2.) from one peer, twice in the same process: from a peer that keeps the whole history, and
   from a peer that adopted a trainer-signed cut of the first ``--below`` of them (its store then
   holds only the entries above the cut). Real hosts on loopback, real sync sessions (the second
   fetches the cut in pages first). Prints for each the time to the peer's digest, the bytes on
   /swarm/ledger/1.1.0 (both directions: the requests are a few bytes each), the new node's database
   size, and that both new nodes reach the same digest and totals.

The machine is shared and noisy: compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import math
import shutil
import sys
import tempfile
import time
import tomllib
import tracemalloc
from dataclasses import dataclass, replace
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from node import hashes
from node.app.demo import REAL_TASK, TINY_TASK
from node.config import NodeConfig, RunConfig, read_run_record
from node.context import NodeContext
from node.net.host import open_swarm_host
from node.identity import Identity
from node.ledger.config import LedgerConfig
from node.ledger.chain import Evidence, Ledger, Outcome
from node.ledger.entries import (
    DOMAIN,
    GENESIS,
    MAX_RECEIPT_ITEMS,
    CheckpointPublished,
    ReceiptItem,
    Receipts,
    RolloutsJudged,
    Verdict,
    make_entry,
    parse_entry,
)
from node.counters import StreamBytes
from node.ledger.messages import PROTOCOL, PROTOCOL_CUTS, RangeReply, SyncHello
from node.ledger.store import DB_FILE, open_ledger_store, rebuild
from node.ledger.cut import cut_problem, ledger_from_cut, make_cut, open_cut, rebase, replay_to, sign_cut
from node.ledger.service import LedgerService, serve_ledger
from node.roles.sections import RunSections
from node.wire import Envelope, decode_as, encode
from quick import parse_args  # bench/, the script's own folder

RUN = "bench"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TRAINER = Identity.from_seed(b"B" * 32)
VALIDATOR = Identity.from_seed(b"V" * 32)
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
    return RunConfig(name=RUN, trainers=[TRAINER.peer_id], validators=[VALIDATOR.peer_id],
                     tables={"ledger": {"sync_interval": 3600.0, "sync_timeout": 3600.0}})


async def bench_ingest(entries: list) -> tuple[float, float]:
    """(entries/s through LedgerService.ingest, raw Ed25519 verifications/s)."""
    rate, raw_rate, _replica = await measure_ingest(entries)
    return rate, raw_rate


@dataclass(frozen=True)
class Replica:
    """What a replica of some entries costs, measured: the SQLite file and the in-memory chain state."""

    db_bytes: int  # ledger.sqlite (and any -wal) after the store is closed
    empty_db_bytes: int  # the same file with the schema and no entries
    ram_bytes: int  # Python memory the chain state (node/ledger/chain.py Ledger) holds after loading them
    hello_bytes: int  # the SyncHello a node sends with these heads


async def measure_ingest(entries: list) -> tuple[float, float, Replica]:
    """(entries/s through LedgerService.ingest, raw Ed25519 verifications/s, what the replica costs)."""
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
            hello_bytes = len(encode(SyncHello(heads=tuple(service.ledger.heads()))))
            ram_bytes = replica_memory(store, config.run)
        db_bytes = db_size(Path(tmp))
        empty = Path(tmp) / "empty"
        with open_ledger_store(empty) as store:
            store.bind_run(RUN)
        empty_bytes = db_size(empty)
    return rate, raw_rate, Replica(db_bytes, empty_bytes, ram_bytes, hello_bytes)


def db_size(data_dir: Path) -> int:
    return sum(p.stat().st_size for p in data_dir.glob(DB_FILE + "*"))


def replica_memory(store, run: RunConfig) -> int:
    """Bytes of Python memory a fresh chain state holds once it has loaded ``store`` (as a node does on start)."""
    cfg = LedgerConfig()
    gc.collect()
    tracemalloc.start()
    try:
        ledger = Ledger(run.name, run.trainers, run.validators, int(cfg.max_clock_skew * 1000), cfg.limits(),
                        history=store.entries)
        skipped = rebuild(store, ledger)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert not skipped, skipped
    return held


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
                sections = RunSections.of(run_config())
                seed = await nursery.start(serve_ledger, n1, sections.ledger, sections.streams)
                fresh = await nursery.start(serve_ledger, n2, sections.ledger, sections.streams)
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


@dataclass(frozen=True)
class CatchUp:
    seconds: float  # until the new node's digest is the peer's
    wire_bytes: int  # on /swarm/ledger/1.1.0 (and 1.0.0), both directions
    db_bytes: int  # the new node's ledger.sqlite afterwards
    stored: int  # entries in it
    digest: bytes
    totals: dict


async def catch_up(entries: list, below: int) -> CatchUp:
    """A new node syncing from a peer that holds ``entries`` (``below`` > 0: based on a cut of the
    first ``below`` of them, entries at or below it pruned), as 6. of the module docstring."""
    with tempfile.TemporaryDirectory() as tmp:
        seed_dir, fresh_dir = Path(tmp) / "seed", Path(tmp) / "fresh"
        seed_dir.mkdir()
        run = run_config()
        with open_ledger_store(seed_dir) as store:
            store.bind_run(RUN)
            store.commit(entries)
            if below:
                maker = Ledger(RUN, run.trainers, run.validators, 10**12)
                for se in entries[:below]:
                    maker.apply(maker.check(se, se.time_ms))
                sections = RunSections.of(run)
                cut = make_cut(maker, time_ms=entries[below - 1].time_ms, keep_versions=sections.ledger.keep_versions,
                               keep_steps=sections.ledger.keep_steps)
                raw = sign_cut(TRAINER, cut)
                opened = open_cut(raw, maker)
                store.adopt_cut(cut.number, opened.hash, raw, {log.author: (log.seq, log.hash) for log in cut.logs})
        async with open_swarm_host(Identity.generate(), LOOPBACK) as h1, open_swarm_host(Identity.generate(), LOOPBACK) as h2:
            n1 = NodeContext(NodeConfig(data_dir=str(seed_dir), run=run), h1.identity, h1, seed_dir)
            n2 = NodeContext(NodeConfig(data_dir=str(fresh_dir), run=run), h2.identity, h2, fresh_dir)
            async with trio.open_nursery() as nursery:
                sections = RunSections.of(run)
                seed = await nursery.start(serve_ledger, n1, sections.ledger, sections.streams)
                fresh = await nursery.start(serve_ledger, n2, sections.ledger, sections.streams)
                peer = await h2.connect(h1.listen_addrs()[0])
                wire0 = sum(StreamBytes.received.get(p, 0) for p in (PROTOCOL, PROTOCOL_CUTS))
                t0 = time.perf_counter()
                while fresh.digest() != seed.digest():
                    await fresh.sync_with(peer)
                seconds = time.perf_counter() - t0
                wire = sum(StreamBytes.received.get(p, 0) for p in (PROTOCOL, PROTOCOL_CUTS)) - wire0
                assert fresh.ledger.cut_number == (1 if below else 0)
                stored, digest, totals = fresh.store.count(), fresh.digest(), fresh.totals()
                nursery.cancel_scope.cancel()
        return CatchUp(seconds, wire, db_size(fresh_dir), stored, digest, totals)


def catch_up_report(n: int, below_frac: float) -> None:
    t0 = time.perf_counter()
    entries = make_history(n)
    print(f"made {len(entries)} signed entries in {time.perf_counter() - t0:.1f} s")
    below = int(n * below_frac)
    whole = trio.run(catch_up, entries, 0)
    from_cut = trio.run(catch_up, entries, below)
    print(f"a new node catching up {n} entries from one peer (loopback, this process):")
    for name, c in (("peer keeps the whole history", whole), (f"peer based on a cut of {below}", from_cut)):
        print(f"  {name:32s} {c.seconds:8.2f} s  {human(c.wire_bytes):>10s} on the wire  "
              f"db {human(c.db_bytes):>10s}  {c.stored} entries stored")
    print(f"  same digest {whole.digest == from_cut.digest}, same totals {whole.totals == from_cut.totals}")
    print(f"  ratio cut / whole: time {from_cut.seconds / whole.seconds:.2f}, "
          f"bytes {from_cut.wire_bytes / whole.wire_bytes:.2f}, db {from_cut.db_bytes / whole.db_bytes:.2f}")


# ---------------------------------------------------------------------------------------- a long run


def batch_samples(task: str) -> int:
    """Samples in one worker batch of a demo run file's [rl] table: group_size x prompts_per_batch."""
    rl = tomllib.loads(task)["rl"]
    return rl["group_size"] * rl["prompts_per_batch"]


@dataclass(frozen=True)
class Traffic:
    """What a run writes to the ledger, from a measured demo run (docs/benchmarks.md, the row named).

    Per batch a worker sends, the trainer signs one ``rollouts`` entry (node/trainer/service.py
    ledger_loop) and each judging validator one ``verdict`` (node/validator/service.py
    record_in_ledger); per step, the trainer publishes one checkpoint; every downloader (the
    workers and the validator) flushes its byte receipts once per ``receipt_interval`` or at
    MAX_RECEIPT_ITEMS (peer, manifest) pairs (node/ledger/service.py note_received). Penalties
    (cheaters only) are left out. The per-worker rates stay the demo's at any number of workers,
    and so does the trainer's step rate: the issue's "the demo's rates", not a model of how a
    trainer would keep up with a thousand workers.
    """

    name: str
    steps_per_min: float  # trainer steps (= checkpoints published) per minute in the measured demo
    samples_per_step: float  # samples the trainer takes a step
    batch_samples: int  # samples a worker batch holds (the demo's run file)
    demo_workers: int  # inference nodes in the measured demo
    checkpoint_bytes: int  # one published checkpoint (a receipt's byte count is a share of it)
    sources: int = 4  # peers a downloader fetches one checkpoint's pieces from (assumed)
    verdicts_per_batch: float = 1.0  # the demo's one validator judges every batch
    receipt_interval: float = LedgerConfig().receipt_interval

    @property
    def batches_per_worker_min(self) -> float:
        return self.steps_per_min * self.samples_per_step / self.batch_samples / self.demo_workers

    @property
    def receipts_per_downloader_min(self) -> float:
        """Receipts entries one downloader writes a minute: a flush per interval with anything pending
        (at most one per checkpoint), more when the pairs outrun MAX_RECEIPT_ITEMS per entry."""
        flushes = min(60.0 / self.receipt_interval, self.steps_per_min)
        return max(flushes, self.steps_per_min * self.sources / MAX_RECEIPT_ITEMS)

    @property
    def items_per_receipt(self) -> int:
        pairs = self.steps_per_min * self.sources / self.receipts_per_downloader_min
        return max(1, min(MAX_RECEIPT_ITEMS, round(pairs)))

    def per_minute(self, workers: int) -> dict[str, float]:
        """Entries a minute by kind for ``workers`` workers, one trainer and one validator."""
        batches = workers * self.batches_per_worker_min
        return {
            CheckpointPublished.TYPE: self.steps_per_min,
            RolloutsJudged.TYPE: batches,
            Verdict.TYPE: batches * self.verdicts_per_batch,
            Receipts.TYPE: (workers + 1) * self.receipts_per_downloader_min,
        }

    def describe(self) -> str:
        return (f"{self.steps_per_min:.1f} checkpoints/min; {self.batches_per_worker_min:.1f} batches/worker/min "
                f"({self.steps_per_min:.1f} steps/min x {self.samples_per_step:.0f} samples / {self.batch_samples} "
                f"per batch / {self.demo_workers} workers); {self.verdicts_per_batch:g} verdict/batch; "
                f"{self.receipts_per_downloader_min:.2f} receipts/downloader/min of {self.items_per_receipt} items "
                f"(assumed {self.sources} sources per checkpoint, a flush per {self.receipt_interval:.0f} s "
                f"or per {MAX_RECEIPT_ITEMS} items)")


PROFILES = (
    # `swarm-node demo --duration 300`: 163-176 steps in 300 s with 2 inference nodes; a step takes
    # every verified batch, ~190 samples (node/app/demo.py's run file).
    Traffic("the demo (tiny model)", steps_per_min=170 / 5, samples_per_step=190,
            batch_samples=batch_samples(TINY_TASK), demo_workers=2, checkpoint_bytes=CHECKPOINT),
    # `swarm-node demo --model .models/smollm2-135m-instruct`: a step every 37 s of 32 samples
    # (max_step_samples), checkpoints of 273 MB in bfloat16, 2 inference nodes.
    Traffic("the demo --model SmolLM2-135M", steps_per_min=60 / 37, samples_per_step=32,
            batch_samples=batch_samples(REAL_TASK), demo_workers=2, checkpoint_bytes=273_000_000),
)
GOAL_S = 60.0  # issue 46: a new node caught up within 60 s of a 100 Mbit/s link, whatever the history
START_MS = 1_700_000_000_000  # the sample's first time stamp (Unix ms: 2023, in the past as a replay's are)


def worker_ids(n: int) -> list[Identity]:
    return [Identity.from_seed(hashes.digest(b"bench-worker %d" % i)) for i in range(n)]


def make_sample(traffic: Traffic, workers: list[Identity], n: int) -> tuple[list, float]:
    """About ``n`` signed entries of ``traffic`` at ``len(workers)`` workers in time order, and the
    simulated seconds they span (at most an hour). Each kind's events are spread evenly over the span;
    batch i is worker i mod W's, and its verdict names the same batch; receipt j is downloader j mod
    (W + 1)'s and vouches for ``sources`` other workers per checkpoint, the latest checkpoints first."""
    rates = traffic.per_minute(len(workers))
    seconds = min(3600.0, 60.0 * n / sum(rates.values()))
    events = []
    for kind, rate in rates.items():
        count = max(1, round(rate * seconds / 60))
        events += [((i + 0.5) * seconds / count, kind, i) for i in range(count)]
    return make_entries(traffic, workers, sorted(events)), seconds


def make_entries(traffic: Traffic, workers: list[Identity], events: list[tuple[float, str, int]]) -> list:
    """The signed entries of ``events``, (simulated second, kind, index of the kind's event) in time
    order: what :func:`make_sample` says each index is (whose batch, whose receipt)."""
    downloaders = workers + [VALIDATOR]
    heads = {}
    out = []
    published = 0

    def add(author: Identity, t: float, body) -> None:
        seq, prev = heads.get(author.peer_id, (0, GENESIS))
        se = make_entry(author, RUN, seq + 1, prev, START_MS + int(t * 1000), body)
        heads[author.peer_id] = (se.seq, se.hash)
        out.append(se)

    def manifest(version: int) -> bytes:
        return hashes.digest(b"bench-manifest %d" % max(0, version))

    share = traffic.checkpoint_bytes // traffic.sources
    for t, kind, i in events:
        if kind == CheckpointPublished.TYPE:
            add(TRAINER, t, CheckpointPublished(version=i, manifest_id=manifest(i), total_bytes=traffic.checkpoint_bytes))
            published = i + 1
        elif kind in (RolloutsJudged.TYPE, Verdict.TYPE):
            worker = workers[i % len(workers)].peer_id
            batch = hashes.digest(b"bench-batch %d" % i)
            if kind == RolloutsJudged.TYPE:
                add(TRAINER, t, RolloutsJudged(worker=worker, step=i // len(workers), accepted=True,
                                               samples=traffic.batch_samples,
                                               tokens=traffic.batch_samples * 16, batch_hash=batch))
            else:
                add(VALIDATOR, t, Verdict(worker=worker, step=i // len(workers), batch_hash=batch, ok=True, reasons=("ok",)))
        else:
            me = i % len(downloaders)
            items = tuple(ReceiptItem(peer=workers[(me + 1 + k % traffic.sources) % len(workers)].peer_id,
                                      manifest_id=manifest(published - 1 - k // traffic.sources), nbytes=share,
                                      pieces=max(1, share >> 20))
                          for k in range(traffic.items_per_receipt))
            add(downloaders[me], t, Receipts(items=items))
    return out


@dataclass(frozen=True)
class CutCost:
    """A trainer-signed cut (node/ledger/cut.py) of a long run, measured on a sample's replica: the part
    that follows the peers (logs and rows, integers widened to the run's length), the open windows'
    parts (per batch of a draw step kept open, per checkpoint version kept open), and the CPU to open
    and load one, per byte."""

    closed_bytes: int  # the signed cut with every batch and version closed, its integers those of the whole run
    per_batch: float  # bytes each open batch adds (its claims)
    per_version: float  # bytes each open checkpoint version adds (vouched bytes, published sizes)
    batches: int  # batches and versions of the sample (what per_batch and per_version are measured over)
    versions: int
    load_s_per_byte: float  # open_cut (schema, signature) + ledger_from_cut, per byte of the sample's cut

    def size(self, workers: int, keep_versions: int, keep_steps: int) -> float:
        """A cut keeping each worker's newest ``keep_steps`` draw steps (one batch each) and the newest
        ``keep_versions`` checkpoints open."""
        return self.closed_bytes + workers * keep_steps * self.per_batch + keep_versions * self.per_version


def measure_cut(entries: list, factor: float) -> CutCost:
    """The cut of a replica of ``entries`` (the chain rules' check and apply), with everything open, with
    the batches closed and with everything closed; the last one's totals, seqs and receipt counts
    scaled by ``factor`` (the run's entries over the sample's) so that their encodings are a long run's."""
    run = run_config()
    ledger = Ledger(run.name, run.trainers, run.validators, max_skew_ms=0)
    now = max(se.time_ms for se in entries)
    for se in entries:
        decision = ledger.check(se, now)
        assert decision.outcome is Outcome.ACCEPT, decision.reason
        ledger.apply(decision)
    versions = ledger.newest_version() + 1
    everything = make_cut(ledger, time_ms=now, keep_versions=versions, keep_steps=2**32)
    versions_open = make_cut(ledger, time_ms=now, keep_versions=versions)
    closed = make_cut(ledger, time_ms=now)
    k = max(1, round(factor))
    wide = replace(closed, logs=tuple(replace(log, seq=log.seq * k, receipts=log.receipts * k) for log in closed.logs),
                   rows=tuple(replace(r, totals=tuple(v * k for v in r.totals), trusted_vouched=r.trusted_vouched * k,
                                      open_step=r.open_step * k) for r in closed.rows))
    raw = sign_cut(TRAINER, everything)
    template = Ledger(run.name, run.trainers, run.validators, max_skew_ms=0)
    t0 = time.perf_counter()
    loaded = ledger_from_cut(open_cut(raw, template), template)
    load_s = time.perf_counter() - t0
    assert loaded.totals() == ledger.totals()
    mid, low = len(sign_cut(TRAINER, versions_open)), len(sign_cut(TRAINER, closed))
    batches = max(1, len(everything.batches))
    return CutCost(len(sign_cut(TRAINER, wide)), (len(raw) - mid) / batches, (mid - low) / max(1, versions),
                   batches, versions, load_s / len(raw))


def sync_bytes(entries: list, batch: int = LedgerConfig().sync_batch) -> int:
    """Bytes of the RangeReply frames that carry ``entries`` to a new node (``batch`` per reply, + 4-byte length prefixes)."""
    return sum(len(encode(RangeReply(id=1, entries=tuple(se.raw for se in entries[i:i + batch])))) + 4
               for i in range(0, len(entries), batch))


@dataclass(frozen=True)
class Sample:
    """Measured costs of a sample of a run's entries: per entry, and the rate they verify and apply at."""

    entries: int
    seconds: float  # simulated seconds the sample spans
    wire: float  # sync bytes per entry
    disk: float  # SQLite bytes per entry (the empty file's bytes left out)
    ram: float  # replica memory per entry
    rate: float  # entries/s through LedgerService.ingest (parse, signature, chain rules, SQLite commit)
    replica: Replica
    cut: CutCost | None = None  # measured by measure_sample for a run of ``run_entries``


def measure_sample(traffic: Traffic, workers: int, n: int, run_entries: float) -> Sample:
    entries, seconds = make_sample(traffic, worker_ids(workers), n)
    rate, _raw, replica = trio.run(measure_ingest, entries)
    k = len(entries)
    return Sample(k, seconds, sync_bytes(entries) / k, (replica.db_bytes - replica.empty_db_bytes) / k,
                  replica.ram_bytes / k, rate, replica, measure_cut(entries, run_entries / k))


@dataclass(frozen=True)
class LongRun:
    """A run's ledger after ``days``, extrapolated linearly from a measured :class:`Sample`."""

    workers: int
    per_day: float  # entries
    entries: float
    disk_bytes: float
    ram_bytes: float
    sync_bytes: float
    transfer_s: float
    verify_s: float
    # With trainer-signed cuts every ``period`` entries (node/ledger/cut.py), keep_versions and keep_steps open:
    cut_bytes: float  # one signed cut (:class:`CutCost`)
    period: float  # entries between cuts
    cut_disk_bytes: float  # a replica that keeps its cut and at most two periods of entries (the next cut's check)
    cut_sync_bytes: float  # a new node's download: the cut, a SyncHello, at most one period of entries
    cut_catch_up_s: float  # a new node fetches and loads the latest cut, then at most one period of entries
    max_period: float  # the longest period whose catch-up still meets GOAL_S

    @property
    def catch_up_s(self) -> float:
        """Sync as node/ledger/service.py runs it today: a range is requested, then verified and
        applied, then the next requested, so transfer and CPU add up (round trips left out)."""
        return self.transfer_s + self.verify_s


def long_run(traffic: Traffic, workers: int, sample: Sample, days: float, link_mbit: float,
             period: float, keep_versions: int, keep_steps: int) -> LongRun:
    per_day = sum(traffic.per_minute(workers).values()) * 1440
    n = per_day * days
    link = link_mbit * 1e6 / 8  # bytes/s
    wire = n * sample.wire + sample.replica.hello_bytes
    per_entry_s = sample.wire / link + 1 / sample.rate  # fetch, then verify and apply, one entry
    cut = sample.cut.size(workers, keep_versions, keep_steps)
    head_s = (cut + sample.replica.hello_bytes) / link + cut * sample.cut.load_s_per_byte
    return LongRun(workers, per_day, n, n * sample.disk, n * sample.ram, wire, wire / link, n / sample.rate,
                   cut, period, cut + 2 * period * sample.disk, cut + sample.replica.hello_bytes + period * sample.wire,
                   head_s + period * per_entry_s,
                   max(0.0, (GOAL_S - head_s) / per_entry_s))


def human(n: float, unit: str = "B") -> str:
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(n) < 1000 or prefix == "P":
            return f"{n:.3g} {prefix}{unit}"
        n /= 1000
    raise AssertionError


def duration(s: float) -> str:
    return f"{s:.3g} s" if s < 600 else f"{s / 3600:.3g} h" if s < 2 * 86400 else f"{s / 86400:.3g} days"


def scale_report(traffic: Traffic, workers: int, baseline: int, n: int, days: float, link_mbit: float,
                 period: float, keep_versions: int, keep_steps: int) -> float:
    """Print one profile's table; returns the catch-up time at ``workers`` over the goal."""
    print(f"\n{traffic.name}: {traffic.describe()}")
    runs = []
    for w in (baseline, workers):
        t0 = time.perf_counter()
        sample = measure_sample(traffic, w, n, sum(traffic.per_minute(w).values()) * 1440 * days)
        print(f"  sample at {w} workers: {sample.entries} real signed entries = {sample.seconds:.1f} simulated s, "
              f"measured: {sample.wire:.0f} B/entry on the wire, {sample.disk:.0f} B/entry in SQLite, "
              f"{sample.ram:.0f} B/entry of replica RAM, {sample.rate:.0f} entries/s verified+applied+stored; "
              f"its cut: {sample.cut.closed_bytes} B closed + {sample.cut.per_batch:.0f} B per open batch "
              f"(over {sample.cut.batches}) + {sample.cut.per_version:.0f} B per open version (over "
              f"{sample.cut.versions}), loads at {1 / sample.cut.load_s_per_byte / 1e6:.1f} MB/s "
              f"({time.perf_counter() - t0:.1f} s)")
        runs.append(long_run(traffic, w, sample, days, link_mbit, period, keep_versions, keep_steps))
    base, big = runs
    rows = [
        ("entries per day", human(base.per_day, ""), human(big.per_day, ""), big.per_day / base.per_day),
        (f"entries after {days:g} days", human(base.entries, ""), human(big.entries, ""), big.entries / base.entries),
        ("replica: SQLite file", human(base.disk_bytes), human(big.disk_bytes), big.disk_bytes / base.disk_bytes),
        ("replica: chain state in RAM", human(base.ram_bytes), human(big.ram_bytes), big.ram_bytes / base.ram_bytes),
        ("catch-up: bytes synced", human(base.sync_bytes), human(big.sync_bytes), big.sync_bytes / base.sync_bytes),
        (f"catch-up: transfer at {link_mbit:g} Mbit/s", duration(base.transfer_s), duration(big.transfer_s),
         big.transfer_s / base.transfer_s),
        ("catch-up: verify+apply (CPU)", duration(base.verify_s), duration(big.verify_s), big.verify_s / base.verify_s),
        ("catch-up: total", duration(base.catch_up_s), duration(big.catch_up_s), big.catch_up_s / base.catch_up_s),
        (f"cuts every {human(period, '')} entries, {keep_steps} steps/{keep_versions} versions open:", "", "", None),
        ("  one signed cut", human(base.cut_bytes), human(big.cut_bytes), big.cut_bytes / base.cut_bytes),
        ("  ... signed every", duration(period / base.per_day * 86400), duration(period / big.per_day * 86400),
         base.per_day / big.per_day),
        ("  replica: cut + 2 periods (disk)", human(base.cut_disk_bytes), human(big.cut_disk_bytes),
         big.cut_disk_bytes / base.cut_disk_bytes),
        ("  catch-up: bytes (cut + 1 period)", human(base.cut_sync_bytes), human(big.cut_sync_bytes),
         big.cut_sync_bytes / base.cut_sync_bytes),
        ("  catch-up: cut + 1 period", duration(base.cut_catch_up_s), duration(big.cut_catch_up_s),
         big.cut_catch_up_s / base.cut_catch_up_s),
        ("  longest period within the goal", human(base.max_period, ""), human(big.max_period, ""),
         big.max_period / base.max_period if base.max_period else float("nan")),
    ]
    print(f"  after {days:g} days, extrapolated linearly from the samples' measured per-entry figures:")
    print(f"  {'':34}{f'{baseline} workers':>16}{f'{workers} workers':>16}{'ratio':>10}")
    for name, a, b, ratio in rows:
        print(f"  {name:34}{a:>16}{b:>16}" + ("" if ratio is None else f"{ratio:>10.3g}"))
    for name, x, y in ((f"ratio catch-up / goal ({GOAL_S:.0f} s)", base.catch_up_s, big.catch_up_s),
                       ("  the same from a cut", base.cut_catch_up_s, big.cut_catch_up_s)):
        print(f"  {name:34}{x / GOAL_S:16.3g}{y / GOAL_S:16.3g}")
    return big.catch_up_s / GOAL_S


MEMORY_GOAL_MB_H = 5.0  # issue 45: RSS slope per node after warm-up


def deep_size(obj, seen: set[int]) -> int:
    """Bytes of ``obj`` and everything it holds that ``seen`` does not list yet (``sys.getsizeof``
    of each object once; functions, methods and classes are not followed)."""
    total, stack = 0, [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, type) or callable(o):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif hasattr(o, "__dict__"):
            stack.append(vars(o))
        elif hasattr(type(o), "__slots__"):
            stack.extend(getattr(o, name) for name in type(o).__slots__ if hasattr(o, name))
    return total


def memory_report(data_dir: Path) -> float:
    """Print what a replica loaded from ``data_dir``'s ledger costs per entry (4. of the docstring);
    returns the replica's bytes per entry over the entries' own bytes."""
    run = read_run_record(data_dir)
    with tempfile.TemporaryDirectory() as tmp:
        for path in data_dir.glob(DB_FILE + "*"):
            shutil.copy2(path, tmp)
        with open_ledger_store(Path(tmp), read_only=True) as store:
            raw_bytes, kinds, times = 0, collections.Counter(), []
            for _author, _seq, _hash, raw in store.iter_raw():
                se = parse_entry(raw, verify_signature=False)
                raw_bytes += len(raw)
                kinds[se.kind] += 1
                times.append(se.time_ms)
            cfg = RunSections.of(run).ledger
            gc.collect()
            tracemalloc.start()
            try:
                ledger = Ledger(store.run() or run.name, run.trainers, run.validators,
                                int(cfg.max_clock_skew * 1000), cfg.limits(), history=store.entries)
                skipped = rebuild(store, ledger)
                gc.collect()
                held = tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
    n = len(ledger)
    if not n or skipped:
        print(f"--memory: {data_dir}: {n} entries loaded; not loaded: {skipped or 'none'}", file=sys.stderr)
        raise SystemExit(2)
    hours = (max(times) - min(times)) / 3.6e6
    print(f"replica of {data_dir}: {n} entries by {len(ledger.authors())} authors over {hours:.2f} h of "
          f"timestamps ({', '.join(f'{k} {v}' for k, v in kinds.most_common())})")
    seen: set[int] = set()
    parts = {name: deep_size(value, seen) for name, value in sorted(vars(ledger).items(),
                                                                   key=lambda kv: kv[0] != "_logs")}
    print(f"  {'baseline: entries as stored (raw)':44}{raw_bytes / n:10.0f} B/entry")
    rate = f"= {held / hours / 1e6:.1f} MB/h at this database's rate" if hours else "(one timestamp: no rate)"
    print(f"  {'replica chain state (tracemalloc)':44}{held / n:10.0f} B/entry  {rate} (goal {MEMORY_GOAL_MB_H:g} MB/h)")
    for name, size in sorted(parts.items(), key=lambda kv: -kv[1]):
        if size / n >= 1:
            print(f"    {name:42}{size / n:10.0f} B/entry  (sys.getsizeof walk)")
    print(f"  {'ratio replica / raw entries':44}{held / raw_bytes:10.2f}")
    return held / raw_bytes


CUT_SIGNER = Identity.from_seed(hashes.digest(b"bench-ledger cut signer"))  # stands in for the run's trainer
CUT_AT = (0.5, 0.9)  # fractions of a database's entries, by time stamp, below the cuts --cut makes


def cut_report(data_dir: Path, keep_versions: int, keep_steps: int) -> float:
    """Print what cuts of ``data_dir``'s ledger hold and cost (5. of the docstring); returns the last
    cut's signed bytes over the entries' own bytes below it."""
    run = read_run_record(data_dir)
    cfg = RunSections.of(run).ledger
    with tempfile.TemporaryDirectory() as tmp:
        for path in data_dir.glob(DB_FILE + "*"):
            shutil.copy2(path, tmp)
        with open_ledger_store(Path(tmp), read_only=True) as store:
            name = store.run() or run.name
            entries = [parse_entry(raw, verify_signature=False) for _a, _s, _h, raw in store.iter_raw()]
            evidence = [Evidence(parse_entry(a), parse_entry(b)) for a, b in store.iter_evidence()]

    def replica() -> Ledger:
        return Ledger(name, [*run.trainers, CUT_SIGNER.peer_id], run.validators, int(cfg.max_clock_skew * 1000),
                      cfg.limits())

    def load(ledger: Ledger, chosen) -> Ledger:  # entries as stored: by author, then seq
        for se in chosen:
            ledger.restore(se)
        for ev in evidence:
            ledger.add_evidence(ev)
        return ledger

    whole = load(replica(), entries)
    times = sorted(se.time_ms for se in entries)
    now = times[-1] + 1
    print(f"{data_dir}: {len(entries)} entries ({sum(len(se.raw) for se in entries)} B) by {len(whole.authors())} "
          f"authors, {len(evidence)} evidence pairs; cuts keep {keep_steps} draw steps per worker and "
          f"{keep_versions} checkpoint versions open")
    ratio = 0.0
    for frac in CUT_AT:
        t = times[int(frac * (len(times) - 1))]
        maker = load(replica(), [se for se in entries if se.time_ms <= t])
        cut = make_cut(maker, time_ms=t, keep_versions=keep_versions, keep_steps=keep_steps)
        raw = sign_cut(CUT_SIGNER, cut)
        problem = cut_problem(cut, replay_to(cut, replica(), whole.history))
        t0 = time.perf_counter()
        opened = open_cut(raw, replica())
        fresh = ledger_from_cut(opened, replica())
        load_ms = (time.perf_counter() - t0) * 1000
        heads = {log.author: log.seq for log in cut.logs}
        pending = sorted((se for se in entries if se.seq > heads.get(se.author, 0)), key=lambda se: se.time_ms)
        above, below = len(pending), sum(len(se.raw) for se in entries if se.seq <= heads.get(se.author, 0))
        for _round in range(len(pending) + 1):  # what fits, again until nothing more does (anti-entropy)
            left = []
            for se in pending:
                decision = fresh.check(se, now)
                if decision.outcome is Outcome.ACCEPT:
                    fresh.apply(decision)
                elif decision.outcome in (Outcome.GAP, Outcome.REJECT):
                    left.append(se)
            if len(left) == len(pending):
                break
            pending = left
        for ev in evidence:
            fresh.add_evidence(ev)
        based = rebase(whole, opened)
        same = (fresh.digest(), fresh.totals(), fresh.flagged()) == (based.digest(), based.totals(), based.flagged())
        totals = whole.totals()
        differ = [p for p, row in based.totals().items() if totals.get(p) != row]
        ratio = len(raw) / below
        print(f"  cut at {frac:.0%} of the entries: {len(raw)} B signed ({len(cut.rows)} rows, {len(cut.logs)} logs, "
              f"{len(cut.batches)} open batches, {len(cut.vouched)} open vouched) for {below} B of entries below it; "
              f"a replica with the history finds it {problem or 'right'}; opened and loaded in {load_ms:.0f} ms")
        print(f"    a new node from it: {above - len(pending)} of {above} entries above taken; "
              f"its state {'=' if same else '!='} the whole replica rebased on the cut; "
              f"peers whose totals differ from the whole database's: {len(differ)}")
    print(f"  ratio cut / entries below it {ratio:10.4f}")
    return ratio


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ingest", type=int, default=20_000, help="entries for the ingest benchmark")
    parser.add_argument("--sync", type=int, default=100_000, help="entries for the sync benchmark")
    parser.add_argument("--scale", action="store_true", help="only the long run's figures (3. of the docstring)")
    parser.add_argument("--workers", type=int, default=1000, help="workers of the long run")
    parser.add_argument("--baseline-workers", type=int, default=10, help="workers of the baseline beside it")
    parser.add_argument("--days", type=float, default=7.0, help="length of the long run")
    parser.add_argument("--sample", type=int, default=20_000,
                        help="real signed entries measured per profile and worker count (at most one simulated hour)")
    parser.add_argument("--link-mbit", type=float, default=100.0, help="a new node's download link")
    parser.add_argument("--cut-every", type=float, default=1_000_000,
                        help="entries between trainer-signed cuts (node/ledger/cut.py)")
    parser.add_argument("--keep-versions", type=int, default=16,
                        help="checkpoint versions a cut keeps open for receipts (downloads of older ones count no more)")
    parser.add_argument("--keep-steps", type=int, default=64,
                        help="draw steps per worker a cut keeps open (above the trainers' step window and validators' lag)")
    parser.add_argument("--cut", type=Path, metavar="DATA_DIR",
                        help="only cuts of a node's ledger database (5. of the docstring)")
    parser.add_argument("--catch-up", type=int, metavar="N",
                        help="only a new node catching up N entries from a peer with and without a cut (6.)")
    parser.add_argument("--below", type=float, default=0.9, help="with --catch-up: the part of the entries below the cut")
    parser.add_argument("--memory", type=Path, metavar="DATA_DIR",
                        help="only the replica memory of a node's ledger database (4. of the docstring)")
    args = parse_args(parser, {"ingest": 2000, "sync": 2000, "sample": 1000}, argv)
    if min(args.workers, args.baseline_workers) <= max(p.sources for p in PROFILES):
        parser.error(f"--workers and --baseline-workers: more than {max(p.sources for p in PROFILES)} "
                     "(each receipt vouches for that many other workers)")
    if args.sample < 100 or args.days <= 0 or args.link_mbit <= 0 or min(args.cut_every, args.keep_versions,
                                                                          args.keep_steps) < 1:
        parser.error("--sample: at least 100; --days and --link-mbit: more than 0; "
                     "--cut-every, --keep-versions, --keep-steps: at least 1")
    for flag, data_dir in (("--memory", args.memory), ("--cut", args.cut)):
        if data_dir and (not (data_dir / DB_FILE).is_file() or read_run_record(data_dir) is None):
            parser.error(f"{flag}: {data_dir} is not a node's data dir (it needs {DB_FILE} and run.json)")
    if args.memory:
        memory_report(args.memory)
        return
    if args.catch_up:
        if not 0 < args.below < 1:
            parser.error("--below: between 0 and 1")
        catch_up_report(args.catch_up, args.below)
        return
    if args.cut:
        cut_report(args.cut, args.keep_versions, args.keep_steps)
        return
    if args.scale:
        scale(args)
        return

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
    scale(args)


def scale(args: argparse.Namespace) -> None:
    print(f"a long run's ledger (one trainer, one validator, the workers; {args.sample} entries measured per column):")
    for traffic in PROFILES:
        scale_report(traffic, args.workers, args.baseline_workers, args.sample, args.days, args.link_mbit,
                     args.cut_every, args.keep_versions, args.keep_steps)


if __name__ == "__main__":
    main()
