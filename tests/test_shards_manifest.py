"""Manifests: cutting a folder into pieces, signing, and refusing bad manifests; the piece store."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from node.hashes import digest
from node.identity import Identity
from node.shards.manifest import (
    DEFAULT_PIECE_SIZE,
    MAX_PIECES,
    MIN_AUTO_PIECE_SIZE,
    FolderError,
    build_manifest,
    choose_piece_size,
    open_manifest,
    read_range,
    sign_manifest,
)
from node.shards.protocol import Announce, open_announce
from node.shards.store import PieceStore, StoreConflict
from node.shards.testing import write_checkpoint
from node.wire import RemoteProtocolError, encode, pack, seal

KiB = 1024
TRAINER = Identity.from_seed(b"t" * 32)
OTHER = Identity.from_seed(b"o" * 32)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt", 300 * KiB + 17, seed=5, files=4)


def test_pieces_cover_the_concatenated_files(folder: Path) -> None:
    m = build_manifest(folder, "run", 3, piece_size=64 * KiB)
    blob = b"".join((folder / f.name).read_bytes() for f in m.files)
    assert [f.name for f in m.files] == sorted(p.name for p in folder.iterdir())
    assert m.num_pieces == -(-len(blob) // (64 * KiB)) == 5
    for i in range(m.num_pieces):
        piece = blob[i * 64 * KiB : (i + 1) * 64 * KiB]
        assert m.piece_hash(i) == digest(piece) and m.check_piece(i, piece)
        assert read_range(folder, m, i * 64 * KiB, len(piece)) == piece
    assert not m.check_piece(0, b"x" * 64 * KiB)
    assert sum(n for _, _, n in m.spans(60 * KiB, 200 * KiB)) == 200 * KiB


def test_piece_size_grows_only_for_huge_checkpoints_and_shrinks_for_small_ones() -> None:
    assert choose_piece_size(256 << 20) == DEFAULT_PIECE_SIZE  # 256 pieces: enough to pipeline
    assert choose_piece_size(64 << 20) == 256 << 10  # halved until there are 256 pieces
    assert choose_piece_size(32 << 20) == MIN_AUTO_PIECE_SIZE
    assert choose_piece_size(1 << 20) == MIN_AUTO_PIECE_SIZE  # but never below 128 KiB
    assert choose_piece_size(0) == MIN_AUTO_PIECE_SIZE
    assert choose_piece_size(1 << 20, configured=1 << 20) == 1 << 20
    assert choose_piece_size(MAX_PIECES * DEFAULT_PIECE_SIZE) == DEFAULT_PIECE_SIZE
    assert choose_piece_size(MAX_PIECES * DEFAULT_PIECE_SIZE + 1) == 2 * DEFAULT_PIECE_SIZE


def test_signed_manifest_round_trip(folder: Path) -> None:
    signed = sign_manifest(TRAINER, build_manifest(folder, "run", 3))
    again = open_manifest(signed.envelope, "run", [TRAINER.peer_id])
    assert again.root == signed.root == digest(signed.envelope.payload)
    assert again.manifest == signed.manifest and again.signer == TRAINER.peer_id


def test_bad_signature_is_rejected(folder: Path) -> None:
    env = sign_manifest(TRAINER, build_manifest(folder, "run", 3)).envelope
    forged = replace(env, signature=bytes(64))
    with pytest.raises(RemoteProtocolError) as e:
        open_manifest(forged, "run", [TRAINER.peer_id])
    assert e.value.reason == "bad-signature"
    tampered = replace(env, payload=env.payload.replace(b"run", b"rum", 1))
    with pytest.raises(RemoteProtocolError, match="bad-signature"):
        open_manifest(tampered, "run", [TRAINER.peer_id])


def test_non_trainer_key_is_rejected(folder: Path) -> None:
    signed = sign_manifest(OTHER, build_manifest(folder, "run", 3))
    with pytest.raises(RemoteProtocolError) as e:
        open_manifest(signed.envelope, "run", [TRAINER.peer_id])
    assert e.value.reason == "not-trainer"


def test_other_run_is_rejected(folder: Path) -> None:
    signed = sign_manifest(TRAINER, build_manifest(folder, "other-run", 3))
    with pytest.raises(RemoteProtocolError) as e:
        open_manifest(signed.envelope, "run", [TRAINER.peer_id])
    assert e.value.reason == "wrong-run"


def test_inconsistent_or_unsafe_manifests_are_rejected(folder: Path) -> None:
    m = build_manifest(folder, "run", 3)
    wire = m.to_wire()
    cases = {
        "hash count": dict(wire, hashes=m.hashes + bytes(32)),
        "unsafe name": dict(wire, files=[dict(wire["files"][0], name="../etc")] + wire["files"][1:]),
        "unsorted": dict(wire, files=list(reversed(wire["files"]))),
        "piece size": dict(wire, piece_size=3 * 65536),
        "negative size": dict(wire, files=[dict(wire["files"][0], size=-1)] + wire["files"][1:]),
    }
    for name, bad in cases.items():
        env = seal(TRAINER, "shards-manifest", pack(bad))
        with pytest.raises(RemoteProtocolError):
            open_manifest(env, "run", [TRAINER.peer_id])
        print("rejected", name)
    # Same content, different msgpack encoding: refused, so one manifest has one root id.
    wire_sorted = dict(sorted(wire.items()))
    env = seal(TRAINER, "shards-manifest", pack(wire_sorted))
    with pytest.raises(RemoteProtocolError, match="non-canonical"):
        open_manifest(env, "run", [TRAINER.peer_id])


def test_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(FolderError):
        build_manifest(tmp_path / "missing", "run", 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FolderError):
        build_manifest(tmp_path / "empty", "run", 1)
    (tmp_path / "nested" / "sub").mkdir(parents=True)
    with pytest.raises(FolderError):
        build_manifest(tmp_path / "nested", "run", 1)


def test_announce_checks() -> None:
    a = Announce(run="run", version=2, root=bytes(32), total_size=10, num_pieces=1)
    ok = encode(seal(TRAINER, "shards-announce", a))
    assert open_announce(ok, "run", [TRAINER.peer_id]).announce == a
    for data, reason in [
        (encode(seal(OTHER, "shards-announce", a)), "not-trainer"),
        (encode(seal(TRAINER, "shards-manifest", a)), "wrong-domain"),
        (encode(seal(TRAINER, "shards-announce", replace(a, run="x"))), "wrong-run"),
        (b"\x93garbage", "malformed"),
        (b"x" * 5000, "oversized"),
    ]:
        with pytest.raises(RemoteProtocolError) as e:
            open_announce(data, "run", [TRAINER.peer_id])
        assert e.value.reason == reason


def test_an_announcement_is_valid_gossip_only_from_the_trainer_that_signed_it() -> None:
    """Announcements jump every outbound queue and push bulk gossip out of a full one (UrgentTopics,
    node/net/patches/safety.py). Anyone could republish a trainer's signed announcement as a pubsub
    message of their own (a new message id each time, passing the seen cache) and so flood the swarm
    with urgent messages that evict ledger and membership gossip at every node that forwards them.
    A trainer publishes its announcements itself, so the originator must be the signer (review of
    f17b3cd: a replay by OTHER was valid)."""
    from types import SimpleNamespace

    from libp2p.peer.id import ID
    from libp2p.pubsub.pb import rpc_pb2

    from node.metrics import Metrics
    from node.shards.announce import validate_announce

    node = SimpleNamespace(metrics=Metrics(), topic=lambda name: f"/swarm/run/{name}/1")
    data = encode(seal(TRAINER, "shards-announce", Announce(run="run", version=2, root=bytes(32), total_size=10,
                                                               num_pieces=1)))

    def gossip(origin: Identity):
        return rpc_pb2.Message(from_id=ID.from_base58(origin.peer_id).to_bytes(), data=data, seqno=b"\x01" * 8)

    assert validate_announce(node, "run", [TRAINER.peer_id], gossip(TRAINER))
    assert not validate_announce(node, "run", [TRAINER.peer_id], gossip(OTHER))
    assert node.metrics.rejections() == {"/swarm/run/checkpoints/1/not-origin": 1}


# ---------------------------------------------------------------------------------------------
# Piece store


def _store(tmp_path: Path, keep: int = 2) -> PieceStore:
    return PieceStore(tmp_path / "data" / "checkpoints", "run", [TRAINER.peer_id], keep=keep)


def test_store_writes_verified_pieces_and_resumes(tmp_path: Path, folder: Path) -> None:
    signed = sign_manifest(TRAINER, build_manifest(folder, "run", 1, piece_size=64 * KiB))
    m = signed.manifest
    blob = b"".join((folder / f.name).read_bytes() for f in m.files)
    piece = lambda i: blob[i * m.piece_size : i * m.piece_size + m.piece_length(i)]  # noqa: E731
    store = _store(tmp_path)
    vs = store.open_version(signed)
    assert all((vs.folder / f.name).stat().st_size == f.size for f in m.files)  # preallocated
    assert not vs.put_piece(0, b"\0" * m.piece_length(0))  # wrong bytes are never written
    assert vs.put_piece(0, piece(0)) and vs.put_piece(3, piece(3))
    vs.close()
    # A crash later: the verified log is reread and every claimed piece re-hashed.
    vs = _store(tmp_path).open_version(signed)
    assert vs.verified == {0, 3}
    vs.close()
    # Damage piece 3 on disk: resume drops it (it will be fetched again).
    f0 = vs.folder / m.files[0].name
    with open(f0, "r+b") as fh:
        fh.seek(0)
        fh.write(b"\xff")
    vs = _store(tmp_path).open_version(signed)
    assert vs.verified == {3}
    for i in range(m.num_pieces):
        vs.put_piece(i, piece(i))
    assert store.path_of(1) is None
    vs.finish()
    assert store.path_of(1) == vs.folder and (vs.folder / ".shards" / "COMPLETE").exists()
    assert all((vs.folder / f.name).read_bytes() == (folder / f.name).read_bytes() for f in m.files)
    with pytest.raises(ValueError):
        vs.read_block(0, m.piece_size - 10, 20)
    vs.close()


def test_a_piece_written_with_writeback_asks_the_kernel_for_exactly_its_spans(tmp_path: Path, folder: Path,
                                                                           monkeypatch) -> None:
    """The worker thread's writes start their own writeback (so the final fsync waits for little):
    one request per file span the piece covers, none for the event loop's writes, bytes unchanged."""
    import node.shards.store as store_mod
    from node.atomic import start_writeback

    signed = sign_manifest(TRAINER, build_manifest(folder, "run", 1, piece_size=64 * KiB))
    m = signed.manifest
    blob = b"".join((folder / f.name).read_bytes() for f in m.files)
    piece = lambda i: blob[i * m.piece_size : i * m.piece_size + m.piece_length(i)]  # noqa: E731
    asked: list[tuple[int, int, int, bool]] = []

    def recorded(fd: int, offset: int, length: int) -> bool:
        ok = start_writeback(fd, offset, length)
        asked.append((fd, offset, length, ok))
        return ok

    monkeypatch.setattr(store_mod, "start_writeback", recorded)
    vs = _store(tmp_path).open_version(signed)
    spanning = next(i for i in range(m.num_pieces) if len(m.spans(i * m.piece_size, m.piece_length(i))) > 1)
    assert vs.check_and_write(0, piece(0)) and asked == []  # the event loop's write: no writeback
    assert vs.check_and_write(spanning, piece(spanning), writeback=True)
    spans = m.spans(spanning * m.piece_size, m.piece_length(spanning))
    assert [(fd, off, n) for fd, off, n, _ in asked] == [(vs._fds[i], off, n) for i, off, n in spans]
    if os.uname().sysname == "Linux":
        assert all(ok for *_, ok in asked)  # the kernel took the requests (not a silent no-op)
    for i in range(m.num_pieces):
        vs.put_piece(i, piece(i))
    vs.finish()
    assert all((vs.folder / f.name).read_bytes() == (folder / f.name).read_bytes() for f in m.files)
    vs.close()


def test_a_write_that_comes_up_short_is_finished_or_refused(tmp_path: Path, folder: Path, monkeypatch) -> None:
    """A write may take fewer bytes than asked (a disk filling up, a signal). Ignored, the rest of
    the piece was never written, yet the piece counted as held and was served, corrupt, to every
    peer (who banned us for it). Now the rest is written after it, and a write that makes no
    progress is an error: the piece is not counted."""
    import node.shards.store as store_mod

    signed = sign_manifest(TRAINER, build_manifest(folder, "run", 1, piece_size=64 * KiB))
    m = signed.manifest
    blob = b"".join((folder / f.name).read_bytes() for f in m.files)
    piece = lambda i: blob[i * m.piece_size : i * m.piece_size + m.piece_length(i)]  # noqa: E731
    real_pwrite, asked = os.pwrite, []

    def short(fd: int, data, offset: int) -> int:  # at most 1000 bytes a call, as a full disk might
        asked.append(len(data))
        return real_pwrite(fd, bytes(data[:1000]), offset)

    monkeypatch.setattr(store_mod.os, "pwrite", short)
    vs = _store(tmp_path).open_version(signed)
    for i in range(m.num_pieces):
        assert vs.check_and_write(i, piece(i))
        vs.mark_verified(i)
    assert max(asked) > 1000  # the writes did come up short
    assert all((vs.folder / f.name).read_bytes() == (folder / f.name).read_bytes() for f in m.files)
    monkeypatch.setattr(store_mod.os, "pwrite", lambda fd, data, offset: 0)
    with pytest.raises(OSError, match="wrote nothing"):
        vs.check_and_write(0, piece(0))
    vs.close()


def test_writeback_is_advisory_a_descriptor_it_cannot_apply_to_is_refused_quietly() -> None:
    from node.atomic import start_writeback

    r, w = os.pipe()
    try:
        assert start_writeback(w, 0, 4096) is False  # a pipe has no pages to write: refused, no error
    finally:
        os.close(r)
        os.close(w)


def test_store_keeps_last_k_and_refuses_a_second_root(tmp_path: Path, folder: Path) -> None:
    store = _store(tmp_path, keep=2)
    for v in (1, 2, 3):
        signed = sign_manifest(TRAINER, build_manifest(folder, "run", v))
        store.import_folder(folder, signed).close()
        store.prune()
    assert store.complete_versions() == [2, 3]
    assert not (store.root / "1").exists()
    os.remove(folder / "config.json")
    (folder / "config.json").write_text("{}")
    other = sign_manifest(TRAINER, build_manifest(folder, "run", 3))
    with pytest.raises(StoreConflict):
        store.open_version(other)
