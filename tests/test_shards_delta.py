"""Checkpoint deltas, pure layer: round trips (hypothesis), bounds refusals, corrupt deltas, manifests."""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.identity import Identity
from node.shards import delta as D
from node.shards.manifest import (
    DeltaManifest,
    Manifest,
    open_delta_manifest,
    open_manifest,
    sign_delta_manifest,
    sign_manifest,
)
from node.wire import RemoteProtocolError, pack, seal

TRAINER = Identity.from_seed(bytes(range(32)))


def safetensors_bytes(tensors: dict[str, tuple[str, np.ndarray]]) -> bytes:
    """A safetensors file of ``name -> (dtype, uint array of the dtype's width)``, written by hand
    (bf16 has no numpy dtype; the format is 8-byte header length, JSON header, raw data)."""
    header, off, blobs = {}, 0, []
    for name in sorted(tensors):
        dtype, arr = tensors[name]
        data = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": [arr.size], "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def changed_copy(arr: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """``arr`` with about ``fraction`` of its elements nudged by one or two ulps (the RL case)."""
    out = arr.copy()
    mask = rng.random(arr.size) < fraction
    out[mask] = out[mask] + rng.integers(1, 3, size=int(mask.sum())).astype(arr.dtype)
    return out


def model_pair(seed: int, fraction: float, dtypes=("BF16", "F32"), sizes=(1000, 37, 1)) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    base, target = {}, {}
    for k, (dtype, n) in enumerate((d, s) for d in dtypes for s in sizes):
        u = np.uint16 if dtype == "BF16" else np.uint32
        a = rng.integers(0, np.iinfo(u).max, size=n, dtype=u)
        base[f"t{k}"] = (dtype, a)
        target[f"t{k}"] = (dtype, changed_copy(a, fraction, rng))
    return base, target


def folders(base_t: dict, target_t: dict) -> tuple[dict[str, bytes], dict[str, bytes]]:
    base = {"config.json": b'{"a": 1}', "model.safetensors": safetensors_bytes(base_t), "old.txt": b"gone"}
    target = {"config.json": b'{"a": 2}', "model.safetensors": safetensors_bytes(target_t), "new.txt": b"hi"}
    return base, target


def sizes(files: dict[str, bytes]) -> dict[str, int]:
    return {k: len(v) for k, v in files.items()}


# ---------------------------------------------------------------------------------------------
# Round trips


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), fraction=st.sampled_from([0.0, 1e-4, 0.01, 0.3, 0.9, 1.0]),
       dtype=st.sampled_from([("BF16",), ("F32",), ("BF16", "F32")]), codec=st.sampled_from(list(D.CODECS)),
       n=st.integers(1, 3000))
def test_round_trip_is_byte_identical(seed: int, fraction: float, dtype, codec: str, n: int) -> None:
    base, target = folders(*model_pair(seed, fraction, dtype, sizes=(n, 7, 1)))
    data, stats = D.encode_delta(base, target, codec)
    assert D.apply_delta(base, data, sizes(target)) == target
    assert stats.values == sum(n_ for n_ in (n, 7, 1)) * len(dtype)
    if fraction == 0.0:
        assert stats.changed == 0
    if fraction == 1.0:  # every element nudged
        assert stats.changed == stats.values


def test_unchanged_folder_is_tiny_and_all_same() -> None:
    base, _ = folders(*model_pair(1, 0.0))
    data, stats = D.encode_delta(base, dict(base))
    assert stats.changed == 0 and stats.raw_files == 0 and stats.size < 200
    assert D.apply_delta(base, data, sizes(base)) == base


def test_encoder_gives_up_on_a_body_too_large() -> None:
    base, target = folders(*model_pair(2, 1.0))
    data, stats = D.encode_delta(base, target, max_body=100)
    assert data is None and stats.body > 100


def test_sparse_change_is_small() -> None:
    """1 % of bf16 values moved by an ulp or two: the delta is a small fraction of the full file."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2**16, size=200_000, dtype=np.uint16)
    base = {"m.safetensors": safetensors_bytes({"w": ("BF16", a)})}
    target = {"m.safetensors": safetensors_bytes({"w": ("BF16", changed_copy(a, 0.01, rng))})}
    data, stats = D.encode_delta(base, target)
    assert 0.008 < stats.changed_fraction < 0.012
    assert stats.ratio < 0.05
    assert D.apply_delta(base, data, sizes(target)) == target


def test_positions_pick_the_smaller_coding() -> None:
    sparse = np.zeros(10_000, dtype=bool)
    sparse[[3, 500, 9_999]] = True
    assert D.encode_positions(sparse)[0] == D.POS_VARINT
    dense = np.ones(10_000, dtype=bool)
    dense[::2] = False
    assert D.encode_positions(dense)[0] == D.POS_BITMAP
    for mask in (sparse, dense):
        kind, data = D.encode_positions(mask)
        assert list(D.decode_positions(kind, data, int(mask.sum()), mask.size)) == list(np.flatnonzero(mask))


@given(st.lists(st.integers(0, 2**56 - 1), max_size=50))
def test_varint_round_trip(values: list[int]) -> None:
    arr = np.array(values, dtype=np.uint64)
    assert list(D.varint_decode(D.varint_encode(arr), len(values))) == values


def test_header_change_sends_the_file_raw() -> None:
    base_t, target_t = model_pair(4, 0.01)
    target_t["extra"] = ("F32", np.arange(3, dtype=np.uint32))
    base, target = folders(base_t, target_t)
    data, stats = D.encode_delta(base, target)
    assert stats.raw_files == 3  # config.json, new.txt, model.safetensors (its header moved)
    assert D.apply_delta(base, data, sizes(target)) == target


# ---------------------------------------------------------------------------------------------
# Bounds and bad input


def _delta(body: object, codec: int = 1) -> bytes:
    raw = pack(body)
    return D._HEAD.pack(D.MAGIC, codec, len(raw)) + zlib.compress(raw)


def test_refusals() -> None:
    base, target = folders(*model_pair(5, 0.01))
    good, _ = D.encode_delta(base, target, "zlib")
    t_index = sorted(target).index("model.safetensors")
    body = D.decode_delta(good, 1 << 24)
    tensors = body.files[t_index][2]
    idx, kind, count, pos, planes = tensors[0]
    n0 = 1000  # the first tensor's elements

    def with_tensor(t):
        files = [list(r) for r in body.files]
        files[t_index] = ["model.safetensors", D.TENSORS, [t] + tensors[1:]]
        return _delta({"files": files})

    cases = {
        "not a delta": b"garbage" * 4,
        "short": D.MAGIC,
        "unknown codec": D._HEAD.pack(D.MAGIC, 9, 10) + b"x" * 10,
        "body too large": D._HEAD.pack(D.MAGIC, 1, 1 << 40) + zlib.compress(b"x"),
        "length lies": D._HEAD.pack(D.MAGIC, 1, 5) + zlib.compress(pack({"files": []})),
        "corrupt stream": good[:-8] + bytes(8),
        "not a map": _delta([1, 2]),
        "too many files": _delta({"files": [[f"f{i:05d}", D.SAME] for i in range(D.MAX_DELTA_FILES + 1)]}),
        "unsorted names": _delta({"files": [["b", D.SAME], ["a", D.SAME]]}),
        "unknown kind": _delta({"files": [["a", "patch"]]}),
        "tensor index out of range": with_tensor([10_000, kind, count, pos, planes]),
        "more changes than elements": with_tensor([idx, kind, n0 + 1, pos, planes]),
        "values do not match count": with_tensor([idx, kind, count, pos, planes[:-1]]),
        "zero changes": with_tensor([idx, kind, 0, b"", b""]),
        "position kind": with_tensor([idx, 7, count, pos, planes]),
        "position out of range": with_tensor([idx, D.POS_VARINT, 1, D.varint_encode(np.array([n0])), planes[:2]]),
        "varint too long": with_tensor([idx, D.POS_VARINT, 1, b"\xff" * 9 + b"\x01", planes[:2]]),
        "bitmap count": with_tensor([idx, D.POS_BITMAP, count, bytes((n0 + 7) // 8), planes]),
    }
    for name, data in cases.items():
        with pytest.raises(RemoteProtocolError) as e:
            D.apply_delta(base, data, sizes(target))
        assert e.value.reason in ("bad-delta", "malformed", "oversized"), name
    # files that do not match the full manifest, or sizes that do not
    with pytest.raises(RemoteProtocolError, match="full manifest"):
        D.apply_delta(base, good, dict(sizes(target), extra=3))
    with pytest.raises(RemoteProtocolError, match="builds"):
        D.apply_delta(base, good, dict(sizes(target), **{"new.txt": 3}))
    # a record that needs a base file we do not hold
    with pytest.raises(RemoteProtocolError, match="base file"):
        D.apply_delta({k: v for k, v in base.items() if k != "model.safetensors"}, good, sizes(target))


def test_compression_bomb_is_bounded() -> None:
    """A body claiming to be small but decompressing to much more is refused, not inflated."""
    huge = zlib.compress(b"\0" * (64 << 20))
    data = D._HEAD.pack(D.MAGIC, 1, 1000) + huge
    with pytest.raises(RemoteProtocolError, match="length"):
        D.decode_delta(data, 1 << 20)


def test_corrupt_delta_rebuilds_wrong_bytes_which_the_full_hashes_catch() -> None:
    """A delta that decodes fine but was built from other bytes rebuilds a wrong file; the full
    version's piece hashes (the only thing a receiver trusts) catch it."""
    from node.hashes import digest

    base, target = folders(*model_pair(6, 0.01))
    tampered = dict(target)
    blob = bytearray(target["model.safetensors"])
    blob[-1] ^= 0x01
    tampered["model.safetensors"] = bytes(blob)
    data, _ = D.encode_delta(base, tampered)
    rebuilt = D.apply_delta(base, data, sizes(target))  # decodes and has the right sizes...
    assert digest(rebuilt["model.safetensors"]) != digest(target["model.safetensors"])  # ...but not the bytes


# ---------------------------------------------------------------------------------------------
# Delta manifests


def _delta_manifest(**kw) -> DeltaManifest:
    fields = dict(run="run", version=2, base_version=1, base_root=bytes(32), target_root=b"\1" * 32,
                  piece_size=1 << 17, files=[], hashes=b"")
    from node.shards.manifest import FileEntry

    fields["files"] = [FileEntry(name="delta.bin", size=10)]
    fields["hashes"] = bytes(32)
    fields.update(kw)
    return DeltaManifest(**fields)


def test_delta_manifest_is_signed_under_its_own_domain() -> None:
    sd = sign_delta_manifest(TRAINER, _delta_manifest())
    assert open_delta_manifest(sd.envelope, "run", [TRAINER.peer_id]).root == sd.root
    # the delta seen as a version for the piece store: its root is the delta's
    assert sd.as_signed_manifest.root == sd.root and sd.as_signed_manifest.manifest.num_pieces == 1
    with pytest.raises(RemoteProtocolError, match="domain"):
        open_manifest(sd.envelope, "run", [TRAINER.peer_id])  # never passes for a full manifest
    full = sign_manifest(TRAINER, Manifest(run="run", version=2, piece_size=1 << 17, files=_delta_manifest().files,
                                           hashes=bytes(32)))
    with pytest.raises(RemoteProtocolError, match="domain"):
        open_delta_manifest(full.envelope, "run", [TRAINER.peer_id])
    with pytest.raises(RemoteProtocolError, match="not-trainer"):
        open_delta_manifest(sd.envelope, "run", [Identity.generate().peer_id])
    with pytest.raises(RemoteProtocolError, match="wrong-run"):
        open_delta_manifest(sd.envelope, "other", [TRAINER.peer_id])


def test_delta_manifest_bounds() -> None:
    wire = _delta_manifest().to_wire()
    cases = {
        "base not older": dict(wire, base_version=2),
        "short root": dict(wire, target_root=b"x"),
        "hash count": dict(wire, hashes=bytes(64)),
        "piece size": dict(wire, piece_size=3 << 16),
    }
    for name, bad in cases.items():
        with pytest.raises(RemoteProtocolError):
            open_delta_manifest(seal(TRAINER, "shards-delta", pack(bad)), "run", [TRAINER.peer_id])
        print("rejected", name)


def test_announce_delta_fields() -> None:
    from node.shards.protocol import Announce

    a = Announce(run="r", version=3, root=bytes(32), total_size=1, num_pieces=1)
    assert a.delta is None
    b = replace(a, delta_root=b"\2" * 32, delta_base=2)
    assert b.delta == (2, b"\2" * 32)
    for bad in (dict(delta_root=b"\2" * 32, delta_base=3), dict(delta_base=1), dict(delta_root=b"x", delta_base=1)):
        with pytest.raises(ValueError):
            replace(a, **bad)


# ---------------------------------------------------------------------------------------------
# Delta store: a delta is stored like a version, so its download resumes


def test_delta_download_resumes_from_its_verified_pieces(tmp_path) -> None:
    from node.shards.deltasync import DELTA_FILE, DeltaStore
    from node.shards.manifest import build_manifest, read_range

    src = tmp_path / "src"
    src.mkdir()
    (src / DELTA_FILE).write_bytes(np.random.default_rng(0).bytes(40_000))
    m = build_manifest(src, "run", 2, piece_size=16 << 10)
    assert m.num_pieces == 3
    sd = sign_delta_manifest(TRAINER, _delta_manifest(piece_size=m.piece_size, files=m.files, hashes=m.hashes))
    store = DeltaStore(tmp_path / "deltas", "run", [TRAINER.peer_id])
    vs = store.open(sd)
    piece = lambda i: read_range(src, m, i * m.piece_size, m.piece_length(i))  # noqa: E731
    assert vs.put_piece(0, piece(0)) and not vs.put_piece(1, piece(2))  # a wrong piece is not kept
    vs.close()
    # a restart: a new store finds the delta by the version it builds and resumes it
    store = DeltaStore(tmp_path / "deltas", "run", [TRAINER.peer_id])
    assert store.find(b"\1" * 32).root == sd.root and store.find(bytes(32)) is None
    vs = store.open(sd)
    assert vs.verified == {0}
    for i in (1, 2):
        assert vs.put_piece(i, piece(i))
    vs.finish()
    vs.close()
    assert store.is_complete(2, 1) and store.open(sd).verified == {0, 1, 2}
    # the disk is not trusted blindly: a manifest that no longer verifies is not found
    (store.folder_of(2, 1) / ".shards" / "manifest").write_bytes(b"junk")
    assert store.saved(2, 1) is None and store.find(b"\1" * 32) is None
