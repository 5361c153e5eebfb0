"""``swarm-node status``: the member table of a running node, from its status.json or over the network.

Reading a local data dir must not load the network stack (tests/test_cli.py checks it)."""

from __future__ import annotations

import argparse
import json

from ..options import add_common, config_from_args


def add_commands(sub) -> None:
    p = sub.add_parser("status", help="member table of a running node")
    add_common(p)
    p.add_argument("--connect", metavar="MULTIADDR", help="ask the node at this address (else the local node's status.json)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from ..status_view import fetch_status, render_status

    config = config_from_args(args)
    status = fetch_status(config, args.connect)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        render_status(status)
    return 0
