"""The piece store: checkpoint versions on disk, written piece by piece, resumable, pruned.

How this works
--------------
Layout under ``<data_dir>/checkpoints/``::

    <version>/                  the model folder itself (config.json, *.safetensors, ...): load it
    <version>/.shards/manifest  the signed manifest (envelope bytes)
    <version>/.shards/verified  which pieces are verified: root id, then one uint32 per piece, appended
    <version>/.shards/COMPLETE  written last, by rename, after every piece is verified and fsync'd

* Files are preallocated to their final size and each verified piece is written in place with
  ``pwrite``; unverified bytes never reach the disk (the downloader hashes a piece in memory first).
* A large piece, written in a worker thread, has its writeback to disk started at once
  (``sync_file_range``), so the fsync at the end of a download waits for little: it overlapped
  the network instead of following it.
* After each verified piece its index is appended to ``verified`` (one ``write`` of 4 bytes, after
  the piece's ``pwrite``), so a process killed with SIGKILL loses nothing it had verified. It is not
  fsync'd per piece (replacing a bitmap by rename per piece cost ~3.6 ms here, a third of the event
  loop at 100 MiB/s): on resume every piece the log claims is hashed again (SHA-256 reads ~1.8 GB/s,
  1 GB in about half a second), which also catches data lost in a power cut or a torn last record.
  A piece that fails is simply fetched again.
* A version is complete only when ``.shards/COMPLETE`` exists; it is created after the data files are
  fsync'd, with write-fsync-rename-fsync(dir), so a crash never leaves a "complete" version with
  missing bytes. Hidden names keep the state out of the model folder's file list.
* A complete version is not trusted either: at start the shards service re-hashes every piece of
  it in the background (node/shards/service.py, ``_recheck_version``) and serves each piece only
  once it has passed; pieces that fail are fetched again (:meth:`VersionStore.mark_incomplete`).
* Only the newest ``keep`` complete versions are kept; older ones (and abandoned partial downloads
  older than them) are renamed away, then deleted, so a crash mid-delete leaves no half version.
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..atomic import fsync_dir, start_writeback, write_atomic
from ..wire import Envelope, RemoteProtocolError, decode_as, encode
from .manifest import Manifest, SignedManifest, open_manifest

STATE = ".shards"
_INDEX = struct.Struct(">I")
TRASH_PREFIX = ".trash-"


class StoreConflict(Exception):
    """We already hold a different manifest for this version (a trainer equivocated)."""


def bitfield_of(pieces: set[int], n: int) -> bytes:
    """BitTorrent-order bitfield (BEP 3: bit 7 of byte 0 is piece 0) of ``pieces`` out of ``n``."""
    out = bytearray((n + 7) // 8)
    for i in pieces:
        out[i >> 3] |= 0x80 >> (i & 7)
    return bytes(out)


def pieces_of(bits: bytes, n: int) -> set[int]:
    """The set of piece indices in a BitTorrent-order bitfield (bit 7 of byte 0 = piece 0)."""
    return {i for i in range(min(n, len(bits) * 8)) if bits[i >> 3] & (0x80 >> (i & 7))}




def read_verified_log(folder: Path, root: bytes, num_pieces: int) -> set[int]:
    """Pieces the ``verified`` log of a version folder claims (unchecked; a torn tail is ignored)."""
    try:
        raw = (Path(folder) / STATE / "verified").read_bytes()
    except FileNotFoundError:
        return set()
    if raw[:32] != root:
        return set()
    body = raw[32 : 32 + (len(raw) - 32) // 4 * 4]
    return {i for (i,) in _INDEX.iter_unpack(body) if i < num_pieces}


class VersionStore:
    """One version's files: write verified pieces, read blocks of verified pieces."""

    def __init__(self, folder: Path, signed: SignedManifest) -> None:
        self.folder = folder
        self.signed = signed
        self.manifest: Manifest = signed.manifest
        self.state = folder / STATE
        self.verified: set[int] = set()
        self._fds: list[int] = []
        # Held by worker threads while they use the fds (a download's writer, the re-check) and by
        # close(), so that a closed fd (whose number the OS hands out again) is never written to.
        self._io = threading.Lock()
        self._log = -1  # fd of .shards/verified, opened for appending

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def complete(self) -> bool:
        return (self.state / "COMPLETE").exists()

    @property
    def verified_bytes(self) -> int:
        return sum(self.manifest.piece_length(i) for i in self.verified)

    def bitfield(self) -> bytes:
        return bitfield_of(self.verified, self.manifest.num_pieces)

    def _open(self, create: bool) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        for f in self.manifest.files:
            path = self.folder / f.name
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
            self._fds.append(fd)  # close() closes it, whatever fails next
            if os.fstat(fd).st_size != f.size:
                os.ftruncate(fd, f.size)
                if f.size and hasattr(os, "posix_fallocate"):
                    try:
                        os.posix_fallocate(fd, 0, f.size)  # fail now, not mid-download, on a full disk
                    except OSError:
                        pass  # filesystems without fallocate: sparse file, written in place anyway

    def reopen(self) -> None:
        """Open the files of a version already on disk, creating a lost one at its size (its pieces
        then fail the re-check); on a failure none stays open."""
        with self._closed_on_failure():
            self._open(create=True)

    def start(self, envelope: bytes | None) -> None:
        """Open this version's files, creating any that are missing at their size. With ``envelope``
        (no manifest saved yet) a new store: save it as the manifest, drop COMPLETE, start an empty
        log. Without, go on with the one on disk: complete as it is (COMPLETE was written after
        fsync), partial from the pieces its log claims, re-checked. Used for versions and deltas alike."""
        with self._closed_on_failure():
            self.folder.mkdir(parents=True, exist_ok=True)
            self._open(create=True)
            if envelope is not None:
                write_atomic(self.state / "manifest", envelope, durable=True)
                (self.state / "COMPLETE").unlink(missing_ok=True)
                self._start_log()
            elif self.complete:
                self.verified = set(range(self.manifest.num_pieces))
            else:
                self.resume()

    @contextmanager
    def _closed_on_failure(self) -> Iterator[None]:
        """Whatever fails inside (a full disk: ENOSPC) closes the files opened so far: a store dropped
        half-made kept them open, 5 descriptors per version announced on a full disk (issue 45's soak)."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        with self._io:
            for fd in self._fds:
                os.close(fd)
            self._fds = []
        if self._log >= 0:
            os.close(self._log)
            self._log = -1

    def _pwrite(self, start: int, data: bytes | memoryview, writeback: bool) -> None:
        view = memoryview(data)
        pos = 0
        for i, off, n in self.manifest.spans(start, len(view)):
            pwrite_all(self._fds[i], view[pos : pos + n], off)
            if writeback:
                start_writeback(self._fds[i], off, n)
            pos += n

    def _pread(self, start: int, length: int) -> bytes:
        return b"".join(os.pread(self._fds[i], n, off) for i, off, n in self.manifest.spans(start, length))

    def put_piece(self, index: int, data: bytes) -> bool:
        """Hash-check and write piece ``index``. False (nothing written) if it does not match."""
        if index in self.verified:
            return True
        if not self.check_and_write(index, data):
            return False
        self.mark_verified(index)
        return True

    def check_and_write(self, index: int, data: bytes | memoryview, *, writeback: bool = False) -> bool:
        """Hash-check piece ``index`` and write it in place, changing no state (a worker thread may
        run it; :meth:`mark_verified` then, in the event loop). False (nothing written) on a mismatch;
        OSError if the write fails or the store was closed. ``writeback``: start writing the piece
        to disk now, so that :meth:`finish`'s fsync has little left to wait for: a worker thread's
        choice (it costs ~0.07 ms a piece, and slows the ``pwrite`` of pages written meanwhile)."""
        if not self.manifest.check_piece(index, data):
            return False
        with self._io:
            if not self._fds:
                raise OSError(f"v{self.version}: store closed")
            self._pwrite(index * self.manifest.piece_size, data, writeback)
        return True

    def mark_verified(self, index: int) -> None:
        """Piece ``index`` is written and matched its hash: serve it, and log it for a resume."""
        self.verified.add(index)
        os.write(self._log, _INDEX.pack(index))

    def read_block(self, piece: int, offset: int, length: int) -> bytes:
        """Bytes of a verified piece. ValueError for pieces we do not hold or ranges outside it."""
        if piece not in self.verified:
            raise ValueError("piece not held")
        if offset < 0 or length <= 0 or offset + length > self.manifest.piece_length(piece):
            raise ValueError("range outside the piece")
        return self._pread(piece * self.manifest.piece_size + offset, length)

    def read_piece(self, piece: int) -> bytes:
        return self._pread(piece * self.manifest.piece_size, self.manifest.piece_length(piece))

    def check_pieces(self, pieces: list[int]) -> list[int]:
        """Those of ``pieces`` whose bytes on disk match the manifest (reads only: a worker thread may run it)."""
        with self._io:
            return [i for i in pieces if self.manifest.check_piece(i, self.read_piece(i))]

    def mark_incomplete(self) -> None:
        """A complete version found damaged: drop COMPLETE, log only the pieces verified now, so the
        missing ones are fetched again (and a crash meanwhile leaves an ordinary partial version)."""
        (self.state / "COMPLETE").unlink(missing_ok=True)
        fsync_dir(self.state)
        self._start_log()

    def resume(self) -> int:
        """Re-check every piece the log claims, then start a fresh log. Returns how many were kept."""
        for i in sorted(read_verified_log(self.folder, self.signed.root, self.manifest.num_pieces)):
            if self.manifest.check_piece(i, self.read_piece(i)):
                self.verified.add(i)
        self._start_log()
        return len(self.verified)

    def _start_log(self) -> None:
        """Rewrite the log with the pieces verified now (atomically), then open it for appending."""
        if self._log >= 0:
            os.close(self._log)
            self._log = -1  # if the rewrite fails (a full disk), close() must not close this number again
        body = self.signed.root + b"".join(_INDEX.pack(i) for i in sorted(self.verified))
        write_atomic(self.state / "verified", body, durable=False)
        self._log = os.open(self.state / "verified", os.O_WRONLY | os.O_APPEND)

    def finish(self) -> None:
        """Mark the version complete (every piece verified): fsync data, then COMPLETE by rename."""
        if len(self.verified) != self.manifest.num_pieces:
            raise RuntimeError("finish() before every piece is verified")
        for fd in self._fds:
            os.fsync(fd)
        self._start_log()
        os.fsync(self._log)
        write_atomic(self.state / "COMPLETE", self.signed.root, durable=True)

    def adopt_written(self, envelope: bytes, what: str = "piece") -> None:
        """Take the files already in the folder as this version, complete (the publisher's side):
        save the signed manifest ``envelope``, hash-check every piece, finish. RuntimeError when a
        piece no longer matches (the files changed while publishing); on that or any failure (a full
        disk) the store is closed."""
        with self._closed_on_failure():
            self._open(create=False)
            write_atomic(self.state / "manifest", envelope, durable=True)
            for i in range(self.manifest.num_pieces):
                if not self.manifest.check_piece(i, self.read_piece(i)):
                    raise RuntimeError(f"{what} {i} changed while publishing")
                self.verified.add(i)
            self.finish()


class PieceStore:
    """All versions under ``<data_dir>/checkpoints``."""

    def __init__(self, root: Path, run: str, trainers: list[str], keep: int = 3) -> None:
        self.root = Path(root)
        self.run = run
        self.trainers = trainers
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)
        self._clear_trash()

    def folder_of(self, version: int) -> Path:
        return self.root / str(version)

    def _versions_on_disk(self) -> list[int]:
        return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and p.is_dir())

    def complete_versions(self) -> list[int]:
        return [v for v in self._versions_on_disk() if (self.folder_of(v) / STATE / "COMPLETE").exists()]

    def partial_versions(self) -> list[int]:
        done = set(self.complete_versions())
        return [v for v in self._versions_on_disk() if v not in done]

    def path_of(self, version: int) -> Path | None:
        """The model folder of a complete version, else None."""
        return self.folder_of(version) if version in self.complete_versions() else None

    def complete_root(self, version: int) -> bytes | None:
        """The manifest root recorded in a complete version's COMPLETE marker (None if unreadable)."""
        try:
            root = (self.folder_of(version) / STATE / "COMPLETE").read_bytes()
        except OSError:
            return None
        return root if len(root) == 32 else None

    def forget_manifest(self, version: int) -> None:
        """A version whose saved manifest is damaged: drop its state (manifest, log, COMPLETE) and
        keep its files, so it is no longer held and a download of it starts afresh."""
        state = self.folder_of(version) / STATE
        for name in ("COMPLETE", "manifest", "verified"):
            (state / name).unlink(missing_ok=True)
        fsync_dir(state)

    def demote(self, version: int) -> None:
        """A complete version whose files cannot be opened: partial from now on (a resume re-checks
        the pieces its log claims), so it is neither held nor served."""
        (self.folder_of(version) / STATE / "COMPLETE").unlink(missing_ok=True)

    def remove(self, version: int) -> None:
        """Delete a version (complete or not) from disk."""
        if self.folder_of(version).exists():
            self._remove(version)

    def saved_manifest(self, version: int) -> SignedManifest | None:
        """The manifest stored for ``version`` (checked again: the disk is not trusted blindly)."""
        try:
            raw = (self.folder_of(version) / STATE / "manifest").read_bytes()
            return open_manifest(decode_as(Envelope, raw), self.run, self.trainers)
        except (OSError, RemoteProtocolError):
            return None

    def open_version(self, signed: SignedManifest) -> VersionStore:
        """Open (resuming) or create the store of a version. StoreConflict on another root."""
        folder = self.folder_of(signed.version)
        saved = self.saved_manifest(signed.version)
        if saved is not None and saved.root != signed.root:
            raise StoreConflict(f"version {signed.version}: already holding another manifest")
        vs = VersionStore(folder, signed)
        vs.start(encode(signed.envelope) if saved is None else None)
        return vs

    def import_folder(self, source: Path, signed: SignedManifest) -> VersionStore:
        """Copy a published folder in as a complete version (the trainer side), checking hashes."""
        folder = self.folder_of(signed.version)
        if Path(source).resolve() != folder.resolve():
            staging = self.root / f"{TRASH_PREFIX}import-{signed.version}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            for f in signed.manifest.files:
                shutil.copyfile(Path(source) / f.name, staging / f.name)
            if folder.exists():
                self._remove(signed.version)
            os.replace(staging, folder)
        vs = VersionStore(folder, signed)
        vs.adopt_written(encode(signed.envelope))
        return vs

    def prune(self, protect: set[int] = frozenset()) -> list[int]:
        """Delete all but the newest ``keep`` complete versions (and partials older than those)."""
        done = self.complete_versions()
        keep = set(done[-self.keep :]) | set(protect)
        oldest_kept = min(keep) if keep else -1
        removed = []
        for v in self._versions_on_disk():
            if v in keep:
                continue
            if v in done or v < oldest_kept:
                self._remove(v)
                removed.append(v)
        return removed

    def _remove(self, version: int) -> None:
        trash = self.root / f"{TRASH_PREFIX}{version}"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(self.folder_of(version), trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _clear_trash(self) -> None:
        for p in self.root.iterdir():
            if p.name.startswith(TRASH_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write every byte of ``view`` at ``offset``. A write may take fewer bytes than asked (a disk
    filling up, a signal): the rest is written after it, so that the next attempt raises the real
    error (ENOSPC). Ignored, the piece was counted as held with its tail never written, and served,
    corrupt, to every peer (who then banned us)."""
    while view:
        done = os.pwrite(fd, view, offset)
        if done <= 0:
            raise OSError(f"a write of {len(view)} bytes at offset {offset} wrote nothing")
        view, offset = view[done:], offset + done
