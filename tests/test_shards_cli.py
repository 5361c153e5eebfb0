"""`swarm-node publish` and `swarm-node checkpoints`: happy path and one-line errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from node.identity import load_or_create_identity
from node.app.commands.checkpoints import add_commands
from node.shards.testing import safetensors_bytes, write_checkpoint


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    return args.func(args)


@pytest.fixture
def setup(tmp_path: Path):
    data = tmp_path / "data"
    ident, _ = load_or_create_identity(data)
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'[run]\nname = "clitest"\ntrainers = ["{ident.peer_id}"]\n[shards]\nprogress = false\n')
    return tmp_path, data, run_file


def test_publish_then_list(setup, capsys) -> None:
    tmp, data, run_file = setup
    ckpt = write_checkpoint(tmp / "ckpt", 3 << 20, seed=1)
    rc = run("publish", str(ckpt), "--version", "4", "--run", str(run_file), "--data-dir", str(data),
             "--listen", "/ip4/127.0.0.1/tcp/0", "--seed-for", "0.2", "--log-level", "warning")
    out = capsys.readouterr().out
    assert rc == 0 and "published version 4: 24 pieces of 131072 bytes" in out  # small: 128 KiB pieces
    assert run("checkpoints", "--run", str(run_file), "--data-dir", str(data)) == 0
    assert capsys.readouterr().out.splitlines() == [f"v4\tcomplete\t{data / 'checkpoints' / '4'}"]
    assert not (data / "trainer").exists()  # the core seeded it; no trainer started (its own v0, its steps)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--version", "1", "PATH/missing"], "not a directory"),
        (["--version", "-1", "PATH/ckpt"], "--version must be >= 0"),
        (["--version", "1", "PATH/ckpt", "--other-key"], "not among the run's trainers"),
        (["--version", "1", "PATH/nan"], "lm_head (F32) holds NaN or infinity"),
    ],
)
def test_publish_errors_are_one_line(setup, capsys, extra, message) -> None:
    tmp, data, run_file = setup
    write_checkpoint(tmp / "ckpt", 1 << 20)
    write_checkpoint(tmp / "nan", 1 << 20)
    (tmp / "nan" / "model-00000.safetensors").write_bytes(
        safetensors_bytes(1 << 19, b"\x00\x00\xc0\x7f", dtype="F32", name="lm_head"))  # a NaN
    argv = ["publish", "--run", str(run_file)]
    if "--other-key" in extra:
        extra = [e for e in extra if e != "--other-key"]
        argv += ["--data-dir", str(tmp / "other")]
    else:
        argv += ["--data-dir", str(data)]
    argv += [e.replace("PATH", str(tmp)) for e in extra]
    assert run(*argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
