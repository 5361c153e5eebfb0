"""reasoning-gym as a task source: procedural tasks generated from the draw, no task file.

``[rl] taskset = "reasoning-gym"`` with a table of generators::

    [rl.reasoning_gym.basic_arithmetic]
    weight = 2            # relative share of the draw (default 1)
    min_terms = 2         # every other key is the generator's own option
    max_terms = 2

How a task is drawn: SHA-256 of (this source's digest, step key, prompt index) picks a generator by
weight and a seed; ``reasoning_gym.create_dataset(generator, size=1, seed=seed, **options)[0]`` is
the task (reasoning-gym's generators are deterministic in their seed). A validator regenerates the
same question and answer from the same draw and re-scores the completion; no task file travels.
Training seeds are below 2**62; :func:`GymTasks.evaluation` draws from 2**62 up, so no step key
can ever be asked to train on an evaluation seed (small generators still repeat questions: there
are only 100 one-digit sums).

The answer format is part of the spec: the system prompt (:data:`ANSWER_INSTRUCTION`, unless the
run gives its own) asks for ``<answer>...</answer>``; :func:`extract_answer` takes the text of
exactly one such pair (none, two, or an unclosed one: no answer, reward 0), and the generator's own
scorer judges it, in the bounded scoring server (node/rl/bounded.py). The run may pay a share of
the reward for the format alone (``[rl] format_reward``, off unless set): a small model that never
writes the tag (SmolLM2-135M-Instruct: 1 sample in 64) otherwise gives GRPO no signal at all. Or
the run prefills the tag (``[rl] answer_prefill``): the assistant's turn starts with ``<answer>``,
which is part of the prompt, and the completion is read as the answer up to ``</answer>`` or its
end (:func:`prefilled`). SmolLM2-135M then answers in the tag from its first step (greedy, 2-term
one-digit chain_sum: 0.18 against 0.00 without the prefill).

Identity: the source's digest hashes the reasoning-gym version and the generator table, so two
nodes that disagree on either draw other tasks; a node whose installed reasoning-gym is not the
run's ``reasoning_gym_version`` refuses to start (:func:`check_version`).

Which generators: only those in :data:`AUDITED`, whose scorers were read and found to compare
text (string, ``Decimal``, ``json.loads``) without evaluating it. Others are refused: several
reasoning-gym 0.1.25 scorers ``eval`` the answer or pass it to sympy's ``parse_expr`` (which
evaluates it), so a completion would run as code in the scorer (string_insertion, spiral_matrix,
binary_matrix, n_queens, countdown, puzzle24, polynomial_multiplication, the integration tasks...).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from dataclasses import dataclass
from typing import Any

from ..hashes import digest
from .bounded import Bound, Call, score_bounded
from .tasks import Task, TaskFormatError

NAME = "reasoning-gym"
KIND = "reasoning-gym"  # Task.kind of drawn tasks
ANSWER_INSTRUCTION = ("Answer the question. Think briefly if you need to, then give only the final answer "
                      "inside <answer> </answer> tags, for example <answer>42</answer>.")
# With the tag prefilled (``[rl] answer_prefill``) the instruction shows no example answer: SmolLM2-135M
# copied the example's 42 into the tag (greedy chain_sum 0.06 with it, 0.18 without).
PREFILL_INSTRUCTION = "Give only the final answer inside <answer> </answer> tags."
MAX_ANSWER_CHARS = 4096  # a longer answer is not an answer
SEED_SPACE = 1 << 62  # training seeds: [0, 2**62); evaluation seeds: [2**62, ...)
MAX_GENERATORS = 64
# Scorers read in reasoning-gym 0.1.25 and found to evaluate nothing (module docstring).
AUDITED = frozenset({
    "basic_arithmetic", "chain_sum", "products", "leg_counting", "letter_counting", "spell_backward",
    "word_sorting", "gcd", "lcm", "count_bits", "number_sorting", "fraction_simplification", "decimal_arithmetic",
})

ANSWER_OPEN = "<answer>"
_OPEN, _CLOSE = ANSWER_OPEN, "</answer>"


def installed_version() -> str | None:
    """The installed reasoning-gym's version (its distribution metadata: the module's ``__version__``
    says 0.1.19 in 0.1.25), or None when it is not installed."""
    try:
        return importlib.metadata.version("reasoning-gym")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(wanted: str) -> None:
    """TaskFormatError (one line) unless reasoning-gym ``wanted`` is the one installed."""
    have = installed_version()
    if have != wanted:
        now = "is not installed" if have is None else f"{have} is installed"
        raise TaskFormatError(f"this run draws tasks from reasoning-gym {wanted}, but {now} here "
                              f"(pip install reasoning-gym=={wanted})")


@dataclass(frozen=True)
class Generator:
    name: str
    weight: float
    options: dict[str, Any]


def parse_generators(table: Any) -> tuple[Generator, ...]:
    """The run's ``[rl.reasoning_gym]`` table, checked: known audited names, positive weights, options
    the generator accepts (each is built once). TaskFormatError names the generator on any problem."""
    import reasoning_gym

    if not isinstance(table, dict) or not table:
        raise TaskFormatError("run.rl.reasoning_gym: name at least one generator "
                              "([rl.reasoning_gym.basic_arithmetic] ...)")
    if len(table) > MAX_GENERATORS:
        raise TaskFormatError(f"run.rl.reasoning_gym: at most {MAX_GENERATORS} generators")
    out = []
    for name in sorted(table):
        where = f"run.rl.reasoning_gym.{name}"
        spec = table[name]
        if not isinstance(spec, dict):
            raise TaskFormatError(f"{where}: expected a table of options")
        if name not in AUDITED:
            known = name in reasoning_gym.factory.DATASETS
            why = ("its scorer is not on the audited list (some evaluate the answer as code)" if known
                   else "no such reasoning-gym generator")
            raise TaskFormatError(f"{where}: {why}; use one of {', '.join(sorted(AUDITED))}")
        options = {k: v for k, v in spec.items() if k != "weight"}
        weight = spec.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise TaskFormatError(f"{where}.weight: a positive number")
        if {"seed", "size"} & set(options):
            raise TaskFormatError(f"{where}: seed and size come from the draw, not the run file")
        try:
            reasoning_gym.create_dataset(name, size=1, seed=0, **options)[0]
        except (TypeError, ValueError, AssertionError, KeyError) as e:
            raise TaskFormatError(f"{where}: bad options ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        out.append(Generator(name, float(weight), dict(sorted(options.items()))))
    return tuple(out)


class GymTasks:
    """A reasoning-gym task source: ``draw(key, index)`` as node/rl/tasks.py's TaskSet."""

    def __init__(self, generators: tuple[Generator, ...], version: str) -> None:
        self.name = NAME
        self.generators = generators
        self.version = version
        ident = {"version": version, "generators": [[g.name, g.weight, g.options] for g in generators]}
        self.digest = digest(b"swarm-reasoning-gym\x00" + json.dumps(ident, sort_keys=True).encode())
        self._total = math.fsum(g.weight for g in generators)

    def task(self, generator: Generator, seed: int) -> Task:
        """The task ``generator`` makes from ``seed``."""
        import reasoning_gym

        entry = reasoning_gym.create_dataset(generator.name, size=1, seed=seed, **generator.options)[0]
        return Task(f"{generator.name}/{seed}", KIND, str(entry["question"]), str(entry["answer"]),
                    metadata={"generator": generator.name, "seed": seed, "options": generator.options})

    def pick(self, u: float) -> Generator:
        """The generator at ``u`` in [0, 1) of the weighted line."""
        at, acc = u * self._total, 0.0
        for g in self.generators:
            acc += g.weight
            if at < acc:
                return g
        return self.generators[-1]

    def draw(self, key: bytes, index: int) -> Task:
        """The task of prompt ``index`` at the step whose key is ``key``."""
        if len(key) != 32 or index < 0:
            raise ValueError("a 32-byte step key and an index >= 0")
        h = int.from_bytes(digest(b"swarm-gym-draw\x00" + self.digest + key + index.to_bytes(8, "big")), "big")
        return self.task(self.pick((h >> 128) / float(1 << 128)), h % SEED_SPACE)

    held_out = True  # evaluation seeds are beyond every training seed

    def evaluation(self, count: int) -> list[Task]:
        """``count`` held-out tasks: seeds from 2**62 up, generators in proportion to their weights."""
        return [self.task(self.pick((i + 0.5) / count), SEED_SPACE + i) for i in range(count)]


def prefilled(completion: str) -> str:
    """The tagged text of a completion whose turn began with the prefilled ``<answer>``: the tag
    before it, and the closing tag after it unless the model wrote one (it may stop at its end of turn)."""
    text = _OPEN + completion
    return text if _CLOSE in completion else text + _CLOSE


def extract_answer(completion: str) -> str | None:
    """The text inside exactly one ``<answer>...</answer>``, stripped; None otherwise (module docstring)."""
    if completion.count(_OPEN) != 1 or completion.count(_CLOSE) != 1:
        return None
    start = completion.index(_OPEN) + len(_OPEN)
    end = completion.find(_CLOSE, start)
    if end < 0:
        return None
    answer = completion[start:end].strip()
    return answer if 0 < len(answer) <= MAX_ANSWER_CHARS else None


def score_calls(tasks: list[Task], completions: list[str], bound: Bound, format_reward: float = 0.0,
                answer_prefill: bool = False) -> list[float]:
    """Rewards of ``completions`` (one per task) by each generator's own scorer, each call bounded;
    with ``format_reward`` f, ``(1 - f) * score + f`` for a completion with one well-formed answer;
    with ``answer_prefill``, each completion is read as :func:`prefilled`."""
    answers = [extract_answer(prefilled(c) if answer_prefill else c) for c in completions]
    calls = [Call("reasoning-gym", {"generator": t.metadata["generator"], "options": t.metadata["options"],
                                    "seed": t.metadata["seed"], "answer": a})
             for t, a in zip(tasks, answers) if a is not None]
    outcomes = iter(score_bounded(calls, bound))
    return [(1 - format_reward) * next(outcomes).score + format_reward if a is not None else 0.0 for a in answers]
