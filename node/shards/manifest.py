"""Checkpoint manifests: a model folder cut into fixed-size pieces, one hash per piece, signed.

How this works
--------------
* A checkpoint version is a Hugging Face model folder (``config.json``, ``*.safetensors``, tokenizer
  files). Its regular files, sorted by name, are read as one byte string; that string is cut into
  pieces of ``piece_size`` bytes (the last one shorter), as BitTorrent does for multi-file torrents
  (BEP 3, "info dictionary"). Each piece gets one :func:`node.hashes.digest`.
* The manifest (run, version, files with sizes, piece size, the piece hashes) is msgpack-encoded
  canonically by :mod:`node.wire`; its **root id** is the digest of those bytes. The trainer seals the
  bytes with ``seal(identity, DOMAIN, ...)``; a peer accepts a manifest only when the signature holds,
  the signer is a trainer of this run, the run name matches, the payload re-encodes to the same bytes
  (so one manifest has exactly one root id) and every size and count is within bounds.

Why these sizes (measured on this project's 2-core dev machine, loopback, py-libp2p 0.8.1 TCP +
Noise + Yamux, one stream, length-prefixed msgpack frames; ``bench/shards.py --calibrate``):

=============  ===============  ================================================================
block (request)  stream goodput  reading
=============  ===============  ================================================================
16 KiB          34 MiB/s        BitTorrent's block size: per-frame Python/Noise overhead dominates
64 KiB          105 MiB/s
256 KiB         152 MiB/s       within ~12% of 1 MiB blocks: the knee of the curve
1 MiB           172 MiB/s       but a whole piece per request: no parallel fetch of one piece
=============  ===============  ================================================================

SHA-256 runs at ~1.8 GB/s for 1, 4 and 16 MiB pieces alike, so hashing never limits the piece
size. The piece is what a peer may serve onward only after verifying it, so small pieces make the
swarm a finer pipeline (a relay re-serves after 1 MiB instead of 50 MB as in SHARDCAST) and let
rarest-first balance better; large pieces shrink the manifest (32 bytes per piece). We take
**1 MiB pieces of four 256 KiB blocks** and double the piece size only when a checkpoint would need
more than :data:`MAX_PIECES` pieces (16 GiB at 1 MiB), which keeps a manifest under ~260 KiB and
lets it travel in one stream frame.

Small checkpoints get smaller pieces: 1 MiB is halved, down to :data:`MIN_AUTO_PIECE_SIZE`, while a
checkpoint would have fewer than :data:`MIN_PIECES` pieces. A swarm's start-up (every downloader
waits for its first piece to have something to pass on) and its tail (the last piece the seed sends
still has to reach the N-1 others) each last a few piece-times, so they cost ~(N-1)/pieces of the
distribution time. Measured (``bench/shards.py swarm``: 32 MiB, 8 downloaders, 10 Mbit/s upload
each, one run per size on a shared 2-core machine): 1 MiB pieces (32) 1.40x the Kumar-Ross bound,
256 KiB (128) 1.16x, 128 KiB (256) 1.11x, 64 KiB (512) 1.34x (per-piece round trips and Python
work per message start to show). Pieces of 128 KiB are single 128 KiB requests (~130 MiB/s on one
stream by the table above: far above any link they are meant for).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ..hashes import DIGEST_SIZE, digest, hasher
from ..identity import peer_id_of
from ..wire import Envelope, Message, RemoteProtocolError, bounded, decode_as, encode, register, seal

DOMAIN = "shards-manifest"
DEFAULT_PIECE_SIZE = 1 << 20  # see the module docstring
MIN_PIECES = 256  # automatic piece size: halve 1 MiB while a checkpoint has fewer pieces than this...
MIN_AUTO_PIECE_SIZE = 128 << 10  # ...but not below this (see the module docstring)
DEFAULT_BLOCK_SIZE = 256 << 10
MIN_PIECE_SIZE = 16 << 10
MAX_PIECE_SIZE = 64 << 20
MAX_PIECES = 1 << 14  # 16384 pieces -> 512 KiB of hashes at most, one frame
MAX_FILES = 1024
MAX_FILE_NAME = 255
MAX_TOTAL_SIZE = MAX_PIECES * MAX_PIECE_SIZE  # 1 TiB
MAX_MANIFEST_BYTES = MAX_PIECES * DIGEST_SIZE + MAX_FILES * (MAX_FILE_NAME + 32) + 4096
MAX_VERSION = 2**53  # fits every JSON reader

# A file name is one path component: no directories, no hidden files, nothing a shell or a path
# join could turn into an escape from the version folder.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}$")


@register
@dataclass(frozen=True)
class FileEntry(Message):
    """One file of the checkpoint folder."""

    TYPE: ClassVar[str] = "shards.file"
    name: str = bounded(max_len=MAX_FILE_NAME)
    size: int = bounded(min=0, max=MAX_TOTAL_SIZE)

    def __post_init__(self) -> None:
        if not _SAFE_NAME.match(self.name) or ".." in self.name:
            raise ValueError(f"unsafe file name {self.name[:40]!r}")


@register
@dataclass(frozen=True)
class Manifest(Message):
    """What a checkpoint version contains and how it is cut. Pure data with piece arithmetic."""

    TYPE: ClassVar[str] = "shards.manifest"
    run: str = bounded(max_len=64)
    version: int = bounded(min=0, max=MAX_VERSION)
    piece_size: int = bounded(min=MIN_PIECE_SIZE, max=MAX_PIECE_SIZE)
    files: list[FileEntry] = bounded(max_len=MAX_FILES)
    hashes: bytes = bounded(max_len=MAX_PIECES * DIGEST_SIZE)  # piece digests, concatenated

    def __post_init__(self) -> None:
        names = [f.name for f in self.files]
        if names != sorted(set(names)):
            raise ValueError("files must be sorted by name and unique")
        if self.piece_size & (self.piece_size - 1):
            raise ValueError("piece_size must be a power of two")
        if len(self.hashes) != pieces_for(self.total_size, self.piece_size) * DIGEST_SIZE:
            raise ValueError("number of piece hashes does not match the total size")

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def num_pieces(self) -> int:
        return len(self.hashes) // DIGEST_SIZE

    def piece_hash(self, index: int) -> bytes:
        return self.hashes[index * DIGEST_SIZE : (index + 1) * DIGEST_SIZE]

    def piece_length(self, index: int) -> int:
        if not 0 <= index < self.num_pieces:
            raise IndexError(index)
        return min(self.piece_size, self.total_size - index * self.piece_size)

    def check_piece(self, index: int, data: bytes | memoryview) -> bool:
        """True when ``data`` is exactly piece ``index``."""
        return len(data) == self.piece_length(index) and digest(data) == self.piece_hash(index)

    def spans(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """The byte range [start, start+length) of the concatenation as (file index, offset, n)."""
        out: list[tuple[int, int, int]] = []
        pos = 0
        end = start + length
        for i, f in enumerate(self.files):
            lo, hi = max(start, pos), min(end, pos + f.size)
            if lo < hi:
                out.append((i, lo - pos, hi - lo))
            pos += f.size
            if pos >= end:
                break
        return out


def pieces_for(total_size: int, piece_size: int) -> int:
    return -(-total_size // piece_size)


def choose_piece_size(total_size: int, configured: int = 0) -> int:
    """``configured`` if set, else 1 MiB, halved (down to MIN_AUTO_PIECE_SIZE) while the checkpoint
    would have fewer than MIN_PIECES pieces, doubled until it fits in MAX_PIECES pieces."""
    if configured:
        return configured
    size = DEFAULT_PIECE_SIZE
    while pieces_for(total_size, size) < MIN_PIECES and size > MIN_AUTO_PIECE_SIZE:
        size //= 2
    while pieces_for(total_size, size) > MAX_PIECES and size < MAX_PIECE_SIZE:
        size *= 2
    return size


def root_id(payload: bytes) -> bytes:
    """The manifest's content id: digest of its canonical encoding (the signed payload)."""
    return digest(payload)


# --------------------------------------------------------------------------------------------
# Checking a manifest that came from the network


@dataclass(frozen=True)
class SignedManifest:
    """A manifest that passed :func:`open_manifest`, with its envelope (to pass on) and root id."""

    manifest: Manifest
    envelope: Envelope
    root: bytes
    signer: str  # peer id of the trainer that signed it

    @property
    def version(self) -> int:
        return self.manifest.version


def open_manifest(envelope: Envelope, run: str, trainers: list[str]) -> SignedManifest:
    """Verify a sealed manifest for run ``run``. RemoteProtocolError names what is wrong."""
    manifest, signer = _open_signed(envelope, DOMAIN, Manifest, run, trainers, "manifest")
    return SignedManifest(manifest, envelope, root_id(envelope.payload), signer)


def _open_signed(envelope: Envelope, domain: str, cls, run: str, trainers: list[str], what: str):
    """(message, signer) of a sealed ``cls`` signed under ``domain`` by a trainer of ``run``: the
    signature first, then the signer, then the bounded decode, then run and canonical bytes."""
    payload = envelope.open(domain)  # bad-signature / wrong-domain
    signer = peer_id_of(envelope.public_key)
    if signer not in trainers:
        raise RemoteProtocolError("not-trainer", signer)
    msg = decode_as(cls, payload, max_size=MAX_MANIFEST_BYTES)
    if msg.run != run:
        raise RemoteProtocolError("wrong-run", msg.run[:64])
    if encode(msg) != payload:
        raise RemoteProtocolError("non-canonical", f"{what} does not re-encode to its own bytes")
    return msg, signer


def sign_manifest(identity, manifest: Manifest) -> SignedManifest:
    """Seal a manifest we built (the trainer side)."""
    envelope = seal(identity, DOMAIN, manifest)
    return SignedManifest(manifest, envelope, root_id(envelope.payload), identity.peer_id)


# --------------------------------------------------------------------------------------------
# Building a manifest from a folder (I/O)


class FolderError(ValueError):
    """The folder cannot be published (missing, empty, unsafe names, too large): an operator error."""


def folder_files(folder: Path) -> list[FileEntry]:
    """The publishable files of ``folder``, sorted by name; FolderError when it cannot be one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FolderError(f"{folder}: not a directory")
    entries = []
    for p in sorted(folder.iterdir(), key=lambda p: p.name):
        if p.name.startswith("."):
            continue  # editor and git droppings are not part of a checkpoint
        if p.is_dir():
            raise FolderError(f"{p}: subdirectories are not supported in a checkpoint folder")
        if not p.is_file():
            continue
        if not _SAFE_NAME.match(p.name):
            raise FolderError(f"{p.name!r}: file name not allowed in a checkpoint")
        entries.append(FileEntry(name=p.name, size=p.stat().st_size))
    if not entries:
        raise FolderError(f"{folder}: no files to publish")
    if len(entries) > MAX_FILES:
        raise FolderError(f"{folder}: more than {MAX_FILES} files")
    total = sum(e.size for e in entries)
    if total == 0 or total > MAX_TOTAL_SIZE:
        raise FolderError(f"{folder}: total size {total} out of range")
    return entries


def build_manifest(folder: Path, run: str, version: int, piece_size: int = 0) -> Manifest:
    """Hash ``folder`` into a manifest, streaming the files (memory: one piece)."""
    files = folder_files(folder)
    size = choose_piece_size(sum(f.size for f in files), piece_size)
    if pieces_for(sum(f.size for f in files), size) > MAX_PIECES:
        raise FolderError(f"{folder}: too large for piece size {size}")
    hashes = bytearray()
    h, filled = hasher(), 0
    for f in files:
        with open(Path(folder) / f.name, "rb") as fh:
            remaining = f.size
            while remaining:
                chunk = fh.read(min(size - filled, remaining))
                if not chunk:
                    raise FolderError(f"{f.name}: changed while hashing")
                h.update(chunk)
                filled += len(chunk)
                remaining -= len(chunk)
                if filled == size:
                    hashes += h.digest()
                    h, filled = hasher(), 0
    if filled:
        hashes += h.digest()
    return Manifest(run=run, version=version, piece_size=size, files=files, hashes=bytes(hashes))


def read_range(folder: Path, manifest: Manifest, start: int, length: int) -> bytes:
    """Bytes [start, start+length) of the concatenated files of ``folder``."""
    parts = []
    for i, off, n in manifest.spans(start, length):
        with open(os.path.join(folder, manifest.files[i].name), "rb") as fh:
            fh.seek(off)
            parts.append(fh.read(n))
    return b"".join(parts)


# --------------------------------------------------------------------------------------------
# Delta manifests (node/shards/delta.py is the format, node/shards/deltasync.py the transfer)

DELTA_DOMAIN = "shards-delta"


@register
@dataclass(frozen=True)
class DeltaManifest(Message):
    """Version ``version`` as a delta against ``base_version``: the delta's own files and pieces
    (so it travels like any version) and the root ids of the base and target full manifests it
    joins. Signed by a trainer under :data:`DELTA_DOMAIN`, so it can never pass for a full one."""

    TYPE: ClassVar[str] = "shards.delta-manifest"
    run: str = bounded(max_len=64)
    version: int = bounded(min=1, max=MAX_VERSION)
    base_version: int = bounded(min=0, max=MAX_VERSION)
    base_root: bytes = bounded(exact_len=DIGEST_SIZE)
    target_root: bytes = bounded(exact_len=DIGEST_SIZE)
    piece_size: int = bounded(min=MIN_PIECE_SIZE, max=MAX_PIECE_SIZE)
    files: list[FileEntry] = bounded(max_len=MAX_FILES)
    hashes: bytes = bounded(max_len=MAX_PIECES * DIGEST_SIZE)

    def __post_init__(self) -> None:
        if self.base_version >= self.version:
            raise ValueError("a delta's base must be older than its target")
        self.pieces  # checks files, piece size and hashes as a Manifest does

    @property
    def pieces(self) -> Manifest:
        """The delta's payload as a Manifest (what the piece store and the transfer sessions use)."""
        return Manifest(run=self.run, version=self.version, piece_size=self.piece_size, files=self.files,
                        hashes=self.hashes)


@dataclass(frozen=True)
class SignedDelta:
    """A delta manifest that passed :func:`open_delta_manifest`, with its envelope and root id."""

    delta: DeltaManifest
    envelope: Envelope
    root: bytes
    signer: str

    @property
    def as_signed_manifest(self) -> SignedManifest:
        """The delta seen as a version of its own (its root is the delta's), for the piece store."""
        return SignedManifest(self.delta.pieces, self.envelope, self.root, self.signer)


def open_delta_manifest(envelope: Envelope, run: str, trainers: list[str]) -> SignedDelta:
    """Verify a sealed delta manifest for run ``run``. RemoteProtocolError names what is wrong."""
    delta, signer = _open_signed(envelope, DELTA_DOMAIN, DeltaManifest, run, trainers, "delta manifest")
    return SignedDelta(delta, envelope, root_id(envelope.payload), signer)


def sign_delta_manifest(identity, delta: DeltaManifest) -> SignedDelta:
    envelope = seal(identity, DELTA_DOMAIN, delta)
    return SignedDelta(delta, envelope, root_id(envelope.payload), identity.peer_id)
