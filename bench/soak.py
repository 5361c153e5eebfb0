"""An hour of churn, partitions and crashes (issue 45): nothing acked is lost, nothing leaks, the run learns.

    .venv/bin/python bench/soak.py [--minutes 30] [--seed 1] [--keep DIR] [--quick]

Two relays, a trainer, two validators and four inference nodes run as real ``swarm-node`` processes
on the embedded tiny model and the demo's task (node/app/demo.py's run file, with two validators),
through node/app/localswarm.py. As root each node runs in its own network namespace on one bridge
(tests/netns.py: a 1 Gbit/s cap, fixed address and port, so a restarted node is where it was), which
is what makes partitions real: an nftables rule on the bridge drops every frame between the cut-off
nodes and the rest, and deleting it heals. Without root the nodes run on loopback and the schedule
has no partitions (printed). One node's data dir is a small tmpfs (as root), for the disk-full event.

Every 30-90 s (seeded: bench/soaklib.py ``make_schedule``, printed first) one fault: kill -9 and
restart of a node of every role (the trainer included), SIGTERM and restart, a partition of one
node or of two for 30-120 s, a relay gone for good and a new one joining, a validator SIGSTOPped
for 60 s, a node's disk full for 45 s, a new inference node joining late with nothing, and a burst
of hostile traffic at the trainer from tests/hostile.py's peer (16 silent rollout streams, oversized
frames, garbage on the members topic). Every ``SAMPLE_S`` it samples each node: RSS, open file
descriptors, threads, its SQLite files, its status (step, acks, verdicts, ledger digest) and the
trainer's spool rows.

At the end the trainer is stopped first (nothing new enters the ledger) and the time until every other
replica's digest is equal is taken. Printed, per node and for the run: acked batches (summed over
each worker's processes) against what the trainer's spool did with them (trained, rejected,
expired, pending; ``lost`` is acked but in no state), the recovery time of each fault (until the
node's own progress counter moves: trainer step, acked batches, verdicts, relay connections),
RSS / fds / threads / SQLite size with their slope after warm-up, steps per minute and the reward
of the first and last 10 steps, every ERROR and traceback of the node logs by kind. A PNG of memory
and steps over time, the raw samples (samples.jsonl) and the node logs (logs/) go to the run's folder.

The baseline is the fault-free swarm: the rate of the first ``FIRST_EVENT_S`` seconds (steps per
minute) against the rest of the run, printed as a ratio last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from loop import set_run_values  # noqa: E402  (bench/, the script's own folder)
from quick import parse_args  # noqa: E402
from soaklib import (  # noqa: E402
    DISK_FULL, FIRST_EVENT_S, HOSTILE, KILL9, LATE_JOIN, PARTITION, PARTITION_GROUP, RELAY_REPLACE, SIGTERM,
    SILENCE, AckTally, SpoolRow, account, count_errors, make_schedule, overlaps, recovery_s, replication_lag,
    role_of, slope_per_hour,
)
from node.app.demo import DEMO_THREADS, demo_run_text, node_env  # noqa: E402
from node.app.localswarm import LocalSwarm, Proc  # noqa: E402
from node.app.loopfigures import reward_ratio  # noqa: E402
from node.status_files import NODE_FILE  # noqa: E402

START_NODES = ["relay-1", "relay-2", "trainer", "validator-1", "validator-2",
               "inference-1", "inference-2", "inference-3", "inference-4"]
DISK_NODE = "inference-4"  # its data dir is a tmpfs of DISK_MB (as root)
DISK_MB = 512
PORT = 4001  # every node's port, on its namespace's own address
MBIT = 1000  # each namespace's upload cap: not the bottleneck, a real link all the same
SAMPLE_S = 5.0  # seconds between two samples of every node
WARMUP_S = 300.0  # resource slopes are fitted after this much of a process's life (less in short runs)
RESOURCES = ("rss_mb", "fds", "threads", "tasks", "sqlite_mb")  # sampled per process; slopes fitted
STOP_WAIT_S = 30.0  # a node that has not exited this long after SIGTERM is a finding, then killed
LAG_GRACE_S = 60.0  # the bound: every replica holds the trainer's chain this long after the last heal
DIGEST_WAIT_S = 120.0  # how long the end waits for the replicas' digests to agree
BRIDGE_IP = "10.77.0.254"  # this process's address on the bridge (the hostile peer dials from it)


def run_text(swarm: LocalSwarm) -> str:
    """The demo's run file with both validators."""
    text = demo_run_text(swarm.peer_id("trainer"), swarm.peer_id("validator-1"))
    both = json.dumps([swarm.peer_id("validator-1"), swarm.peer_id("validator-2")])
    return set_run_values(text, {"run.validators": both})


class SoakSwarm(LocalSwarm):
    """LocalSwarm whose nodes each run in a namespace of ``nets`` (None: on loopback, any port), each
    started with the relays alive at that moment as its bootstrap peers."""

    def __init__(self, root: Path, nets, **kw) -> None:
        super().__init__(root, **kw)
        self.nets = nets
        self.slot: dict[str, int] = {}  # node -> namespace index
        self.gone: set[str] = set()  # relays gone for good
        self.bootstrap_addr = ""  # not LocalSwarm's one bootstrap peer: each start gets the live relays

    def addr_of(self, name: str) -> str:
        if self.nets is None:
            return self.addr(name)
        return f"/ip4/{self.nets.ip(self.slot[name])}/tcp/{PORT}/p2p/{self.peer_id(name)}"

    def relays(self, but: str = "") -> list[str]:
        """Addresses of the relays not gone for good (on loopback: those running and ready)."""
        names = [n for n, p in self.procs.items() if p.role == "relay" and n not in self.gone and n != but]
        if self.nets is not None:
            return [self.addr_of(n) for n in names]
        return [self.addr(n) for n in names if self.procs[n].alive() and (self.procs[n].data_dir / NODE_FILE).exists()]

    def launch(self, name: str) -> Proc:
        """Start ``name`` (its role from its name), bootstrapped from the live relays."""
        if self.nets is not None:
            self.slot[name] = len(self.slot)
        listen = f"/ip4/{self.nets.ip(self.slot[name])}/tcp/{PORT}" if self.nets else "/ip4/127.0.0.1/tcp/0"
        boot = self.relays(but=name)
        return self.start(name, role_of(name), "--listen", listen, *(["--bootstrap", *boot] if boot else []),
                          bootstrap=False, wait=0)

    def _spawn(self, proc: Proc) -> None:
        args = proc.args
        if "--bootstrap" in args:  # a restart joins through the relays alive now
            args = args[:args.index("--bootstrap")]
        boot = self.relays(but=proc.name)
        args = args + (["--bootstrap", *boot] if boot else [])
        if self.nets is not None and args[0] != "ip":
            args = ["ip", "netns", "exec", self.nets.names[self.slot[proc.name]], *args]
        proc.args = args
        super()._spawn(proc)


# ---------------------------------------------------------------------------------- faults


class Partitions:
    """Cuts between groups of namespaces: one nftables bridge table, a chain per cut (named after its
    first node), deleted to heal."""

    TABLE = "soakcut"

    def __init__(self, swarm: SoakSwarm) -> None:
        self.swarm = swarm
        subprocess.run(["nft", "delete", "table", "bridge", self.TABLE], capture_output=True)
        _nft(f"add table bridge {self.TABLE}")

    def cut(self, names: tuple[str, ...]) -> None:
        ports = ", ".join(f'"{self.swarm.nets.names[self.swarm.slot[n]]}b"' for n in names)
        chain = f"cut_{names[0].replace('-', '_')}"
        _nft(f"add chain bridge {self.TABLE} {chain} {{ type filter hook forward priority 0; policy accept; }}")
        _nft(f"add rule bridge {self.TABLE} {chain} iifname {{ {ports} }} oifname != {{ {ports} }} drop")
        _nft(f"add rule bridge {self.TABLE} {chain} oifname {{ {ports} }} iifname != {{ {ports} }} drop")

    def heal(self, names: tuple[str, ...]) -> None:
        _nft(f"delete chain bridge {self.TABLE} cut_{names[0].replace('-', '_')}")

    def close(self) -> None:
        subprocess.run(["nft", "delete", "table", "bridge", self.TABLE], capture_output=True)


def _nft(command: str) -> None:
    subprocess.run(["nft", command], check=True, capture_output=True, text=True)


def fill_disk(data_dir: Path) -> int:
    """Fill the file system of ``data_dir`` with a ballast file (allocated at once: writing 512 MB held
    up the sampler for 50 s on a busy machine); its size in bytes."""
    st = os.statvfs(data_dir)
    free = st.f_bavail * st.f_frsize
    fd = os.open(data_dir / "ballast", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, free)
    except OSError:
        pass
    finally:
        os.close(fd)
    return os.path.getsize(data_dir / "ballast")


def hostile_burst(target: str, run_name: str, seconds: float) -> dict:
    """tests/hostile.py's peer at ``target`` (a multiaddr) for ``seconds``: 16 silent rollout streams,
    20 frames announcing 1 GiB, garbage on the members topic. What it saw, for the report."""
    import logging

    import trio

    from hostile import frame, open_hostile

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # the attacker's own dial errors are no finding
    from node.rollouts.schema import ROLLOUTS_PROTOCOL

    seen = {"connected": False, "raw_answers": 0}

    async def burst() -> None:
        async with open_hostile() as mallory:
            with trio.move_on_after(seconds):
                peer = await mallory.connect(target)
                seen["connected"] = True
                mallory.hold_streams(peer, ROLLOUTS_PROTOCOL, 16, payload=b"\0\0")
                async with trio.open_nursery() as n:
                    async def raw() -> None:
                        if await mallory.send_raw(peer, ROLLOUTS_PROTOCOL, frame(1 << 30, b"junk")):
                            seen["raw_answers"] += 1
                    for _ in range(20):
                        n.start_soon(raw)
                    await mallory.publish_raw(f"/swarm/{run_name}/members/1", [os.urandom(200) for _ in range(60)])
            seen["failed_streams"] = mallory.failed

    try:
        trio.run(burst)
    except Exception as e:  # noqa: BLE001 — the attacker's own failures are part of what it saw
        seen["error"] = f"{type(e).__name__}: {e}"[:200]
    return seen


# ---------------------------------------------------------------------------------- sampling


def proc_figures(pid: int) -> dict | None:
    """RSS (MB), threads and open fds of a live process, from /proc."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (OSError, KeyError, ValueError):
        return None


def sqlite_mb(data_dir: Path) -> float:
    """The node's SQLite files in MB. A running node deletes folders meanwhile (an old checkpoint
    version), so the walk skips what vanished under it rather than failing the sample."""
    total = 0
    for root, _dirs, files in os.walk(data_dir, onerror=lambda e: None):
        for name in files:
            if ".sqlite" in name:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except OSError:
                    pass
    return total / 1e6


def progress(role: str, status: dict) -> float:
    """A node's own progress counter: what moves when it does its work."""
    if role == "trainer":
        return float((status.get("trainer") or {}).get("step") or 0)
    if role == "inference":
        return float(((status.get("inference") or {}).get("batches") or {}).get("accepted", 0))
    if role == "validator":
        v = (status.get("validator") or {}).get("verdicts") or {}
        return float(v.get("accepted", 0) + v.get("rejected", 0))
    return float((status.get("membership") or {}).get("connections") or 0)  # a relay: the peers it holds


SINCE = {"trainer": "since_step_s", "validator": "since_verdict_s", "inference": "since_ack_s"}  # health.progress


def last_progress_ago(role: str, status: dict, now: float) -> float | None:
    """Seconds before ``now`` (wall clock) that the node last moved its progress counter, by its own
    status (None where it does not say: a relay, or nothing done yet)."""
    since = ((status.get("health") or {}).get("progress") or {}).get(SINCE.get(role, ""))
    written = status.get("time")
    if since is None or written is None:
        return None
    return since + max(0.0, now - written)


def read_only(path: Path, sql: str, params: tuple = (), timeout: float = 5.0) -> list[tuple] | None:
    """The rows of ``sql`` in the SQLite file ``path`` opened read-only (safe while its node runs);
    None when it cannot be read now."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout)
        try:
            return db.execute(sql, params).fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return None


def spool_rows(path: Path) -> dict[bytes, SpoolRow]:
    """The trainer spool's batch rows; {} when it cannot be read now."""
    rows = read_only(path, "SELECT batch_id, worker, state, reason, accepted_step FROM batches", timeout=2.0)
    return {bytes(b): SpoolRow(w, s, r, a is not None) for b, w, s, r, a in rows or ()}


def ledger_head(data_dir: Path, author: str) -> int | None:
    """``author``'s last seq in the node's stored ledger (once the node stopped)."""
    rows = read_only(data_dir / "ledger.sqlite", "SELECT max(seq) FROM entries WHERE author = ?", (author,))
    return rows[0][0] if rows else None


def trainer_steps(path: Path) -> list[tuple[int, float]]:
    return read_only(path, "SELECT step, mean_reward FROM steps ORDER BY step") or []


class Soak:
    """One soak run: the swarm, its schedule, the samples; :meth:`run` then :meth:`report`."""

    def __init__(self, root: Path, minutes: float, seed: int, nets, schedule: list) -> None:
        self.root, self.seconds, self.seed = root, minutes * 60.0, seed
        (root / "logs").mkdir(parents=True, exist_ok=True)  # not in the data dirs: one of them fills up
        self.swarm = SoakSwarm(root, nets, log_level="info", extra_env=node_env(DEMO_THREADS), log_dir=root / "logs")
        self.cuts = Partitions(self.swarm) if nets is not None else None
        self.disk = nets is not None  # a tmpfs needs root, as the namespaces do
        self.schedule = schedule
        self.samples: list[dict] = []
        # node -> (t, pid, progress, when its status says it last moved: soaklib.recovery_s)
        self.series: dict[str, list[tuple[float, int, float, float | None]]] = defaultdict(list)
        # worker -> the same for the submissions a trainer answered (the batch reached it): "first sent"
        self.answers: dict[str, list[tuple[float, int, float, float | None]]] = defaultdict(list)
        self.acks = AckTally()
        self.rows: dict[bytes, SpoolRow] = {}
        self.results: list[dict] = []  # one per event: what was done, when it was back
        self.findings: list[str] = []  # what went wrong that the schedule did not inject
        self.starting: dict[str, int] = {}  # node -> pid of a process started but not yet ready
        self.ready_at: dict[int, float] = {}  # pid -> when its node.json appeared (it listens, its services run)
        self.t0 = 0.0
        self.out = open(root / "samples.jsonl", "w")

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- the run -------------------------------------------------------------------------------

    def start(self) -> None:
        sw = self.swarm
        sw.root.mkdir(parents=True, exist_ok=True)
        if self.disk:
            (sw.root / DISK_NODE).mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(sw.root / DISK_NODE)], check=True)
        sw.write_run_file(run_text(sw))
        # Relays first, each ready before the next starts: on loopback a relay's address (its port)
        # is known only once it is up, and every later node bootstraps from the relays up by then.
        relays = [n for n in START_NODES if role_of(n) == "relay"]
        for name in relays:
            sw.launch(name)
            sw.wait_ready(name, 180.0)
        rest = [n for n in START_NODES if n not in relays]
        for name in rest:
            sw.launch(name)
        for name in rest:
            sw.wait_ready(name, 180.0)

    def run(self) -> None:
        self.t0 = time.monotonic()
        due: list[tuple[float, str, object]] = [(e.at, "begin", e) for e in self.schedule]
        next_sample = 0.0
        while self.now() < self.seconds:  # bounded by --minutes
            due.sort(key=lambda d: d[0])
            while due and due[0][0] <= self.now():
                _, what, event = due.pop(0)
                if what == "begin":
                    end = self.begin(event)
                    if end is not None:
                        due.append((self.now() + event.hold, "end", (event, end)))
                else:
                    self.end(*event)
            if self.now() >= next_sample:
                self.sample()
                next_sample = self.now() + SAMPLE_S
            self.watch_starting()
            time.sleep(0.2)

    def begin(self, event) -> dict | None:
        """Inject ``event``; the record to finish when its hold ends (None: nothing to finish)."""
        sw, (name, *rest) = self.swarm, event.targets
        rec = {"event": event.describe(), "kind": event.kind, "node": name, "targets": list(event.targets),
               "at": round(self.now(), 1)}
        self.results.append(rec)
        print(f"  [{self.now():6.0f}s] {event.describe()}", flush=True)
        if event.kind in (KILL9, SIGTERM):
            pid = sw.procs[name].pid
            if event.kind == SIGTERM:
                rec["stop_s"] = self.stop(name)
            else:
                sw.kill(name, signal.SIGKILL)
            sw.restart(name, wait=0)
            self.started(name)
            rec.update(pid_before=pid, pid_after=sw.procs[name].pid, back_at=self.now())
            return None
        if event.kind in (PARTITION, PARTITION_GROUP):
            self.cuts.cut(event.targets)
            rec.update(pid_before=sw.procs[name].pid)
            return rec
        if event.kind == SILENCE:
            os.kill(sw.procs[name].pid, signal.SIGSTOP)
            rec.update(pid_before=sw.procs[name].pid)
            return rec
        if event.kind == DISK_FULL:
            rec["ballast_mb"] = fill_disk(sw.procs[name].data_dir) >> 20
            rec.update(pid_before=sw.procs[name].pid)
            return rec
        if event.kind == RELAY_REPLACE:
            sw.kill(name, signal.SIGKILL)
            sw.gone.add(name)
            new = rest[0]
            sw.launch(new)
            self.started(new)
            rec.update(node=new, pid_before=-1, pid_after=sw.procs[new].pid, back_at=self.now(), gone=name)
            return None
        if event.kind == LATE_JOIN:
            sw.launch(name)
            self.started(name)
            rec.update(pid_before=-1, pid_after=sw.procs[name].pid, back_at=self.now())
            return None
        if event.kind == HOSTILE:
            rec.update(pid_before=sw.procs[name].pid)
            target = sw.addr_of(name)
            thread = threading.Thread(target=lambda: rec.update(hostile=hostile_burst(target, "demo", event.hold)),
                                      daemon=True)
            thread.start()
            rec["thread"] = thread
            return rec
        raise ValueError(f"unknown event kind {event.kind}")

    def end(self, event, rec: dict) -> None:
        sw, name = self.swarm, event.targets[0]
        print(f"  [{self.now():6.0f}s] end of {event.kind} {','.join(event.targets)}", flush=True)
        if event.kind in (PARTITION, PARTITION_GROUP):
            self.cuts.heal(event.targets)
        elif event.kind == SILENCE:
            os.kill(sw.procs[name].pid, signal.SIGCONT)
        elif event.kind == DISK_FULL:
            (sw.procs[name].data_dir / "ballast").unlink(missing_ok=True)
            if not sw.procs[name].alive():
                self.findings.append(f"{name} exited while its disk was full (t={self.now():.0f}s): restarted")
                sw.restart(name, wait=0)
                self.started(name)
        elif event.kind == HOSTILE:  # the burst ends itself after the hold; finish() joins a late one
            rec["thread"].join(timeout=5.0)
            if not rec["thread"].is_alive():
                del rec["thread"]
        rec["back_at"] = self.now()

    def started(self, name: str) -> None:
        self.starting[name] = self.swarm.procs[name].pid

    def watch_starting(self) -> None:
        """Note when each process started since the last tick wrote its node.json (it is ready)."""
        for name, pid in list(self.starting.items()):
            proc = self.swarm.procs[name]
            try:
                ready = json.loads((proc.data_dir / NODE_FILE).read_text()).get("pid") == pid
            except (OSError, ValueError):
                ready = False
            if ready or proc.pid != pid or not proc.alive():
                del self.starting[name]
            if ready:
                self.ready_at[pid] = self.now()

    def stop(self, name: str) -> float:
        """SIGTERM ``name`` and wait for it to exit; seconds it took (a finding past STOP_WAIT_S: killed)."""
        proc, began = self.swarm.procs[name], time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.popen.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.findings.append(f"{name} still running {STOP_WAIT_S:.0f} s after SIGTERM (t={self.now():.0f}s): killed")
            os.kill(proc.pid, signal.SIGKILL)
            proc.popen.wait()
        return round(time.monotonic() - began, 1)

    def sample(self) -> None:
        t = round(self.now(), 1)
        trainer_id = self.swarm.peer_id("trainer")
        for name, proc in self.swarm.procs.items():
            if not proc.alive():
                continue
            st = self.swarm.status(name, wait=0.5)
            row = {"t": t, "node": name, "pid": proc.pid, **(proc_figures(proc.pid) or {}),
                   "sqlite_mb": round(sqlite_mb(proc.data_dir), 3), "tasks": st.get("tasks"),
                   "progress": progress(proc.role, st) if st else None,  # {}: no status yet
                   "digest": (st.get("ledger") or {}).get("digest"),
                   "trainer_seq": ((st.get("ledger") or {}).get("trusted_heads") or {}).get(trainer_id),
                   # The newest checkpoint heard announced and the newest held: a worker waiting for a
                   # checkpoint either never heard of it (gossip) or could not fetch it (shards).
                   **{f"newest_{k}": max((st.get("shards") or {}).get(k) or [], default=None)
                      for k in ("announced", "held")}}
            ago = last_progress_ago(proc.role, st, time.time()) if st else None
            row["last_progress_t"] = None if ago is None else round(self.now() - ago, 1)
            if row["progress"] is not None:
                self.series[name].append((t, proc.pid, row["progress"], row["last_progress_t"]))
                if proc.role == "inference":
                    self.acks.observe(self.swarm.peer_id(name), proc.pid, int(row["progress"]))
            if proc.role == "trainer":
                row["step"] = (st.get("trainer") or {}).get("step")
            batches = (st.get("inference") or {}).get("batches") or {}
            if "answered" in batches:
                since = batches.get("since_answered_s")
                written = st.get("time")
                row["answered"] = batches["answered"]
                row["answered_t"] = (None if since is None or written is None
                                     else round(self.now() - since - max(0.0, time.time() - written), 1))
                self.answers[name].append((t, proc.pid, row["answered"], row["answered_t"]))
            self.samples.append(row)
            self.out.write(json.dumps(row) + "\n")
        self.rows.update(spool_rows(self.swarm.procs["trainer"].data_dir / "trainer" / "spool.sqlite"))
        self.out.flush()

    def finish(self) -> dict:
        """Stop the trainer (nothing new enters the ledger), wait for every other replica's digest to agree,
        then sample a last time and stop everything. The seconds until they agreed (None: not within
        DIGEST_WAIT_S)."""
        sw = self.swarm
        for rec in self.results:  # a hostile burst still running
            if "thread" in rec:
                rec.pop("thread").join(timeout=60.0)
        self.sample()
        trainer_stop = self.stop("trainer")
        began, agreed = time.monotonic(), None
        while time.monotonic() - began < DIGEST_WAIT_S:
            digests = {n: (sw.status(n, wait=0.5).get("ledger") or {}).get("digest")
                       for n, p in sw.procs.items() if p.alive()}
            if len(set(digests.values())) == 1 and None not in digests.values():
                agreed = round(time.monotonic() - began, 1)
                break
            time.sleep(1.0)
        self.rows.update(spool_rows(sw.procs["trainer"].data_dir / "trainer" / "spool.sqlite"))
        return {"trainer_stop_s": trainer_stop, "digests_agreed_s": agreed, "last_digests": digests}

    # -- the report ----------------------------------------------------------------------------

    def report(self, end: dict) -> dict:
        sw = self.swarm
        for rec in self.results:
            if "back_at" in rec:
                took = recovery_s(self.series[rec["node"]], rec["pid_before"], rec["back_at"])
                rec["recovery_s"] = None if took is None else round(took, 1)
                if rec.get("pid_after") in self.ready_at:  # a new process: how much of that was its start-up
                    rec["ready_s"] = round(self.ready_at[rec["pid_after"]] - rec["back_at"], 1)
                if self.answers.get(rec["node"]):  # a worker: its first batch the trainer answered
                    sent = recovery_s(self.answers[rec["node"]], rec["pid_before"], rec["back_at"])
                    rec["first_sent_s"] = None if sent is None else round(sent, 1)
        flag_overlaps(self.results, self.seconds)
        workers = {sw.peer_id(n): n for n, p in sw.procs.items() if p.role == "inference"}
        ledger = account({pid: self.acks.acked(pid) for pid in workers}, self.rows)
        warmup = min(WARMUP_S, self.seconds / 4)
        resources = {}
        for name in sw.procs:
            mine = [s for s in self.samples if s["node"] == name and "rss_mb" in s and s["tasks"] is not None]
            if not mine:
                continue
            pid = Counter(s["pid"] for s in mine).most_common(1)[0][0]  # its longest-lived process
            life = [s for s in mine if s["pid"] == pid]
            t0 = life[0]["t"]
            resources[name] = {
                "restarts": len({s["pid"] for s in mine}) - 1,
                **{f"{k}_last": life[-1][k] for k in RESOURCES},
                **{f"{k}_per_h": slope_per_hour([(s["t"] - t0, s[k]) for s in life], warmup) for k in RESOURCES},
            }
        errors = {name: count_errors(p.log_path.read_text(errors="replace").splitlines())
                  for name, p in sw.procs.items() if p.log_path and p.log_path.exists()}
        steps = trainer_steps(sw.procs["trainer"].data_dir / "trainer" / "spool.sqlite")
        # Every replica stored the trainer's whole chain? (Digests differ once the trainer stopped: the
        # others still append verdicts and receipts, and flush some as they stop.)
        trainer_id = sw.peer_id("trainer")
        heads = {n: ledger_head(p.data_dir, trainer_id) for n, p in sw.procs.items() if n not in sw.gone}
        last_back = max((rec["back_at"] for rec in self.results if "back_at" in rec), default=0.0)
        step_t = [(s["t"], s["step"]) for s in self.samples if s.get("step") is not None]
        return {"seed": self.seed, "minutes": self.seconds / 60, "events": self.results, "findings": self.findings,
                "accounting": {workers.get(w, w[-8:]): r for w, r in ledger.items()}, "resources": resources,
                "errors": {n: dict(c) for n, c in errors.items()}, "reward": steps, "step_t": step_t,
                "trainer_heads": heads, "lag": self.lag(last_back), **end}

    def lag(self, last_back: float) -> dict:
        """Each replica's lag behind the trainer's chain while it writes (soaklib.replication_lag):
        its 95th percentile over the run, and its largest from LAG_GRACE_S after the last restart or
        heal on (the issue's 60 s), with that time."""
        writer = [(s["t"], s["trainer_seq"]) for s in self.samples
                  if s["node"] == "trainer" and s.get("trainer_seq") is not None]
        out = {}
        for name in self.swarm.procs:
            if name == "trainer":
                continue
            mine = [(s["t"], s["trainer_seq"]) for s in self.samples
                    if s["node"] == name and s.get("trainer_seq") is not None]
            timed = replication_lag(writer, mine)
            lags = [lag for _, lag in timed]
            late = [lag for t, lag in timed if t >= last_back + LAG_GRACE_S]
            if lags:
                out[name] = {"p95_s": round(sorted(lags)[int(0.95 * (len(lags) - 1))], 1),
                             "after_last_heal_max_s": round(max(late), 1) if late else None}
        return {"last_back_s": round(last_back, 1), "grace_s": LAG_GRACE_S, "replicas": out}


def flag_overlaps(events: list[dict], end: float) -> None:
    """Note on each event the other faults on its node or on the trainer inside its recovery window
    (soaklib.overlaps): a recovery that timed another fault, or the load, not a protocol wait."""
    for rec, flags in zip(events, overlaps(events, end)):
        rec["overlaps"] = flags


def steps_per_minute(step_t: list[tuple[float, int]], start: float, end: float) -> float | None:
    inside = [(t, s) for t, s in step_t if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] == inside[0][0]:
        return None
    return (max(s for _, s in inside) - inside[0][1]) / (inside[-1][0] - inside[0][0]) * 60


def print_report(r: dict) -> None:
    print(f"\nsoak: seed {r['seed']}, {r['minutes']:.0f} min")
    print("\nfaults and recovery: seconds from the restart, heal or SIGCONT until the node's own progress moved\n"
          "(trainer step, acked batch, verdict, relay connection); a new process's start-up in brackets; for a\n"
          "worker its first batch the trainer answered (sent; the ack after it waits for the trainer's queue);\n"
          "OVERLAP: another fault on the node or the trainer inside the recovery window")
    for e in r["events"]:
        rec = e.get("recovery_s")
        extra = f" (ready after {e['ready_s']} s)" if "ready_s" in e else ""
        extra += f" first sent {e['first_sent_s']} s" if "first_sent_s" in e else ""
        extra += f" OVERLAP {'; '.join(e['overlaps'])}" if e.get("overlaps") else ""
        extra += f" SIGTERM exit {e['stop_s']} s" if "stop_s" in e else ""
        extra += f" hostile saw {e['hostile']}" if "hostile" in e else ""
        print(f"  {e['event']:<55} {'never' if rec is None and 'back_at' in e else rec} {extra}")
    print("\nacked batches (workers' count, summed over restarts) against the trainer's spool")
    print(f"  {'worker':<13} {'acked':>6} {'spooled':>8} {'trained':>8} {'rejected':>9} {'expired':>8} {'pending':>8} {'lost':>5}")
    for w, a in r["accounting"].items():
        print(f"  {w:<13} {a['acked']:>6} {a['spooled']:>8} {a['trained']:>8} {a['rejected']:>9} {a['expired']:>8} "
              f"{a['pending']:>8} {a['lost']:>5}")
    lost = sum(a["lost"] for a in r["accounting"].values())
    print(f"  lost (acked, in no state of the spool): {lost}")
    print("\nresources (last value; slope per hour of the longest-lived process after warm-up)")
    print(f"  {'node':<13} {'restarts':>8} {'RSS MB':>8} {'MB/h':>7} {'fds':>5} {'fds/h':>7} {'thr':>4} {'thr/h':>6} "
          f"{'tasks':>6} {'tasks/h':>8} {'sqlite MB':>10} {'MB/h':>7}")

    def f(x, spec=".1f"):
        return "-" if x is None else format(x, spec)
    for n, s in r["resources"].items():
        print(f"  {n:<13} {s['restarts']:>8} {f(s['rss_mb_last']):>8} {f(s['rss_mb_per_h']):>7} {s['fds_last']:>5} "
              f"{f(s['fds_per_h']):>7} {s['threads_last']:>4} {f(s['threads_per_h']):>6} {s['tasks_last']:>6} "
              f"{f(s['tasks_per_h']):>8} {f(s['sqlite_mb_last'], '.2f'):>10} "
              f"{f(s['sqlite_mb_per_h'], '.2f'):>7}")
    print("\nERROR lines and tracebacks in the node logs, by kind")
    total = Counter()
    for n, c in r["errors"].items():
        total.update(c)
    for kind, k in total.most_common(25) or [("(none)", 0)]:
        print(f"  {k:>5}  {kind}")
    print("  per node: " + ", ".join(
        f"{n} {sum(v for k, v in c.items() if k.startswith('ERROR'))}/{sum(v for k, v in c.items() if k.startswith('traceback'))}"
        for n, c in r["errors"].items()) + " (ERROR lines / tracebacks)")
    curve = [[s, m] for s, m in r["reward"]]
    ratio = reward_ratio(curve)
    if ratio:
        print(f"\nreward: {len(curve)} steps, first 10 {ratio[0]:.3f}, last 10 {ratio[1]:.3f}"
              + (f" ({ratio[2]:.2f}x)" if ratio[2] is not None else ""))
    agreed = r["digests_agreed_s"]
    print(f"\nledger: trainer stopped in {r['trainer_stop_s']} s; every other replica's digest equal "
          + (f"{agreed} s later" if agreed is not None else f"NOT within {DIGEST_WAIT_S:.0f} s: {r['last_digests']}")
          )
    lag = r["lag"]
    worst = max((v["after_last_heal_max_s"] or 0.0 for v in lag["replicas"].values()), default=None)
    print(f"ledger: replicas' lag behind the trainer's chain while it writes, 95th percentile over the run: "
          + ", ".join(f"{n} {v['p95_s']}" for n, v in lag["replicas"].items()) + " s")
    print(f"ledger: largest lag from {lag['grace_s']:.0f} s after the last restart or heal "
          f"(t={lag['last_back_s']:.0f} s) to the end: {f(worst)} s (0: every replica held every entry the trainer "
          "had reported by its sample)")
    heads = r["trainer_heads"]
    whole = sum(h == heads.get("trainer") for h in heads.values())
    print(f"ledger: the trainer's chain (its last seq {heads.get('trainer')}) whole on {whole} of {len(heads)} stored replicas"
          + ("" if whole == len(heads) else f": {heads}"))
    for line in r["findings"]:
        print(f"finding: {line}")
    calm = steps_per_minute(r["step_t"], 0, FIRST_EVENT_S)
    churn = steps_per_minute(r["step_t"], FIRST_EVENT_S, r["minutes"] * 60)
    print(f"\ntrainer steps per minute: before the first fault {f(calm)}, under faults {f(churn)}"
          + (f", ratio {churn / calm:.2f}" if calm and churn is not None else ""))


def plot(r: dict, samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, steps) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name in sorted({s["node"] for s in samples}):
        pts = [(s["t"] / 60, s["rss_mb"]) for s in samples if s["node"] == name and "rss_mb" in s]
        mem.plot(*zip(*pts), label=name, lw=1)
    mem.set_ylabel("RSS (MB)")
    mem.legend(fontsize=7, ncol=3)
    if r["step_t"]:
        steps.plot([t / 60 for t, _ in r["step_t"]], [s for _, s in r["step_t"]], color="k", lw=1)
    for e in r["events"]:
        for ax in (mem, steps):
            ax.axvline(e["at"] / 60, color="r", alpha=0.25, lw=0.8)
    steps.set_ylabel("trainer step")
    steps.set_xlabel(f"minutes (red: faults; seed {r['seed']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def reprint(root: Path) -> None:
    """The report of a soak kept in ``root``, with the overlap flags (reports written before they
    existed get them here; "first sent" only where the samples hold the workers' answered counts)."""
    r = json.loads((root / "soak.json").read_text())
    flag_overlaps(r["events"], r["minutes"] * 60)
    print_report(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the faults run (default 30)")
    ap.add_argument("--seed", type=int, default=1, help="the fault schedule's seed (printed with the results)")
    ap.add_argument("--keep", type=Path, default=None, help="keep data dirs, logs, samples and the PNG here")
    ap.add_argument("--loopback", action="store_true", help="no namespaces even as root (no partitions)")
    ap.add_argument("--report", type=Path, default=None, metavar="DIR",
                    help="print the report of a finished soak's DIR/soak.json again (overlaps flagged) and exit")
    args = parse_args(ap, {"minutes": 0.75})
    if args.report is not None:
        reprint(args.report)
        return
    if args.minutes <= 0:
        sys.exit("bench/soak.py: --minutes must be above 0")
    from netns import Namespaces, missing_for_namespaces

    # SIGTERM (a test's timeout, an operator) unwinds like Ctrl-C: the finally below stops our nodes
    # by PID and deletes the namespaces, the cut table and the tmpfs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = "--loopback" if args.loopback else missing_for_namespaces()
    root = args.keep or Path(tempfile.mkdtemp(prefix="soak-"))
    if root.exists() and args.keep:
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)  # mkdtemp made it already
    schedule = make_schedule(args.seed, args.minutes * 60, START_NODES, disk_node=None if why else DISK_NODE,
                             can_partition=not why)
    joining = sum(e.kind in (RELAY_REPLACE, LATE_JOIN) for e in schedule)  # each in a namespace of its own
    nets = None if why else Namespaces(len(START_NODES) + joining, MBIT, prefix="sk")
    soak = None
    try:
        if nets is not None:
            nets.__enter__()
            subprocess.run(["ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", nets.bridge], check=True)
        else:
            print(f"soak: on loopback ({why}): no partitions", flush=True)
        soak = Soak(root, args.minutes, args.seed, nets, schedule)
        print(f"soak: seed {args.seed}, {args.minutes:g} min, data in {root}; schedule:")
        for e in soak.schedule:
            print(f"  {e.describe()}")
        soak.start()
        print(f"soak: {len(START_NODES)} nodes up; faults begin", flush=True)
        soak.run()
        end = soak.finish()
        soak.swarm.close()
        r = soak.report(end)
    finally:
        if soak is not None:
            soak.swarm.close()
            soak.out.close()
            if soak.cuts is not None:
                soak.cuts.close()
            if soak.disk:
                subprocess.run(["umount", "-l", str(root / DISK_NODE)], capture_output=True)
        if nets is not None:
            nets.__exit__()
    print_report(r)
    plot(r, soak.samples, root / "soak.png")
    (root / "soak.json").write_text(json.dumps(r, indent=1, default=str))
    print(f"\nsamples, figures and the PNG: {root}/samples.jsonl, soak.json, soak.png")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
