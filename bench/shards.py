"""Checkpoint swarm benchmarks: each figure is printed beside a baseline measured in the same run.

    .venv/bin/python bench/shards.py calibrate                 # block size sweep (manifest.py's table)
    .venv/bin/python bench/shards.py overhead [--size-mib 256] [--seeders 4] [--tasks]
    .venv/bin/python bench/shards.py swarm [--n 8] [--size-mib 32] [--mbit 10] [--hog] [--profile DIR]  # needs root
    .venv/bin/python bench/shards.py shardcast [--n 8] [--size-mib 32] [--mbit 10] [--shardcast-venv DIR]
    .venv/bin/python bench/shards.py deltas [--n 8] [--size-mib 32] [--mbit 10] [--changed 0.03]  # needs root
    .venv/bin/python bench/shards.py all

1. **calibrate**: goodput of one libp2p stream (TCP + Noise + Yamux) carrying length-prefixed
   frames of 16 KiB .. 1 MiB, and SHA-256 speed: why blocks are 256 KiB and pieces 1 MiB.
2. **overhead**: one downloader fetching a checkpoint from 4 seeders (all in this process, loopback)
   vs one plain libp2p stream between two hosts copying the same bytes with 1 MiB writes (the stack's
   ceiling here). Ratio = swarm goodput / stream goodput.
3. **swarm**: a seeder and N downloaders, each in its own network namespace behind a veth on one
   bridge, every host's upload capped with ``tc tbf`` (no download cap). Distribution time (publish
   -> last downloader complete, announcement included) vs the Kumar & Ross lower bound
   T_min = max(F/u_s, F/d_min, N*F/(u_s + sum u_i)) (IEEE HotWeb 2006). Skipped with a message when
   not root or when ``ip netns`` fails. Also the CPU-seconds of each node process from publish to the
   last completion (``/proc/<pid>/stat``) per MiB delivered, by role and for the whole tree, beside
   one plain libp2p stream carrying the same bytes on loopback and one carrying 8 MiB through one
   capped link (py-libp2p's own cost per byte when bytes trickle in), both in the same run; and
   each downloader's TCP writes (Noise messages) and reads per MiB beside that capped stream's.
   ``--hog`` keeps one core busy meanwhile; ``--profile DIR`` cProfiles the seed and one downloader.
4. **shardcast**: the same namespaces and caps with SHARDCAST 0.3.2 (origin -> 2 middle nodes ->
   N clients, as INTELLECT-2 ran it), then this project's swarm on the same N+3 hosts (the 2 extra
   hosts as relays), in the same run: time ratio. SHARDCAST lives in its own virtualenv
   (``python -m venv DIR && DIR/bin/pip install shardcast``), never in the project's. Its middle
   nodes poll every second here (default 30 s) and its shard size is F/4 (the 200 MB / 50 MB ratio
   of its defaults), both in its favour.

5. **deltas**: the swarm's namespaces and caps; the trainer publishes v1 (a bf16 safetensors
   checkpoint) to N downloaders, then v2 with ``--changed`` of its values one ulp off, which the N
   holders of v1 fetch as a delta (node/shards/deltasync.py). Ratio = v2's distribution time / v1's.

The machine is shared and noisy (2 cores, other jobs): compare the ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "tests"))
from netns import Namespaces  # noqa: E402  (shared with the NAT test)
from procstat import cpu_seconds  # noqa: E402  (bench/, the script's own folder)
from quick import parse_args  # noqa: E402  (bench/, the script's own folder)
from node.net.host import open_swarm_host  # noqa: E402
from node.counters import TcpBytes  # noqa: E402
from node.identity import Identity  # noqa: E402
from node.shards.testing import open_shards_swarm, same_files, write_checkpoint  # noqa: E402
from node.wire import read_frame, write_frame  # noqa: E402

MiB = 1 << 20
PROTO = "/bench/stream/1"
CAPPED_STREAM_MIB = 8  # the plain stream through a capped link: 6.7 s at 10 Mbit/s


def stream_cpu_per_mib(total: int) -> tuple[float, float]:
    """(CPU-seconds per MiB, MiB/s) of one plain libp2p stream carrying ``total`` bytes in 1 MiB
    writes between two hosts in this process: both ends' CPU (sender and receiver), host start-up
    excluded. The baseline the swarm's CPU per MiB delivered is set beside."""
    out = {}

    async def run() -> None:
        t0 = time.process_time()
        out["rate"] = await stream_goodput(total, None, cpu=out)
        out.setdefault("cpu", time.process_time() - t0)

    trio.run(run)
    return out["cpu"] / (total / MiB), out["rate"]


# ---------------------------------------------------------------------------------------------
# Plain stream baseline


async def stream_goodput(total: int, frame: int | None, cpu: dict | None = None) -> float:
    """MiB/s of one libp2p stream between two fresh hosts: raw 1 MiB writes, or frames of ``frame``.
    With ``cpu``, ``cpu["cpu"]`` is set to this process's CPU-seconds from the first byte to the last."""
    async with open_swarm_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]) as a, open_swarm_host(
        Identity.generate(), ["/ip4/127.0.0.1/tcp/0"]
    ) as b:
        done = trio.Event()
        elapsed = {}

        async def handler(stream):
            got = 0
            t0 = time.perf_counter()
            if frame is None:
                while got < total:
                    chunk = await stream.read(MiB)
                    if not chunk:
                        break
                    got += len(chunk)
            else:
                while got < total:
                    got += len(await read_frame(stream, 2 * MiB))
            elapsed["t"] = time.perf_counter() - t0
            await stream.write(b"k")
            done.set()

        b.set_handler(PROTO, handler)
        await a.connect(b.listen_addrs()[0])
        s = await a.open_stream(b.peer_id, PROTO)
        block = os.urandom(frame or MiB)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(total // len(block)):
            if frame is None:
                await s.write(block)
            else:
                await write_frame(s, block)
        await s.read(1)
        await done.wait()
        if cpu is not None:
            cpu["cpu"] = time.process_time() - c0
        return total / (time.perf_counter() - t0) / MiB


def _tcp_calls() -> int:
    return sum(TcpBytes.calls.values())


async def _stream_end(args: argparse.Namespace) -> None:
    """One end of the plain stream across the capped namespaces (``_stream-end`` subcommand): it
    prints its address (receiver) and then its own CPU-seconds from the first byte to the last."""
    total = args.size_mib * MiB
    async with open_swarm_host(Identity.generate(), [args.listen]) as h:
        if not args.dial:
            done = trio.Event()

            async def handler(stream):
                got, c0, n0 = 0, None, 0
                while got < total:
                    chunk = await stream.read(MiB)
                    if not chunk:
                        break
                    if c0 is None:
                        c0, n0 = time.process_time(), _tcp_calls()
                    got += len(chunk)
                print(json.dumps({"cpu": time.process_time() - c0, "bytes": got, "calls": _tcp_calls() - n0}), flush=True)
                await stream.write(b"k")
                done.set()

            h.set_handler(PROTO, handler)
            print(json.dumps({"addr": h.listen_addrs()[0]}), flush=True)
            await done.wait()
            await trio.sleep(1.0)  # let the ack leave
        else:
            peer = await h.connect(args.dial)
            s = await h.open_stream(peer, PROTO)
            block = os.urandom(MiB)
            c0, t0, n0 = time.process_time(), time.perf_counter(), _tcp_calls()
            for _ in range(total // MiB):
                await s.write(block)
            await s.read(1)
            print(json.dumps({"cpu": time.process_time() - c0, "seconds": time.perf_counter() - t0,
                              "calls": _tcp_calls() - n0}), flush=True)


def capped_stream_cpu_per_mib(nets: Namespaces, size_mib: int) -> tuple[float, float, float]:
    """(CPU-seconds per MiB, both ends; MiB/s; TCP writes + reads per MiB, both ends) of one plain
    libp2p stream from host 0 to host 1 of ``nets`` through the same upload cap as the swarm: what
    py-libp2p itself costs per byte when bytes trickle in at the link's rate (more, smaller reads
    than on loopback)."""
    me = [sys.executable, str(Path(__file__).resolve()), "_stream-end", "--size-mib", str(size_mib)]
    rx = subprocess.Popen(["ip", "netns", "exec", nets.names[1], *me, "--listen", f"/ip4/{nets.ip(1)}/tcp/4002"],
                          cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        addr = _read_json(rx, 60)["addr"]
        tx = subprocess.run(["ip", "netns", "exec", nets.names[0], *me, "--listen", f"/ip4/{nets.ip(0)}/tcp/4002",
                             "--dial", addr], cwd=REPO, capture_output=True, text=True, timeout=60 + size_mib * 2)
        sent = json.loads(tx.stdout.strip().splitlines()[-1])
        got = _read_json(rx, 30)
    finally:
        _stop([rx])
    return (sent["cpu"] + got["cpu"]) / size_mib, size_mib / sent["seconds"], (sent["calls"] + got["calls"]) / size_mib


# ---------------------------------------------------------------------------------------------
# 1. calibrate


def calibrate(stream_mib: int = 64) -> None:
    print("== calibrate: stream goodput by frame (block) size, SHA-256 by piece size")
    data = os.urandom(16 * MiB)
    for piece in (1 * MiB, 4 * MiB, 16 * MiB):
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.5:
            for off in range(0, len(data), piece):
                hashlib.sha256(memoryview(data)[off : off + piece]).digest()
                n += piece
        print(f"  sha256, {piece // MiB:>2} MiB pieces: {n / (time.perf_counter() - t0) / MiB:7.0f} MiB/s")
    for kib in (16, 64, 256, 1024):
        rate = trio.run(stream_goodput, stream_mib * MiB, kib * 1024)
        print(f"  stream, {kib:>4} KiB frames: {rate:7.1f} MiB/s")


# ---------------------------------------------------------------------------------------------
# 2. overhead


class TaskCpu(trio.abc.Instrument):
    """The event loop's CPU-seconds by task (the coroutine's qualified name) and its steps: where a
    download's loop goes, beside the plain stream's (which spends it all in the stack's tasks)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self._task, self._t0 = None, 0.0  # the step under way (none for the step that added us)

    def before_task_step(self, task) -> None:
        self._task, self._t0 = task, time.thread_time()

    def after_task_step(self, task) -> None:
        if task is not self._task:
            return
        self._task = None
        name = getattr(getattr(task.coro, "cr_code", None), "co_qualname", task.name)
        self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - self._t0
        self.steps[name] = self.steps.get(name, 0) + 1

    def report(self, top: int = 9) -> str:
        rows = sorted(self.cpu.items(), key=lambda kv: -kv[1])[:top]
        return "\n".join(f"    {cpu * 1000:6.0f} ms {self.steps[name]:6d} steps  {name}" for name, cpu in rows)


async def _overhead(size: int, seeders: int, tmp: Path, tasks: TaskCpu | None = None) -> tuple[float, float, float, float]:
    """(MiB/s, seconds, event-loop CPU-s, process CPU-s) of the download alone: its CPU varies
    less between runs than its goodput does on a shared machine, so A/B pairs compare it too.
    ``tasks`` is added as an instrument for the download's time only."""
    src = write_checkpoint(tmp / "src", size, seed=1)
    trainer = Identity.generate()
    tr = [trainer.peer_id]
    quiet = dict(progress=False, announce_interval=3600.0, super_seed=False)
    async with open_shards_swarm() as swarm:
        t = await swarm.add(tmp / "t", identity=trainer, trainers=tr, role="trainer", **quiet)
        signed = await t.shards.publish(src, 1)
        seeds = [await swarm.add(tmp / f"s{k}", trainers=tr, fetch="none", **quiet) for k in range(seeders)]
        for s in seeds:
            await s.shards.seed(src, signed)
        d = await swarm.add(tmp / "d", trainers=tr, role="inference", **quiet)
        for s in seeds:
            await d.host.connect(s.host.listen_addrs()[0])
        svc = d.shards
        if tasks is not None:
            trio.lowlevel.add_instrument(tasks)
        t0, loop0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
        svc.fetch(1, signed.root, seeds[0].peer_id)
        path = await svc.wait_version(1)
        dt, loop, proc = time.perf_counter() - t0, time.thread_time() - loop0, time.process_time() - proc0
        if tasks is not None:
            trio.lowlevel.remove_instrument(tasks)
        assert same_files(src, path), "downloaded bytes differ"
        per_peer = {p[-6:]: round(n / MiB) for (p, _), n in svc.receipts().items()}
        print(f"  per seeder (MiB): {per_peer}")
    return size / dt / MiB, dt, loop, proc


def overhead(size_mib: int, seeders: int, by_task: bool = False) -> float:
    size = size_mib * MiB
    print(f"== overhead: 1 downloader, {seeders} seeders, {size_mib} MiB, one process on loopback")
    cpu1, cpu2 = {}, {}
    base1 = trio.run(stream_goodput, size, None, cpu1)
    tasks = TaskCpu() if by_task else None
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp:
        swarm, dt, loop, proc = trio.run(_overhead, size, seeders, Path(tmp), tasks)
    base2 = trio.run(stream_goodput, size, None, cpu2)
    base = (base1 + base2) / 2
    print(f"  plain libp2p stream (1 MiB writes), mean of before/after: {base:.1f} MiB/s ({base1:.1f}, {base2:.1f}); "
          f"CPU {(cpu1['cpu'] + cpu2['cpu']) / 2:.2f} s (both ends, one thread)")
    print(f"  shards download from {seeders} seeders: {swarm:.1f} MiB/s ({dt:.2f} s); CPU: event loop {loop:.2f} s "
          f"(seeders and downloader), whole process {proc:.2f} s (with the hash-and-write thread)")
    ratio = swarm / base
    print(f"  ratio (shards goodput / plain stream goodput): {ratio:.2f}")
    if tasks is not None:
        print("  the download's event loop by task (instrumented, so a little slower):\n" + tasks.report())
    return ratio


# ---------------------------------------------------------------------------------------------
# 3. swarm efficiency in network namespaces


class UploadSampler:
    """Every host's upload as the kernel counted it, sampled every ``period`` seconds in a thread.

    A host's upload leaves its namespace through the tbf on ``<ns>a`` and arrives on the bridge side
    ``<ns>b``, whose rx_bytes we read from the root namespace: wire bytes (payload + Noise, yamux,
    TCP/IP and Ethernet headers), nothing inside the nodes involved.
    """

    def __init__(self, nets: Namespaces, period: float = 0.05) -> None:
        self.files = [Path(f"/sys/class/net/{ns}b/statistics/rx_bytes") for ns in nets.names]
        self.period = period
        self.samples: list[tuple[float, list[int]]] = []  # (wall time, bytes per host)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> list[int]:
        return [int(f.read_text()) for f in self.files]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._read()))
            self._stop.wait(self.period)

    def __enter__(self) -> "UploadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def host(self, i: int, since: float) -> tuple[list[float], list[int]]:
        """(times, bytes sent since ``since``) of host ``i``."""
        base = next((b[i] for t, b in reversed(self.samples) if t <= since), self.samples[0][1][i])
        pts = [(t, b[i] - base) for t, b in self.samples if t >= since]
        return [t for t, _ in pts], [b for _, b in pts]


def _first_time(ts: list[float], bs: list[int], level: float) -> float:
    return next((t for t, b in zip(ts, bs) if b >= level), ts[-1])


def _phases(sampler: UploadSampler, published: float, done_at: list[float], from_seed: int, size: int,
            cap: float, n: int) -> dict:
    """Where the distribution time went, from the seed's and the downloaders' upload counters."""
    ts, bs = sampler.host(0, published)
    total = bs[-1]
    start = _first_time(ts, bs, 64 * 1024)  # the seed's first block is on the wire
    stop = _first_time(ts, bs, total - 128 * 1024)  # its last (what follows is gossip and control)
    last = max(done_at)
    # Seed idle: 0.2 s windows (finer ones see the sampler's jitter) in which it sent under half its cap.
    step = max(1, round(0.2 / sampler.period))
    window = [(t, b) for t, b in zip(ts, bs) if start <= t <= stop][::step]
    idle = sum(t1 - t0 for (t0, b0), (t1, b1) in itertools.pairwise(window) if (b1 - b0) < 0.5 * cap * (t1 - t0))
    peers = []
    for i in range(1, n + 1):
        pt, pb = sampler.host(i, published)
        end = next((b for t, b in zip(pt, pb) if t >= last), pb[-1])
        peers.append(end / (cap * (last - start)))
    return {
        "startup": start - published,  # publish -> the seed's first block on the wire
        "seed_sending": stop - start,  # the seed's first block -> its last
        "seed_busy": (total - 128 * 1024) / (cap * max(stop - start, 1e-9)),  # of its cap, meanwhile
        "seed_idle": idle,
        "tail": last - stop,  # the seed's last block -> the last downloader complete
        "wire_overhead": total / max(from_seed, 1),  # wire bytes per payload byte on the seed's link
        "peer_upload_busy": sum(peers) / len(peers),  # downloaders, of their cap, first seed block -> end
    }


@contextmanager
def _scratch(prefix: str):
    """A temporary folder and a list for child processes; at the end the children are killed and
    the folder removed (kept, and its path printed, when BENCH_KEEP is set)."""
    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp, procs
    finally:
        _stop(procs)
        if os.environ.get("BENCH_KEEP"):
            print(f"  kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _hog(on: bool):
    """With ``on``, a process spinning on one core for the duration (what a GPU driver, a tokenizer
    or a validator's prefill take from a real node)."""
    if not on:
        yield
        return
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        p.kill()
        p.wait()


def _spawn(ns: str, args: list[str], log: Path, stdin: bool = False, profile: Path | None = None) -> subprocess.Popen:
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "node.shards.testing", *args]
    env = dict(os.environ, SHARDS_PROFILE=str(profile)) if profile else None  # cProfile (node/shards/testing.py)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                            stdin=subprocess.PIPE if stdin else None, env=env)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _read_json(proc: subprocess.Popen, timeout: float) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError("child silent")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"child exited with {proc.poll()}")
    return json.loads(line)


def swarm(n: int, size_mib: int, mbit: float, piece_kib: int = 0, relays: int = 0,
          timeout: float = 300.0, trace: Path | None = None, hog: bool = False,
          profile: Path | None = None) -> float | None:
    """Distribution time to ``n`` downloaders (plus ``relays`` relay hosts); prints the ratio to T_min."""
    print(f"== swarm: seeder + {relays} relays + {n} downloaders in network namespaces, {size_mib} MiB, "
          f"upload {mbit} Mbit/s each, pieces {f'{piece_kib} KiB' if piece_kib else 'automatic'}"
          f"{', a CPU hog keeping one core busy' if hog else ''}")
    if os.geteuid() != 0:
        print("  skipped: needs root (ip netns, tc)")
        return None
    if profile:
        profile.mkdir(parents=True, exist_ok=True)  # the children's first dump would fail and end them
    size = size_mib * MiB
    u = mbit * 1e6 / 8  # bytes/s
    t_min = max(size / u, n * size / (u + (n + relays) * u))  # no download cap: F/d_min = 0
    trainer_seed = "22" * 32
    base_cpu, base_rate = stream_cpu_per_mib(size)  # the same bytes on one plain stream, this run
    cpu_at: dict[str, list[float]] = {}  # "publish" / "done" -> CPU-seconds of each node process
    with _scratch("bench-shards-ns-") as (tmp, procs), _hog(hog):
        try:
            with Namespaces(n + relays + 1, mbit) as nets:
                capped_cpu, capped_rate, capped_calls = capped_stream_cpu_per_mib(nets, CAPPED_STREAM_MIB)
                src = write_checkpoint(tmp / "src", size, seed=3)
                settings = {"progress": False}  # the shipped announce interval: its gossip is part of the cost
                if piece_kib:
                    settings.update(piece_size=piece_kib * 1024, block_size=min(256, piece_kib) * 1024)
                common = ["--trainer-seed", trainer_seed, "--shards", json.dumps(settings)]
                addrs = []
                for i in range(1, n + relays + 1):  # downloaders first, each dialing the ones before it
                    role = "relay" if i > n else "inference"
                    p = _spawn(nets.names[i], ["--data-dir", str(tmp / f"d{i}"), "--role", role,
                                               "--listen", f"/ip4/{nets.ip(i)}/tcp/4001", *common, "--connect", *addrs],
                               tmp / f"d{i}.err", profile=profile / "d1.prof" if profile and i == 1 else None)
                    procs.append(p)
                    addrs.append(_read_json(p, 60)["addr"])
                with UploadSampler(nets) as sampler:
                    seeder = _spawn(nets.names[0], ["--data-dir", str(tmp / "seed"), "--seed", trainer_seed,
                                                    "--role", "trainer", "--listen", f"/ip4/{nets.ip(0)}/tcp/4001",
                                                    "--publish", str(src), "--publish-delay", "3", *common,
                                                    "--connect", *addrs], tmp / "seed.err",
                                    profile=profile / "seed.prof" if profile else None)
                    procs.append(seeder)
                    _read_json(seeder, 60)  # hello
                    published = _read_json(seeder, 60)["published_at"]
                    # Start-up (imports, dials, gossip meshes) excluded: counted from the publish on.
                    cpu_at["publish"] = [cpu_seconds(p.pid) for p in procs]
                    done, reports = [], []
                    from_seed = 0  # payload bytes the seeder sent (downloaders and relays)
                    seed_id = Identity.from_seed(bytes.fromhex(trainer_seed)).peer_id
                    for k, p in enumerate(procs[: n + relays]):
                        while True:
                            msg = _read_json(p, timeout)
                            if "complete" in msg:
                                if k < n:
                                    done.append(msg["at"] - published)
                                    reports.append(msg)
                                from_seed += sum(b for key, b in msg["receipts"].items() if key.startswith(seed_id))
                                break
                    cpu_at["done"] = [cpu_seconds(p.pid) for p in procs]  # the last one complete
                for i in range(1, n + 1):
                    assert same_files(src, tmp / f"d{i}" / "checkpoints" / "1"), f"d{i} differs"
                _stop(procs)  # before the namespaces go away
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            print(f"  skipped: could not set up namespaces ({e})")
            return None
    t = max(done)
    cap = mbit * 1e6 / 8  # tbf's rate, in wire bytes per second
    ph = _phases(sampler, published, [published + x for x in done], from_seed, size, cap, n + relays)

    def rel(key: str) -> list[float]:
        return sorted(round(r["timeline"][key] - published, 1) for r in reports if r["timeline"].get(key) is not None)

    print(f"  manifest fetched at (s after publish): {rel('download_at')}")
    print(f"  first piece verified at (s): {rel('first_piece_at')}")
    print(f"  completion times (s): {sorted(round(x, 1) for x in done)}")
    print(f"  seed upload: first block on the wire {ph['startup']:.2f} s after publishing, last {ph['seed_sending']:.1f} s "
          f"later, busy {ph['seed_busy']:.0%} of its cap meanwhile ({ph['seed_idle']:.1f} s below half); "
          f"{ph['wire_overhead']:.2f} wire bytes per payload byte credited (headers, control, duplicates)")
    shares = sorted(sum(b for key, b in r["receipts"].items() if key.startswith(seed_id)) / size * 100 for r in reports)
    print(f"  pieces each downloader got from the seed (% of F): {[round(x) for x in shares]}; their uploads busy "
          f"{ph['peer_upload_busy']:.0%} of their caps (first seed block -> last completion)")
    print(f"  tail: last completion {ph['tail']:.1f} s after the seed's last block")
    print(f"  the seeder sent {from_seed / size:.2f} x the checkpoint directly (1.00 = each piece once)")
    cpu = [b - a for a, b in zip(cpu_at["publish"], cpu_at["done"])]  # procs: downloaders, relays, seed
    delivered = (n + relays) * size / MiB
    seed_cpu, dl_cpu = cpu[-1], cpu[:n]
    print(f"  CPU-s from publish to the last completion: seed {seed_cpu:.1f}, downloaders "
          f"{sum(dl_cpu):.1f} (each {min(dl_cpu):.1f}..{max(dl_cpu):.1f}), all node processes {sum(cpu):.1f} "
          f"in {t:.1f} s wall ({sum(cpu) / t:.2f} cores busy)")
    print(f"  CPU-s per MiB delivered ({delivered:.0f} MiB): seed {seed_cpu / delivered:.4f}, downloaders "
          f"{sum(dl_cpu) / delivered:.4f} (per MiB each received: {statistics.median(dl_cpu) / (size / MiB):.4f} median), "
          f"whole tree {sum(cpu) / delivered:.4f}")
    # A write is one Noise message, a read one recv (nearly one wake-up): on a slow link a node's CPU
    # follows these more than its bytes, and they vary less from run to run than CPU-seconds do.
    calls = [r["tcp_calls"]["sent"] + r["tcp_calls"]["received"] for r in reports]
    sent = statistics.median(r["tcp_calls"]["sent"] for r in reports)
    print(f"  TCP writes + reads per downloader, from its download's start (median): {statistics.median(calls):.0f} "
          f"({sent:.0f} writes, i.e. Noise messages sent), {statistics.median(calls) / (2 * size / MiB):.0f} per MiB "
          f"moved (received and sent); plain stream through one capped link: {capped_calls:.0f} per MiB (both ends)")
    print(f"  plain libp2p stream, same bytes, both ends, same run: {base_cpu:.4f} CPU-s per MiB ({base_rate:.0f} MiB/s)")
    print(f"  plain libp2p stream through one capped link ({CAPPED_STREAM_MIB} MiB, host 0 -> 1, same run): "
          f"{capped_cpu:.4f} CPU-s per MiB ({capped_rate:.2f} MiB/s)")
    print(f"  ratio (whole-tree CPU per MiB delivered / capped plain stream's): {sum(cpu) / delivered / capped_cpu:.1f}")
    print(f"  ratio (whole-tree CPU per MiB delivered / plain stream's): {sum(cpu) / delivered / base_cpu:.1f}")
    print(f"  Kumar-Ross T_min = max(F/u_s, N*F/(u_s + sum u_i)) = {t_min:.1f} s")
    print(f"  distribution time: {t:.1f} s")
    print(f"  ratio (distribution time / T_min): {t / t_min:.2f}")
    if trace is not None:
        trace.write_text(json.dumps({
            "n": n, "relays": relays, "size": size, "mbit": mbit, "published": published, "t_min": t_min,
            "done": done, "phases": ph, "reports": reports, "period": sampler.period,
            "uploads": [[round(t - published, 3), b] for t, b in sampler.samples],
        }))
        print(f"  trace written to {trace}")
    return t


def deltas(n: int, size_mib: int, mbit: float, changed: float, timeout: float = 300.0) -> float | None:
    """Time to deliver v2 to ``n`` holders of v1 (as a delta) vs delivering v1 (full), same run."""
    print(f"== deltas: seeder + {n} downloaders in network namespaces, {size_mib} MiB bf16 checkpoint, "
          f"{changed:.1%} of values changed in v2, upload {mbit} Mbit/s each")
    if os.geteuid() != 0:
        print("  skipped: needs root (ip netns, tc)")
        return None
    from node.shards.testing import bf16_values, next_step, write_bf16_checkpoint

    trainer_seed = "22" * 32
    seed_id = Identity.from_seed(bytes.fromhex(trainer_seed)).peer_id
    with _scratch("bench-shards-deltas-") as (tmp, procs):
        try:
            with Namespaces(n + 1, mbit) as nets:
                w1 = bf16_values(size_mib * MiB // 2, seed=5)
                v1 = write_bf16_checkpoint(tmp / "v1", w1, 1)
                v2 = write_bf16_checkpoint(tmp / "v2", next_step(w1, 6, changed), 2)
                common = ["--trainer-seed", trainer_seed, "--then-version", "2",
                          "--shards", json.dumps({"announce_interval": 1.0, "progress": False})]
                addrs = []
                for i in range(1, n + 1):
                    p = _spawn(nets.names[i], ["--data-dir", str(tmp / f"d{i}"), "--role", "inference",
                                               "--listen", f"/ip4/{nets.ip(i)}/tcp/4001", *common, "--connect", *addrs],
                               tmp / f"d{i}.err")
                    procs.append(p)
                    addrs.append(_read_json(p, 60)["addr"])
                seeder = _spawn(nets.names[0], ["--data-dir", str(tmp / "seed"), "--seed", trainer_seed, "--role",
                                                "trainer", "--listen", f"/ip4/{nets.ip(0)}/tcp/4001", "--publish",
                                                str(v1), "--then-publish", str(v2), "--publish-delay", "3", *common,
                                                "--connect", *addrs], tmp / "seed.err", stdin=True)
                procs.append(seeder)
                _read_json(seeder, 60)  # hello
                times, reports = {}, {}
                for version in (1, 2):
                    if version == 2:
                        seeder.stdin.write("go\n")
                        seeder.stdin.flush()
                    while "published_at" not in (msg := _read_json(seeder, 60)):
                        pass
                    published = msg["published_at"]
                    done = []
                    for p in procs[:n]:
                        while "complete" not in (msg := _read_json(p, timeout)) or msg["complete"] != version:
                            pass
                        done.append(msg["at"] - published)
                        reports.setdefault(version, []).append(msg)
                    times[version] = max(done)
                    print(f"  v{version}: completion times (s after publish): {sorted(round(x, 1) for x in done)}")
                for i in range(1, n + 1):
                    assert same_files(v2, tmp / f"d{i}" / "checkpoints" / "2"), f"d{i} differs"
                _stop(procs)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            print(f"  skipped: could not set up namespaces ({e})")
            return None
    rebuilt = [r.get("rebuilt_from_delta") for r in reports[2]]
    print(f"  v2 rebuilt from a delta of {rebuilt[0]} bytes by {sum(1 for x in rebuilt if x)} of {n} holders of v1")
    print(f"  full distribution of v1: {times[1]:.1f} s; delta distribution of v2: {times[2]:.1f} s "
          f"(publish -> last holder complete, the trainer's delta encoding included)")
    print(f"  ratio (delta distribution / full distribution): {times[2] / times[1]:.3f}")
    return times[2] / times[1]


SHARDCAST_CLIENT = """
import sys, time
from shardcast.client_node import ClientNode
servers, out = sys.argv[1].split(","), sys.argv[2]
while True:
    try:  # the client probes every server when created: retry until the middle nodes are up
        if ClientNode(servers, out).download_version("v1", out + "/model.bin"):
            break
    except Exception:
        pass
    time.sleep(1.0)
print(time.time(), flush=True)
"""
SHARDCAST_ORIGIN = """
import sys, time, shardcast
shardcast.initialize(sys.argv[1], port=8000)
print("ready", flush=True)
time.sleep(float(sys.argv[4]))  # middle nodes and clients start meanwhile
print(time.time(), flush=True)
shardcast.broadcast(sys.argv[2], shard_size=int(sys.argv[3]))
time.sleep(1e9)
"""


def shardcast(n: int, size_mib: int, mbit: float, venv: Path, timeout: float = 240.0) -> float | None:
    print(f"== shardcast: origin + 2 middle nodes + {n} clients in namespaces, {size_mib} MiB, upload {mbit} Mbit/s each")
    if os.geteuid() != 0:
        print("  skipped: needs root (ip netns, tc)")
        return None
    py = venv / "bin" / "python"
    if not py.exists() or subprocess.run([py, "-c", "import shardcast"], capture_output=True).returncode:
        print(f"  skipped: no shardcast in {venv} (python -m venv {venv} && {venv}/bin/pip install shardcast)")
        return None
    size = size_mib * MiB
    env = dict(os.environ, SHARDCAST_LOG_LEVEL="WARNING")
    with _scratch("bench-shardcast-") as (tmp, procs):
        try:
            with Namespaces(n + 3, mbit, prefix="scb") as nets:
                src = write_checkpoint(tmp / "src", size, seed=3, files=2)
                blob = tmp / "model.bin"
                with open(blob, "wb") as out:
                    for f in sorted(src.iterdir()):
                        out.write(f.read_bytes())

                def spawn(i: int, *argv: str) -> subprocess.Popen:
                    p = subprocess.Popen(["ip", "netns", "exec", nets.names[i], str(py), *argv], cwd=tmp, env=env,
                                         stdout=subprocess.PIPE, stderr=open(tmp / f"h{i}.err", "w"), text=True)
                    procs.append(p)
                    return p

                for d in ("origin", "m1", "m2"):  # the bandwidth probe every shardcast client fetches first
                    (tmp / d).mkdir()
                    (tmp / d / "data1.bin").write_bytes(os.urandom(64 * 1024))
                origin = spawn(0, "-c", SHARDCAST_ORIGIN, str(tmp / "origin"), str(blob), str(max(size // 4, 1)),
                               str(4 + n * 0.5))
                assert origin.stdout.readline().strip() == "ready"
                for i in (1, 2):
                    spawn(i, "-m", "shardcast.middle_node", "--upstream", f"http://{nets.ip(0)}:8000",
                          "--data-dir", str(tmp / f"m{i}"), "--port", "8000", "--check-interval", "1", "--log-level", "WARNING")
                relays = f"http://{nets.ip(1)}:8000,http://{nets.ip(2)}:8000"
                clients = [spawn(3 + k, "-c", SHARDCAST_CLIENT, relays, str(tmp / f"c{k}")) for k in range(n)]
                start = float(origin.stdout.readline())
                done = []
                for c in clients:
                    left = start + timeout - time.time()
                    ready, _, _ = select.select([c.stdout], [], [], max(left, 0))
                    if not ready:
                        print(f"  shardcast: {len(done)} of {n} clients done after {timeout:.0f} s; stopped (see its logs:"
                              " its single-threaded http.server and 30 s wget timeouts under contention)")
                        return float("inf")
                    done.append(float(c.stdout.readline()) - start)
                for k in range(n):
                    assert (tmp / f"c{k}" / "model.bin").read_bytes() == blob.read_bytes(), f"client {k} differs"
                _stop(procs)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            print(f"  skipped: could not set up namespaces ({e})")
            return None
    t = max(done)
    print(f"  shardcast completion times (s): {sorted(round(x, 1) for x in done)}")
    print(f"  shardcast distribution time: {t:.1f} s")
    return t


def main() -> None:
    # timeout(1) and Ctrl-C: unwind, so that the children are killed and the namespaces removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["calibrate", "overhead", "swarm", "shardcast", "deltas", "all"], nargs="?",
                    default="all")
    ap.add_argument("--changed", type=float, default=0.03,
                    help="deltas: fraction of bf16 values v2 changes (bench/deltas.py: 1-6 %% per RL step)")
    ap.add_argument("--size-mib", type=int, default=0,
                    help="checkpoint size (default 256 overhead, 32 swarm and shardcast; calibrate's streams: 64)")
    ap.add_argument("--seeders", type=int, default=4)
    ap.add_argument("--n", type=int, default=8, help="downloaders in the swarm benchmark")
    ap.add_argument("--mbit", type=float, default=10.0, help="upload cap per host (10 Mbit/s keeps 9 Python processes off the CPU limit of a 2-core machine)")
    ap.add_argument("--shardcast-venv", type=Path, default=Path("/tmp/shardcast-venv"),
                    help="virtualenv with shardcast installed (benchmark only)")
    ap.add_argument("--piece-kib", type=int, default=0, help="piece size for the swarm benchmark (default: automatic)")
    ap.add_argument("--profile", type=Path, help="swarm: cProfile the seed and one downloader into DIR/seed.prof, DIR/d1.prof")
    ap.add_argument("--tasks", action="store_true", help="overhead: the download's event-loop CPU by task")
    ap.add_argument("--hog", action="store_true", help="swarm: keep one core busy with a spinning process meanwhile")
    ap.add_argument("--trace", type=Path, help="swarm: write per-piece times and every host's upload samples (JSON) here")
    if sys.argv[1:2] == ["_stream-end"]:  # one end of capped_stream_cpu_per_mib, in a namespace
        sp = argparse.ArgumentParser()
        sp.add_argument("_", choices=["_stream-end"])
        sp.add_argument("--size-mib", type=int, required=True)
        sp.add_argument("--listen", required=True)
        sp.add_argument("--dial", default="")
        trio.run(_stream_end, sp.parse_args())
        return
    # Quick: every part at a few MiB and 3 downloaders (the namespace parts need root, else they say skipped).
    args = parse_args(ap, {"size_mib": 4, "n": 3, "mbit": 20.0})
    if args.what in ("calibrate", "all"):
        calibrate(args.size_mib or 64)
    if args.what in ("overhead", "all"):
        overhead(args.size_mib or 256, args.seeders, args.tasks)
    if args.what in ("swarm", "all"):
        swarm(args.n, args.size_mib or 32, args.mbit, args.piece_kib, trace=args.trace, hog=args.hog,
              profile=args.profile)
    if args.what in ("deltas", "all"):
        deltas(args.n, args.size_mib or 32, args.mbit, args.changed)
    if args.what in ("shardcast", "all"):
        theirs = shardcast(args.n, args.size_mib or 32, args.mbit, args.shardcast_venv)
        if theirs is not None:
            ours = swarm(args.n, args.size_mib or 32, args.mbit, args.piece_kib, relays=2)
            if ours is not None and theirs == float("inf"):
                print(f"  ratio (shardcast time / shards time, same hosts and caps): > {240.0 / ours:.2f} (shardcast unfinished)")
            elif ours is not None:
                print(f"  ratio (shardcast time / shards time, same hosts and caps): {theirs / ours:.2f}")


if __name__ == "__main__":
    main()
