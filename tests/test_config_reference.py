"""The configuration reference is generated from the code, parses as a run file, and docs/configuration.md has it."""

from __future__ import annotations

from pathlib import Path

from node.config import load_config
from node.app.commands.config_reference import reference

REFERENCE_DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_reference_is_a_valid_run_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(reference())
    cfg = load_config(path, {}, {"data_dir": str(tmp_path)})
    assert cfg.run.name == "demo" and cfg.run.section("grpo").epsilon == 0.2


def test_docs_embed_the_current_reference():
    text = REFERENCE_DOC.read_text()
    start, end = "<!-- config-reference:start -->\n```toml\n", "```\n<!-- config-reference:end -->"
    assert start in text and end in text, "docs/configuration.md lacks the generated configuration reference"
    embedded = text.split(start, 1)[1].split(end, 1)[0]
    assert embedded == reference(), "docs/configuration.md's reference is stale: paste `swarm-node config` into it"


def test_swarm_run_names_the_run_file_and_run_wins(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('[run]\nname = "from-env"\n')
    b.write_text('[run]\nname = "from-flag"\n')
    assert load_config(None, {"SWARM_RUN": str(a)}, {"data_dir": str(tmp_path)}).run.name == "from-env"
    assert load_config(b, {"SWARM_RUN": str(a)}, {"data_dir": str(tmp_path)}).run.name == "from-flag"
    assert load_config(None, {}, {"data_dir": str(tmp_path)}).run.name == "demo"


def test_bind_addresses_must_be_ip_addresses(tmp_path):
    import pytest

    from node.config import ConfigError

    with pytest.raises(ConfigError, match="http_listen"):
        load_config(None, {"SWARM_HTTP_LISTEN": "localhost:80"}, {"data_dir": str(tmp_path)})
    cfg = load_config(None, {"SWARM_METRICS_LISTEN": "0.0.0.0"}, {"data_dir": str(tmp_path), "http_port": 8080})
    assert cfg.metrics_listen == "0.0.0.0" and cfg.http_port == 8080 and cfg.http_listen == "127.0.0.1"
