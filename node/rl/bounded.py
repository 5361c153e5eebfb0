"""Scorers on untrusted text, every call under a time and a memory bound.

A completion is written by a worker nobody trusts, and third-party scorers (reasoning-gym's) parse
it: a crafted answer can make one loop, recurse or allocate without end. So they never run in the
node's process. How this works:

* A **scoring server** (this module run as ``python -m node.rl.bounded``) is started once per node
  process, on first use; it scores nothing itself. The node sends it a batch of calls as one JSON
  line and reads one JSON line back per call, in order.
* For a batch the server forks a **child** that caps its address space (RLIMIT_AS: its size at
  fork plus ``memory_mb``) and answers the calls one by one. The server gives each call ``time_s``
  of wall time from the previous answer; past it, it kills the child (by pid) and the call scores
  0 (``timeout``), and a fresh child takes the rest of the batch. An allocation past the cap is a
  ``MemoryError`` in the child: 0 (``memory``). A child that dies without answering: 0 (``crashed``).
  So a hostile completion scores 0 and costs at most ``time_s`` and ``memory_mb``; honest calls of
  the same batch are unaffected (one fork per batch, not per call, keeps the honest path cheap).
* The node side kills the server too (by pid) when it stops answering, and starts another on the
  next call.

Forking happens in the server, a single-threaded process, never in the node (whose threads could
hold locks a forked child would wait on forever).

A bound is not a sandbox: a scorer that evaluates the text as code (``eval``, sympy's
``parse_expr``) would run it. Which reasoning-gym generators may be used at all is node/rl/gym.py's
rule (its audited list); this module bounds what they cost.

Families: ``reasoning-gym`` (args: generator, options, seed, answer: the entry is regenerated in the
child, so only JSON crosses the pipe).
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SERVER_SLACK_S = 60.0  # beyond the calls' own bounds, how long the node waits for the server (its first import)
MAX_LINE = 1 << 20  # bytes of one answer line from a child or the server


@dataclass(frozen=True)
class Bound:
    """What one scoring call may cost."""

    time_s: float = 2.0  # wall-clock seconds
    memory_mb: int = 256  # address space beyond the child's size at fork


@dataclass(frozen=True)
class Call:
    family: str
    args: dict


@dataclass(frozen=True)
class Outcome:
    score: float  # in [0, 1]
    reason: str  # ok | timeout | memory | crashed | error: <type>


# --------------------------------------------------------------------------------------------
# Families (run in the child)


def _score_reasoning_gym(generator: str, options: dict, seed: int, answer: str) -> float:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(generator, size=1, seed=seed, **options)
    return dataset.score_answer(answer, dataset[0])


FAMILIES: dict[str, Callable[..., float]] = {"reasoning-gym": _score_reasoning_gym}
# Imported by the server before it forks, so a child does not pay for them on every batch.
PRELOAD = {"reasoning-gym": "reasoning_gym"}


def _answer(call: dict) -> dict:
    try:
        value = float(FAMILIES[call["family"]](**call["args"]))
    except MemoryError:
        return {"score": 0.0, "reason": "memory"}
    except BaseException as e:  # noqa: BLE001 - whatever the text made the scorer do is a result
        return {"score": 0.0, "reason": f"error: {type(e).__name__}"}
    if not math.isfinite(value):
        return {"score": 0.0, "reason": "error: not finite"}
    return {"score": min(1.0, max(0.0, value)), "reason": "ok"}


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _child(calls: list[dict], memory_mb: int, out_fd: int) -> None:
    import resource

    cap = _address_space() + memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for call in calls:
        line = (json.dumps(_answer(call)) + "\n").encode()
        os.write(out_fd, line)
    os._exit(0)


def _run_batch(calls: list[dict], bound: dict, emit: Callable[[dict], None]) -> None:
    """Answer ``calls`` in order through forked children, each call within ``bound``."""
    done = 0
    while done < len(calls):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(calls[done:], int(bound["memory_mb"]), w)
        os.close(w)
        buf = b""
        try:
            while done < len(calls):
                ready, _, _ = select.select([r], [], [], float(bound["time_s"]))
                if not ready:
                    os.kill(pid, signal.SIGKILL)
                    emit({"score": 0.0, "reason": "timeout"})
                    done += 1
                    break
                chunk = os.read(r, 65536)
                if not chunk:  # the child died mid-call (a signal, a limit the interpreter could not turn into an error)
                    emit({"score": 0.0, "reason": "crashed"})
                    done += 1
                    break
                buf += chunk
                while b"\n" in buf and done < len(calls):
                    line, buf = buf.split(b"\n", 1)
                    emit(json.loads(line))
                    done += 1
                if len(buf) > MAX_LINE:
                    raise RuntimeError("scoring child wrote an overlong line")
        finally:
            os.close(r)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)


def serve(stdin=None, stdout=None) -> None:
    """The server loop: one request line in, one answer line per call out, until stdin closes."""
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer

    def emit(answer: dict) -> None:
        stdout.write((json.dumps(answer) + "\n").encode())
        stdout.flush()

    for line in stdin:
        request = json.loads(line)
        for family in {c["family"] for c in request["calls"]}:
            if family in PRELOAD:
                __import__(PRELOAD[family])
        _run_batch(request["calls"], request["bound"], emit)


# --------------------------------------------------------------------------------------------
# The node's side


class ScoringServer:
    """The node's handle on its scoring server: started on first use, restarted when it stops answering."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one batch at a time (scoring runs in worker threads)
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-m", "node.rl.bounded"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        return self._proc

    def stop(self) -> None:
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def score(self, calls: Sequence[Call], bound: Bound) -> list[Outcome]:
        if not calls:
            return []
        for c in calls:
            if c.family not in FAMILIES:
                raise ValueError(f"unknown scorer family {c.family!r}")  # our bug, not the text's
        request = {"bound": {"time_s": bound.time_s, "memory_mb": bound.memory_mb},
                   "calls": [{"family": c.family, "args": c.args} for c in calls]}
        with self._lock:
            proc = self._start()
            out: list[Outcome] = []
            try:
                proc.stdin.write((json.dumps(request) + "\n").encode())
                proc.stdin.flush()
                # Read the pipe itself: a buffered readline would take several answers at once and
                # leave them where select cannot see them (the batch then waited for nothing and its
                # rest scored "crashed").
                fd, buf = proc.stdout.fileno(), b""
                while len(out) < len(calls):
                    if b"\n" not in buf:
                        if len(buf) > MAX_LINE:
                            raise ValueError("scoring server wrote an overlong line")
                        ready, _, _ = select.select([fd], [], [], bound.time_s + SERVER_SLACK_S)
                        chunk = os.read(fd, 65536) if ready else b""
                        if not chunk:
                            raise OSError("scoring server stopped answering")
                        buf += chunk
                        continue
                    line, buf = buf.split(b"\n", 1)
                    answer = json.loads(line)
                    out.append(Outcome(float(answer["score"]), str(answer["reason"])))
            except (OSError, ValueError, KeyError):
                self._stop()
                out += [Outcome(0.0, "crashed")] * (len(calls) - len(out))
            return out


_SERVER = ScoringServer()


def score_bounded(calls: Sequence[Call], bound: Bound) -> list[Outcome]:
    """Each call's score, each under ``bound`` (module docstring), in this process's scoring server."""
    return _SERVER.score(calls, bound)


def stop_server() -> None:
    """Stop this process's scoring server (a later call starts another)."""
    _SERVER.stop()


if __name__ == "__main__":
    serve()
