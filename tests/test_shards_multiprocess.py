"""Real processes on loopback: a seeder, 2 relays and 4 downloaders fetch a 64 MiB checkpoint.

The seeder's upload is capped (4 MiB/s) so the download takes ~16 s. The downloader that first
gets halfway is killed with SIGKILL and restarted: it must resume from its verified log and fetch
only what it had not verified. The seeder is killed with SIGKILL as soon as every piece has left it
(the union of the others' verified logs covers the checkpoint); with super-seeding the others trail
it closely, so they hold most pieces by then, and they must complete from each other.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from node.app.localswarm import Proc
from node.identity import Identity
from node.shards.store import read_verified_log
from node.shards.testing import same_files, write_checkpoint

pytestmark = pytest.mark.slow

MiB = 1 << 20
SIZE = 64 * MiB
PIECES = SIZE // MiB
TRAINER_SEED = "11" * 32
REPO = Path(__file__).resolve().parents[1]
PHASE_SECONDS = 90


class Child:
    """One shards node process (node/shards/testing.py's main): a JSON line on stdout when it listens
    and when it completes; node/app/localswarm.py's Proc runs it."""

    def __init__(self, name: str, tmp: Path, role: str, connect: list[str], *, publish: Path | None = None,
                 shards: dict | None = None, seed: str | None = None, extra: list[str] = ()) -> None:
        self.name, self.data = name, tmp / name
        self.seed = seed or os.urandom(32).hex()
        cmd = [sys.executable, "-m", "node.shards.testing", "--data-dir", str(self.data), "--seed", self.seed,
               "--trainer-seed", TRAINER_SEED, "--role", role, "--shards",
               json.dumps({"announce_interval": 1.0, "progress": False, **(shards or {})}), "--connect", *connect]
        if publish is not None:
            cmd += ["--publish", str(publish)]
        cmd += list(extra)
        self.proc = Proc(name, role, self.data, cmd)
        self.proc.spawn(tmp / f"{name}.err", talk=True, cwd=REPO)
        hello = self.proc.read(lambda m: True, 30)
        self.addr, self.resumed = hello["addr"], hello["resumed"]
        self.complete: dict | None = None

    def poll_complete(self) -> bool:
        while self.complete is None and (msg := self.proc.next_message(0)) is not None:
            if "complete" in msg:
                self.complete = msg
        return self.complete is not None

    def verified(self) -> set[int]:
        folder = self.data / "checkpoints" / "1"
        try:
            root = (folder / ".shards" / "verified").read_bytes()[:32]
        except OSError:
            return set()
        return read_verified_log(folder, root, PIECES)

    def log_tail(self, lines: int = 30) -> str:
        return self.proc.tail(lines)

    def kill9(self) -> None:
        self.proc.kill(signal.SIGKILL, wait=10)

    def stop(self) -> None:
        self.proc.stop(5)


def test_seven_processes_kill_seeder_and_resume_downloader(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "ckpt", SIZE, seed=9)
    assert Identity.from_seed(bytes.fromhex(TRAINER_SEED))  # the seeder's key is the run's trainer
    children: list[Child] = []
    try:
        relays, downloaders = [], []
        for name, role, group in [("relay0", "relay", relays), ("relay1", "relay", relays)] + [
            (f"dl{k}", "inference", downloaders) for k in range(4)
        ]:
            group.append(Child(name, tmp_path, role, [c.addr for c in children]))
            children.append(group[-1])
        # The seeder comes last, dials everyone, and publishes once gossip meshes have formed.
        seeder = Child("seeder", tmp_path, "trainer", [c.addr for c in children], publish=src,
                       shards={"upload_rate": 4 * MiB, "piece_size": MiB}, seed=TRAINER_SEED,
                       extra=["--publish-delay", "2"])
        children.append(seeder)
        others = relays + downloaders
        # Each phase has its own budget, so a slow phase on a loaded CI machine does not eat the
        # next one's (each takes ~8 s on an idle machine).
        deadline = time.monotonic() + PHASE_SECONDS
        # 1. A downloader halfway through is killed with SIGKILL and restarted at once.
        while not any(len(c.verified()) >= PIECES // 2 for c in downloaders):
            assert time.monotonic() < deadline, "no downloader got halfway"
            time.sleep(0.1)
        victim = max(downloaders, key=lambda c: len(c.verified()))
        victim.kill9()
        had = victim.verified()
        restarted = Child(victim.name, tmp_path, "inference", [c.addr for c in children if c is not victim],
                          seed=victim.seed)
        children.append(restarted)
        resumed = restarted.resumed.get("1", restarted.resumed.get(1, 0))
        assert resumed >= len(had), f"resumed {resumed} pieces, its log had {len(had)}"
        others = [c for c in others if c is not victim] + [restarted]
        deadline = time.monotonic() + PHASE_SECONDS
        # 2. Once every piece has left the seeder, the seeder is killed with SIGKILL.
        while True:
            union = set().union(*(c.verified() for c in others))
            if len(union) == PIECES:
                break
            assert time.monotonic() < deadline, f"only {len(union)} pieces left the seeder"
            time.sleep(0.1)
        seeder.kill9()
        progress = {c.name: len(c.verified()) for c in others}
        deadline = time.monotonic() + PHASE_SECONDS
        # 3. Everyone completes from the others, byte-identical.
        for c in others:
            while not c.poll_complete():
                assert time.monotonic() < deadline, (
                    f"{c.name} incomplete: {len(c.verified())}/{PIECES}; held when the seeder died: "
                    f"{progress}; its log ends:\n{c.log_tail()}")
                time.sleep(0.2)
        for c in others:
            assert same_files(src, c.data / "checkpoints" / "1"), c.name
        refetched = PIECES - resumed
        print(f"\n{victim.name} killed with {len(had)}/{PIECES} verified, resumed {resumed}, fetched {refetched} "
              f"after restart; seeder killed with pieces held {progress}")
        # Nothing it had verified before the kill was fetched again (all pieces are 1 MiB here).
        assert sum(restarted.complete["receipts"].values()) == refetched * MiB
    finally:
        for c in children:
            c.stop()
