"""Task sets (JSONL) and the deterministic task draw.

A task file has one JSON object per line::

    {"id": "gsm-17", "kind": "math", "prompt": "...", "answer": "42", "metadata": {...}}
    {"id": "code-3", "kind": "code", "prompt": "...", "tests": "assert f(2) == 4\\n", ...}

``kind`` is one of ``synthetic`` (answer), ``math`` (answer) or ``code`` (tests: ``assert`` lines of
the shapes node/rl/harness.py can judge, checked when the file loads). Small packaged sets
live in ``node/data/<kind>.jsonl``; any file path works too. A task set is named by the SHA-256 of
its bytes (``TaskSet.digest``), so every peer can check it draws from the same set.

The draw (INTELLECT-2, "deterministic task sampling"): task index = SHA-256(set digest, step key,
counter) mod len(set), where the step key (``node.rl.spec.step_key``) hashes the run, the peer id,
the root of the checkpoint manifest the batch claims and the step. A node cannot cherry-pick easy
problems: the validator recomputes which task (key, counter) must have been.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..hashes import digest
from .harness import TestFormatError, parse_tests

KINDS = ("synthetic", "math", "code")
DATA_DIR = Path(__file__).resolve().parent.parent / "data"
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_TASKS = 1_000_000
MAX_PROMPT_CHARS = 32_768
MAX_TESTS_CHARS = 65_536
MAX_ID_CHARS = 256


class TaskFormatError(ValueError):
    """A task file line is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Task:
    id: str
    kind: str
    prompt: str
    answer: str | None = None  # synthetic and math
    tests: str | None = None  # code: assert lines of the shape node/rl/harness.py judges
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class TaskSet:
    name: str
    digest: bytes  # sha256 of the file's bytes
    tasks: tuple[Task, ...]

    def __len__(self) -> int:
        return len(self.tasks)

    def by_id(self, task_id: str) -> Task | None:
        return _index(self).get(task_id)

    def draw(self, key: bytes, index: int) -> Task:
        """The task of prompt ``index`` at the step whose key is ``key`` (:func:`draw_index`)."""
        return self.tasks[draw_index(self.digest, len(self), key, index)]

    @property
    def held_out(self) -> bool:
        """Whether :meth:`evaluation` gives tasks no draw of this set can give: a digit-reversal set's
        (node/rl/synthetic.py makes others); not another file's (no held-out part of its own)."""
        return all(t.kind == "synthetic" and t.metadata.get("task") == "reverse" for t in self.tasks)

    def evaluation(self, count: int) -> list[Task]:
        """``count`` evaluation tasks: for a digit-reversal set, reversals of digit strings none of its
        prompts holds (held out, :attr:`held_out`); for another file, its first ``count`` tasks."""
        if not self.held_out:
            return list(self.tasks[:count])
        from .synthetic import held_out_reversals

        records = held_out_reversals(count, {t.prompt for t in self.tasks})
        return [parse_task(r, f"{self.name} evaluation") for r in records]


_INDEXES: dict[bytes, dict[str, Task]] = {}


def _index(ts: TaskSet) -> dict[str, Task]:
    idx = _INDEXES.get(ts.digest)
    if idx is None:
        idx = _INDEXES[ts.digest] = {t.id: t for t in ts.tasks}
    return idx


def parse_task(obj: Any, where: str) -> Task:
    """One task from a decoded JSON value; TaskFormatError names ``where`` on any problem."""
    if not isinstance(obj, dict):
        raise TaskFormatError(f"{where}: expected a JSON object")
    tid, kind, prompt = obj.get("id"), obj.get("kind"), obj.get("prompt")
    if not isinstance(tid, str) or not 0 < len(tid) <= MAX_ID_CHARS:
        raise TaskFormatError(f"{where}: id must be a string of 1..{MAX_ID_CHARS} characters")
    if kind not in KINDS:
        raise TaskFormatError(f"{where}: kind must be one of {', '.join(KINDS)}")
    if not isinstance(prompt, str) or not 0 < len(prompt) <= MAX_PROMPT_CHARS:
        raise TaskFormatError(f"{where}: prompt must be a non-empty string of at most {MAX_PROMPT_CHARS} characters")
    answer, tests = obj.get("answer"), obj.get("tests")
    meta = obj.get("metadata", {})
    if kind in ("synthetic", "math") and not isinstance(answer, str):
        raise TaskFormatError(f"{where}: a {kind} task needs a string answer")
    if kind == "code" and (not isinstance(tests, str) or not 0 < len(tests) <= MAX_TESTS_CHARS):
        raise TaskFormatError(f"{where}: a code task needs tests (a string of at most {MAX_TESTS_CHARS} characters)")
    if kind == "code":
        try:
            parse_tests(tests)  # the harness judges only tests of its shape: refuse others now, not at scoring
        except TestFormatError as e:
            raise TaskFormatError(f"{where}: {e}") from None
    if not isinstance(meta, dict):
        raise TaskFormatError(f"{where}: metadata must be an object")
    return Task(tid, kind, prompt, answer if isinstance(answer, str) else None,
                tests if isinstance(tests, str) else None, meta)


def parse_taskset(data: bytes, name: str) -> TaskSet:
    """A task set from JSONL bytes (blank lines skipped; ids must be unique)."""
    if len(data) > MAX_FILE_BYTES:
        raise TaskFormatError(f"{name}: larger than {MAX_FILE_BYTES} bytes")
    tasks: list[Task] = []
    seen: set[str] = set()
    for n, line in enumerate(data.decode("utf-8", errors="strict").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFormatError(f"{where}: not JSON ({e.msg})") from None
        task = parse_task(obj, where)
        if task.id in seen:
            raise TaskFormatError(f"{where}: duplicate id {task.id!r}")
        seen.add(task.id)
        tasks.append(task)
        if len(tasks) > MAX_TASKS:
            raise TaskFormatError(f"{name}: more than {MAX_TASKS} tasks")
    if not tasks:
        raise TaskFormatError(f"{name}: no tasks")
    return TaskSet(name, digest(data), tuple(tasks))


def load_taskset(name_or_path: str) -> TaskSet:
    """A packaged set (``synthetic``, ``math``, ``code``) or a JSONL file path."""
    if name_or_path in KINDS:
        path = DATA_DIR / f"{name_or_path}.jsonl"
    else:
        path = Path(name_or_path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TaskFormatError(f"{path}: {e.strerror or e}") from None
    try:
        return parse_taskset(data, name_or_path)
    except UnicodeDecodeError:
        raise TaskFormatError(f"{path}: not UTF-8") from None


def load_run_tasks(rl) -> TaskSet:
    """The run's task source under its ``[rl]`` table (node/rl/config.py ``RLConfig``): a packaged set,
    a task file whose bytes must have the run's ``taskset_sha256``, or reasoning-gym's generators
    (node/rl/gym.py ``GymTasks``, which draws like a TaskSet). TaskFormatError (one line) on any
    mismatch: a node that would draw other tasks than the run's refuses to start."""
    if rl.taskset == "reasoning-gym":
        from .gym import GymTasks, check_version, parse_generators

        check_version(rl.reasoning_gym_version)
        return GymTasks(parse_generators(rl.reasoning_gym), rl.reasoning_gym_version)
    taskset = load_taskset(rl.taskset)
    if rl.taskset not in KINDS:
        have = taskset.digest.hex()
        if not rl.taskset_sha256:
            raise TaskFormatError(f"{rl.taskset}: a task file must be pinned by the run, so every node draws from the same "
                                  f"bytes: add taskset_sha256 = \"{have}\" to [rl]")
        if have != rl.taskset_sha256.lower():
            raise TaskFormatError(f"{rl.taskset}: SHA-256 {have[:16]}... is not the run's taskset_sha256 "
                                  f"{rl.taskset_sha256.lower()[:16]}...: every node needs the run's file")
    return taskset


def runs_code(taskset) -> bool:
    """Whether scoring this set runs model-written code (it has a code task): a node that scores it
    needs the code sandbox (``node.rl.sandbox.require_isolation``)."""
    return isinstance(taskset, TaskSet) and any(t.kind == "code" for t in taskset.tasks)


def draw_index(taskset_digest: bytes, num_tasks: int, key: bytes, index: int) -> int:
    """Task index for (step key, counter): SHA-256 of the set digest, key and counter, mod num_tasks."""
    if num_tasks <= 0:
        raise ValueError("empty task set")
    if index < 0:
        raise ValueError("index must be >= 0")
    if len(key) != 32:
        raise ValueError("a step key is 32 bytes (node.rl.spec.step_key)")
    h = digest(b"swarm-task-draw\x00" + taskset_digest + key + index.to_bytes(8, "big"))
    return int.from_bytes(h, "big") % num_tasks


def draw_task(taskset: TaskSet, key: bytes, index: int) -> Task:
    """The task a worker must work on as its ``index``-th prompt of the step whose key is ``key``
    (a task file's :meth:`TaskSet.draw`, or a generated source's, node/rl/gym.py)."""
    return taskset.draw(key, index)
