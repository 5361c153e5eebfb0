"""``swarm-node demo``: a local swarm on loopback with a live table (node/app/demo.py runs it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...config import LOG_LEVELS
from ...rollouts.config import CHEATS


def add_commands(sub) -> None:
    p = sub.add_parser("demo", help="run a local swarm on loopback with a live table")
    p.add_argument("--duration", type=float, default=0.0, help="stop after SECONDS (default: until Ctrl-C)")
    p.add_argument("--extra", type=int, default=0, help="extra inference nodes beyond the default two")
    p.add_argument("--cheat", choices=_cheats(), help="add a dishonest inference node of this kind")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                   help="vllm: the second inference node runs vLLM (its CPU build without a GPU) and the run accepts it")
    p.add_argument("--model", default="", metavar="DIR|FILE.gguf",
                   help="post-train this model on reasoning-gym's chain_sum instead of the tiny model on digit "
                        "reversal (make smollm2 writes .models/smollm2-135m-instruct)")
    p.add_argument("--data-root", type=Path, default=Path("demo-data"), help="folder for the nodes' data dirs")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
    p.add_argument("--http-port", type=int, default=8080,
                   help="port of the trainer's web status page on 127.0.0.1 (default 8080; 0 = off)")
    p.set_defaults(func=cmd_demo)


def _cheats() -> tuple[str, ...]:
    return tuple(c for c in CHEATS if c)  # "" is honest


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    return run_demo(args)
