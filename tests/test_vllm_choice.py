"""A run that selects vLLM on a node that cannot run it: one line on stderr, exit 2, before the node
makes anything (issue 41, bad input). Runs in .venv, where vLLM is not installed; the CPU build's
side (vLLM's CPU platform allowed only when the run names vLLM) is in tests/vllm_real/."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.engines.vllm_engine import VLLM_VERSION

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here: these need a venv without it"
)

RUN = """\
[run]
name = "vllm-choice"

[inference]
engine = "{engine}"
engines = ["torch", "vllm"]
"""


def swarm_node(*args, tmp_path: Path, engine: str = "vllm", pythonpath: Path | None = None):
    run = tmp_path / "run.toml"
    run.write_text(RUN.format(engine=engine))
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "node", *args, "--run", str(run)], capture_output=True, text=True,
                          timeout=120, env=env)


def one_line_error(proc) -> str:
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def installed_vllm(root: Path, version: str) -> Path:
    """A site folder holding a distribution named vllm at ``version``, as pip leaves one."""
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    info = root / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root


def test_an_inference_node_selecting_vllm_without_it_stops_with_one_line(tmp_path):
    proc = swarm_node("--role", "inference", "--listen", "/ip4/127.0.0.1/tcp/0", tmp_path=tmp_path)
    line = one_line_error(proc)
    assert "run.inference.engine" in line and "vLLM is not installed" in line and "make vllm-venv" in line
    assert not (tmp_path / "data").exists()  # refused before a data dir or key was made


def test_a_rollout_selecting_vllm_at_another_version_stops_with_one_line(tmp_path):
    site = installed_vllm(tmp_path / "site", "0.31.0")
    line = one_line_error(swarm_node("rollout", "--steps", "1", tmp_path=tmp_path, pythonpath=site))
    assert "vLLM 0.31.0 is installed" in line and VLLM_VERSION in line


def test_auto_falls_back_to_torch_when_vllm_cannot_run():
    from node.rl.config import InferenceConfig
    from node.inference.generate import choose_engine

    assert choose_engine(InferenceConfig(engine="auto", engines=["torch", "vllm"])) == "torch"
    assert choose_engine(InferenceConfig(engine="torch", engines=["torch", "vllm"])) == "torch"


def test_the_demo_with_vllm_where_it_cannot_run_stops_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "node", "demo", "--engine", "vllm", "--duration", "1",
                           "--data-root", str(tmp_path / "demo")], capture_output=True, text=True, timeout=120)
    line = one_line_error(proc)
    assert "demo --engine vllm" in line and "vLLM is not installed" in line
    assert not (tmp_path / "demo").exists()  # no node was started
