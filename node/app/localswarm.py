"""A swarm of real ``swarm-node`` processes on loopback: used by the demo, the tests and benchmarks.

Each node gets its own data dir under ``root``; the first node started is the bootstrap peer of the
others. Processes are tracked by PID and always reaped by :meth:`LocalSwarm.close` (also on
errors, when used as a context manager). Nothing here listens beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..identity import load_or_create_identity
from ..status_files import FRESH_WAIT, NODE_FILE, STATUS_FILE, read_status, want_status

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@dataclass
class Proc:
    name: str
    role: str
    data_dir: Path
    args: list[str]
    popen: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen else -1

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


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
        proc.log_path = self.log_dir / f"{proc.name}.log" if self.log_dir else proc.data_dir / "node.log"
        log = open(proc.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env}
        # A new session: Ctrl-C in the demo's terminal reaches us, and we stop children in order.
        proc.popen = subprocess.Popen(proc.args, stdout=log, stderr=log, env=env, start_new_session=True)
        log.close()

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
        proc = self.procs[name]
        if proc.alive():
            os.kill(proc.pid, sig)
            proc.popen.wait(timeout=15)

    def close(self, grace: float = 8.0) -> None:
        """SIGTERM every child we started, wait, then SIGKILL stragglers. Always reaps."""
        for proc in self.procs.values():
            if proc.alive():
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            if proc.popen is None:
                continue
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.popen.wait()

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
        path = self.procs[name].log_path
        if not path or not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

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
