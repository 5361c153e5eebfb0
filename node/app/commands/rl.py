"""Subcommands of the ML core: ``init-model`` (the embedded default model) and ``rl-local`` (the RL
loop in one process, to watch a model learn without a swarm)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def add_commands(sub) -> None:
    p = sub.add_parser("init-model", help="create the tiny default model (Qwen2-shaped, local tokenizer, no download), "
                                          "or convert a GGUF file into a model folder")
    p.add_argument("--out", required=True, help="folder to write (an ordinary Hugging Face model folder)")
    p.add_argument("--from-gguf", default="", metavar="FILE",
                   help="convert this GGUF file (weights dequantised to float32, its tokenizer and chat template) instead")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="supervised warm-up steps on the synthetic task's format (default: the demo's; 0 = random init)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace an existing folder")
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser("rl-local", help="run draw -> sample -> score -> GRPO in one process and print the reward per step")
    p.add_argument("--model", default="", help="HF model folder (default: create the tiny default model in a temp dir)")
    p.add_argument("--taskset", default="synthetic", help="synthetic | math | code | reasoning-gym | path to a JSONL file")
    p.add_argument("--gym", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                   help="with --taskset reasoning-gym: a generator, its weight and options "
                        "(e.g. basic_arithmetic:weight=2,min_terms=2,max_terms=2); repeat for a mixture")
    p.add_argument("--system-prompt", default="", help="system prompt ([rl] system_prompt; reasoning-gym's default states the answer format)")
    p.add_argument("--format-reward", type=float, default=0.0,
                   help="reasoning-gym: share of the reward paid for a well-formed <answer> tag ([rl] format_reward; 0 = off)")
    p.add_argument("--answer-prefill", action="store_true",
                   help="reasoning-gym: start the model's turn with <answer> ([rl] answer_prefill)")
    p.add_argument("--chat-template", default="auto", help="auto (the model's template when it has one) | none (raw prompts)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seconds", type=float, default=None, help="stop after this much wall time")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--max-new-tokens", type=int, default=10)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: [grpo] default)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default="", help="write step,mean_reward,seconds to this file")
    p.set_defaults(func=cmd_rl_local)


def parse_gym_args(specs: list[str]) -> dict[str, dict]:
    """``--gym`` values -> the ``[rl.reasoning_gym]`` table (values read as JSON where they parse:
    numbers, true/false, lists; else strings). ValueError names the bad one."""
    import json

    table: dict[str, dict] = {}
    for spec in specs:
        name, _, rest = spec.partition(":")
        if not name or name in table:
            raise ValueError(f"--gym {spec!r}: a generator name, once")
        options = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise ValueError(f"--gym {spec!r}: options are KEY=VALUE")
            try:
                options[key] = json.loads(value)
            except json.JSONDecodeError:
                options[key] = value
        table[name] = options
    return table


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def cmd_init_model(args: argparse.Namespace) -> int:
    from ...rl.warmup import DEFAULT_WARMUP_STEPS, create_default_model

    out = Path(args.out).expanduser()
    if args.from_gguf:
        return _init_from_gguf(Path(args.from_gguf), out, args.force)
    steps = DEFAULT_WARMUP_STEPS if args.warmup_steps is None else args.warmup_steps
    if steps < 0:
        return _fail("--warmup-steps must be >= 0")
    if out.exists() and any(out.iterdir()):
        if not args.force:
            return _fail(f"{out} exists and is not empty (use --force to replace it)")
        shutil.rmtree(out)
    try:
        path, stats = create_default_model(out, seed=args.seed, warmup_steps=steps)
    except OSError as e:
        return _fail(f"{out}: {e.strerror or e}")
    note = f"warm-up {stats.steps} steps, loss {stats.first_loss:.2f} -> {stats.last_loss:.2f}" if stats else "random init"
    print(f"wrote {path} ({note})")
    return 0


def _init_from_gguf(path: Path, out: Path, replace: bool) -> int:
    from ...engines.gguf_folder import GGUFError, convert_gguf

    try:
        folder, params = convert_gguf(path, out, replace=replace)
    except GGUFError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{out}: {e.strerror or e}")
    print(f"wrote {folder} ({params / 1e6:.1f} M parameters, from {path.name})")
    return 0


def has_tokenizer(folder: Path) -> bool:
    """Whether a model folder holds a tokenizer transformers can load without a download."""
    return any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def cmd_rl_local(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from ...engines.torch_engine import TorchEngine
    from ...engines.model import ModelFolderError, check_model_folder
    from ...rl.config import GRPOConfig, RLConfig
    from ...rl.loop import greedy_score, run_local_loop
    from ...rl.sandbox import SandboxUnavailable, require_isolation
    from ...rl.tasks import TaskFormatError, load_run_tasks, load_taskset, runs_code
    from ...rl.warmup import create_default_model

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        rl = RLConfig(group_size=args.group_size, prompts_per_batch=args.prompts, max_new_tokens=args.max_new_tokens,
                      taskset=args.taskset, reasoning_gym=parse_gym_args(args.gym), system_prompt=args.system_prompt,
                      chat_template=args.chat_template, format_reward=args.format_reward,
                      answer_prefill=args.answer_prefill)
        rl.validate()
        if args.gym and args.taskset != "reasoning-gym":
            raise ValueError("--gym needs --taskset reasoning-gym")
        grpo = GRPOConfig() if args.lr is None else GRPOConfig(lr=args.lr)
        grpo.validate()
        taskset = load_run_tasks(rl) if args.taskset == "reasoning-gym" else load_taskset(args.taskset)
        if runs_code(taskset):
            require_isolation(f"task set {args.taskset!r} has code tasks", instead="pick another --taskset")
    except (ValueError, TaskFormatError, SandboxUnavailable) as e:
        return _fail(str(e))
    with tempfile.TemporaryDirectory(prefix="swarm-rl-local-") as tmp:
        model_dir = Path(args.model).expanduser() if args.model else Path(tmp) / "model"
        if args.model:
            try:
                check_model_folder(model_dir)  # says what is wrong, a hub id included
            except ModelFolderError as e:
                return _fail(str(e))
        if args.model and not has_tokenizer(model_dir):
            return _fail(f"{model_dir}: no tokenizer in the model folder (tokenizer.json, tokenizer.model or vocab.json)")
        if not args.model:
            create_default_model(model_dir)
        engine = TorchEngine("cpu")
        engine.load(model_dir)
        rows = []

        def show(s) -> None:
            rows.append(s)
            print(f"step {s.step:4d}  reward {s.mean_reward:.3f}  groups with signal {s.groups_with_signal}"
                  f"  trained {s.samples_trained:4d}  entropy {s.entropy:.2f}  {s.seconds:.2f}s", flush=True)

        greedy_before = greedy_score(engine, taskset, rl)
        run_local_loop(engine, taskset, rl, grpo, args.steps, seed=args.seed, max_seconds=args.seconds, on_step=show)
        greedy_after = greedy_score(engine, taskset, rl)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("step,mean_reward,seconds\n")
            f.writelines(f"{s.step},{s.mean_reward:.5f},{s.seconds:.4f}\n" for s in rows)
    k = max(1, min(10, len(rows) // 4))
    first = sum(s.mean_reward for s in rows[:k]) / k
    last = sum(s.mean_reward for s in rows[-k:]) / k
    print(f"mean reward: first {k} steps {first:.3f}, last {k} steps {last:.3f} ({len(rows)} steps, "
          f"{sum(s.seconds for s in rows):.0f}s)")
    print(f"greedy reward on 64 evaluation tasks: {greedy_before:.3f} before, {greedy_after:.3f} after")
    return 0
