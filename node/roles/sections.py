"""The run's component tables, typed: built once from the run file, then handed to the services.

node/config.py keeps the run file's component tables raw and checks each one at load through its
registry (``SECTIONS``), so that the base module imports no component. Here every table becomes its
component's dataclass once, one typed field per table. A role's composition takes the sections a
service reads out of it (:meth:`RunSections.pick`) and hands them in, so the service's signature
says what it reads (``serve_trainer(node, TrainerSections, ...)``) and no service looks a section
up by name.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import TypeVar

from ..config import ConfigError, RunConfig
from ..gossip.membership import MembershipConfig
from ..ledger.config import LedgerConfig, keep_steps_problem
from ..net.budget import StreamsConfig
from ..proofs.config import ProofsConfig
from ..rl.config import GRPOConfig, InferenceConfig, RLConfig
from ..rollouts.config import WorkerConfig
from ..rollouts.quota import QuotaConfig
from ..rollouts.steps import step_window_size
from ..shards.config import ShardsConfig
from ..trainer.config import TrainerConfig
from ..validator.config import ValidatorConfig

B = TypeVar("B")


@dataclass(frozen=True)
class RunSections:
    """One field per component table of the run file (``[grpo]`` is ``grpo``), each its defaults
    where the file has no such table. The names and classes are node/config.py's ``SECTIONS``
    (tests/test_run_sections.py holds the two together)."""

    membership: MembershipConfig
    shards: ShardsConfig
    ledger: LedgerConfig
    trainer: TrainerConfig
    validator: ValidatorConfig
    worker: WorkerConfig
    quota: QuotaConfig
    rl: RLConfig
    grpo: GRPOConfig
    inference: InferenceConfig
    proofs: ProofsConfig
    streams: StreamsConfig

    @classmethod
    def of(cls, run: RunConfig) -> RunSections:
        """Every table of ``run`` built and checked (ConfigError naming the field, as at load)."""
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: run.section(f.name, hints[f.name]) for f in dataclasses.fields(cls)})

    def cross_check(self) -> None:
        """ConfigError (one line) for tables that are each valid but contradict each other; checked
        before a node starts (node/app/cli.py)."""
        if not self.ledger.cut_every:
            return  # keep_steps matters only to cuts (a run without them keeps every draw step open)
        window = step_window_size(self.worker.max_pending_batches)
        problem = keep_steps_problem(self.ledger.keep_steps, window,
                                     f"worker.max_pending_batches {self.worker.max_pending_batches}")
        if problem:
            raise ConfigError(problem)

    def pick(self, bundle: type[B]) -> B:
        """A service's bundle of the sections it reads (a dataclass whose fields are named and typed
        as here), filled from these."""
        mine = typing.get_type_hints(type(self))
        hints = typing.get_type_hints(bundle)
        for f in dataclasses.fields(bundle):
            if mine.get(f.name) is not hints[f.name]:  # a bundle that names no section of the run: our bug
                raise TypeError(f"{bundle.__name__}.{f.name}: not a section of the run ({hints[f.name]})")
        return bundle(**{f.name: getattr(self, f.name) for f in dataclasses.fields(bundle)})
