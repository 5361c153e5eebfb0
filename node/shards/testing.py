"""In-process shards nodes on loopback, for tests and benchmarks (no CLI, no roles)."""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ..config import NodeConfig, RunConfig, build
from ..context import NodeContext, RunningNode
from ..net.budget import StreamsConfig
from ..counters import TcpBytes
from ..net.host import GossipParams, open_swarm_host
from ..identity import Identity
from ..ledger.entries import check_receipt
from ..peers import serve_peers
from .config import ShardsConfig
from .service import ShardsService


def safetensors_bytes(total: int, body: bytes = b"", *, dtype: str = "U8", name: str = "data") -> bytes:
    """A valid safetensors file of exactly ``total`` bytes: one 1-D tensor ``name`` of ``dtype``
    whose bytes are ``body`` (then zeros), the header padded with spaces as the format allows."""
    import json
    import struct

    item = {"U8": 1, "F16": 2, "BF16": 2, "F32": 4, "F64": 8}[dtype]

    def header(data_len: int) -> bytes:
        return json.dumps({name: {"dtype": dtype, "shape": [data_len // item], "data_offsets": [0, data_len]}}).encode()

    size = len(header(total)) + (-len(header(total)) % 8)  # the longest the header can be, 8-aligned
    data_len = total - 8 - size
    if data_len < len(body) or data_len % item:
        raise ValueError(f"no {total}-byte safetensors file holds {len(body)} bytes of {dtype}")
    head = header(data_len)
    return struct.pack("<Q", size) + head + b" " * (size - len(head)) + body + bytes(data_len - len(body))


def write_checkpoint(folder: Path, size: int, seed: int = 0, files: int = 3) -> Path:
    """A fake model folder of ``size`` bytes spread over ``files`` files (random, reproducible): the
    weights are valid safetensors files, each one ``U8`` tensor of random bytes (a random float
    would sometimes be NaN, which no node accepts: node/shards/finite.py)."""
    import random

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    (folder / "config.json").write_text('{"model_type": "test", "seed": %d}' % seed)
    rest = size - (folder / "config.json").stat().st_size
    for k in range(files - 1):
        n = rest // (files - 1) + (rest % (files - 1) if k == files - 2 else 0)
        (folder / f"model-{k:05d}.safetensors").write_bytes(safetensors_bytes(n, rng.randbytes(max(0, n - 128))))
    return folder


def write_bf16_checkpoint(folder: Path, values, step: int) -> Path:
    """A model folder: config.json and one safetensors file holding ``values`` (a numpy uint16
    array) as a single bf16 tensor: what deltas are measured and tested on."""
    import json
    import struct

    folder.mkdir(parents=True, exist_ok=True)
    head = json.dumps({"w": {"dtype": "BF16", "shape": [values.size], "data_offsets": [0, 2 * values.size]}}).encode()
    head += b" " * (-len(head) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + values.tobytes())
    (folder / "config.json").write_text('{"model_type": "test", "step": %d}' % step)
    return folder


def bf16_values(count: int, seed: int):
    import numpy as np

    # Weight-like values (the top 16 bits of normal float32s): random bit patterns would include
    # NaN and infinity, which every node refuses to hold (node/shards/finite.py).
    weights = np.random.default_rng(seed).standard_normal(count, dtype=np.float32) * 0.02
    return (weights.view(np.uint32) >> 16).astype(np.uint16)


def next_step(values, seed: int, fraction: float = 0.01):
    """About ``fraction`` of the values moved by one bf16 ulp: what a small-lr RL step publishes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = values.copy()
    out[rng.random(values.size) < fraction] += 1
    return out


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    if names != sorted(p.name for p in b.iterdir() if not p.name.startswith(".")):
        return False
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


@dataclass
class ReceiptLog:
    """The ledger's receipt intake (node/ledger/service.py: note_received), recorded: the ledger a
    shards node without a ledger service credits."""

    received: dict[tuple[str, bytes], list[int]] = field(default_factory=dict)  # -> [bytes, pieces]

    def note_received(self, peer: str, manifest_id: bytes, nbytes: int, pieces: int = 1) -> None:
        check_receipt(peer, manifest_id, nbytes, pieces)
        acc = self.received.setdefault((peer, manifest_id), [0, 0])
        acc[0] += nbytes
        acc[1] += pieces


class StaticMembers:
    """A membership view (node/shards/api.py ``MemberAddrs``) of fixed records, counting the
    look-ups of each kind (a rescan's cost: tests/test_shards_dial_crowd.py)."""

    def __init__(self, records: dict[str, tuple[str, list[str]]]) -> None:
        self.records = records  # peer id -> (reachability, addresses)
        self.calls = {"members": 0, "addrs_of": 0, "reachability_of": 0}

    def members(self) -> dict[str, str]:
        self.calls["members"] += 1
        return {peer: "relay" for peer in self.records}

    def addrs_of(self, peer_id: str) -> list[str]:
        self.calls["addrs_of"] += 1
        return self.records[peer_id][1] if peer_id in self.records else []

    def reachability_of(self, peer_id: str) -> str:
        self.calls["reachability_of"] += 1
        return self.records[peer_id][0] if peer_id in self.records else "unknown"


@dataclass
class ShardsNode(RunningNode):
    """A host plus the shards service (``node.shards``) crediting ``node.ledger``."""

    shards: ShardsService
    ledger: ReceiptLog


@asynccontextmanager
async def open_shards_node(
    data_dir: Path,
    *,
    identity: Identity | None = None,
    trainers: list[str],
    role: str = "relay",
    run: str = "test",
    service_class: type[ShardsService] = ShardsService,
    listen: str = "/ip4/127.0.0.1/tcp/0",
    **shards: object,
):
    """A host plus the shards service; yields a :class:`ShardsNode`."""
    identity = identity or Identity.generate()
    tables = {"shards": dict(shards)}
    config = NodeConfig(role=role, listen=[listen], data_dir=str(data_dir),
                        run=RunConfig(name=run, trainers=trainers, tables=tables))
    cfg = build(ShardsConfig, tables["shards"], "run.shards")  # as the run file's table is built at load
    os.makedirs(data_dir, exist_ok=True)
    async with open_swarm_host(identity, [listen], GossipParams()) as host:
        node = NodeContext(config=config, identity=identity, host=host, data_dir=Path(data_dir))
        ledger = ReceiptLog()
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_peers, node)
            svc = await nursery.start(service_class(node, cfg, ledger, StreamsConfig()).run)
            try:
                yield ShardsNode(node, svc, ledger)
            finally:
                nursery.cancel_scope.cancel()


class ShardsSwarm:
    """Nodes started as siblings in one nursery (see :func:`open_shards_swarm`)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    async def add(self, data_dir: Path, **kw) -> ShardsNode:
        async def run(task_status=trio.TASK_STATUS_IGNORED):
            async with open_shards_node(data_dir, **kw) as node:
                task_status.started(node)
                await trio.sleep_forever()

        return await self._nursery.start(run)


@asynccontextmanager
async def open_shards_swarm():
    """Yield a :class:`ShardsSwarm`; on exit every node is stopped at once.

    Stopping nodes one after another (nested contexts) lets a live peer open a pubsub stream into a
    host whose pubsub service already stopped, which py-libp2p 0.8.1 turns into a crash.
    """
    async with trio.open_nursery() as nursery:
        yield ShardsSwarm(nursery)
        nursery.cancel_scope.cancel()


async def _child(args) -> None:
    """One process of a multi-process test swarm (see ``main``)."""
    import json
    import sys
    import time

    identity = Identity.from_seed(bytes.fromhex(args.seed)) if args.seed else None
    trainer = Identity.from_seed(bytes.fromhex(args.trainer_seed))
    extra = json.loads(args.shards) if args.shards else {}
    async with open_shards_node(Path(args.data_dir), identity=identity, trainers=[trainer.peer_id],
                                role=args.role, run=args.run, listen=args.listen, **extra) as node:
        svc = node.shards
        resumed = {v: len(vs.verified) for vs in svc.serving.values() for v in [vs.version]}
        print(json.dumps({"addr": node.host.listen_addrs()[0], "resumed": resumed}), flush=True)
        for addr in args.connect:
            try:
                await node.host.connect(addr)
            except Exception as e:  # a dead peer in the list: carry on with the others
                print(json.dumps({"connect_failed": addr, "error": str(e)[:80]}), file=sys.stderr, flush=True)
        if args.publish:
            await trio.sleep(args.publish_delay)  # let gossip meshes form before announcing
            print(json.dumps({"published_at": time.time()}), flush=True)
            await svc.publish(Path(args.publish), args.version)
        await _report_complete(svc, args.version)
        if args.then_version:  # a second version (a delta against the first, when offered)
            if args.then_publish:
                await trio.to_thread.run_sync(sys.stdin.readline)  # the benchmark says when
                print(json.dumps({"published_at": time.time()}), flush=True)
                await svc.publish(Path(args.then_publish), args.then_version)
            await _report_complete(svc, args.then_version)
        await trio.sleep_forever()


async def _report_complete(svc, version: int) -> None:
    """Wait until ``version`` is complete here, then print when, who sent what, and its timeline."""
    import json
    import time

    start = trio.current_time()
    wall = time.time() - start  # trio time -> wall clock, to compare with other processes
    downloads = []
    calls = dict(TcpBytes.calls)  # from the download's start: TCP writes (Noise messages) and reads

    async def watch() -> None:  # the Download object, once the manifest is in
        while (dl := svc.downloads.get(version)) is None:
            await trio.sleep(0.1)  # a download lasts seconds; a faster poll shows in the bench's CPU figures
        calls.update(TcpBytes.calls)
        downloads.append(dl)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await svc.wait_version(version)
        nursery.cancel_scope.cancel()
    timeline = {}
    if downloads:
        dl = downloads[0]
        pieces = sorted((t + wall, i, p[-8:]) for i, (t, p) in dl.verified_at.items())
        timeline = {"download_at": dl.started + wall, "first_piece_at": pieces[0][0] if pieces else None,
                    "last_piece_at": pieces[-1][0] if pieces else None, "pieces": pieces}
    print(json.dumps({"complete": version, "seconds": trio.current_time() - start, "at": time.time(),
                      "receipts": {f"{p}:{r[:8]}": n for (p, r), n in svc.receipts().items()},
                      "rebuilt_from_delta": svc.deltas.rebuilt.get(version), "timeline": timeline,
                      "tcp_calls": {k: n - calls[k] for k, n in TcpBytes.calls.items()}}), flush=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m node.shards.testing``: a host plus the shards service, for multi-process tests."""
    import argparse
    import logging

    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--seed", default="", help="hex 32-byte identity seed")
    p.add_argument("--trainer-seed", required=True)
    p.add_argument("--role", default="relay")
    p.add_argument("--run", default="test")
    p.add_argument("--connect", nargs="*", default=[])
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    p.add_argument("--publish", default="")
    p.add_argument("--publish-delay", type=float, default=0.0)
    p.add_argument("--version", type=int, default=1)
    p.add_argument("--shards", default="", help="JSON of [shards] settings")
    p.add_argument("--then-version", type=int, default=0, help="then wait for this version too")
    p.add_argument("--then-publish", default="", help="publisher: after a line on stdin, publish this folder")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    # Drops and back-offs: what a failed test needs; SHARDS_DEBUG=1 adds every super-seeding reveal.
    logging.getLogger("node.shards").setLevel(logging.DEBUG if os.environ.get("SHARDS_DEBUG") else logging.INFO)
    try:
        if os.environ.get("SHARDS_PROFILE"):
            _profiled(_child, args, Path(os.environ["SHARDS_PROFILE"]))
        else:
            trio.run(_child, args)
    except KeyboardInterrupt:
        pass


def _profiled(fn, args, out: Path) -> None:
    """Benchmarks only: run ``fn`` under cProfile, writing the stats to ``out`` every 2 s (children
    are killed, not stopped, so the last dump is what remains)."""
    import cProfile

    prof = cProfile.Profile()

    async def dump_every() -> None:
        while True:
            await trio.sleep(2.0)
            prof.disable()
            prof.dump_stats(out)
            prof.enable()

    async def both() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dump_every)
            await fn(args)
            nursery.cancel_scope.cancel()

    prof.enable()
    trio.run(both)


if __name__ == "__main__":
    main()
