"""The configuration reference is generated from the code, parses as a run file, and the README has it."""

from __future__ import annotations

import os
from pathlib import Path

from node.config import load_config
from node.app.config_reference import reference

README = Path(__file__).resolve().parent.parent / "README.md"


def test_reference_is_a_valid_run_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(reference())
    cfg = load_config(path, {}, {"data_dir": str(tmp_path)})
    assert cfg.run.name == "demo" and cfg.run.section("grpo").epsilon == 0.2


def test_readme_embeds_the_current_reference():
    text = README.read_text()
    start, end = "<!-- config-reference:start -->\n```toml\n", "```\n<!-- config-reference:end -->"
    assert start in text and end in text, "README lacks the generated configuration reference"
    embedded = text.split(start, 1)[1].split(end, 1)[0]
    assert embedded == reference(), "README's reference is stale: paste `swarm-node config` into it"
