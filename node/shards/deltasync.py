"""Checkpoints shipped as the bytes that changed: publish v as a delta against v-1, fetch it, rebuild v.

How this works
--------------
* **Publisher** (the trainer). After publishing the full version v it takes the newest older
  complete version b it holds, encodes delta(b -> v) (node/shards/delta.py) into
  ``<data_dir>/deltas/<v>-<b>/delta.bin`` and cuts that file into pieces under a
  :class:`DeltaManifest`, signed under its own domain and naming the root ids of the full manifests
  of b and v. The delta is stored and served exactly like a version whose root is the delta's (same
  sessions, same super-seeding), and v's announcement carries (b, delta root). A delta is checked
  to rebuild v before it is published, and one larger than ``delta_max_ratio`` of v is not published.
* **Receiver**. Before fetching v's pieces the shards service calls :meth:`DeltaSync.fill`. If v's
  announcement offers a delta whose base we hold complete, it fetches the delta manifest (signature,
  trainer, run, then: it must join the base root we hold to v's announced root), downloads the
  delta as a version of its own (the same :class:`Download`: picker, rarest first, every piece
  hash-checked, liars banned, senders credited), rebuilds v's files from b's and the delta off the
  event loop, and puts every rebuilt piece through v's :class:`VersionStore`, which checks it
  against the full manifest's hash. A piece that does not match is not written; the full download
  that follows fetches whatever is missing, so a bad delta costs a fallback, never a wrong byte.
  Receivers without b (or when anything above fails or stalls for ``delta_stall_timeout``) simply
  fetch full pieces.
* **Whose fault.** Delta pieces are checked against the signed delta manifest, so a peer that sends
  bad delta bytes is caught and banned by the picker like any liar. A delta that passes those checks
  but rebuilds wrong bytes (or does not decode) was signed that way: its signer is reported to the
  peer table under :data:`DELTA_SOURCE` (scored down; its further deltas refused for ``ban_seconds``;
  not disconnected, since its full pieces are still checked one by one).
* The delta is stored like a version (``.shards/manifest``, the ``verified`` log, ``COMPLETE``), so
  an interrupted delta download resumes from its verified pieces after a restart, and a node that
  rebuilt v serves the delta onward to others holding b. Deltas go when their target version goes.

Memory: the rebuild holds the base and target folders in memory (fine for the checkpoints this
project runs on CPUs and single GPUs; a per-file streaming rebuild is the step for 62 GB ones).

The delta part sees the shards service only as a :class:`DeltaOwner` (node/shards/session_api.py):
it serves deltas and stops serving them through it, and reports verified pieces to it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import trio

from ..peers import FaultRule
from ..wire import Envelope, LocalProtocolError, RemoteProtocolError, decode_as, encode
from .announce import call_signed
from .client import Download
from .delta import apply_delta, encode_delta
from .manifest import (
    DeltaManifest,
    SignedDelta,
    SignedManifest,
    build_manifest,
    open_delta_manifest,
    sign_delta_manifest,
)
from .protocol import FIRST_MESSAGE_TIMEOUT
from .session_api import DeltaOwner
from .store import STATE, TRASH_PREFIX, PieceStore, VersionStore

log = logging.getLogger("node.shards.service")  # deltas log as part of the service

DELTA_SOURCE = "shards-delta"  # fault source in the peer table: signers of deltas that rebuild wrong
DELTA_FILE = "delta.bin"
DELTA_WEIGHT = 10.0  # score points a signer loses for a delta that rebuilds wrong


def delta_rule(ban_seconds: float) -> FaultRule:
    """One delta that rebuilds wrong bans its signer's deltas; its connections stay (its full
    checkpoints and gossip may still be good), but its gossip score drops."""
    return FaultRule(weight=DELTA_WEIGHT, strikes=1, ban_seconds=ban_seconds, disconnect=False)
MAX_OFFERS = 64  # announced deltas remembered (newest versions kept)
MAX_BAD = 256  # delta roots known to rebuild wrong (never fetched again)
# lzma and zlib shrink delta bodies by 1.6-2.5x (bench/deltas.py prints body/full beside delta/full:
# the demo's fp32 body is ~1.03x its checkpoint and compresses to ~0.65x; a realistic bf16 step's
# 0.082x compresses to 0.034x with zlib), so a body over three times the size limit is given up on
# before the compression, which is most of the encoding time.
BODY_SLACK = 3.0
PUT_BATCH = 16  # rebuilt pieces hash-checked between two yields to the event loop
_FOLDER = re.compile(r"^(\d+)-(\d+)$")


@dataclass(frozen=True)
class Offer:
    """A trainer offers version v as a delta against ``base`` with delta manifest root ``root``."""

    base: int
    root: bytes


# --------------------------------------------------------------------------------------------
# Storage: one folder per delta, laid out like a version (node/shards/store.py)


class DeltaStore:
    """Deltas under ``<data_dir>/deltas/<version>-<base>/``."""

    def __init__(self, root: Path, run: str, trainers: list[str]) -> None:
        self.root = Path(root)
        self.run = run
        self.trainers = trainers
        self.root.mkdir(parents=True, exist_ok=True)
        for p in self.root.iterdir():
            if p.name.startswith(TRASH_PREFIX):
                shutil.rmtree(p, ignore_errors=True)

    def folder_of(self, version: int, base: int) -> Path:
        return self.root / f"{version}-{base}"

    def entries(self) -> list[tuple[int, int]]:
        """(version, base) of every delta folder on disk, oldest first."""
        out = []
        for p in self.root.iterdir():
            if (m := _FOLDER.match(p.name)) and p.is_dir():
                out.append((int(m.group(1)), int(m.group(2))))
        return sorted(out)

    def saved(self, version: int, base: int) -> SignedDelta | None:
        """The delta manifest stored for (version, base), checked again (the disk is not trusted blindly)."""
        try:
            raw = (self.folder_of(version, base) / STATE / "manifest").read_bytes()
            sd = open_delta_manifest(decode_as(Envelope, raw), self.run, self.trainers)
        except (OSError, RemoteProtocolError):
            return None
        return sd if (sd.delta.version, sd.delta.base_version) == (version, base) else None

    def find(self, target_root: bytes) -> SignedDelta | None:
        """A stored delta that builds the full manifest ``target_root`` (to resume it)."""
        for v, b in reversed(self.entries()):
            sd = self.saved(v, b)
            if sd is not None and sd.delta.target_root == target_root:
                return sd
        return None

    def is_complete(self, version: int, base: int) -> bool:
        return (self.folder_of(version, base) / STATE / "COMPLETE").exists()

    def open(self, sd: SignedDelta) -> VersionStore:
        """Open (resuming) or create the store of a delta we download."""
        d = sd.delta
        folder = self.folder_of(d.version, d.base_version)
        saved = self.saved(d.version, d.base_version)
        if saved is not None and saved.root != sd.root:
            self.remove(d.version, d.base_version)  # another delta for the same pair: start afresh
            saved = None
        vs = VersionStore(folder, sd.as_signed_manifest)
        vs.start(encode(sd.envelope) if saved is None else None)
        return vs

    def add_complete(self, sd: SignedDelta) -> VersionStore:
        """Store a delta whose ``delta.bin`` is already in its folder (the publisher), checking hashes."""
        d = sd.delta
        vs = VersionStore(self.folder_of(d.version, d.base_version), sd.as_signed_manifest)
        vs.adopt_written(encode(sd.envelope), what="delta piece")
        return vs

    def remove(self, version: int, base: int) -> None:
        folder = self.folder_of(version, base)
        if folder.exists():
            trash = self.root / f"{TRASH_PREFIX}{version}-{base}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(folder, trash)
            shutil.rmtree(trash, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Pure-ish helpers run in worker threads (file reads, encode, rebuild)


def _read_files(folder: Path, names: list[str]) -> dict[str, bytes]:
    return {n: (Path(folder) / n).read_bytes() for n in names}


def encode_folder_delta(base: Path, base_names: list[str], target: Path, target_names: list[str],
                        codec: str, max_ratio: float) -> tuple[bytes | None, object]:
    """delta(base folder -> target folder) and its stats, checked to rebuild the target exactly;
    None when it would be larger than ``max_ratio`` of the target."""
    b = _read_files(base, base_names)
    t = _read_files(target, target_names)
    full = sum(len(v) for v in t.values())
    # A body over BODY_SLACK x the limit is not compressed at all (see BODY_SLACK).
    data, stats = encode_delta(b, t, codec, max_body=int(BODY_SLACK * max_ratio * full))
    if data is None or stats.size > max_ratio * full:
        return None, stats
    if apply_delta(b, data, {n: len(v) for n, v in t.items()}) != t:
        raise LocalProtocolError("the delta encoder built a delta that does not rebuild its target")
    return data, stats


def rebuild_folder(base: Path, base_names: list[str], delta_file: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    """The target files from the base folder and a delta file (RemoteProtocolError if malformed)."""
    return apply_delta(_read_files(base, base_names), Path(delta_file).read_bytes(), sizes)


def piece_of(files: dict[str, bytes], manifest, index: int) -> bytes:
    """Piece ``index`` of ``manifest`` cut from in-memory files (name -> bytes)."""
    start = index * manifest.piece_size
    return b"".join(files[manifest.files[i].name][off : off + n]
                    for i, off, n in manifest.spans(start, manifest.piece_length(index)))


# --------------------------------------------------------------------------------------------
# The service part


class DeltaSync:
    """Publishes and fetches deltas for the shards service ``owner`` of ``node``, beside the full
    versions in ``versions`` (see the module docstring)."""

    def __init__(self, owner: DeltaOwner, node, versions: PieceStore) -> None:
        self.owner = owner
        self.node = node  # its identity signs deltas; its peer table scores their signers
        self.versions = versions
        self.cfg = owner.cfg
        self.run_name, self.trainers = versions.run, versions.trainers
        self.store = DeltaStore(Path(node.data_dir) / "deltas", self.run_name, self.trainers)
        self.offers: dict[int, Offer] = {}  # version -> offer, from announcements
        self.published: dict[int, Offer] = {}  # version -> the delta we published for it
        self.bad: set[bytes] = set()
        self.rebuilt: dict[int, int] = {}  # version -> delta bytes downloaded to rebuild it (status, tests)
        self.running: set[Download] = set()  # delta downloads under way (their peers are in use)
        self.m_outcomes = node.metrics.counter("shards_delta_total", "Versions tried through a delta, by outcome",
                                               ["outcome"])
        node.peers.set_rule(DELTA_SOURCE, delta_rule(self.cfg.ban_seconds))

    # -- announcements -----------------------------------------------------------------------

    def note_offer(self, version: int, delta: tuple[int, bytes] | None) -> None:
        if delta is None or version in self.offers:
            return
        self.offers[version] = Offer(*delta)
        while len(self.offers) > MAX_OFFERS:
            del self.offers[min(self.offers)]

    def published_offer(self, version: int) -> tuple[int, bytes] | None:
        o = self.published.get(version)
        return (o.base, o.root) if o else None

    # -- publisher ---------------------------------------------------------------------------

    def base_for(self, version: int) -> int | None:
        older = [v for v in self.versions.complete_versions() if v < version]
        return older[-1] if older else None

    def encode(self, base: Path, base_names: list[str], target: Path, target_names: list[str]):
        """(delta bytes, stats) of base -> target, in a worker thread (tests subclass this to publish
        a corrupt delta)."""
        return encode_folder_delta(base, base_names, target, target_names, self.cfg.delta_codec,
                                   self.cfg.delta_max_ratio)

    async def publish(self, signed: SignedManifest) -> Offer | None:
        """Encode, store and serve the delta of ``signed``'s version against the newest older one held."""
        v, versions = signed.version, self.versions
        base = self.base_for(v)
        if not self.cfg.delta or base is None:
            return None
        base_signed = versions.saved_manifest(base)
        target = versions.path_of(v)
        if base_signed is None or target is None:
            return None
        folder = self.store.folder_of(v, base)
        staging = self.store.root / f"{TRASH_PREFIX}new-{v}-{base}"

        def build():
            data, stats = self.encode(versions.folder_of(base), [f.name for f in base_signed.manifest.files],
                                      target, [f.name for f in signed.manifest.files])
            if data is None:
                return None, stats
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            (staging / DELTA_FILE).write_bytes(data)
            m = build_manifest(staging, self.run_name, v, self.cfg.piece_size)
            self.store.remove(v, base)
            os.replace(staging, folder)
            return m, stats

        m, stats = await trio.to_thread.run_sync(build)
        if m is None:
            log.info("shards: no delta for v%d: %d bytes is %.2f of the full version (limit %.2f)", v, stats.size,
                     stats.ratio, self.cfg.delta_max_ratio)
            return None
        sd = sign_delta_manifest(self.node.identity, DeltaManifest(
            run=self.run_name, version=v, base_version=base, base_root=base_signed.root, target_root=signed.root,
            piece_size=m.piece_size, files=m.files, hashes=m.hashes))
        vs = await trio.to_thread.run_sync(self.store.add_complete, sd)
        if self.cfg.super_seed:
            self.owner.add_superseeder(sd.as_signed_manifest)
        self.owner.serve(vs)
        self.published[v] = Offer(base, sd.root)
        while len(self.published) > MAX_OFFERS:
            del self.published[min(self.published)]
        log.info("shards: published v%d as a delta against v%d: %d bytes (%.4f of %d; %.3f%% of values changed)",
                 v, base, stats.size, stats.ratio, signed.manifest.total_size, 100 * stats.changed_fraction)
        return self.published[v]

    # -- receiver ----------------------------------------------------------------------------

    async def fill(self, vs: VersionStore) -> None:
        """Fill the full version ``vs`` from a delta if one is offered (or stored) against a version
        we hold; pieces the delta does not rebuild correctly are left for the full download."""
        if not self.cfg.delta or len(vs.verified) == vs.manifest.num_pieces:
            return
        try:
            sd = await self._delta_for(vs)
            if sd is None:
                return
            base = self.versions.saved_manifest(sd.delta.base_version)
            base_path = self.versions.path_of(sd.delta.base_version)
            if base is None or base_path is None or base.root != sd.delta.base_root:
                return
            dvs = self.store.open(sd)
            self.owner.serve(dvs)  # its verified pieces go onward at once, like any version's
            if not dvs.complete:
                dl = Download(self.owner, dvs)
                if not await self._download(dl):
                    log.info("shards: delta for v%d stalled; fetching full pieces", vs.version)
                    self.m_outcomes.labels(outcome="stalled").inc()
                    return
                await trio.to_thread.run_sync(dvs.finish)
            await self._rebuild(sd, dvs, base, base_path, vs)
        except OSError as e:  # the base went away under us (pruned), a full disk: full pieces instead
            log.warning("shards: delta for v%d not used: %s", vs.version, e)
            self.m_outcomes.labels(outcome="error").inc()

    async def _delta_for(self, vs: VersionStore) -> SignedDelta | None:
        """The delta to build ``vs`` with: one stored (a resumed download), else the announced one."""
        sd = self.store.find(vs.signed.root)
        if sd is not None and sd.root not in self.bad:
            return sd
        offer = self.offers.get(vs.version)
        if offer is None or offer.root in self.bad or self.owner.path_of(offer.base) is None:
            return None
        source = self.owner.announced.get(vs.version, (b"", ""))[1]
        with trio.move_on_after(self.cfg.delta_stall_timeout):
            while True:
                for peer in [source] + [p for p in self.owner.host.connected_peers() if p != source]:
                    if not peer or self.owner.is_banned(peer, trio.current_time()):
                        continue
                    try:
                        with trio.fail_after(FIRST_MESSAGE_TIMEOUT):
                            sd = await call_delta_manifest(self.owner.host, peer, offer.root, self.run_name,
                                                           self.trainers)
                    except RemoteProtocolError as e:
                        self.owner.reject(e.reason)
                        continue
                    except (LocalProtocolError, AssertionError):
                        raise
                    except Exception as e:  # unreachable peer, timeout, reset
                        log.debug("shards: delta manifest from %s: %s", peer[-8:], e)
                        continue
                    d = sd.delta
                    if (d.version, d.target_root, d.base_version) != (vs.version, vs.signed.root, offer.base):
                        self.owner.reject("delta-mismatch")
                        self._blame(sd, "delta-mismatch")
                        return None
                    if self.node.peers.is_banned(sd.signer, DELTA_SOURCE, trio.current_time()):
                        return None
                    return sd
                await trio.sleep(1.0)
        return None

    async def _download(self, dl: Download) -> bool:
        """Run ``dl``; False (cancelled) when no new piece verified for ``delta_stall_timeout``."""
        self.running.add(dl)
        try:
            return await self._run_download(dl)
        finally:
            self.running.discard(dl)

    async def _run_download(self, dl: Download) -> bool:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dl.run)
            seen, last = len(dl.vs.verified), trio.current_time()
            while not dl.done.is_set():
                with trio.move_on_after(1.0):
                    await dl.done.wait()
                now = trio.current_time()
                if len(dl.vs.verified) > seen:
                    seen, last = len(dl.vs.verified), now
                elif now - last > self.cfg.delta_stall_timeout:
                    nursery.cancel_scope.cancel()
                    return False
        return True

    async def _rebuild(self, sd: SignedDelta, dvs: VersionStore, base: SignedManifest, base_path: Path,
                       vs: VersionStore) -> None:
        m = vs.manifest
        sizes = {f.name: f.size for f in m.files}
        try:
            files = await trio.to_thread.run_sync(rebuild_folder, base_path, [f.name for f in base.manifest.files],
                                                  dvs.folder / DELTA_FILE, sizes)
        except RemoteProtocolError as e:
            self._bad_delta(sd, dvs, vs, f"does not decode: {e}")
            return
        failed = 0
        for i in range(m.num_pieces):
            if i not in vs.verified:
                if vs.put_piece(i, piece_of(files, m, i)):
                    self.owner.on_piece_verified(vs, i)
                else:
                    failed += 1
            if i % PUT_BATCH == PUT_BATCH - 1:
                await trio.sleep(0)
        if failed:
            self._bad_delta(sd, dvs, vs, f"{failed} of {m.num_pieces} rebuilt pieces do not match the full hashes")
            return
        self.rebuilt[vs.version] = dvs.manifest.total_size
        self.m_outcomes.labels(outcome="rebuilt").inc()
        log.info("shards: v%d rebuilt from a %d-byte delta against v%d (full version %d bytes)", vs.version,
                 dvs.manifest.total_size, sd.delta.base_version, m.total_size)

    def _bad_delta(self, sd: SignedDelta, dvs: VersionStore, vs: VersionStore, why: str) -> None:
        log.warning("shards: delta %s for v%d signed by %s %s; fetching the rest as full pieces",
                    sd.root.hex()[:12], vs.version, sd.signer[-8:], why)
        self.m_outcomes.labels(outcome="bad").inc()
        self.owner.reject("bad-delta")
        self._blame(sd, "bad-delta")
        self.owner.stop_serving(sd.root)
        dvs.close()
        self.store.remove(sd.delta.version, sd.delta.base_version)

    def _blame(self, sd: SignedDelta, reason: str) -> None:
        if len(self.bad) < MAX_BAD:
            self.bad.add(sd.root)
        self.node.peers.report(sd.signer, DELTA_SOURCE, reason, trio.current_time())

    # -- lifecycle ---------------------------------------------------------------------------

    def load_held(self) -> None:
        """At start: serve complete deltas whose target we hold; keep partial ones to resume."""
        held = set(self.versions.complete_versions()) | set(self.versions.partial_versions())
        for v, b in self.store.entries():
            sd = self.store.saved(v, b)
            if sd is None or v not in held:
                self.store.remove(v, b)
            elif self.store.is_complete(v, b) and v in self.versions.complete_versions():
                vs = self.store.open(sd)
                self.owner.serve(vs)
                if b == self.base_for(v):
                    self.published.setdefault(v, Offer(b, sd.root))  # a restarted trainer re-announces it

    def prune(self, downloading: Iterable[int]) -> None:
        """Drop deltas whose target version is no longer held (nor among the versions ``downloading``)."""
        keep = set(self.versions.complete_versions()) | set(downloading)
        for v, b in self.store.entries():
            if v not in keep:
                sd = self.store.saved(v, b)
                if sd is not None:
                    held = self.owner.stop_serving(sd.root)
                    if held is not None:
                        held.close()
                self.store.remove(v, b)


async def call_delta_manifest(host, peer: str, root: bytes, run_name: str, trainers: list[str]) -> SignedDelta:
    """Ask ``peer`` for the delta manifest with root ``root``; RemoteProtocolError unless it sends that one."""
    return await call_signed(host, peer, root, lambda env: open_delta_manifest(env, run_name, trainers),
                             "delta manifest")
