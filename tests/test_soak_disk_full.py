"""A node whose disk fills up keeps running and gets back to work once there is room again
(bench/soak.py's disk-full event: an inference node died of ``sqlite3.OperationalError: database or
disk is full`` in its ledger store's commit when its data dir's tmpfs filled)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from node.app.demo import TINY_TASK, node_env
from node.app.localswarm import LocalSwarm
from node.ledger.api import LedgerError
from test_ledger_sync import TRAINER, WORKER, connect, ledger, open_ledger_node, rollouts
from waiting import wait_for

DISK_MB = 64
UNLIMITED_PAGES = 1073741823  # SQLite's largest max_page_count


async def test_a_full_disk_keeps_gossiped_entries_in_memory_and_stores_them_once_there_is_room(tmp_path):
    async with open_ledger_node(tmp_path, "t", TRAINER) as t, open_ledger_node(tmp_path, "w", WORKER) as w:
        await connect(t, w)
        await ledger(t).append(rollouts(1))
        await wait_for(lambda: ledger(w).digest() == ledger(t).digest())
        # The worker's database may not grow by a page: SQLite answers SQLITE_FULL, as on a full disk.
        db = ledger(w).store._db
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        for i in range(40):
            await ledger(t).append(rollouts(i + 2))
        await wait_for(lambda: ledger(w).digest() == ledger(t).digest())  # its replica follows in memory
        assert w.status["ledger"]()["entries"] < 41
        with pytest.raises(LedgerError, match="disk is full"):  # its own entries are refused, not lost silently
            ledger(w).note_received(TRAINER.peer_id, b"m" * 32, 5000)
            await ledger(w).flush_receipts()
        db.execute(f"PRAGMA max_page_count = {UNLIMITED_PAGES}")
        await ledger(t).append(rollouts(99))
        await wait_for(lambda: w.status["ledger"]()["entries"] == 42)
    async with open_ledger_node(tmp_path, "w", WORKER) as w:
        assert len(ledger(w).ledger) == 42  # all of it on disk


def fill(folder: Path) -> None:
    """A ballast file as large as ``folder``'s file system lets it be (bounded by DISK_MB)."""
    with open(folder / "ballast", "wb") as f:
        for _ in range(DISK_MB + 1):
            try:
                f.write(b"\0" * (1 << 20))
                f.flush()
            except OSError:
                return


@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root (a small tmpfs as the worker's data dir)")
    where = tmp_path / "worker"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(where)], check=True)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_version_whose_store_cannot_be_created_on_a_full_disk_leaves_no_descriptor_open(tmp_path, tmpfs):
    """The soak's inference-4 kept 10-50 descriptors more after each disk-full event, never given
    back: each version announced meanwhile opened its files, failed to save its manifest
    (ENOSPC), and the half-made store was dropped with its files still open."""
    from node.identity import Identity
    from node.shards.manifest import build_manifest, sign_manifest
    from node.shards.store import PieceStore
    from node.shards.testing import write_checkpoint

    trainer = Identity.from_seed(b"t" * 32)
    signed = sign_manifest(trainer, build_manifest(write_checkpoint(tmp_path / "ckpt", 300_000, files=4), "run", 1))
    store = PieceStore(tmpfs / "checkpoints", "run", [trainer.peer_id])
    fail_on_a_full_disk_with_no_descriptor_left_open(tmpfs, lambda: store.open_version(signed))


def fail_on_a_full_disk_with_no_descriptor_left_open(tmpfs: Path, *makes) -> None:
    """Each of ``makes`` (making a store) fails three times on the full disk ``tmpfs`` and leaves
    the process's descriptors as they were; once there is room again each makes its store as before."""
    fill(tmpfs)
    held = open_files()
    for _ in range(3):
        for make in makes:
            with pytest.raises(OSError):
                make()
    assert open_files() == held
    (tmpfs / "ballast").unlink()
    for make in makes:
        make().close()


def signed_delta(trainer, folder: Path, base_root: bytes):
    """The signed delta manifest of the files in ``folder`` (v1 -> v2)."""
    from node.shards.manifest import DeltaManifest, build_manifest, sign_delta_manifest

    m = build_manifest(folder, "run", 2)
    return sign_delta_manifest(trainer, DeltaManifest(run="run", version=2, base_version=1, base_root=base_root,
                                                      target_root=b"\1" * 32, piece_size=m.piece_size,
                                                      files=m.files, hashes=m.hashes))


def test_a_version_that_cannot_finish_on_a_full_disk_closes_only_its_own_descriptors(tmp_path, tmpfs):
    """finish() closes the ``verified`` log to rewrite it; on a full disk the rewrite fails, and the
    store kept the closed number: its close() then closed whatever file the process had opened
    under that number since (a socket, the ledger's database)."""
    from node.identity import Identity
    from node.shards.manifest import build_manifest, sign_manifest
    from node.shards.store import PieceStore
    from node.shards.testing import write_checkpoint

    trainer = Identity.from_seed(b"t" * 32)
    ckpt = write_checkpoint(tmp_path / "ckpt", 300_000, files=4)
    signed = sign_manifest(trainer, build_manifest(ckpt, "run", 1))
    vs = PieceStore(tmpfs / "checkpoints", "run", [trainer.peer_id]).open_version(signed)
    data = b"".join((ckpt / f.name).read_bytes() for f in signed.manifest.files)
    size = signed.manifest.piece_size
    for i in range(signed.manifest.num_pieces):
        assert vs.put_piece(i, data[i * size : (i + 1) * size])
    fill(tmpfs)
    held = open_files()
    with pytest.raises(OSError):
        vs.finish()
    freed = [int(fd) for fd in held.keys() - open_files().keys()]
    assert freed  # the log's descriptor
    other = os.open(os.devnull, os.O_RDONLY)
    for fd in set(freed) - {other}:
        os.dup2(other, fd)  # another file of the process, under the number the log had
    vs.close()
    kept = {fd for fd in {other, *freed} if os.path.lexists(f"/proc/self/fd/{fd}")}
    for fd in kept:
        os.close(fd)
    assert kept == {other, *freed}, "the store's close() closed a descriptor that was no longer its own"


def test_a_delta_whose_store_cannot_be_created_on_a_full_disk_leaves_no_descriptor_open(tmp_path, tmpfs):
    """A delta is stored like a version, and its store was made by a copy of open_version without
    the close: each delta offered during a disk-full event left its file open (ENOSPC saving its manifest)."""
    from node.identity import Identity
    from node.shards.deltasync import DELTA_FILE, DeltaStore

    trainer = Identity.from_seed(b"t" * 32)
    src = tmp_path / "delta"
    src.mkdir()
    (src / DELTA_FILE).write_bytes(os.urandom(300_000))
    sd = signed_delta(trainer, src, bytes(32))
    store = DeltaStore(tmpfs / "deltas", "run", [trainer.peer_id])
    fail_on_a_full_disk_with_no_descriptor_left_open(tmpfs, lambda: store.open(sd))


def test_a_version_that_cannot_be_adopted_on_a_full_disk_leaves_no_descriptor_open(tmp_path, tmpfs):
    """The publisher's side (a version written into its folder, a delta encoded into its own):
    adopting them opens their files, then saves the manifest and finishes, which fail on a full disk."""
    from node.identity import Identity
    from node.shards.deltasync import DeltaStore
    from node.shards.manifest import build_manifest, sign_manifest
    from node.shards.store import PieceStore
    from node.shards.testing import write_checkpoint

    trainer = Identity.from_seed(b"t" * 32)
    store = PieceStore(tmpfs / "checkpoints", "run", [trainer.peer_id])
    folder = write_checkpoint(store.folder_of(1), 300_000, files=4)  # the trainer saved it in place
    signed = sign_manifest(trainer, build_manifest(folder, "run", 1))
    deltas = DeltaStore(tmpfs / "deltas", "run", [trainer.peer_id])
    sd = signed_delta(trainer, write_checkpoint(deltas.folder_of(2, 1), 300_000, files=2), signed.root)
    fail_on_a_full_disk_with_no_descriptor_left_open(tmpfs, lambda: store.import_folder(folder, signed),
                                                     lambda: deltas.add_complete(sd))


def open_files() -> dict[str, str]:
    """This process's descriptors and what each is open on."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            pass
    return out


def acked(sw: LocalSwarm) -> int:
    return ((sw.status("worker").get("inference") or {}).get("batches") or {}).get("accepted", 0)


@pytest.mark.slow
def test_a_worker_with_a_full_disk_stays_up_and_works_again_when_space_is_back(tmp_path, tmpfs):
    logs = tmp_path / "logs"
    logs.mkdir()
    with LocalSwarm(tmp_path, log_dir=logs, extra_env=node_env(1)) as sw:
        sw.write_run_file(f'[run]\nname = "disk"\ntrainers = ["{sw.peer_id("trainer")}"]\n\n{TINY_TASK}')
        sw.start("relay", "relay")
        sw.start("trainer", "trainer")
        sw.start("worker", "inference")
        explain = lambda: sw.tail("worker") + "\n" + sw.tail("trainer")  # noqa: E731
        sw.wait_until(lambda: acked(sw) >= 1, timeout=300, explain=explain)
        fill(tmpfs)
        step = (sw.status("trainer").get("trainer") or {}).get("step") or 0
        # Two new versions published while the disk is full: the worker tries to fetch them.
        sw.wait_until(lambda: ((sw.status("trainer").get("trainer") or {}).get("step") or 0) >= step + 2,
                      timeout=300, explain=explain)
        sw.wait_until(lambda: (sw.status("worker").get("shards") or {}).get("held") is not None, timeout=60)
        assert sw.procs["worker"].alive(), sw.tail("worker", 80)
        (tmpfs / "ballast").unlink()
        before = acked(sw)
        sw.wait_until(lambda: acked(sw) > before, timeout=300, explain=explain)
        assert sw.procs["worker"].alive(), sw.tail("worker", 80)
