"""The trainer's held-out evaluation, run beside training: the evaluation process and the loop that feeds it.

How this works (issue 40, item 5; what to score is node/trainer/evaluation.py). One child process
(node/trainer/evalproc.py) loads the run's evaluation tasks once and scores the model folders it is
given, greedily. It is a process, not a thread of the trainer, so that nothing it does touches the
training path: it holds no lock of the trainer's Python (generation is Python-heavy on a small
model), owns its own torch threads (``[trainer] eval_threads``; torch's thread settings are
process-wide), runs at a low priority (nice 10) so a busy CPU serves training and the other nodes first, and a crash
or an out-of-memory kill of it costs a score, not the trainer. :func:`serve_evaluation` wakes
after each publish, asks the book for the version to score, hands the process its folder, and
records the answer (spool, metrics, status). The process's stderr goes to ``<trainer dir>/eval.log``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from . import checkpoints
from .evaluation import EvalBook, EvalRecord

log = logging.getLogger("node.trainer")

READY_TIMEOUT_S = 600.0  # the process imports torch and loads (or generates) the evaluation tasks
EVAL_TIMEOUT_S = 3600.0  # one version's evaluation; past it the process is killed and the version passed over
MAX_LINE = 64 * 1024  # bytes of one answer line
RESTART_AFTER_S = 30.0  # a process that died is started again after this long ...
MAX_RESTARTS = 3  # ... at most this many times, then evaluation stops with its error in status
IDLE_WAKE_S = 30.0  # with nothing to score, look again at least this often (a missed wake-up costs no more)


class EvalProcessError(Exception):
    """The evaluation process died, said something unreadable or took too long."""


class EvalProcess:
    """The trainer's side of node/trainer/evalproc.py: one JSON line out, one JSON line back."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self._buf = bytearray()

    async def ask(self, obj: dict, timeout: float) -> dict:
        try:
            await self.proc.stdin.send_all((json.dumps(obj) + "\n").encode())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise EvalProcessError(f"the evaluation process exited (see {self.proc.args[-1]})") from None
        with trio.move_on_after(timeout) as scope:
            while b"\n" not in self._buf:
                data = await self.proc.stdout.receive_some(MAX_LINE)
                if not data:
                    raise EvalProcessError(f"the evaluation process exited (see {self.proc.args[-1]})")
                self._buf += data
                if len(self._buf) > MAX_LINE:
                    raise EvalProcessError("the evaluation process wrote an over-long line")
        if scope.cancelled_caught:
            raise EvalProcessError(f"no answer from the evaluation process in {timeout:.0f} s")
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        try:
            answer = json.loads(line)
        except ValueError:
            raise EvalProcessError(f"unreadable answer from the evaluation process: {line[:80]!r}") from None
        if not isinstance(answer, dict):
            raise EvalProcessError("the evaluation process answered something other than an object")
        return answer


@asynccontextmanager
async def open_eval_process(settings: dict, log_path: Path) -> AsyncIterator[tuple[EvalProcess, dict]]:
    """Start the evaluation process with ``settings`` (evalproc.py); yields it and its first answer.
    The process is killed on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The trainer's own code: ``-m`` puts the working directory first on sys.path, so the child runs
    # in the trainer's directory (no package there) with this package's folder first on PYTHONPATH.
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    with open(log_path, "ab") as err:
        # The last argument names the log, for error messages and for people reading ps.
        proc = await trio.lowlevel.open_process([sys.executable, "-m", "node.trainer.evalproc", str(log_path)],
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                                cwd=str(log_path.parent), env=env)
    try:
        ev = EvalProcess(proc)
        hello = await ev.ask(settings, READY_TIMEOUT_S)
        yield ev, hello
    finally:
        with trio.CancelScope(shield=True):
            proc.kill()
            await proc.wait()


async def serve_evaluation(book: EvalBook, settings: dict, root: Path, *, latest: Callable[[], int | None],
                           record: Callable[[EvalRecord], Awaitable[None]],
                           wait: Callable[[float], Awaitable[None]]) -> None:
    """Score what ``book`` says is due, until cancelled. ``root`` is the trainer's directory (model
    folders by version, node/trainer/checkpoints.py); ``latest()`` the newest published version;
    ``record`` persists a result; ``wait(timeout)`` returns early when a version is published."""
    restarts = 0
    while True:
        try:
            async with open_eval_process(settings, root / "eval.log") as (proc, hello):
                if "error" in hello:  # the run's tasks cannot load here: a setting, not a passing fault
                    book.on_failure(None, str(hello["error"])[:500])
                    log.error("trainer: held-out evaluation is off: %s", book.error)
                    return
                book.held_out = bool(hello.get("held_out"))
                while True:
                    top = latest()
                    version = None if top is None else book.next(top, checkpoints.versions_on_disk(root))
                    if version is None:
                        await wait(IDLE_WAKE_S)
                        continue
                    book.start(version)
                    answer = await proc.ask({"version": version, "folder": str(checkpoints.model_dir(root, version))},
                                            EVAL_TIMEOUT_S)
                    if "score" not in answer:
                        book.on_failure(version, str(answer.get("error", "no score"))[:500])
                        log.warning("trainer: held-out evaluation of v%d failed: %s", version, book.error)
                        continue
                    result = EvalRecord(version, float(answer["score"]), int(answer["tasks"]), float(answer["seconds"]))
                    await record(result)
                    book.on_result(result)
                    log.info("trainer: held-out evaluation of v%d: %.4f on %d tasks (%.1f s)", version, result.score,
                             result.tasks, result.seconds)
        except (EvalProcessError, OSError) as e:
            book.on_failure(book.running, str(e))
            restarts += 1
            if restarts > MAX_RESTARTS:
                log.error("trainer: held-out evaluation stopped after %d restarts: %s", MAX_RESTARTS, e)
                return
            log.warning("trainer: held-out evaluation: %s; starting it again in %.0f s", e, RESTART_AFTER_S)
            await trio.sleep(RESTART_AFTER_S)
