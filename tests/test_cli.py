"""The command line: bad input gives one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from node.app.cli import main
from node.identity import KEY_FILE


def run_cli(*args, env=None, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "node", *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}, cwd=cwd,
    )


def one_line_error(stderr: str) -> str:
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--role", "wizard"], "--role"),
        (["--listen", "not-an-addr"], "listen"),
        (["--bootstrap", "/ip4/127.0.0.1/tcp/4001"], "/p2p/"),
        (["--metrics-port", "99999"], "metrics_port"),
        (["--metrics-port", "abc"], "--metrics-port"),
    ],
)
def test_bad_flags(tmp_path, args, needle):
    proc = run_cli(*args, "--data-dir", str(tmp_path))
    assert proc.returncode == 2
    assert needle in one_line_error(proc.stderr)


@pytest.mark.parametrize(
    "content, needle",
    [
        ("[run\nname=", "not valid TOML"),
        ('[run]\nname = 5\n', "run.name: expected a string"),
        ('[run]\ntrainers = ["not-a-peer"]\n', "run.trainers"),
        ('[membership]\nprobe_period = "fast"\n', "run.membership.probe_period"),
        ('[membership]\nprobe_period = -1.0\n', "run.membership"),
        ('[nonsense]\nx = 1\n', "run.nonsense: unknown section"),
        ('[node]\nrole = "king"\n', "role"),
    ],
)
def test_bad_run_file(tmp_path, capsys, content, needle):
    run = tmp_path / "run.toml"
    run.write_text(content)
    assert main(["--run", str(run), "--data-dir", str(tmp_path / "d"), "--listen", "/ip4/127.0.0.1/tcp/0"]) == 2
    err = capsys.readouterr().err
    assert needle in one_line_error(err)


def test_missing_run_file(tmp_path, capsys):
    assert main(["--run", str(tmp_path / "nope.toml")]) == 2
    assert "No such file" in one_line_error(capsys.readouterr().err)


def test_bad_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SWARM_LOG_LEVEL", "chatty")
    assert main(["id", "--data-dir", str(tmp_path)]) == 2
    assert "log_level" in one_line_error(capsys.readouterr().err)


def test_unreadable_and_corrupt_key(tmp_path, capsys):
    (tmp_path / KEY_FILE).write_text("this is not a key")
    assert main(["id", "--data-dir", str(tmp_path)]) == 2
    assert "corrupt" in one_line_error(capsys.readouterr().err)
    assert (tmp_path / KEY_FILE).read_text() == "this is not a key"  # never silently replaced
    if os.geteuid() != 0:  # root reads files whatever their mode
        (tmp_path / KEY_FILE).chmod(0)
        assert main(["id", "--data-dir", str(tmp_path)]) == 2


def test_keygen_then_id_is_stable(tmp_path, capsys):
    assert main(["keygen", "--data-dir", str(tmp_path)]) == 0
    peer = capsys.readouterr().out.strip()
    assert main(["id", "--data-dir", str(tmp_path), "--listen", "/ip4/127.0.0.1/tcp/4001"]) == 0
    out = capsys.readouterr().out.split()
    assert out == [peer, f"/ip4/127.0.0.1/tcp/4001/p2p/{peer}"]


def test_empty_packaged_bootstrap_list_is_explained(tmp_path, capsys):
    assert main(["--role", "inference", "--bootstrap", "--data-dir", str(tmp_path)]) == 2
    assert "bootstrap" in one_line_error(capsys.readouterr().err)


def test_status_without_running_node(tmp_path, capsys):
    assert main(["status", "--data-dir", str(tmp_path)]) == 2
    assert "no status" in one_line_error(capsys.readouterr().err)


def test_status_view_shows_members_rejections_and_ledger_bans():
    from rich.console import Console

    from node.app.status_view import render_status

    console = Console(record=True, width=200)
    render_status({
        "peer_id": "12D3KooWself", "role": "trainer", "run": "r", "uptime_s": 5,
        "membership": {"connections": 1, "counts": {"alive": 1},
                       "members": [{"peer_id": "12D3KooWpeerA", "role": "inference", "state": "alive", "for_s": 3,
                                    "seq": 17, "checkpoints": [2], "addrs": ["/ip4/127.0.0.1/tcp/1"],
                                    "suspected_by": "12D3KooWaccuser"}],
                       "rejected": {"members/forged": 2}},
        "ledger": {"bans": {"12D3KooWcheat": {"seconds_left": 590, "reason": "reward_mismatch", "by": "12D3KooWval"}}},
        "validator": {"proof_margins": {
            "rollouts": 480,
            "thresholds": {"max_exp_mismatches": 38, "max_mantissa_mean": 10.0, "max_mantissa_median": 8.0},
            "worst_passing": {"max_exp_mismatches": 7.0, "max_mantissa_mean": 1.39, "max_mantissa_median": 1.0},
            "recommended": {"max_exp_mismatches": 14, "max_mantissa_mean": 2.78, "max_mantissa_median": 2.0}}},
    }, console)
    text = console.export_text()
    assert "480 accepted rollouts" in text and "mantissa_mean 1.39 / 10.0" in text
    assert "recommended for the run file's [proofs]: max_exp_mismatches = 14" in text
    assert "12D3KooWpeerA" in text and "inference" in text and "members/forged=2" in text
    assert "alive (accused by 12D3KooWaccu…)" in text  # hearsay is shown, and is no verdict
    assert "banned 12D3KooWcheat" in text and "reward_mismatch" in text and "590s left" in text


def test_status_of_a_running_node(tmp_path):
    from node.app.localswarm import LocalSwarm

    with LocalSwarm(tmp_path / "swarm") as swarm:
        swarm.start("relay", "relay")
        addr = swarm.addr("relay")
        swarm.wait_until(lambda: swarm.status("relay"), 20)
        local = run_cli("status", "--json", "--data-dir", str(tmp_path / "swarm" / "relay"))
        assert local.returncode == 0, local.stderr
        assert json.loads(local.stdout)["role"] == "relay"
        remote = run_cli("status", "--connect", addr)
        assert remote.returncode == 0, remote.stderr
        assert "role=relay" in remote.stdout and "members:" in remote.stdout


def test_help_lists_roles_and_commands():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for word in ("trainer", "inference", "relay", "validator", "keygen", "status", "demo", "--bootstrap"):
        assert word in proc.stdout


def test_damaged_state_files_are_refused_with_one_line(tmp_path):
    """A damaged database or training state stops the node with one clear line and exit 2, never a
    traceback and never a silent fresh start over acknowledged work (issue 14)."""
    for name, rel, role in (("ledger", "ledger.sqlite", "relay"), ("spool", "trainer/spool.sqlite", "trainer")):
        data = tmp_path / name
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_bytes(b"this is not a database" * 100)
        res = run_cli("--role", role, "--data-dir", str(data), "--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "error")
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr and "damaged" in res.stderr.strip().splitlines()[-1], res.stderr
        assert (data / rel).read_bytes() == b"this is not a database" * 100  # left for the operator


def test_a_changed_training_state_is_refused(tmp_path):
    import torch

    from node.atomic import DataDirError
    from node.trainer.checkpoints import STATE, load_state, save_state

    save_state(tmp_path, {"step": 3, "w": torch.ones(4)})
    assert load_state(tmp_path)["step"] == 3
    raw = bytearray((tmp_path / STATE).read_bytes())
    raw[len(raw) // 2] ^= 1
    (tmp_path / STATE).write_bytes(bytes(raw))
    with pytest.raises(DataDirError, match="checksum"):
        load_state(tmp_path)
    (tmp_path / STATE).write_bytes(bytes(raw[: len(raw) // 3]))  # truncated too
    with pytest.raises(DataDirError):
        load_state(tmp_path)
