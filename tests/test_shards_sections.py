"""The shards service reads the run's tables it is handed (:class:`ShardsSections`, issue 44 item 5),
as the role services do (tests/test_run_sections.py): none of node/shards/ looks a section up by name."""

from __future__ import annotations

import dataclasses

from node.config import RunConfig
from node.roles.sections import RunSections
from node.shards.config import ShardsSections, kept_versions

from test_run_sections import NODE, section_lookups


def test_the_shards_package_looks_no_section_up_by_name():
    paths = sorted((NODE / "shards").rglob("*.py"))
    assert len(paths) > 10
    assert section_lookups(paths) == []


def test_the_shards_bundle_is_filled_from_the_run():
    sections = RunSections.of(RunConfig(tables={"grpo": {"async_level": 3}, "shards": {"max_peers": 5}}))
    picked = sections.pick(ShardsSections)
    for f in dataclasses.fields(ShardsSections):
        assert getattr(picked, f.name) is getattr(sections, f.name)
    assert ShardsSections() == RunSections.of(RunConfig()).pick(ShardsSections)


def test_the_versions_kept_cover_the_run_s_staleness_bounds():
    """What serve_shards did with the [grpo] table it looked up by name, now from the bundle."""
    run = RunConfig(tables={"grpo": {"async_level": 3, "verify_grace_steps": 2}, "shards": {"max_peers": 5}})
    cfg = RunSections.of(run).pick(ShardsSections).kept()
    assert cfg.keep_versions == kept_versions(3, 3, 2) == 6
    assert cfg.max_peers == 5
    few = RunSections.of(RunConfig(tables={"grpo": {"async_level": 0, "verify_grace_steps": 0},
                                           "shards": {"keep_versions": 4}})).pick(ShardsSections)
    assert few.kept().keep_versions == 4
