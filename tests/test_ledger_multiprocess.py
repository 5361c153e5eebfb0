"""Ledger across real processes on loopback: concurrent appends, partition and heal, kill -9 mid-ingest.

Each child is ``python -c CHILD`` running one libp2p host plus the ledger service (the
``swarm-node`` runtime does not start the ledger yet), driven by JSON commands on stdin. A partition
is made inside the children: each drops its connections to the other group's peers and keeps
dropping them (py-libp2p's auto-connector would otherwise redial them from the peerstore).
Children are reaped even when a test fails.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.app.localswarm import Proc
from node.identity import Identity
from node.ledger.entries import GENESIS, RolloutsJudged, make_entry
from node.ledger.store import DB_FILE, open_ledger_store

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RUN = "mp-ledger"
SEEDS = [bytes([i + 1]) * 32 for i in range(6)]
IDS = [Identity.from_seed(s) for s in SEEDS]
TRAINER, VALIDATOR = IDS[0], IDS[1]
RUN_TABLE = {
    "name": RUN,
    "trainers": [TRAINER.peer_id],
    "validators": [VALIDATOR.peer_id],
    # The children write receipts by the hundred for a manifest no trainer published, to load
    # replication: lift the per-author receipt bounds (tests/test_sybil.py covers those).
    "tables": {"ledger": {"sync_interval": 0.5, "sync_batch": 256, "sync_timeout": 30.0,
                          "unvouched_receipts": 1_000_000, "receipts_burst": 1_000_000}},
}

CHILD = r"""
import json, sys, trio
from pathlib import Path
from node.config import NodeConfig, RunConfig
from node.context import NodeContext
from node.net.host import open_swarm_host
from node.app.localswarm import Proc
from node.identity import Identity
from node.ledger.entries import Penalty, ReceiptItem, Receipts, RolloutsJudged
from node.ledger.service import serve_ledger
from node.roles.sections import RunSections
from libp2p.peer.id import ID

args = json.loads(sys.argv[1])
ident = Identity.from_seed(bytes.fromhex(args["seed"]))
run = RunConfig(**args["run"])
others = args["others"]


def body(i):
    if ident.peer_id in run.trainers:
        return RolloutsJudged(worker=others[i % len(others)], step=i, accepted=True, samples=1 + i % 7,
                              tokens=10 * (1 + i % 7), batch_hash=i.to_bytes(32, "big"))
    if ident.peer_id in run.validators:
        return Penalty(peer=others[i % len(others)], reason="test", points=1)
    return Receipts(items=(ReceiptItem(peer=others[i % len(others)], manifest_id=b"m" * 32, nbytes=1000 + i, pieces=1),))


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main():
    data_dir = Path(args["data_dir"])
    config = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], data_dir=str(data_dir), run=run)
    async with open_swarm_host(ident, ["/ip4/127.0.0.1/tcp/0"]) as host:
        node = NodeContext(config, ident, host, data_dir)
        deny = set()

        async def partition_guard():
            while True:
                for p in host.connected_peers():
                    if p in deny:
                        try:
                            await host.disconnect(p)
                        except Exception:
                            pass
                await trio.sleep(0.02)

        async def append_loop(n, delay):
            for i in range(n):
                se = await svc.append(body(svc.ledger.head_of(ident.peer_id)))
                reply({"appended": se.seq})
                await trio.sleep(delay)

        async with trio.open_nursery() as nursery:
            sections = RunSections.of(run)
            svc = await nursery.start(serve_ledger, node, sections.ledger, sections.streams)
            nursery.start_soon(partition_guard)
            reply({"addr": host.listen_addrs()[0], "peer": ident.peer_id})
            while True:
                line = await trio.to_thread.run_sync(sys.stdin.readline)
                if not line:
                    break
                cmd = json.loads(line)
                op = cmd["op"]
                if op == "connect":
                    for addr in cmd["addrs"]:
                        try:
                            await host.connect(addr)
                        except Exception as e:
                            reply({"error": str(e)})
                    reply({"ok": True})
                elif op == "deny":
                    deny.update(cmd["peers"])
                    for p in cmd["peers"]:
                        try:
                            host.host.get_peerstore().clear_addrs(ID.from_base58(p))
                        except Exception:
                            pass
                    reply({"ok": True})
                elif op == "allow":
                    deny.clear()
                    reply({"ok": True})
                elif op == "append":
                    nursery.start_soon(append_loop, cmd["n"], cmd.get("delay", 0.0))
                    reply({"ok": True})
                elif op == "state":
                    reply({"digest": svc.digest().hex(), "entries": svc.stored_entries(),
                           "own": svc.ledger.head_of(ident.peer_id), "flagged": svc.ledger.flagged(),
                           "rejected": dict(svc.rejections), "connected": host.connected_peers()})
                elif op == "quit":
                    break
            nursery.cancel_scope.cancel()


trio.run(main)
"""


class Child:
    """One ledger node process, driven over stdin/stdout (node/app/localswarm.py's Proc talking)."""

    def __init__(self, tmp_path: Path, index: int) -> None:
        self.index = index
        self.data_dir = tmp_path / f"n{index}"
        self.data_dir.mkdir(exist_ok=True)
        others = [i.peer_id for j, i in enumerate(IDS[:5]) if j != index]
        arg = json.dumps({"seed": SEEDS[index].hex(), "run": RUN_TABLE, "data_dir": str(self.data_dir), "others": others})
        self.proc = Proc(f"node {index}", "", self.data_dir, [sys.executable, "-c", CHILD, arg])
        self.proc.spawn(tmp_path / f"n{index}.log", {"PYTHONPATH": str(ROOT)}, talk=True, cwd=ROOT)
        self.appended: list[int] = []  # own seqs whose append() returned (durable by then)
        hello = self.read(lambda m: "addr" in m, timeout=60)
        self.addr, self.peer = hello["addr"], hello["peer"]

    def read(self, want, timeout: float = 30.0) -> dict:
        return self.proc.read(lambda m: self._note(m) or want(m), timeout)

    def _note(self, msg: dict) -> bool:
        if "appended" in msg:
            self.appended.append(msg["appended"])
        return False

    def call(self, op: str, key: str = "ok", **kw) -> dict:
        self.proc.send({"op": op, **kw})
        return self.read(lambda m: key in m or "error" in m)

    def state(self) -> dict:
        return self.call("state", key="digest")

    def kill9(self) -> None:
        self.proc.kill(signal.SIGKILL, wait=10)
        try:  # replies it wrote before dying are still in the pipe
            self.read(lambda m: False, timeout=5)
        except RuntimeError:
            pass

    def stop(self) -> None:
        self.proc.stop(10, request={"op": "quit"})


@pytest.fixture
def children(tmp_path):
    started: list[Child] = []

    def start(index: int) -> Child:
        child = Child(tmp_path, index)
        started.append(child)
        return child

    yield start
    for c in started:
        c.stop()


def wait_until(predicate, timeout: float = 90.0, step: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise TimeoutError("condition not met")


def cli(*argv) -> subprocess.CompletedProcess:
    code = "import sys, argparse; from node.app.commands import ledger as cli; p = argparse.ArgumentParser(); cli.add_commands(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def drain(nodes, expect_each: dict[int, int]) -> None:
    """Let every node report its finished own appends."""
    for n in nodes:
        want = expect_each.get(n.index, 0)
        if len(n.appended) < want:
            n.read(lambda m, n=n, want=want: len(n.appended) >= want, timeout=120)


def test_five_nodes_concurrent_appends_partition_and_heal(children):
    nodes = [children(i) for i in range(5)]
    for n in nodes[1:]:
        n.call("connect", addrs=[nodes[0].addr, nodes[(n.index % 4) + 1].addr])
    # concurrent appends on all five
    for n in nodes:
        n.call("append", n=30, delay=0.01)
    drain(nodes, {n.index: 30 for n in nodes})
    wait_until(lambda: len({n.state()["digest"] for n in nodes}) == 1)
    assert {n.state()["entries"] for n in nodes} == {150}

    # partition {0,1} | {2,3,4}, keep appending on both sides
    a, b = nodes[:2], nodes[2:]
    for n in a:
        n.call("deny", peers=[m.peer for m in b])
    for n in b:
        n.call("deny", peers=[m.peer for m in a])
    wait_until(lambda: all(not set(n.state()["connected"]) & {m.peer for m in (b if n in a else a)} for n in nodes))
    for n in b:  # group b may have lost its links through group a: reconnect inside the group
        n.call("connect", addrs=[m.addr for m in b if m is not n])
    for n in nodes:
        n.call("append", n=20, delay=0.01)
    drain(nodes, {n.index: 50 for n in nodes})
    wait_until(lambda: len({n.state()["digest"] for n in a}) == 1 and len({n.state()["digest"] for n in b}) == 1)
    side_a, side_b = a[0].state(), b[0].state()
    assert side_a["digest"] != side_b["digest"]
    assert side_a["entries"] < 250 and side_b["entries"] < 250

    # heal
    for n in nodes:
        n.call("allow")
    nodes[2].call("connect", addrs=[nodes[0].addr])
    wait_until(lambda: len({n.state()["digest"] for n in nodes}) == 1)
    final = [n.state() for n in nodes]
    assert {s["entries"] for s in final} == {250}
    assert all(not s["flagged"] for s in final)
    assert all(not s["rejected"] for s in final), [s["rejected"] for s in final]


def big_history(data_dir: Path, n: int) -> None:
    """A trainer's log of n entries written straight into a node's database."""
    prev, entries = GENESIS, []
    for i in range(n):
        body = RolloutsJudged(worker=IDS[4].peer_id, step=i, accepted=True, samples=1, tokens=10,
                              batch_hash=i.to_bytes(32, "big"))
        se = make_entry(TRAINER, RUN, i + 1, prev, 1000 + i, body)
        entries.append(se)
        prev = se.hash
    data_dir.mkdir(parents=True, exist_ok=True)
    with open_ledger_store(data_dir) as store:
        store.bind_run(RUN)
        store.commit(entries, durable=True)


def db_count(data_dir: Path, author: str | None = None) -> int:
    db = sqlite3.connect(data_dir / DB_FILE)
    try:
        if author:
            return db.execute("SELECT count(*) FROM entries WHERE author=?", (author,)).fetchone()[0]
        return db.execute("SELECT count(*) FROM entries").fetchone()[0]
    finally:
        db.close()


def test_kill_minus_nine_mid_ingest_loses_nothing(children, tmp_path):
    total = 12_000
    big_history(tmp_path / "n0", total)
    seed = children(0)
    victim = children(3)
    victim.call("append", n=400, delay=0.002)  # its own entries, while it ingests the history
    victim.call("connect", addrs=[seed.addr])
    def mid_ingest():
        s = victim.state()
        return s if 2000 < s["entries"] < total else None

    seen = wait_until(mid_ingest, timeout=120, step=0.05)
    victim.kill9()
    own_acknowledged = max(victim.appended, default=0)
    stored = db_count(victim.data_dir)
    assert stored >= seen["entries"]  # nothing the node had taken in is lost
    assert db_count(victim.data_dir, victim.peer) >= own_acknowledged  # every acknowledged own append
    check = cli("ledger", "verify", "--data-dir", str(victim.data_dir))
    assert check.returncode == 0, check.stdout + check.stderr
    # restart: it resumes from its tail and catches up
    victim = children(3)
    victim.call("connect", addrs=[seed.addr])
    wait_until(lambda: victim.state()["digest"] == seed.state()["digest"], timeout=180)
    assert victim.state()["own"] >= own_acknowledged
    check = cli("ledger", "verify", "--data-dir", str(victim.data_dir))
    assert check.returncode == 0, check.stdout + check.stderr


def test_swarm_node_processes_replicate_the_ledger(tmp_path):
    """Real `swarm-node --role relay` processes (the ledger is a core service): a node holding a
    trainer's history spreads it to nodes that join later; one is killed with -9 mid-ingest and
    restarted; all end with the same digest and `ledger verify` passes everywhere."""
    from node.identity import load_or_create_identity
    from node.app.localswarm import LocalSwarm

    total = 6000
    with LocalSwarm(tmp_path / "swarm", log_level="warning") as swarm:
        holder_id = load_or_create_identity(swarm.root / "holder")[0]
        swarm.write_run_file(
            # Small batches: a newcomer takes ~240 round trips, so a status file (written each
            # second) shows it part-way through. With 100 a sync could finish between two writes.
            f'[run]\nname = "{RUN}"\ntrainers = ["{holder_id.peer_id}"]\n\n[ledger]\nsync_interval = 0.5\n'
            "sync_batch = 25\n"
        )
        history = []
        prev = GENESIS
        for i in range(total):
            body = RolloutsJudged(worker=IDS[4].peer_id, step=i, accepted=True, samples=2, tokens=20,
                                  batch_hash=i.to_bytes(32, "big"))
            se = make_entry(holder_id, RUN, i + 1, prev, 1000 + i, body)
            history.append(se)
            prev = se.hash
        with open_ledger_store(swarm.root / "holder") as store:
            store.bind_run(RUN)
            store.commit(history, durable=True)

        swarm.start("relay", "relay")
        swarm.start("holder", "relay")
        swarm.start("late-1", "relay")
        swarm.start("late-2", "relay")
        names = ["relay", "holder", "late-1", "late-2"]

        def ledger_status(name):
            return swarm.status(name).get("ledger", {})

        # kill late-2 once it is part-way through the history, then restart it
        def explain() -> str:
            return "\n".join(f"{n}: {ledger_status(n)}\n{swarm.tail(n, 15)}" for n in names)

        swarm.wait_until(lambda: 0 < ledger_status("late-2").get("entries", 0) < total, 120, poll=0.05, explain=explain)
        swarm.kill("late-2", signal.SIGKILL)
        check = cli("ledger", "verify", "--data-dir", str(swarm.root / "late-2"))
        assert check.returncode == 0, check.stdout + check.stderr
        swarm.restart("late-2")

        swarm.wait_until(lambda: all(ledger_status(n).get("entries") == total for n in names), 240, explain=explain)
        digests = {ledger_status(n)["digest"] for n in names}
        assert len(digests) == 1
        for n in names:
            assert not ledger_status(n)["rejected"], (n, ledger_status(n)["rejected"])
    for n in names:  # after a clean stop: full digest and a full re-verification of every database
        out = cli("ledger", "--json", "--data-dir", str(swarm.root / n))
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert data["entries"] == total
        assert data["totals"][IDS[4].peer_id]["rollouts_accepted"] == 2 * total
        check = cli("ledger", "verify", "--data-dir", str(swarm.root / n))
        assert check.returncode == 0 and "OK" in check.stdout, check.stdout + check.stderr
