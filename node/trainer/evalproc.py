"""The evaluation process (``python -m node.trainer.evalproc``), started by the trainer (node/trainer/evaluator.py).

One JSON object per line on stdin and stdout. The first line is the settings (``rl``: the run's
``[rl]`` table as a dict; ``tasks``, ``device``, ``threads``); the answer is ``{"held_out": bool,
"tasks": n}`` once the task source is loaded, or ``{"error": "..."}``. Then each
``{"version": v, "folder": path}`` is answered ``{"version": v, "score": s, "tasks": n, "seconds": t}``
or ``{"version": v, "error": "..."}``. The process lowers its own CPU priority (:data:`NICE`) before it
imports torch, so on a shared CPU it runs mostly on what the training path leaves; it ends at
the end of stdin, which is also what it sees when the trainer dies.
"""

from __future__ import annotations

import json
import os
import sys
import time

# A low CPU priority, so training and the other nodes on the machine go first; not the lowest: at
# nice 19 (1.5 % of a core against each busy process) a machine that is never idle never evaluates
# (a test's scores did not come within 120 s while two other processes kept both cores busy). At 10
# it gets about a tenth of a core against each; its work is a few greedy tasks per K-th version.
NICE = 10


def _answer(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    try:
        os.nice(NICE)
    except OSError:
        pass  # already at the floor, or not allowed: evaluate at the priority we have
    line = sys.stdin.readline()
    if not line:
        return 0
    settings = json.loads(line)
    import torch

    from ..engines.torch_engine import TorchEngine
    from ..rl.config import RLConfig
    from ..rl.loop import greedy_score
    from ..rl.sandbox import SandboxUnavailable, require_isolation
    from ..rl.tasks import TaskFormatError, load_run_tasks, runs_code

    torch.set_num_threads(int(settings["threads"]))
    count = int(settings["tasks"])
    try:
        rl = RLConfig(**settings["rl"])
        taskset = load_run_tasks(rl)
        if runs_code(taskset):
            require_isolation("the evaluation tasks include code tasks")
        tasks = taskset.evaluation(count)
    except (TaskFormatError, SandboxUnavailable, ValueError, TypeError) as e:
        _answer({"error": f"evaluation tasks: {e}"})
        return 0
    _answer({"held_out": taskset.held_out, "tasks": len(tasks)})
    engine = TorchEngine(settings["device"])
    for line in sys.stdin:
        ask = json.loads(line)
        version, folder = int(ask["version"]), ask["folder"]
        t0 = time.monotonic()
        try:
            if engine.model is None:
                engine.load(folder)
            else:
                try:
                    engine.swap_weights(folder)  # same architecture: no second model built
                except ValueError:
                    engine.load(folder)
            score = greedy_score(engine, taskset, rl, count)
        except (OSError, ValueError, RuntimeError) as e:  # a folder pruned meanwhile, a model that will not load
            _answer({"version": version, "error": f"v{version}: {type(e).__name__}: {e}"[:500]})
            continue
        _answer({"version": version, "score": score, "tasks": len(tasks), "seconds": time.monotonic() - t0})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
