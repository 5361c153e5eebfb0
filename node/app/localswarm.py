"""A swarm of real ``swarm-node`` processes on loopback: used by the demo, the tests and benchmarks.

Each node gets its own data dir under ``root``; the first node started is the bootstrap peer of the
others. Processes are tracked by PID and always reaped by :meth:`LocalSwarm.close` (also on
errors, when used as a context manager). Nothing here listens beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..identity import load_or_create_identity
from ..status_files import FRESH_WAIT, NODE_FILE, STATUS_FILE, read_status, want_status

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


MAX_LINE = 1 << 20  # bytes of one JSON line a talking child may write


@dataclass
class Proc:
    """One child process we started, known by its PID: spawned into a session of its own, its stderr
    (and its stdout, unless it talks) appended to ``log_path``, and reaped by :meth:`stop` even when
    it will not end. The swarm's nodes are Procs, and so are the tests' stand-alone children
    (tests/test_ledger_multiprocess.py, test_shards_multiprocess.py), which talk: they take one JSON
    command a line on stdin and write one JSON message a line on stdout. ``role`` is the node's
    ``--role`` ("" for a child that is not a ``swarm-node``)."""

    name: str
    role: str
    data_dir: Path
    args: list[str]
    popen: subprocess.Popen | None = None
    log_path: Path | None = None
    _unread: bytes = b""  # what a talking child wrote past its last whole line

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen else -1

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def spawn(self, log_path: Path, env: dict[str, str] | None = None, *, talk: bool = False,
              cwd: Path | None = None) -> None:
        """Start ``args``; ``env`` is added to ours; ``talk``: pipes on stdin and stdout."""
        self.log_path, self._unread = log_path, b""
        with open(log_path, "ab") as log:
            # A new session: Ctrl-C in the demo's terminal reaches us, and we stop children in order.
            self.popen = subprocess.Popen(
                self.args, stdin=subprocess.PIPE if talk else None, stdout=subprocess.PIPE if talk else log,
                stderr=log, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=True)

    # ------------------------------------------------------------------ talking

    def send(self, message: dict) -> None:
        self.popen.stdin.write((json.dumps(message) + "\n").encode())
        self.popen.stdin.flush()

    def next_message(self, timeout: float) -> dict | None:
        """The next JSON line the child wrote, waiting up to ``timeout`` seconds (0: only what is
        there); None if none came. RuntimeError once the child has closed its stdout."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._unread:
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self.popen.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.popen.stdout.fileno(), 65536)
            if not chunk:  # its stdout closed: it ends, or has
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=5)
                raise RuntimeError(f"{self.name} exited (rc={self.popen.poll()}); its log ends:\n{self.tail()}")
            self._unread += chunk
            if len(self._unread) > MAX_LINE and b"\n" not in self._unread:
                raise RuntimeError(f"{self.name} wrote a line over {MAX_LINE} bytes")
        line, self._unread = self._unread.split(b"\n", 1)
        return json.loads(line)

    def read(self, want, timeout: float) -> dict:
        """The first message for which ``want(message)`` holds (the ones before it are passed over);
        TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.next_message(max(0.0, deadline - time.monotonic()))
            if message is None:
                raise TimeoutError(f"{self.name}: no reply in {timeout}s")
            if want(message):
                return message

    # ------------------------------------------------------------------ ending

    def kill(self, sig: int = signal.SIGKILL, wait: float = 15.0) -> None:
        """Send ``sig`` and wait for the process to end (a signal that ends it, then)."""
        if self.alive():
            os.kill(self.pid, sig)
            self.popen.wait(timeout=wait)

    def ask_to_stop(self, request: dict | None = None) -> None:
        """The JSON ``request`` on a talking child's stdin, else (or if its stdin is gone) SIGTERM."""
        if not self.alive():
            return
        if request is not None:
            try:
                self.send(request)
                return
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def reap(self, deadline: float) -> None:
        """Wait for the end until ``deadline`` (time.monotonic()), then SIGKILL. Always reaps."""
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)  # not yet reaped, so the PID is still its own
            self.popen.wait()
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def stop(self, grace: float = 8.0, request: dict | None = None) -> None:
        """:meth:`ask_to_stop`, then :meth:`reap` after ``grace`` seconds at most."""
        self.ask_to_stop(request)
        self.reap(time.monotonic() + grace)

    def tail(self, lines: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class LocalSwarm:
    root: Path
    run_file: Path | None = None
    log_level: str = "info"
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)
    bootstrap_addr: str | None = None
    log_dir: Path | None = None  # where <node>.log go (None: node.log in each node's data dir)

    def __enter__(self) -> "LocalSwarm":
        self.root.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ set-up

    def peer_id(self, name: str) -> str:
        """Create (or read) a node's key before it starts, e.g. to list trainers in a run file."""
        return load_or_create_identity(self.root / name)[0].peer_id

    def write_run_file(self, text: str) -> Path:
        self.run_file = self.root / "run.toml"
        self.run_file.write_text(text)
        return self.run_file

    # ------------------------------------------------------------------ processes

    def start(self, name: str, role: str, *extra: str, bootstrap: bool = True, wait: float = 30.0) -> Proc:
        data_dir = self.root / name
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / NODE_FILE).unlink(missing_ok=True)
        args = [
            sys.executable, "-m", "node",
            "--role", role,
            "--listen", LOOPBACK,
            "--data-dir", str(data_dir),
            "--log-level", self.log_level,
        ]
        if self.run_file is None:  # a node needs a run (node/app/cli.py require_run): the default one
            self.write_run_file("[run]\n")
        args += ["--run", str(self.run_file)]
        if bootstrap and self.bootstrap_addr:
            args += ["--bootstrap", self.bootstrap_addr]
        args += list(extra)
        proc = Proc(name, role, data_dir, args)
        self.procs[name] = proc
        self._spawn(proc)
        if wait:
            self.wait_ready(name, wait)
        if self.bootstrap_addr is None:
            self.bootstrap_addr = self.addr(name)
        return proc

    def _spawn(self, proc: Proc) -> None:
        # Elsewhere when a node's disk is made to fill up (bench/soak.py): its log must not fill with it.
        proc.spawn(self.log_dir / f"{proc.name}.log" if self.log_dir else proc.data_dir / "node.log", self.extra_env)

    def restart(self, name: str, wait: float = 30.0) -> Proc:
        proc = self.procs[name]
        if proc.alive():
            raise RuntimeError(f"{name} is still running")
        # A killed node leaves its last status.json behind; removed, so that what status() returns
        # from now on is the new process's (a stale one satisfied waits and broke a CI run).
        (proc.data_dir / NODE_FILE).unlink(missing_ok=True)
        (proc.data_dir / STATUS_FILE).unlink(missing_ok=True)
        self._spawn(proc)
        if wait:
            self.wait_ready(name, wait)
        return proc

    def wait_ready(self, name: str, timeout: float) -> None:
        proc = self.procs[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (proc.data_dir / NODE_FILE).exists():
                return
            if not proc.alive():
                raise RuntimeError(f"{name} exited with {proc.popen.returncode}:\n{self.tail(name)}")
            time.sleep(0.1)
        raise TimeoutError(f"{name} not ready after {timeout}s:\n{self.tail(name)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].kill(sig)

    def close(self, grace: float = 8.0) -> None:
        """SIGTERM every child we started, wait, then SIGKILL stragglers. Always reaps."""
        for proc in self.procs.values():
            proc.ask_to_stop()
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            proc.reap(deadline)

    # ------------------------------------------------------------------ observing

    def node_info(self, name: str) -> dict:
        return json.loads((self.procs[name].data_dir / NODE_FILE).read_text())

    def addr(self, name: str) -> str:
        return self.node_info(name)["addrs"][0]

    def status(self, name: str, wait: float = FRESH_WAIT) -> dict:
        """The node's status.json, at most a second or two old while the node runs ({} if none);
        ``wait``: how long to block for a fresh one (0 from async code, which polls instead).

        Asks every running node for fresh ones, not only ``name``: callers read the nodes one after
        another (a condition over the whole swarm), and each would otherwise wait for its own."""
        for other in self.procs.values():
            if other.alive():
                want_status(other.data_dir)
        proc = self.procs[name]
        try:
            return read_status(proc.data_dir, running=proc.alive(), wait=wait)
        except (OSError, ValueError):
            return {}

    def member_states(self, name: str) -> dict[str, str]:
        """peer id -> state as ``name`` sees it."""
        rows = self.status(name).get("membership", {}).get("members", [])
        return {r["peer_id"]: r["state"] for r in rows}

    def tail(self, name: str, lines: int = 30) -> str:
        return self.procs[name].tail(lines)

    def wait_until(self, predicate, timeout: float, poll: float = 0.25, explain=None) -> float:
        """Poll until ``predicate()`` is true; returns seconds waited; TimeoutError otherwise, with
        what ``explain()`` says (the state a failed wait needs to be understood: statuses, log tails)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if predicate():
                return time.monotonic() - start
            time.sleep(poll)
        detail = f"\n{explain()}" if explain else ""
        raise TimeoutError(f"condition not met within {timeout}s{detail}")
