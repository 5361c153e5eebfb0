"""A node's settings from its command line: the flags every node command shares, and the
:class:`~node.config.NodeConfig` built from flags, environment and run file (defaults < run file <
env < flags), for starting a node (node/app/cli.py) and for the commands that read one's data dir."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..bootstrap_list import read_bootstrap_list
from ..config import LOG_LEVELS, NodeConfig, load_config
from .errors import UsageError


def add_common(p: argparse.ArgumentParser) -> None:
    """--data-dir, --run and --log-level, on the top-level parser and on each node command."""
    p.add_argument("--data-dir", help="node data dir (key, checkpoints, ledger); default ~/.local/share/swarm-node/<run>")
    p.add_argument("--run", metavar="FILE", type=Path,
                   help="run file (TOML): run name, trusted peers, component tables (default $SWARM_RUN)")
    p.add_argument("--log-level", choices=LOG_LEVELS, help="log verbosity (default info)")


def flags_of(args: argparse.Namespace) -> dict:
    flags = {
        "role": getattr(args, "role", None),
        "listen": getattr(args, "listen", None),
        "data_dir": getattr(args, "data_dir", None),
        "log_level": getattr(args, "log_level", None),
        "log_json": getattr(args, "log_json", None),
        "metrics_port": getattr(args, "metrics_port", None),
        "metrics_listen": getattr(args, "metrics_listen", None),
        "http_port": getattr(args, "http_port", None),
        "http_listen": getattr(args, "http_listen", None),
        "relay_via": getattr(args, "relay_via", None),
    }
    bootstrap = getattr(args, "bootstrap", None)
    if bootstrap is not None:
        flags["bootstrap"] = bootstrap if bootstrap else packaged_bootstrap()
    return flags


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    return load_config(getattr(args, "run", None), dict(os.environ), flags_of(args))


def packaged_bootstrap() -> list[str]:
    peers = read_bootstrap_list()
    if not peers:
        raise UsageError(
            "bootstrap: the packaged list (bootstrap/peers.txt) is empty; pass addresses: --bootstrap /ip4/.../tcp/4001/p2p/<id>"
        )
    return peers
