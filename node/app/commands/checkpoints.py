"""Subcommands: ``swarm-node publish PATH --version N`` and ``swarm-node checkpoints``.

``publish`` is the trainer side until the trainer role publishes by itself: it starts a node with
the given data dir and run file (its key must be one of the run's trainers), publishes the folder as
a signed version, announces it and seeds it until Ctrl-C or ``--seed-for SECONDS``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ...config import LOG_LEVELS, ConfigError, load_config


def add_commands(sub) -> None:
    p = sub.add_parser("publish", help="publish a model folder as a checkpoint version and seed it, with the trainer's "
                                       "key and data dir while the trainer is stopped (refused while it runs)")
    p.add_argument("path", type=Path, help="Hugging Face model folder (config.json, *.safetensors, tokenizer files)")
    p.add_argument("--version", dest="ckpt_version", type=int, required=True, metavar="N", help="version number")
    p.add_argument("--seed-for", type=float, default=0.0, metavar="SECONDS", help="stop seeding after SECONDS (default: until Ctrl-C)")
    p.add_argument("--run", metavar="FILE", type=Path, help="run file (TOML): run name, trainers, [shards] table")
    p.add_argument("--data-dir", help="node data dir (key, checkpoints)")
    p.add_argument("--listen", nargs="+", metavar="MULTIADDR", help="listen addresses")
    p.add_argument("--bootstrap", nargs="+", metavar="MULTIADDR", help="peers to connect to (full multiaddrs)")
    p.add_argument("--log-level", choices=LOG_LEVELS, help="log verbosity (default info)")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("checkpoints", help="checkpoint versions in the data dir (complete and partial)")
    p.add_argument("--run", metavar="FILE", type=Path, help="run file (TOML)")
    p.add_argument("--data-dir", help="node data dir")
    p.set_defaults(func=cmd_checkpoints)


def _config(args: argparse.Namespace, role: str):
    flags = {
        "role": role,
        "data_dir": getattr(args, "data_dir", None),
        "listen": getattr(args, "listen", None),
        "bootstrap": getattr(args, "bootstrap", None),
        "log_level": getattr(args, "log_level", None),
    }
    return load_config(args.run, dict(os.environ), flags)


def cmd_publish(args: argparse.Namespace) -> int:
    from ...shards.finite import non_finite_in_folder
    from ...shards.manifest import FolderError, folder_files

    try:
        config = _config(args, "trainer")
        folder_files(args.path)  # fail before starting a node
    except (ConfigError, FolderError) as e:
        print(f"swarm-node publish: {e}", file=sys.stderr)
        return 2
    problems = non_finite_in_folder(Path(args.path))
    if problems:  # every downloader would refuse it (node/shards/finite.py)
        print(f"swarm-node publish: {args.path} cannot be published: {'; '.join(problems)}", file=sys.stderr)
        return 2
    if args.ckpt_version < 0:
        print("swarm-node publish: --version must be >= 0", file=sys.stderr)
        return 2
    if args.seed_for < 0:
        print("swarm-node publish: --seed-for must be >= 0", file=sys.stderr)
        return 2
    import trio

    from ...atomic import DataDirError, hold_data_dir
    from ...identity import IdentityError, load_or_create_identity

    try:
        # The trainer's data dir, held for the whole publish: a trainer running on it (or a second
        # publish) would write the same author's ledger from two processes and equivocate.
        with hold_data_dir(config.resolved_data_dir()):
            identity, _ = load_or_create_identity(config.resolved_data_dir())
            if identity.peer_id not in config.run.trainers:
                print(f"swarm-node publish: this node's peer id {identity.peer_id} is not among the run's trainers;"
                      " add it to [run] trainers in the run file", file=sys.stderr)
                return 2
            return trio.run(_publish, config, args.path, args.ckpt_version, args.seed_for)
    except (IdentityError, DataDirError) as e:
        print(f"swarm-node publish: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


async def _publish(config, path: Path, version: int, seed_for: float) -> int:
    import signal

    import trio

    from ...log import setup_logging
    from ...roles.core import run_node, start_core

    setup_logging(config.log_level, config.log_json)
    async with trio.open_nursery() as nursery:
        # The core alone (shards, ledger, membership) under the trainer's key: the trainer role
        # would also publish its own version 0 and train on, which is not what was asked.
        node = await nursery.start(lambda task_status: run_node(config, task_status=task_status, handle_signals=False,
                                                                start=start_core))
        for addr in config.bootstrap:
            try:
                await node.host.connect(addr)
            except Exception as e:  # unreachable peer: seed to whoever does connect
                print(f"swarm-node publish: could not reach {addr}: {e}", file=sys.stderr)
        signed = await node.shards.publish(path, version)
        m = signed.manifest
        print(f"published version {version}: {m.num_pieces} pieces of {m.piece_size} bytes, "
              f"{m.total_size} bytes, root {signed.root.hex()}")
        print(f"seeding from {' '.join(node.host.listen_addrs())}", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            with trio.move_on_after(seed_for if seed_for > 0 else float("inf")):
                async for _ in signals:
                    break
        nursery.cancel_scope.cancel()
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from ...shards.store import PieceStore, read_verified_log

    try:
        config = _config(args, None)
    except ConfigError as e:
        print(f"swarm-node checkpoints: {e}", file=sys.stderr)
        return 2
    root = config.resolved_data_dir() / "checkpoints"
    if not root.is_dir():
        print(f"no checkpoints in {root}")
        return 0
    store = PieceStore(root, config.run.name, config.run.trainers)
    done = set(store.complete_versions())
    versions = sorted(done | set(store.partial_versions()))
    if not versions:
        print(f"no checkpoints in {root}")
    for v in versions:
        signed = store.saved_manifest(v)
        if v in done:
            print(f"v{v}\tcomplete\t{store.folder_of(v)}")
        elif signed is None:
            print(f"v{v}\tpartial (no valid manifest)")
        else:
            have = len(read_verified_log(store.folder_of(v), signed.root, signed.manifest.num_pieces))
            print(f"v{v}\tpartial {have}/{signed.manifest.num_pieces} pieces\t{store.folder_of(v)}")
    return 0
