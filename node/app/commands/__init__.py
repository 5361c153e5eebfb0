"""Every ``swarm-node`` subcommand: one module per subject, each with ``add_commands(subparsers)``.

:data:`COMMANDS` is the registration, in the order ``swarm-node --help`` lists them; starting a node
(no subcommand) is node/app/cli.py's ``cmd_run``. They live here, in the app, and not with the
component they read: some start a node (``publish``) or build a generator (``rollout``), which no
component may import, and the rest are offline tools over a data dir, app code as well.

Importing a module here must stay cheap: what a command needs beyond argparse (torch, libp2p, a
model) is imported inside its ``cmd_*`` function, so ``--help``, ``keygen`` and ``id`` stay fast
(tests/test_cli.py checks that ``--help`` loads none of torch, transformers, libp2p).
"""

from __future__ import annotations

from types import ModuleType

from . import checkpoints, config_reference, demo, keys, ledger, penalties, rl, rollout, status, trainer_steps

COMMANDS: tuple[ModuleType, ...] = (
    keys,              # keygen, id: the node's key and the addresses to give other peers
    status,            # status: the member table of a running node
    demo,              # demo: a local swarm on loopback
    ledger,            # ledger, ledger verify, ledger export: the local ledger replica
    checkpoints,       # publish, checkpoints: a model folder as a checkpoint version; the versions held
    rl,                # init-model, rl-local: the embedded model; the RL loop in one process
    penalties,         # penalties: bans and failed verdicts from the local ledger
    rollout,           # rollout: inference steps offline
    trainer_steps,     # trainer-steps: the trainer's steps and evaluations from its spool
    config_reference,  # config: every run-file setting
)
