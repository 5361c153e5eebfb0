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
* **memory of the run**, all its processes together (issue 42: rlimits are per process, and six
  children of 400 MB peaked at 2.4 GB against a 512 MB limit): where the node may make a memory
  cgroup (cgroup v2: under or beside the node's own cgroup where the memory controller is enabled
  for children and the node's uid may write, e.g. root, or a user's systemd scope; or the v1 memory
  hierarchy, i.e. root on a v1 or hybrid host), each run gets its own, capped at the limit with no
  swap; the run joins it before anything is exec'd, and it is emptied and removed after. Elsewhere
  (a non-root node without a delegated cgroup) the run may hold :data:`SHARED_PROCESSES` processes
  of ``memory_mb / SHARED_PROCESSES`` each. In a user namespace RLIMIT_NPROC counts the node's uid,
  so that cap is what the uid runs at the start plus the margin: a node thread that ends during the
  run lends the candidate its slot. :attr:`SandboxResult.memory` says which bound applied.

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
# Without a memory cgroup: processes/threads a run may add, each with this share of the memory limit
# (bwrap's own two count: the candidate may fork three more; a zombie not yet reaped counts too).
SHARED_PROCESSES = 6
CGROUP_PREFIX = "swarm-sbx-"
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
    memory_mb: int = 512  # the run's, all processes together (a cgroup; else a share per process, RLIMIT_AS)
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
    memory: str = ""  # how the run's memory was bounded (the module docstring)
    memory_peak_mb: int | None = None  # the run's peak, all processes together (cgroup only)

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
                n += max(1, len(os.listdir(f"/proc/{pid}/task")))  # a zombie lists none, and counts
        except OSError:
            continue
    return n


class RunCgroup:
    """One run's memory cgroup: capped at the run's limit, joined before exec, emptied and removed after."""

    def __init__(self, path: Path, version: int, limit_bytes: int) -> None:
        self.path, self.version = path, version
        path.mkdir()
        try:
            if version == 2:
                (path / "memory.max").write_text(str(limit_bytes))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                if (path / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swap beyond the limit
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except OSError:
            path.rmdir()
            raise

    @property
    def describe(self) -> str:
        return f"cgroup v{self.version}: all processes of the run together"

    def join_prefix(self) -> list[str]:
        """Run the rest of the command line in this cgroup: the shell moves itself, then execs."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs")]

    def peak_mb(self) -> int | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text()) // (1024 * 1024)
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        """Kill whatever is left in it (bwrap's PID namespace normally took it down already) and
        remove it; a cgroup still holding a process cannot be removed, so retry a bounded number of times."""
        for _ in range(100):
            try:
                pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            except FileNotFoundError:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.01)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per v1 controller, and under "" its v2 one (/proc/self/cgroup)."""
    out = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    except (OSError, ValueError):
        pass
    return out


def _cgroup_mounts() -> dict[str, str]:
    """Mount points: "v2" for the cgroup2 filesystem, "memory" for the v1 memory hierarchy."""
    out = {}
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, where, fstype, options = line.split()[:4]
            if fstype == "cgroup2":
                out.setdefault("v2", where)
            elif fstype == "cgroup" and "memory" in options.split(","):
                out.setdefault("memory", where)
    except (OSError, ValueError):
        pass
    return out


@lru_cache(maxsize=1)
def memory_cgroup_parent() -> tuple[Path, int] | None:
    """Where this node may make a memory cgroup per run, and which version; None where it may not.
    Probed once by making one, moving a process into it and removing it."""
    own, mounts = _own_cgroups(), _cgroup_mounts()
    candidates = []
    if "v2" in mounts and "" in own:
        # Under the node's own cgroup, or beside it (v2 lets a cgroup with processes, like the node's,
        # have no children with controllers: a systemd unit or user scope has them in its parent).
        mine = Path(mounts["v2"]) / own[""].lstrip("/")
        for where in (mine, mine.parent) if own[""].strip("/") else (mine,):
            try:
                if "memory" in (where / "cgroup.subtree_control").read_text().split():
                    candidates.append((where, 2))
            except OSError:
                pass
    if "memory" in mounts:
        root = Path(mounts["memory"])
        mine = root / own.get("memory", "/").lstrip("/")
        candidates.append((mine if mine.is_dir() else root, 1))  # a cgroup namespace shows its own root
    for parent, version in candidates:
        probe = parent / f"{CGROUP_PREFIX}probe-{os.getpid()}"
        try:
            group = RunCgroup(probe, version, 64 * 1024 * 1024)
        except OSError:
            continue
        joined = subprocess.run(group.join_prefix() + ["true"], capture_output=True).returncode == 0
        group.remove()
        if joined:
            _remove_orphans(parent)
            return parent, version
    return None


def _remove_orphans(parent: Path) -> None:
    """Remove run cgroups left by a node that died mid-run (named after its pid; empty once
    ``--die-with-parent`` took its run down). Another live node's are left alone."""
    for d in parent.glob(f"{CGROUP_PREFIX}*-*"):
        pid = d.name[len(CGROUP_PREFIX):].split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                d.rmdir()
            except OSError:
                pass
        except PermissionError:  # alive, another uid's
            pass


def _open_run_cgroup(limits: Limits) -> RunCgroup | None:
    where = memory_cgroup_parent()
    if where is None:
        return None
    parent, version = where
    try:
        return RunCgroup(parent / f"{CGROUP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}", version,
                         limits.memory_mb * 1024 * 1024)
    except OSError:
        return None


def _limit_prefix(limits: Limits, nproc: int, memory_mb: int | None = None) -> list[str]:
    """``prlimit`` arguments setting the run's resource limits before anything else is exec'd.

    Why prlimit rather than a ``preexec_fn``: the node runs threads (torch, trio), and Python code
    between fork and exec in a threaded process can deadlock; prlimit (util-linux) applies the limits
    from a clean process. bwrap and the candidate inherit them.
    """
    cpu = max(1, int(limits.cpu_s))
    mem = (memory_mb or limits.memory_mb) * 1024 * 1024
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
    group = _open_run_cgroup(limits)
    try:
        return _execute_in(iso, code, limits, group)
    finally:
        if group is not None:
            group.remove()


def _execute_in(iso: Isolation, code: str, limits: Limits, group: RunCgroup | None) -> SandboxResult:
    margin, process_mb = NPROC_MARGIN, limits.memory_mb
    if group is None:  # no cgroup: fewer processes, each with its share of the run's memory
        margin, process_mb = SHARED_PROCESSES, max(1, limits.memory_mb // SHARED_PROCESSES)
    memory = group.describe if group else f"per process: {process_mb} MB x {margin} processes (no memory cgroup here)"
    nproc = margin if iso.fresh_uid else _count_uid_tasks(os.getuid()) + margin
    setpriv = shutil.which("setpriv") if iso.fresh_uid else None
    with tempfile.TemporaryDirectory(prefix="swarm-sbx-") as tmp:
        work = Path(tmp)  # the node's side only: the program and the captured output
        main_py = work / "main.py"
        main_py.write_text(code, encoding="utf-8", errors="replace")
        main_py.chmod(0o644)  # readable by a fresh uid whatever the node's umask
        cmd = (group.join_prefix() if group else []) + _limit_prefix(limits, nproc, process_mb) + _bwrap_args(iso, main_py, setpriv)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        start = time.monotonic()
        timed_out = False
        out_path, err_path = work / "stdout", work / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        start_new_session=True, close_fds=True)
            except OSError as e:
                return SandboxResult(None, "", f"could not start: {e}", False, 0.0, iso.name, memory)
            try:
                rc: int | None = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out, rc = True, None
            finally:
                _kill_group(proc)
        wall = time.monotonic() - start
        cap = limits.output_kb * 1024
        return SandboxResult(rc, _read_capped(out_path, cap), _read_capped(err_path, cap), timed_out, wall, iso.name,
                             memory, group.peak_mb() if group else None)


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
