"""The run's typed sections (node/roles/sections.py) and the bundles the roles hand their services."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from node.config import SECTIONS, ConfigError, RunConfig
from node.inference.config import InferenceSections
from node.rl.config import GRPOConfig, RLConfig
from node.roles.sections import RunSections
from node.trainer.config import TrainerSections
from node.validator.config import ValidatorSections

BUNDLES = (TrainerSections, ValidatorSections, InferenceSections)


def test_run_sections_are_the_registry_of_the_run_file():
    hints = typing.get_type_hints(RunSections)
    assert [f.name for f in dataclasses.fields(RunSections)] == list(SECTIONS)
    for name, path in SECTIONS.items():
        mod, _, attr = path.partition(":")
        assert hints[name] is getattr(importlib.import_module(mod), attr), name


def test_sections_are_built_from_the_tables_with_defaults_for_the_rest():
    sections = RunSections.of(RunConfig(tables={"grpo": {"async_level": 3}, "worker": {"max_pending_batches": 5}}))
    assert sections.grpo.async_level == 3 and sections.worker.max_pending_batches == 5
    assert sections.rl == RLConfig()


def test_a_bad_value_fails_naming_the_field():
    with pytest.raises(ConfigError, match=r"run\.grpo\.async_level: expected an integer"):
        RunSections.of(RunConfig(tables={"grpo": {"async_level": "two"}}))


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda b: b.__name__)
def test_each_bundle_is_filled_from_the_run(bundle):
    sections = RunSections.of(RunConfig(tables={"grpo": {"async_level": 3}}))
    picked = sections.pick(bundle)
    for f in dataclasses.fields(bundle):
        assert getattr(picked, f.name) is getattr(sections, f.name)
    # A bundle's defaults are those of a run file without its tables.
    assert bundle() == RunSections.of(RunConfig()).pick(bundle)


def test_a_bundle_naming_no_section_of_the_run_is_refused():
    @dataclass
    class Wrong:
        grpo: RLConfig = dataclasses.field(default_factory=RLConfig)

    @dataclass
    class Right:
        grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)

    sections = RunSections.of(RunConfig())
    with pytest.raises(TypeError, match="Wrong.grpo"):
        sections.pick(Wrong)
    assert sections.pick(Right).grpo is sections.grpo


# The services read the run's tables they are handed (issue 44 item 5): none of their modules looks a
# section up by name, so what a service reads is in its signature. The role services, membership, the
# ledger (the offline ``swarm-node ledger`` command is app code, node/app/commands/) and the reach
# services (relay, dial-back).
NODE = Path(__file__).resolve().parents[1] / "node"
HANDED_IN = ("trainer", "validator", "inference", "gossip", "ledger", "reach")


def section_lookups(paths: list[Path], root: Path = NODE.parent) -> list[str]:
    """``path:line`` (relative to ``root``) of every ``<anything>.section(...)`` call in ``paths``."""
    out = []
    for path in paths:
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "section":
                out.append(f"{path.relative_to(root)}:{n.lineno}")
    return out


def test_the_role_services_look_no_section_up_by_name():
    paths = sorted(p for package in HANDED_IN for p in (NODE / package).rglob("*.py"))
    assert len(paths) > 10
    assert section_lookups(paths) == []


def test_the_lookup_rule_finds_a_planted_lookup(tmp_path):
    """Planted in a copy of trainer/service.py: a lazy lookup in a function, and one in an argument."""
    planted = tmp_path / "node" / "trainer" / "service.py"
    planted.parent.mkdir(parents=True)
    planted.write_text((NODE / "trainer" / "service.py").read_text() + "\n\ndef lazy(node):\n"
                       "    cfg = node.run.section('grpo')\n"
                       "    return f(cfg, streams=node.config.run.section('streams'))\n")
    lines = len(planted.read_text().splitlines())
    assert section_lookups([planted], tmp_path) == [f"node/trainer/service.py:{lines - 1}",
                                                    f"node/trainer/service.py:{lines}"]


@pytest.mark.parametrize("table,setting", [("worker", "checkpoint_poll_s"), ("validator", "checkpoint_timeout")])
def test_a_dropped_setting_is_refused_by_name(tmp_path, table, setting):
    """Issue 44: settings nothing read are gone (checkpoints are delivered, and a batch whose checkpoint
    is not held is handed back at once); a run file still setting one is told which line to delete,
    as for any unknown setting, rather than have it seem to take effect."""
    from node.config import load_config

    path = tmp_path / "run.toml"
    path.write_text(f'[run]\nname = "test"\n[{table}]\n{setting} = 1.0\n')
    with pytest.raises(ConfigError, match=rf"^run\.{table}\.{setting}: unknown setting$"):
        load_config(path, {}, {"data_dir": str(tmp_path)})
