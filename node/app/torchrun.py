"""``torchrun ... -m node.app.torchrun <swarm-node flags>``: the trainer's policy over several GPUs.

Rank 0 runs the whole swarm node (:func:`node.app.cli.main`); the other ranks follow its policy
calls (:func:`node.trainer.fsdp.follow`). See node/trainer/fsdp.py for how the ranks cooperate.
This entry point lives in app/ because it starts the CLI: node/trainer/ never imports upwards.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from ..roles.sections import RunSections
from ..trainer import fsdp
from .cli import build_parser
from .cli import main as node_main
from .options import config_from_args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    fsdp.init_distributed()
    try:
        if dist.get_rank() == 0:
            try:
                return node_main(argv)
            finally:  # also when the node failed before its trainer opened the policy
                fsdp.stop_followers()
        config = config_from_args(build_parser().parse_args(argv))
        sections = RunSections.of(config.run)
        return fsdp.follow(sections.grpo, sections.trainer)
    finally:
        fsdp.leave()


if __name__ == "__main__":
    fsdp.exit_now(main())
