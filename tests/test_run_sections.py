"""The run's typed sections (node/roles/sections.py)."""

from __future__ import annotations

import dataclasses
import importlib
import typing

import pytest

from node.config import SECTIONS, ConfigError, RunConfig
from node.rl.config import RLConfig
from node.roles.sections import RunSections


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
