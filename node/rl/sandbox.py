"""Run untrusted Python (a model's code answer plus unit tests) without letting it hurt the node.

How this works — every run gets, in layers, whatever this machine allows:

* a fresh temporary directory as working dir and HOME, deleted afterwards; a minimal environment;
  ``python -I -S -B`` (isolated mode: no user site, no PYTHON* variables, no site-packages);
* resource limits (set by ``prlimit`` before anything else runs): CPU seconds (RLIMIT_CPU), address space
  (RLIMIT_AS), size of any file it writes (RLIMIT_FSIZE, which also caps its stdout/stderr because
  they go to files), open files, no core dumps, and a process cap (RLIMIT_NPROC) against fork bombs;
* its own session / process group, killed as a whole (SIGKILL) at the wall-clock limit;
* when ``unshare`` works here: new network namespace (no network at all: only a down loopback), new
  PID namespace whose init is killed with the run (so a forked-off grandchild cannot survive), and,
  when we are root, the code runs as ``nobody`` (so it cannot write outside world-writable places,
  and RLIMIT_NPROC counts only its own processes). Without root but with user namespaces we map
  ourselves to root inside a user namespace for the same network/PID isolation.

What is *not* isolated: without unshare the network is reachable (``isolation`` says so); the
filesystem is only protected by permissions (no chroot/mount namespace): run as nobody it can still
write to world-writable directories such as /tmp (bounded by RLIMIT_FSIZE).

Any failure — non-zero exit, signal, timeout, memory error — is just a result; nothing raises.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

NOBODY = 65534
MAX_CODE_BYTES = 256 * 1024  # refuse larger programs outright
NPROC_MARGIN = 32  # processes/threads a candidate may add on top of what the uid already runs
OPEN_FILES = 64


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0  # wall-clock limit; the process group is killed after it
    cpu_s: int = 5  # RLIMIT_CPU seconds
    memory_mb: int = 512  # RLIMIT_AS
    output_kb: int = 64  # RLIMIT_FSIZE: max bytes of stdout, of stderr and of any file written


DEFAULT_LIMITS = Limits()


@dataclass
class SandboxResult:
    returncode: int | None  # None when killed at the wall-clock limit
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    isolation: str  # which isolation applied (see isolation_mode)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _interpreters() -> list[str]:
    """Python interpreters to try, the node's own first. Candidates get the standard library only
    (``-I -S``), so a system python of another minor version does as well; it matters when the
    node's interpreter lives where ``nobody`` cannot read (e.g. under /root)."""
    own = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    out = [own]
    for alt in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(alt) and os.path.realpath(alt) != own:
            out.append(os.path.realpath(alt))
    return out


@lru_cache(maxsize=1)
def isolation_mode() -> tuple[str, tuple[str, ...], str]:
    """(name, command prefix, interpreter) of the strongest isolation that works here (probed once).

    ``netns+pidns+nobody`` (root), ``userns+netns+pidns`` (user namespaces), or ``rlimits-only``
    (network reachable: a clear note in every result).
    """
    base = ("unshare", "--net", "--pid", "--fork", "--kill-child")
    ladder = []
    if os.geteuid() == 0:
        ladder.append(("netns+pidns+nobody", base + ("--setgid", str(NOBODY), "--setuid", str(NOBODY), "--")))
    ladder.append(("userns+netns+pidns", ("unshare", "--map-root-user") + base[1:] + ("--",)))
    for name, prefix in ladder:
        for python in _interpreters():
            try:
                r = subprocess.run(list(prefix) + [python, "-I", "-S", "-c", "pass"], capture_output=True, timeout=10,
                                   check=False)
            except (OSError, subprocess.SubprocessError):
                continue
            if r.returncode == 0:
                return name, prefix, python
    return "rlimits-only (network NOT isolated: unshare unavailable)", (), _interpreters()[0]


def _count_uid_tasks(uid: int) -> int:
    """Threads (tasks) that ``uid`` runs now: RLIMIT_NPROC counts these, per real uid."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return n


def _limit_prefix(limits: Limits, nproc: int) -> list[str]:
    """``prlimit`` arguments setting the run's resource limits before anything else is exec'd.

    Why prlimit rather than a ``preexec_fn``: the node runs threads (torch, trio), and Python code
    between fork and exec in a threaded process can deadlock; prlimit (util-linux, like unshare)
    applies the limits from a clean process.
    """
    cpu = max(1, int(limits.cpu_s))
    mem = limits.memory_mb * 1024 * 1024
    out = limits.output_kb * 1024
    return ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={mem}", f"--fsize={out}", "--core=0",
            f"--nofile={OPEN_FILES}", f"--nproc={nproc}", "--"]


def run_python(code: str, limits: Limits = DEFAULT_LIMITS) -> SandboxResult:
    """Run ``code`` as a Python program under the sandbox; never raises for anything the code does."""
    mode, prefix, python = isolation_mode()
    if len(code.encode("utf-8", "replace")) > MAX_CODE_BYTES:
        return SandboxResult(None, "", "program too large", False, 0.0, mode)
    runs_as_nobody = "nobody" in mode
    # Under the namespace+nobody mode the cap counts nobody's tasks only; otherwise our own uid's,
    # so leave room for what this uid already runs (the node's threads included).
    nproc = NPROC_MARGIN if runs_as_nobody else _count_uid_tasks(os.getuid()) + NPROC_MARGIN
    with tempfile.TemporaryDirectory(prefix="swarm-sbx-") as tmp:
        work = Path(tmp)
        (work / "main.py").write_text(code, encoding="utf-8", errors="replace")
        if runs_as_nobody:
            os.chown(work, NOBODY, NOBODY)
            os.chmod(work, 0o700)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        cmd = _limit_prefix(limits, nproc) + list(prefix) + [python, "-I", "-S", "-B", "main.py"]
        start = time.monotonic()
        timed_out = False
        out_path, err_path = work / ".stdout", work / ".stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            if runs_as_nobody:
                os.chown(out_path, NOBODY, NOBODY)
                os.chown(err_path, NOBODY, NOBODY)
            try:
                proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        start_new_session=True, close_fds=True)
            except OSError as e:
                return SandboxResult(None, "", f"could not start: {e}", False, 0.0, mode)
            try:
                rc: int | None = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out, rc = True, None
            finally:
                _kill_group(proc)
        wall = time.monotonic() - start
        cap = limits.output_kb * 1024
        return SandboxResult(rc, _read_capped(out_path, cap), _read_capped(err_path, cap), timed_out, wall, mode)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's whole process group (a new session, so pgid == pid) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - a zombie we cannot reap; leave it
        pass


def _read_capped(path: Path, cap: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(cap).decode("utf-8", "replace")
    except OSError:
        return ""
