"""``swarm-node keygen`` and ``swarm-node id``: the node's key in its data dir, its peer id, and the
addresses other peers can dial. Neither needs a running node; reading a key writes nothing."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ...atomic import data_dir_holder, hold_data_dir
from ...identity import KEY_FILE, load_identity, load_or_create_identity, save_identity
from ..errors import UsageError
from ..options import add_common, config_from_args


def add_commands(sub) -> None:
    p = sub.add_parser("keygen", help="create the node key in the data dir (if absent) and print the peer id")
    add_common(p)
    p.add_argument("--from", dest="from_dir", metavar="DIR",
                   help="copy the key of data dir DIR instead of making one: the same peer id for another run's "
                        "data dir (never run both dirs in one run: one author, two logs)")
    p.set_defaults(func=cmd_keygen)

    p = sub.add_parser("id", help="print the peer id and the addresses other peers can dial")
    add_common(p)
    p.add_argument("--listen", nargs="+", metavar="MULTIADDR")
    p.add_argument("--create", action="store_true", help="create the key if the data dir has none (as keygen)")
    p.add_argument("--addr", action="store_true",
                   help="print only the addresses, one per line (for --bootstrap $(swarm-node id --addr ...))")
    p.set_defaults(func=cmd_id)


def cmd_keygen(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    data_dir = config.resolved_data_dir()
    where = data_dir / KEY_FILE
    source = load_identity(Path(args.from_dir).expanduser() / KEY_FILE) if args.from_dir else None
    if where.exists():  # reading a key writes nothing: no lock, also while the node runs
        identity, created = load_identity(where), False
        if source is not None and source.peer_id != identity.peer_id:
            raise UsageError(f"{where} already holds another key ({identity.peer_id}); "
                             "--from copies a key only into a data dir without one")
    else:
        with hold_data_dir(data_dir, min_free=0):  # a key is a few hundred bytes
            identity, created = (source, True) if source else load_or_create_identity(data_dir)
            if source is not None:
                save_identity(source, where)
    print(identity.peer_id)
    print(f"{'created' if created else 'already present'}: {where}", file=sys.stderr)
    return 0


def cmd_id(args: argparse.Namespace) -> int:
    """The peer id, then the addresses to give other peers (``--bootstrap``): the running node's
    own (node.json, read while a node holds the data dir) or, when none runs, the configured listen
    addresses; wildcards expanded. ``--addr``: the addresses only."""
    config = config_from_args(args)
    data_dir = config.resolved_data_dir()
    if not (data_dir / KEY_FILE).exists() and not args.create:
        raise UsageError(f"no key in {data_dir}: create one with `swarm-node keygen --data-dir {data_dir}` "
                         "(or `swarm-node id --create`)")
    if (data_dir / KEY_FILE).exists():
        identity = load_identity(data_dir / KEY_FILE)
    else:
        with hold_data_dir(data_dir, min_free=0):  # a key is a few hundred bytes
            identity = load_or_create_identity(data_dir)[0]
        print(f"created: {data_dir / KEY_FILE}", file=sys.stderr)
    if not args.addr:
        print(identity.peer_id)
    from ..addresses import NAT_NOTE, dialable

    shown, expanded = dialable(running_addrs(data_dir) or list(config.listen), identity.peer_id)
    for a in shown:
        print(a)
    if expanded:
        print(NAT_NOTE, file=sys.stderr)
    return 0


def running_addrs(data_dir: Path) -> list[str]:
    """The listen addresses of the node running on ``data_dir`` (its node.json), [] when none runs:
    a node that was killed leaves its node.json behind, so only a held data dir counts."""
    from ...status_files import NODE_FILE

    if data_dir_holder(data_dir) is None:
        return []
    try:
        return list(json.loads((data_dir / NODE_FILE).read_text())["addrs"])
    except (ValueError, KeyError, OSError, TypeError):
        return []
