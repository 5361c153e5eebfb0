"""``make demo``: the whole loop on loopback with a live table, until Ctrl-C or ``--duration``.

One relay (the bootstrap peer), a trainer, a validator and two inference nodes (more with
``--extra``; ``--cheat KIND`` adds a dishonest inference node; ``--engine vllm`` runs the second
on vLLM; ``--model DIR`` trains a real model on a real task, :data:`REAL_TASK`), each a real ``swarm-node``
process with its own data dir under ``--data-root``, on the embedded tiny model and the synthetic
digit-reversal task, each with one torch thread (``DEMO_THREADS``: four torch processes share what
may be two cores). The run file names the trainer and the validator as the run's trusted peers.
The live table shows each node's health (node/health.py: ok, starting, stalled or stopped, and
why when not ok), members, checkpoint versions and where they are, rollouts accepted and
rejected, and the reward; the demo ends with the trainer's reward curve (and the mean reward of its
first and last 10 steps), the held-out score of the base and of the last version evaluated, where
the honest work went (node/app/loopfigures.py: trained and lost fractions, trainer idle, validator
utilisation, the trainer's time by phase, a sample's life, the stalls seen while it ran: how many
per node, the longest and its cause; with ``--cheat``, the cheater's samples and what the trainer
made of them on a line apart, told by the trainer's ledger entries), where a step's time goes
(node/steptime.py: each phase of each role, per batch, step or version, and its share of a trainer
step) and the ledger totals by node name (a ``sybil-flood``'s keys summed in one row).
Those figures are also written to ``<data root>/figures.json``.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..steptime import format_step_time, step_time_figures
from ..trainer.evaluation import format_eval
from .errors import UsageError
from .localswarm import LocalSwarm
from .loopfigures import (StallWatch, cheater_keys, format_figures, format_ledger_totals, health_of, judged_samples,
                          loop_figures, reward_ratio)

TINY_TASK = """\
[rl]
group_size = 8
prompts_per_batch = 4
max_new_tokens = 10
"""
RUN_TEMPLATE = """\
# Written by `swarm-node demo`: the tiny default model on the synthetic digit-reversal task.
[run]
name = "demo"
trainers = ["{trainer}"]
validators = ["{validator}"]

""" + TINY_TASK + """

# Back-pressure sized for one CPU machine (node/trainer/pacing.py): the one validator checks more
# slowly than two workers generate, so the trainer keeps about four batches queued and its acks
# tell the workers to wait instead of producing rollouts that would age in the queue.
[trainer]
max_pending_batches = 12
target_pending_batches = 4
verify_timeout_s = 30.0  # a validator gone silent is given up on sooner (one that cannot judge yet says so at once)

[worker]
max_pending_batches = 2

# Staleness is judged at intake (node/trainer/intake.py); the one CPU validator, sharing two cores,
# can take more than two of the demo's ~2 s steps to reach a batch, so an acknowledged batch stays
# trainable for four steps (measured: with two, 19 % of the honest samples expired in the queue).
[grpo]
verify_grace_steps = 4
# A demo step takes every verified batch (~190 samples): eight AdamW steps on ~24 samples each
# rather than four on ~48, the same compute, twice the updates. Measured (docs/benchmarks.md, bench/loop.py):
# 3.0-3.8x reward in 300 s with 8; one run with 4 gave 3.0x too, so the gain is not established.
optimizer_steps = 8
"""


# `--model DIR`: a real instruct model on a real task. Two-term one-digit chain sums ("7 + 9 =") with
# the answer tag prefilled: SmolLM2-135M-Instruct answers them at 0.18 greedy (partly right: the
# scorer gives part credit for "= 16"), inside the 0.02-0.4 a model can learn from; eight tokens
# hold any answer.
REAL_TASK = """\
[rl]
taskset = "reasoning-gym"
answer_prefill = true
group_size = 8
prompts_per_batch = 2
max_new_tokens = 8

[rl.reasoning_gym.chain_sum]
min_terms = 2
max_terms = 2
min_digits = 1
max_digits = 1
"""
# The tiny model's settings that a 135 M model on a CPU outgrows: its learning rate (rl-local on this
# task: at 1e-5 the entropy collapsed within 14 steps, greedy held-out 0.06 -> 0.11; at 3e-6
# 0.13 -> 0.34 in 46 steps, docs/benchmarks.md); eight AdamW
# mini-batch steps (its backward pass is most of a step: two, on at most 32 samples a step, as
# rl-local's 4 prompts x 8 took); a 30 s verification timeout (one batch took a busy validator ~25 s, and
# 20 batches were reassigned as timed out). Checkpoints are published in bfloat16 (273 MB, and a
# step at this learning rate changes few bfloat16 values, so nodes fetch small deltas: 540 MB of
# float32 a version took 15-41 s per node) and run in float32 by workers and validators alike. A
# forward/backward pass holds two packed rows (SmolLM2 trainer: 2.8 GB at two rows, 7.9 GB at four;
# the kernel killed it at 7 GB on a 24 GB machine shared with other work).
REAL_SETTINGS = (("[grpo]\n", "[grpo]\nlr = 3e-6\nmicro_batch_tokens = 1024\n"), ("optimizer_steps = 8", "optimizer_steps = 2"),
                 ("[trainer]\n", "[trainer]\nmax_step_samples = 32\npublish_dtype = \"bfloat16\"\n"),
                 ("[worker]\n", "[inference]\ndtype = \"float32\"\n\n[worker]\n"),
                 ("verify_timeout_s = 30.0", "verify_timeout_s = 300.0"))


def demo_run_text(trainer: str, validator: str, model: str = "") -> str:
    """The demo's run file: the tiny model on digit reversal, or ``model`` on :data:`REAL_TASK`."""
    text = RUN_TEMPLATE.format(trainer=trainer, validator=validator)
    if not model:
        return text
    text = text.replace("the tiny default model on the synthetic digit-reversal task",
                        f"{Path(model).name} on reasoning-gym's chain_sum", 1)
    text = text.replace(TINY_TASK, f"model = {json.dumps(model)}\n\n" + REAL_TASK, 1)
    for tiny, real in REAL_SETTINGS:
        text = text.replace(tiny, real, 1)
    return text


# Disk a `--model` demo fills, in model-weight sizes: five nodes each keep the versions a batch may
# still refer to (async_level + verify_grace_steps + 1 = 7 here) and their deltas; the trainer also
# its optimizer state. SmolLM2-135M's 540 MB of weights filled 25 GB within 13 minutes.
DISK_PER_WEIGHT_BYTE = 50


def check_demo_disk(model_bytes: int, free_bytes: int, where: Path) -> None:
    """UsageError when ``where`` has less free space than a ``--model`` demo fills."""
    need = DISK_PER_WEIGHT_BYTE * model_bytes
    if free_bytes < need:
        raise UsageError(f"demo --model: about {need / 1e9:.0f} GB of disk needed under {where} "
                         f"(five nodes keep seven versions each), {free_bytes / 1e9:.0f} GB free")


def check_demo_model(model: str) -> str:
    """``--model`` as an absolute path, or UsageError saying what is wrong with it."""
    from ..engines.gguf_folder import check_model_source

    try:
        path = check_model_source(model)
    except ValueError as e:  # GGUFError, ModelFolderError
        raise UsageError(f"demo --model: {e} (make smollm2 writes .models/smollm2-135m-instruct)") from None
    return str(Path(path).resolve())


# `--engine vllm`: the run accepts vLLM batches (a validator checks their proofs and log-probs; vLLM's
# sampler cannot be replayed) and inference-2 runs vLLM, on a CPU its CPU build (`make vllm-venv`,
# then `.vllm-venv/bin/swarm-node demo --engine vllm`: every node runs in that venv).
ACCEPT_VLLM = """
[inference]
engines = ["torch", "vllm"]
"""
VLLM_NODE = "inference-2"


# Torch threads per node process. The demo runs four torch processes (trainer, validator, two
# inference nodes) on a machine that may have two cores: with torch's default (one thread per core
# each) their OpenMP threads spin against each other; one thread each lets the OS share the cores.
DEMO_THREADS = 1


def node_env(threads: int | None) -> dict[str, str]:
    """Environment for the demo's node processes: torch's intra-op threads (None: torch's default)."""
    if not threads:
        return {}
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def _fmt(value, default: str = "-") -> str:
    return default if value is None else str(value)


def describe(role: str, status: dict) -> tuple[str, str, str]:
    """(versions held, rollouts, reward) columns for one node's status."""
    held = ",".join(map(str, (status.get("shards") or {}).get("held", []))) or "-"
    if role == "trainer":
        t = status.get("trainer") or {}
        b = t.get("batches", {})
        rewards = t.get("reward") or []
        reward = f"{rewards[-1][1]:.3f}" if rewards else "-"
        return held, f"step {_fmt(t.get('step'))}: trained {b.get('trained', 0)} rejected {b.get('rejected', 0)} waiting {b.get('gated', 0)}", reward
    if role == "inference":
        i = status.get("inference") or {}
        b = i.get("batches", {})
        refused = sum((b.get("refused") or {}).values())
        cheat = f" [red]cheat={i['cheat']}[/]" if i.get("cheat") else ""
        engine = f" engine={i['engine']}" if i.get("engine") not in (None, "torch") else ""
        # Waiting for an ack before its next step (issue 39: lost batches left it near the trainer's step window).
        step_held = " [yellow]held: step window[/]" if (i.get("step_window") or {}).get("held") else ""
        return held, (f"v{_fmt(i.get('policy_version'))}: sent {b.get('sent', 0)} acked {b.get('accepted', 0)} "
                      f"refused {refused}{cheat}{engine}{step_held}"), _fmt(i.get("mean_reward"))
    if role == "validator":
        v = status.get("validator") or {}
        verdicts = v.get("verdicts", {})
        behind = " [yellow]behind[/]" if v.get("behind") else ""
        return held, f"verdicts ok {verdicts.get('accepted', 0)} rejected {verdicts.get('rejected', 0)} queue {v.get('queue', 0)}{behind}", "-"
    return held, "-", "-"


HEALTH_CELL_CHARS = 80  # a stall's cause is cut to this in the live table (the summary has it whole)
HEALTH_STYLE = {"ok": "green", "starting": "yellow", "stalled": "red", "stopped": "dim"}


def health_cell(status: dict) -> str:
    """The health column: the node's state (node/health.py), and its cause when it is not ok."""
    state, cause = health_of(status)
    if state == "-":
        return state
    text = state if state == "ok" or not cause else f"{state}: {cause}"
    if len(text) > HEALTH_CELL_CHARS:
        text = text[:HEALTH_CELL_CHARS - 1] + "…"
    style = HEALTH_STYLE.get(state)
    return f"[{style}]{escape(text)}[/]" if style else escape(text)


def build_table(swarm: LocalSwarm, statuses: dict[str, tuple[str, dict]], started: float,
                caption: str | None = None) -> Table:
    """The live table of ``statuses`` (:func:`swarm_statuses`, read once per refresh)."""
    table = Table(title=f"swarm-node demo — {time.monotonic() - started:.0f}s (Ctrl-C to stop)", caption=caption)
    for col in ("node", "role", "health", "members a/s/d/l", "conns", "versions held", "rollouts", "reward"):
        table.add_column(col)
    for name, proc in swarm.procs.items():
        status = statuses[name][1]  # a stopped node leaves its last status behind
        member = status.get("membership", {})
        c = member.get("counts", {})
        counts = f"{c.get('alive', '-')}/{c.get('suspect', '-')}/{c.get('dead', '-')}/{c.get('left', '-')}"
        held, rollouts, reward = describe(proc.role, status)
        label = name if proc.alive() else f"{name} [red](exited)[/]"
        table.add_row(label, proc.role, health_cell(status), counts, _fmt(member.get("connections")), held, rollouts, reward)
    return table


def swarm_statuses(swarm: LocalSwarm) -> dict[str, tuple[str, dict]]:
    """Every node's (role, last status), as node/app/loopfigures.py takes them."""
    return {name: (p.role, swarm.status(name)) for name, p in swarm.procs.items()}


def reward_plot(curve: list[list[float]], width: int = 60, height: int = 10) -> str:
    """A text plot of (step, mean reward) points: rows are reward levels, columns steps."""
    if not curve:
        return "(no training steps yet)"
    values = [r for _, r in curve]
    if len(values) > width:  # average into width buckets
        size = len(values) / width
        values = [sum(values[int(i * size): int((i + 1) * size)]) / max(1, len(values[int(i * size): int((i + 1) * size)])) for i in range(width)]
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    rows = []
    for level in range(height, -1, -1):
        y = lo + span * level / height
        line = "".join("*" if round((v - lo) / span * height) == level else " " for v in values)
        rows.append(f"{y:7.3f} |{line}")
    rows.append(" " * 8 + "+" + "-" * len(values))
    rows.append(" " * 9 + f"step {int(curve[0][0])} .. {int(curve[-1][0])}")
    return "\n".join(rows)


def read_ledger(data_dir: Path) -> tuple[dict, list[dict]] | str:
    """One node's ledger replica: its totals (`swarm-node ledger --json`) and its entries (`swarm-node
    ledger export`), or why they could not be read."""
    out = []
    for command in (["ledger", "--json"], ["ledger", "export"]):
        proc = subprocess.run([sys.executable, "-m", "node", *command, "--data-dir", str(data_dir)],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            return proc.stderr
        out.append(proc.stdout)
    return json.loads(out[0]), [json.loads(line) for line in out[1].splitlines() if line.strip()]


def ledger_text(ledger: tuple[dict, list[dict]] | str, names: dict[str, str]) -> str:
    """The ledger totals table with the demo's node names (node/app/loopfigures.py), its size and digest."""
    if isinstance(ledger, str):
        return ledger
    totals, entries = ledger
    authors = {e["author"] for e in entries if "author" in e}
    lines = [format_ledger_totals(totals["totals"], names),
             f"\n{totals['entries']} entries from {len(authors)} authors; digest {totals['digest'][:16]}"]
    lines += [f"EQUIVOCATION: {names.get(a, a)} signed two entries at seq {seq}; its entries from there on are excluded"
              for a, seq in totals["flagged"].items()]
    return "\n".join(lines)


def _free_or_other(port: int) -> int:
    """``port`` if 127.0.0.1 can bind it now, else one the kernel picks (the demo must not fail
    because something else holds 8080)."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_demo(args) -> int:
    console = Console()
    if args.engine == "vllm":
        from ..engines.vllm_engine import vllm_problem

        problem = vllm_problem(allow_cpu=True)
        if problem is not None:
            raise UsageError(f"demo --engine vllm: {problem}")
    model = check_demo_model(args.model) if args.model else ""
    root: Path = args.data_root
    if model:
        weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) or Path(model).stat().st_size
        where = next(p for p in (root, *root.absolute().parents) if p.exists())
        check_demo_disk(weights, shutil.disk_usage(where).free, where)
    if root.exists():
        shutil.rmtree(root)
    names = [("relay", "relay"), ("trainer", "trainer"), ("validator", "validator"),
             ("inference-1", "inference"), ("inference-2", "inference")]
    names += [(f"inference-{i + 3}", "inference") for i in range(args.extra)]
    stop = False

    def on_signal(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if args.http_port:
        args.http_port = _free_or_other(args.http_port)
    with LocalSwarm(root, log_level=args.log_level, extra_env=node_env(DEMO_THREADS)) as swarm:
        run_text = demo_run_text(swarm.peer_id("trainer"), swarm.peer_id("validator"), model)
        engine_args: dict[str, list[str]] = {}
        if args.engine == "vllm":
            run_text += ACCEPT_VLLM
            vllm_run = root / "vllm.toml"
            vllm_run.write_text(run_text.replace("[inference]\n", '[inference]\nengine = "vllm"\n'))
            engine_args[VLLM_NODE] = ["--run", str(vllm_run)]
        swarm.write_run_file(run_text)
        console.print(f"starting {len(names) + bool(args.cheat)} nodes on 127.0.0.1 "
                      f"(data in {root}/, logs in {root}/<node>/node.log)")
        for name, role in names:
            web = ["--http-port", str(args.http_port)] if name == "trainer" and args.http_port else []
            swarm.start(name, role, *web, *engine_args.get(name, []))
        if args.http_port:  # the trainer's page: members, propagation, reward curve, ledger
            console.print(f"status page: http://127.0.0.1:{args.http_port}/")
        if args.cheat:
            cheat_run = root / "cheat.toml"
            cheat_run.write_text(run_text.replace("[worker]\n", f'[worker]\ncheat = "{args.cheat}"\n'))
            swarm.start("cheater", "inference", "--run", str(cheat_run))
        started = time.monotonic()
        caption = f"status page: http://127.0.0.1:{args.http_port}/" if args.http_port else None
        stalls = StallWatch()
        with Live(build_table(swarm, swarm_statuses(swarm), started, caption), console=console,
                  refresh_per_second=1) as live:
            while not stop and (not args.duration or time.monotonic() - started < args.duration):
                time.sleep(1.0)
                statuses = swarm_statuses(swarm)  # one read of each node's status file per refresh
                live.update(build_table(swarm, statuses, started, caption))
                stalls.observe(statuses, time.monotonic())
        seconds = time.monotonic() - started
        stalled = stalls.summary(time.monotonic())
        console.print("stopping nodes (each leaves the swarm with a signed goodbye)…")
    final = swarm_statuses(swarm)  # the nodes stopped: their last statuses
    console.print(build_table(swarm, final, started))
    curve = (final["trainer"][1].get("trainer") or {}).get("reward") or []
    console.print(Text("\nmean reward per training step (trainer)", style="bold"))
    console.print(reward_plot(curve))
    ratio = reward_ratio(curve)
    if ratio is not None:
        first, last, times = ratio
        console.print(f"mean reward, first 10 steps {first:.3f}, last 10 steps {last:.3f}"
                      + (f" ({times:.2f}×)" if times is not None else ""))
    console.print(format_eval((final["trainer"][1].get("trainer") or {}).get("eval")), markup=False)
    peer_names = {swarm.peer_id(name): name for name in swarm.procs}
    ledger = read_ledger(root / "trainer")  # whose batches the trainer judged: the cheater's apart (loopfigures)
    judged = None
    if args.cheat and not isinstance(ledger, str):
        keys = cheater_keys(ledger[0]["totals"], peer_names, "cheater")
        judged = judged_samples(ledger[1], keys, {swarm.peer_id("trainer")})
    figures = loop_figures(final, seconds, stalled, judged)
    console.print(Text("\nwhere the work went", style="bold"))
    console.print(format_figures(figures), markup=False)
    # Each role's phase timings from its status (node/steptime.py): what a step costs on this model and machine.
    figures["step_time"] = step_time_figures(final)
    console.print(Text("\nwhere a step's time goes (mean seconds per batch, step or checkpoint version)", style="bold"))
    console.print(format_step_time(figures["step_time"]), markup=False)
    (root / "figures.json").write_text(json.dumps(figures, indent=1))
    (root / "reward.json").write_text(json.dumps(curve))
    png = subprocess.run(
        [sys.executable, "-m", "node", "trainer-steps", "--data-dir", str(root / "trainer"), "--png", str(root / "reward.png")],
        capture_output=True, text=True, timeout=60,
    )
    console.print(Text("\nledger totals (the trainer's replica)", style="bold"))
    console.print(ledger_text(ledger, peer_names), markup=False)
    saved = f"{root / 'reward.png'} and {root / 'reward.json'}" if png.returncode == 0 else str(root / "reward.json")
    console.print(f"reward curve saved to {saved}")
    return 0
