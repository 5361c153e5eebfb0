"""Run untrusted Python (a model's code answer plus unit tests) without letting it hurt the node.

On a validator that code comes from untrusted workers, so the sandbox must hold whatever uid the node
runs as (root on a dev box, ``swarm`` in the shipped container and systemd unit). How this works:

* **bubblewrap** (``bwrap``, Debian package ``bubblewrap``; the maintained sandbox Flatpak uses) builds
  every run a new mount, PID, network, IPC, UTS and cgroup namespace whose root is
  an empty tmpfs holding only, read-only: the interpreter's installation (its prefix: binary, stdlib,
  libpython), the system's shared libraries (``/usr/lib*``) and ``/etc/ld.so.cache``; plus a new
  ``/proc`` (only the run's own processes), a minimal ``/dev`` and a size-capped tmpfs ``/tmp`` as
  working dir and HOME, gone when the run ends. The node's data dir (key, ledger, checkpoints), the
  repository, /root, /home, /etc and other processes simply do not exist in there; there is no network
  but a down loopback; ``--clearenv`` leaves only the few variables set here; ``--die-with-parent`` and
  the PID namespace take every process of the run down with it.
* **who the candidate is**: when the node is root, bwrap needs no user namespace, and the candidate
  is switched (``setpriv``, util-linux) to a fresh uid from :data:`SANDBOX_UID_BASE` with no groups,
  no capabilities and no-new-privs, so it owns no file and shares no process count with anyone. When
  the node is not root, bwrap makes an unprivileged user namespace (``--unshare-user``, nested ones
  disabled): the candidate keeps the node's uid outside, but every place that uid could reach (files,
  processes, sockets, IPC) is outside its namespaces.
* **limits**, set by ``prlimit`` before bwrap starts: CPU seconds (RLIMIT_CPU), address space
  (RLIMIT_AS), size of any file it writes (RLIMIT_FSIZE, which also caps its stdout/stderr: they go
  to files), open files, no core dumps, a process cap (RLIMIT_NPROC) against fork bombs; the run's
  tmpfs is capped at :data:`SCRATCH_BYTES`; the wall-clock limit kills the whole run.

When bwrap is missing or cannot build its namespaces here (e.g. Docker's default seccomp/AppArmor
profile forbids them; see docs/security.md, "Code sandbox"), :func:`isolation_mode` says so and
:func:`run_python` raises :class:`SandboxUnavailable`: there is no weaker fallback. Nodes that would
run code call :func:`require_isolation` at start and refuse to start instead.

Any failure of the *candidate* — non-zero exit, signal, timeout, memory error — is just a result.
This module imports only the standard library.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

MAX_CODE_BYTES = 256 * 1024  # refuse larger programs outright
NPROC_MARGIN = 32  # processes/threads a candidate may add on top of what its uid already runs
OPEN_FILES = 64
SCRATCH_BYTES = 16 * 1024 * 1024  # size of the run's tmpfs /tmp (its only writable place)
# Candidates of a root node run as SANDBOX_UID_BASE + a random offset below 2**24: far above any
# account (Debian gives users 1000.., subordinate-uid ranges 100000..) and below 2**31.
SANDBOX_UID_BASE = 0x70000000
BWRAP = "bwrap"  # looked up on PATH
SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
GUEST_MAIN = "/tmp/main.py"
INSTALL_HINT = ("install bubblewrap (Debian: apt-get install bubblewrap) and allow it to create namespaces "
                "(in a container: see docs/security.md)")


class SandboxUnavailable(RuntimeError):
    """No isolating sandbox works on this machine; the message says what is missing and how to fix it."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 5.0  # wall-clock limit; the whole run is killed after it
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


class Isolation(NamedTuple):
    """What :func:`isolation_mode` found: ``name`` (reported in every result), the interpreter the
    candidate runs, and whether the candidate is switched to a fresh uid (the node is root)."""

    name: str
    python: str
    fresh_uid: bool
    problem: str = ""  # why no sandbox works (name == NONE)

    @property
    def available(self) -> bool:
        return self.name != NONE


ROOT_MODE = "bwrap: mount+pid+net+ipc+uts namespaces, fresh uid"
USERNS_MODE = "bwrap: user+mount+pid+net+ipc+uts namespaces"
NONE = "none"


def _interpreters() -> list[str]:
    """Python interpreters to try, the node's own first. Candidates get the standard library only
    (``-I -S``), so a system python of another minor version does as well; it matters when the
    node's interpreter lives where the node's uid may not bind it."""
    own = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    out = [own]
    for alt in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(alt) and os.path.realpath(alt) not in out:
            out.append(os.path.realpath(alt))
    return out


def _prefix_of(python: str) -> str:
    """The installation an interpreter needs: ``<prefix>`` of ``<prefix>/bin/pythonX.Y`` (stdlib in
    ``<prefix>/lib/pythonX.Y``, libpython in ``<prefix>/lib``)."""
    d = os.path.dirname(python)
    return os.path.dirname(d) if os.path.basename(d) == "bin" else d


def _bwrap_args(iso: Isolation, main_py: Path, setpriv: str | None) -> list[str]:
    """bwrap's arguments for one run (read-only view, namespaces, scratch tmpfs), program included."""
    args = [shutil.which(BWRAP) or BWRAP, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv", "--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONHASHSEED", "0"]
    if not iso.fresh_uid:
        args += ["--unshare-user", "--disable-userns"]
    # As root: no user namespace (bwrap's --unshare-all would make one, and the fresh uid would not be
    # mapped in it); the namespaces above are created with root's own privileges, dropped by setpriv.
    made: set[str] = set()

    def parents(dest: str) -> None:
        # bwrap would create missing parents 0700 (unreadable for a fresh uid): make them 0755 first.
        parts = Path(dest).parts[1:-1]
        for i in range(len(parts)):
            d = "/" + "/".join(parts[: i + 1])
            if d not in made:
                made.add(d)
                args.extend(["--perms", "0755", "--dir", d])

    def ro(path: str) -> None:
        parents(path)
        args.extend(["--ro-bind", path, path])

    prefix = _prefix_of(iso.python)
    for lib in SYSTEM_LIBS:
        if os.path.islink(lib):
            args.extend(["--symlink", os.readlink(lib), lib])
        elif os.path.isdir(lib) and not (lib + "/").startswith(prefix + "/"):
            ro(lib)
    ro(prefix)
    if os.path.exists("/etc/ld.so.cache"):
        ro("/etc/ld.so.cache")  # where the loader finds libraries outside the default dirs (/usr/local/lib)
    if setpriv:
        ro(setpriv)
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(SCRATCH_BYTES), "--tmpfs", "/tmp",
             "--ro-bind", str(main_py), GUEST_MAIN, "--chdir", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/"]
    args.append("--")
    if setpriv:
        uid = SANDBOX_UID_BASE + secrets.randbelow(1 << 24)
        args += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                 "--inh-caps=-all", "--bounding-set=-all", "--"]
    return args + [iso.python, "-I", "-S", "-B", GUEST_MAIN]


@lru_cache(maxsize=1)
def isolation_mode() -> Isolation:
    """The isolation runs get here (probed once, by running a program in it): :data:`ROOT_MODE` when
    the node is root, :data:`USERNS_MODE` otherwise, or :data:`NONE` with the reason in ``problem``."""
    if shutil.which(BWRAP) is None:
        return Isolation(NONE, _interpreters()[0], False, f"{BWRAP} not found on PATH: {INSTALL_HINT}")
    root = os.geteuid() == 0
    if root and shutil.which("setpriv") is None:
        return Isolation(NONE, _interpreters()[0], False, "setpriv (util-linux) not found on PATH")
    errors = []
    for python in _interpreters():
        iso = Isolation(ROOT_MODE if root else USERNS_MODE, python, root)
        res = _execute(iso, "import sys\nsys.exit(42)", Limits(wall_s=10.0, cpu_s=5, memory_mb=512, output_kb=16))
        if res.returncode == 42:
            return iso
        errors.append(f"{python}: {(res.stderr.strip().splitlines() or [f'exit {res.returncode}'])[-1]}")
    return Isolation(NONE, _interpreters()[0], False,
                     f"{BWRAP} cannot build its sandbox here ({'; '.join(errors)}): {INSTALL_HINT}")


def require_isolation(why: str, instead: str = "") -> Isolation:
    """The sandbox, or :class:`SandboxUnavailable` saying ``why`` one is needed, how to get one and,
    when given, what to do ``instead``."""
    iso = isolation_mode()
    if not iso.available:
        raise SandboxUnavailable(f"{why}, but no code sandbox works on this machine: {iso.problem}"
                                 + (f"; or {instead}" if instead else ""))
    return iso


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
    between fork and exec in a threaded process can deadlock; prlimit (util-linux) applies the limits
    from a clean process. bwrap and the candidate inherit them.
    """
    cpu = max(1, int(limits.cpu_s))
    mem = limits.memory_mb * 1024 * 1024
    out = limits.output_kb * 1024
    return ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={mem}", f"--fsize={out}", "--core=0",
            f"--nofile={OPEN_FILES}", f"--nproc={nproc}", "--"]


def run_python(code: str, limits: Limits = DEFAULT_LIMITS) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox; never raises for anything the code does.

    Raises :class:`SandboxUnavailable` when there is no sandbox here (a node that runs code checks
    :func:`require_isolation` at start, so this is our fault, not the candidate's).
    """
    iso = require_isolation("running a code-task completion")
    if len(code.encode("utf-8", "replace")) > MAX_CODE_BYTES:
        return SandboxResult(None, "", "program too large", False, 0.0, iso.name)
    return _execute(iso, code, limits)


def _execute(iso: Isolation, code: str, limits: Limits) -> SandboxResult:
    # A fresh uid runs nothing else, so the cap is the margin itself. In a user namespace RLIMIT_NPROC
    # counts the node's uid (the kernel checks it at every namespace level), so leave room for what
    # that uid already runs, the node's threads included.
    nproc = NPROC_MARGIN if iso.fresh_uid else _count_uid_tasks(os.getuid()) + NPROC_MARGIN
    setpriv = shutil.which("setpriv") if iso.fresh_uid else None
    with tempfile.TemporaryDirectory(prefix="swarm-sbx-") as tmp:
        work = Path(tmp)  # the node's side only: the program and the captured output
        main_py = work / "main.py"
        main_py.write_text(code, encoding="utf-8", errors="replace")
        main_py.chmod(0o644)  # readable by a fresh uid whatever the node's umask
        cmd = _limit_prefix(limits, nproc) + _bwrap_args(iso, main_py, setpriv)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        start = time.monotonic()
        timed_out = False
        out_path, err_path = work / "stdout", work / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        start_new_session=True, close_fds=True)
            except OSError as e:
                return SandboxResult(None, "", f"could not start: {e}", False, 0.0, iso.name)
            try:
                rc: int | None = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out, rc = True, None
            finally:
                _kill_group(proc)
        wall = time.monotonic() - start
        cap = limits.output_kb * 1024
        return SandboxResult(rc, _read_capped(out_path, cap), _read_capped(err_path, cap), timed_out, wall, iso.name)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL bwrap's process group (a new session, so pgid == pid) and reap it; bwrap's
    ``--die-with-parent`` and the PID namespace take the candidate's own session down with it."""
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
