"""The command line: bad input gives one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from node.app.cli import main
from node.identity import KEY_FILE, load_or_create_identity
from waiting import wait_until


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


# Every subcommand, in the order --help lists them (issue 44 item 8: they had two homes, loaded by
# module-name strings; a module dropped from the registration would lose its commands silently).
SUBCOMMANDS = ["keygen", "id", "status", "demo", "ledger", "publish", "checkpoints", "init-model", "rl-local",
               "penalties", "rollout", "trainer-steps", "config"]


def test_every_subcommand_lives_in_app_commands_and_help_lists_each():
    import argparse
    import pkgutil

    from node.app import commands
    from node.app.cli import build_parser

    homes = {m.name for m in pkgutil.iter_modules(commands.__path__)}
    assert homes == {m.__name__.rsplit(".", 1)[1] for m in commands.COMMANDS}  # each module registered
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(subparsers.choices) == SUBCOMMANDS
    rows = run_cli("--help").stdout.splitlines()
    listed = [r.split()[0] for r in rows if r.startswith("    ") and not r.startswith("     ")]  # not wrapped help
    assert [w for w in listed if w in SUBCOMMANDS] == SUBCOMMANDS


def test_help_loads_no_model_or_network_stack():
    """The commands are registered by importing their modules: what a command needs beyond argparse
    (torch, transformers, libp2p) is imported when it runs, so `swarm-node --help` stays fast."""
    code = ("import sys\n"
            "from node.app.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'libp2p'}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


def test_damaged_state_files_are_refused_with_one_line(tmp_path):
    """A damaged database or training state stops the node with one clear line and exit 2, never a
    traceback and never a silent fresh start over acknowledged work (issue 14)."""
    for name, rel, role in (("ledger", "ledger.sqlite", "relay"), ("spool", "trainer/spool.sqlite", "trainer")):
        data = tmp_path / name
        peer = load_or_create_identity(data)[0].peer_id  # a listed trainer, so it gets as far as its spool
        (tmp_path / f"{name}.toml").write_text(f'[run]\ntrainers = ["{peer}"]\n')
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_bytes(b"this is not a database" * 100)
        res = run_cli("--role", role, "--data-dir", str(data), "--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "error",
                      "--run", str(tmp_path / f"{name}.toml"))
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


# ------------------------------------------------------------------ what operators touch (issue 19)


def test_reading_status_loads_no_network_stack(tmp_path):
    """`swarm-node status` on a local data dir reads status.json: neither the status view nor the
    CLI's path to it may import libp2p (it was 1.0 s of a 1.4 s command)."""
    (tmp_path / "status.json").write_text(json.dumps({"peer_id": "12D3KooWself", "role": "relay"}))
    code = ("import sys\n"
            "import node.app.status_view\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('libp2p', 'trio')], 'view imports the stack'\n"
            "from node.app.cli import main\n"
            f"assert main(['status', '--data-dir', {str(tmp_path)!r}]) == 0\n"
            "assert 'libp2p' not in sys.modules, 'status imports libp2p'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "12D3KooWself" in proc.stdout


def _long_status() -> dict:
    reason = "validator 12D3KooWvalidator timed out on batch " + "x" * 600 + " END-OF-REASON"
    return {
        "peer_id": "12D3KooWselfselfselfselfself", "role": "trainer", "run": "r", "uptime_s": 9.5,
        "addrs": ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWselfselfselfselfself"],
        "traffic": {"tcp_bytes_sent": 3 * 1024 * 1024, "tcp_bytes_received": 2048},
        "membership": {"connections": 0, "counts": {}, "members": [], "self": {"seq": 4, "checkpoints": [11, 12]}},
        "trainer": {"step": 12, "publish_error": reason, "reward": [[i, 0.1 * i] for i in range(40)],
                    "batches": {"ready": 1, "trained": 30}, "gate": {"live_validators": 0, "verdicts": {"pass": 3}},
                    "last_step": {"loss": 0.25, "seconds": 1.5}},
    }


def test_status_shows_the_node_and_readable_sections():
    from rich.console import Console

    from node.app.status_view import render_status

    console = Console(record=True, width=100)
    render_status(_long_status(), console)
    text = console.export_text()
    flat = "".join(text.split())  # rich wraps long lines; nothing may be cut
    assert "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWselfselfselfselfself" in text  # the node itself
    assert "sent 3.0 MiB" in text and "versions held: 11,12  record seq: 4" in text
    assert "END-OF-REASON" in flat and "x" * 600 in flat  # the whole value, not 400 characters of JSON
    assert '{"' not in text  # sections, not JSON
    assert "step: 12" in text and "ready=1, trained=30" in text and "verdicts: pass=3" in text
    assert "(40inall,thelast8shown)" in flat and "(393.9)" in flat
    assert "members: none known yet" in text


@pytest.mark.parametrize("as_json", [False, True])
def test_status_into_a_closed_pipe_ends_quietly(tmp_path, as_json):
    status = _long_status()
    status["membership"]["members"] = [
        {"peer_id": f"12D3KooWpeer{i:04d}", "role": "inference", "state": "alive", "for_s": i, "seq": i,
         "checkpoints": [1], "addrs": [f"/ip4/10.0.0.{i % 250}/tcp/4001"]} for i in range(150)]
    status["trainer"]["publish_error"] = "y" * 300_000  # more than a pipe buffer holds
    (tmp_path / "status.json").write_text(json.dumps(status))
    # `swarm-node status | head -1`: the reader closes its end after one line.
    proc = subprocess.Popen([sys.executable, "-m", "node", "status", "--data-dir", str(tmp_path)] + ["--json"] * as_json,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err and "Broken pipe" not in err and "BrokenPipe" not in err, err
    assert proc.returncode in (0, 1)


def test_connect_to_a_dead_peer_is_one_line_and_exit_1(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = load_or_create_identity(tmp_path / "k")[0].peer_id
    proc = run_cli("status", "--connect", f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}", "--data-dir", str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert "cannot get status from" in one_line_error(proc.stderr)
    assert proc.stdout == ""


def test_id_never_creates_a_key_silently(tmp_path, capsys):
    data = tmp_path / "new"
    assert main(["id", "--data-dir", str(data)]) == 2
    assert "no key in" in one_line_error(capsys.readouterr().err)
    assert not (data / KEY_FILE).exists()
    assert main(["id", "--create", "--data-dir", str(data)]) == 0
    out, err = capsys.readouterr()
    assert f"created: {data / KEY_FILE}" in err
    assert (data / KEY_FILE).exists() and out.split()[0].startswith("12D3KooW")


def test_id_prints_dialable_addresses(tmp_path, capsys, monkeypatch):
    from node.app import addresses

    monkeypatch.setattr(addresses, "interface_ipv4", lambda: ["192.168.7.9", "127.0.0.1"])
    assert main(["keygen", "--data-dir", str(tmp_path)]) == 0
    peer = capsys.readouterr().out.strip()
    assert main(["id", "--data-dir", str(tmp_path), "--listen", "/ip4/0.0.0.0/tcp/4001"]) == 0
    out, err = capsys.readouterr()
    assert out.split() == [peer, f"/ip4/192.168.7.9/tcp/4001/p2p/{peer}", f"/ip4/127.0.0.1/tcp/4001/p2p/{peer}"]
    assert "0.0.0.0" not in out and "relay-via" in err


def test_interface_addresses_are_real_and_never_the_wildcard():
    from node.app.addresses import interface_ipv4

    ips = interface_ipv4()
    assert ips and "0.0.0.0" not in ips and all(ip.count(".") == 3 for ip in ips)


def test_empty_checkpoints_say_so(tmp_path):
    proc = run_cli("checkpoints", "--data-dir", str(tmp_path))
    assert proc.returncode == 0 and "no checkpoints in" in proc.stdout
    (tmp_path / "checkpoints").mkdir()
    proc = run_cli("checkpoints", "--data-dir", str(tmp_path))
    assert proc.returncode == 0 and "no checkpoints in" in proc.stdout


def test_config_with_a_run_file_shows_what_applies(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run.toml"
    run.write_text('[run]\nname = "r7"\n[rl]\ngroup_size = 4\n[node]\nrole = "inference"\n')
    monkeypatch.setenv("SWARM_LOG_LEVEL", "debug")
    assert main(["config", "--run", str(run)]) == 0
    out = capsys.readouterr().out
    lines = {l.split("=")[0].strip(): l for l in out.splitlines() if "=" in l and not l.startswith("#")}
    assert lines["name"].startswith('name = "r7"') and "(set)" in lines["name"]
    assert lines["group_size"].startswith("group_size = 4") and "(set)" in lines["group_size"]
    assert lines["role"].startswith('role = "inference"')
    assert lines["log_level"].startswith('log_level = "debug"')  # the environment applies too
    assert "(set)" not in lines["epsilon"]
    assert main(["config", "--effective"]) == 0  # the environment alone
    assert 'log_level = "debug"' in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('[rl]\ngroup_size = "many"\n')
    assert main(["config", "--run", str(bad)]) == 2
    assert "run.rl.group_size" in one_line_error(capsys.readouterr().err)


def test_unknown_flags_are_named_with_a_suggestion():
    proc = run_cli("status", "--conect", "x")
    line = one_line_error(proc.stderr)
    assert proc.returncode == 2 and "unrecognized arguments: --conect" in line and "did you mean --connect?" in line
    proc = run_cli("--zzzzzz")
    assert proc.returncode == 2 and "unrecognized arguments: --zzzzzz" in one_line_error(proc.stderr)


@pytest.mark.parametrize("role", ["trainer", "validator"])
def test_an_unlisted_trainer_or_validator_stops_with_exit_2(tmp_path, role):
    data = tmp_path / "d"
    run = tmp_path / "run.toml"
    run.write_text('[run]\nname = "r"\n')
    res = run_cli("--role", role, "--data-dir", str(data), "--listen", "/ip4/127.0.0.1/tcp/0", "--run", str(run))
    assert res.returncode == 2 and f"run.{role}s" in one_line_error(res.stderr) and "keygen" in res.stderr
    assert not (data / KEY_FILE).exists()  # a node that cannot start leaves nothing behind
    load_or_create_identity(data)
    other = load_or_create_identity(tmp_path / "other")[0].peer_id
    run.write_text(f'[run]\n{role}s = ["{other}"]\n')
    res = run_cli("--role", role, "--data-dir", str(data), "--listen", "/ip4/127.0.0.1/tcp/0", "--run", str(run))
    assert res.returncode == 2 and f"is not a {role} of run" in one_line_error(res.stderr)


def test_a_listed_trainer_passes_the_check(tmp_path):
    from node.app.cli import check_trusted_role
    from node.config import load_config

    peer = load_or_create_identity(tmp_path)[0].peer_id
    run = tmp_path / "run.toml"
    run.write_text(f'[run]\ntrainers = ["{peer}"]\n')
    check_trusted_role(load_config(run, {}, {"role": "trainer", "data_dir": str(tmp_path)}))
    check_trusted_role(load_config(None, {}, {"role": "inference", "data_dir": str(tmp_path / "x")}))


# ------------------------------------------------------- a swarm built by hand from the README (issue 39)


def _run_file(tmp_path, name="my-run", **lists) -> str:
    body = "".join(f'{k} = {json.dumps(v)}\n' for k, v in lists.items())
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[run]\nname = "{name}"\n{body}')
    return str(path)


def test_a_node_without_a_run_stops_and_says_so(tmp_path):
    """`swarm-node --role relay --listen ...` joined run 'demo', whose peers the operator's run refuses."""
    res = run_cli("--role", "relay", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", str(tmp_path / "relay"))
    assert res.returncode == 2 and "--run" in one_line_error(res.stderr)
    assert not (tmp_path / "relay").exists()  # nothing made for a node that did not start


def test_another_runs_data_dir_says_how_to_keep_the_key(tmp_path):
    from node.ledger.store import open_ledger_store

    old = tmp_path / "relay"
    peer = load_or_create_identity(old)[0].peer_id
    with open_ledger_store(old) as store:
        store.bind_run("demo")
    res = run_cli("--role", "relay", "--run", _run_file(tmp_path), "--data-dir", str(old),
                  "--listen", "/ip4/127.0.0.1/tcp/0")
    line = one_line_error(res.stderr)
    assert res.returncode == 2 and "belongs to run 'demo', not 'my-run'" in line
    assert f"swarm-node keygen --from {old} --data-dir NEW" in line
    new = tmp_path / "new"
    res = run_cli("keygen", "--from", str(old), "--data-dir", str(new))
    assert res.returncode == 0 and res.stdout.split() == [peer]  # the same peer id, in a dir of its own
    assert (new / KEY_FILE).stat().st_mode & 0o777 == 0o600 and not (new / "ledger.sqlite").exists()
    other = run_cli("keygen", "--from", str(tmp_path / "elsewhere"), "--data-dir", str(tmp_path / "x"))
    assert other.returncode == 2 and "cannot read key file" in one_line_error(other.stderr)


@pytest.mark.parametrize("flag", ["--listen", "--http-port", "--metrics-port"])
def test_a_port_in_use_is_one_line_and_exit_2(tmp_path, flag):
    """py-libp2p listens with SO_REUSEPORT: a second node on a taken port started and the kernel split
    dials between two peer ids; the web and metrics ports raised a 115-line traceback."""
    import socket

    with socket.socket() as taken:  # as a libp2p listener holds it
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        value = f"/ip4/127.0.0.1/tcp/{port}" if flag == "--listen" else str(port)
        listen = [] if flag == "--listen" else ["--listen", "/ip4/127.0.0.1/tcp/0"]
        res = run_cli("--role", "relay", "--run", _run_file(tmp_path), "--data-dir", str(tmp_path / "d"),
                      flag, value, *listen)
    assert res.returncode == 2, res.stderr
    assert f"{flag}: 127.0.0.1:{port} is in use by another process" in one_line_error(res.stderr)


def test_one_data_dir_one_process(tmp_path):
    """A second node on a running node's data dir started with its peer id, and deleted the live
    node's node.json when it stopped; with a trainer's key it made the ledger author equivocate.
    Now it stops at once, and so does `publish`; read-only commands still work."""
    data, run = tmp_path / "relay", _run_file(tmp_path)
    peer = run_cli("keygen", "--data-dir", str(data)).stdout.strip()
    first = subprocess.Popen([sys.executable, "-m", "node", "--role", "relay", "--run", run, "--data-dir", str(data),
                              "--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "warning"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (data / "node.json").exists() or first.poll() is not None, what="the relay's node.json")
        assert first.poll() is None
        addrs = json.loads((data / "node.json").read_text())["addrs"]
        assert json.loads((data / "run.json").read_text())["name"] == "my-run"  # what `ledger` judges by
        second = run_cli("--role", "relay", "--run", run, "--data-dir", str(data), "--listen", "/ip4/127.0.0.1/tcp/0")
        assert second.returncode == 2
        assert one_line_error(second.stderr).startswith(f"swarm-node: error: data dir is in use by pid {first.pid}")
        assert (data / "node.json").exists()  # the running node's file is left alone
        from node.shards.testing import write_checkpoint

        ckpt = write_checkpoint(tmp_path / "ckpt", 1 << 20)
        publish = run_cli("publish", str(ckpt), "--version", "1", "--run", run, "--data-dir", str(data))
        assert publish.returncode == 2 and f"data dir is in use by pid {first.pid}" in one_line_error(publish.stderr)
        ident = run_cli("id", "--addr", "--data-dir", str(data))  # what the README's --bootstrap $(...) runs
        assert ident.returncode == 0 and ident.stdout.split() == addrs and addrs[0].endswith(f"/p2p/{peer}")
        assert run_cli("keygen", "--data-dir", str(data)).stdout.strip() == peer
        assert run_cli("ledger", "--data-dir", str(data)).returncode == 0
        assert run_cli("status", "--data-dir", str(data)).returncode == 0
    finally:
        first.terminate()
        first.wait(timeout=60)


def test_id_addr_prints_only_addresses(tmp_path, capsys):
    assert main(["keygen", "--data-dir", str(tmp_path)]) == 0
    peer = capsys.readouterr().out.strip()
    (tmp_path / "node.json").write_text(json.dumps({"addrs": ["/ip4/127.0.0.1/tcp/9/p2p/x"]}))  # a killed node's
    assert main(["id", "--addr", "--data-dir", str(tmp_path), "--listen", "/ip4/127.0.0.1/tcp/4001"]) == 0
    assert capsys.readouterr().out.split() == [f"/ip4/127.0.0.1/tcp/4001/p2p/{peer}"]


def _in_mount_namespace(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``sh -c script`` in a private mount namespace (root only), with the node at "$@"."""
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
                           sys.executable, "-m", "node", *args],
                          capture_output=True, text=True, timeout=120)


needs_mounts = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                  reason="needs root and unshare (a read-only or full file system of its own)")


@needs_mounts
def test_a_read_only_data_dir_is_one_line(tmp_path):
    data = tmp_path / "relay"
    load_or_create_identity(data)
    data.chmod(0o755)  # the node would make it private: it must not claim it did
    res = _in_mount_namespace(f'mount --bind {data} {data} && mount -o remount,bind,ro {data} && exec "$@"',
                              "--role", "relay", "--run", _run_file(tmp_path), "--data-dir", str(data),
                              "--listen", "/ip4/127.0.0.1/tcp/0")
    assert res.returncode == 2, res.stderr
    line = one_line_error(res.stderr)
    assert f"data dir {data} is not writable" in line and "now 700" not in res.stderr


@needs_mounts
def test_a_full_data_dir_is_one_line(tmp_path):
    data = tmp_path / "relay"
    data.mkdir()
    fill = f"dd if=/dev/zero of={data}/filler bs=64k 2>/dev/null; "
    res = _in_mount_namespace(f'mount -t tmpfs -o size=2m tmpfs {data} && {fill}exec "$@"',
                              "--role", "relay", "--run", _run_file(tmp_path), "--data-dir", str(data),
                              "--listen", "/ip4/127.0.0.1/tcp/0")
    assert res.returncode == 2, res.stderr
    assert f"data dir {data} is full" in one_line_error(res.stderr)


@pytest.mark.parametrize("model, needle", [
    ("/nope/model", "run.model: model folder not found: /nope/model"),
    ("Qwen/Qwen2-0.5B", "looks like a Hugging Face hub id"),
    ("/nope/model.gguf", "run.model: /nope/model.gguf: No such file or directory"),
])
def test_a_missing_model_folder_is_one_line(tmp_path, model, needle):
    """A mistyped [run] model ended in 145 lines of Hugging Face's "Repo id must be in the form"."""
    data = tmp_path / "trainer"
    peer = load_or_create_identity(data)[0].peer_id
    run = tmp_path / "run.toml"
    run.write_text(f'[run]\nname = "r"\ntrainers = ["{peer}"]\nmodel = "{model}"\n')
    res = run_cli("--role", "trainer", "--run", str(run), "--data-dir", str(data), "--listen", "/ip4/127.0.0.1/tcp/0")
    assert res.returncode == 2 and needle in one_line_error(res.stderr)


def test_a_bad_task_file_is_one_line(tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"x": 1}\n')
    run = tmp_path / "run.toml"
    run.write_text(f'[run]\nname = "r"\n[rl]\ntaskset = "{tmp_path / "tasks.jsonl"}"\n')
    res = run_cli("--role", "inference", "--run", str(run), "--data-dir", str(tmp_path / "w"),
                  "--listen", "/ip4/127.0.0.1/tcp/0")
    assert res.returncode == 2 and "run.rl.taskset" in one_line_error(res.stderr)


def test_tools_print_no_progress_bars(tmp_path):
    """transformers' bars ("Writing model shards: 100%|...") leaked into init-model, rl-local, rollout."""
    res = run_cli("init-model", "--out", str(tmp_path / "m"), "--warmup-steps", "0")
    assert res.returncode == 0, res.stderr
    assert "it/s" not in res.stderr and "%|" not in res.stderr, res.stderr


def test_status_shows_the_role_first_and_stream_budgets_condensed():
    """`status` printed 224-257 lines, 134 of them stream budgets, before the role's own section."""
    from rich.console import Console

    from node.app.status_view import render_status

    budget = {"streams": 0, "streams_max": 64, "streams_per_peer": 4, "bytes": 0, "bytes_max": 2048,
              "bytes_per_peer": 128, "peak_streams": 0, "peak_bytes": 0, "refused": {}, "stalled": 0}
    streams = {f"/proto/{i}/1.0.0": dict(budget) for i in range(14)}
    streams["/proto/3/1.0.0"].update(streams=2, peak_streams=5, bytes=3072, refused={"per-peer": 7})
    status = {**_long_status(), "streams": streams, "peers": {"tracked": 3}}
    console = Console(record=True, width=200)
    render_status(status, console)
    lines = console.export_text().splitlines()
    first = {key: next(i for i, line in enumerate(lines) if line.startswith(key)) for key in ("trainer", "members", "peers", "streams")}
    assert first["trainer"] < first["members"] < first["peers"] < first["streams"]
    assert lines[first["streams"]:] == [
        "streams: 2 open on 1 protocols used (13 never used; --json has every budget)",
        "  /proto/3/1.0.0: 2/64 open, peak 5, 3.0 KiB buffered (peak 0 B), refused per-peer=7"]


def test_demo_model_that_is_not_a_model_is_one_line(tmp_path):
    res = run_cli("demo", "--model", str(tmp_path / "nope"), "--data-root", str(tmp_path / "d"), "--duration", "1")
    assert res.returncode == 2 and "demo --model: model folder not found" in one_line_error(res.stderr)
    assert not (tmp_path / "d").exists()  # nothing started, nothing written


def test_demo_model_run_file_trains_that_model_on_reasoning_gym(tmp_path):
    """`demo --model DIR`: the run names the model and a real task the nodes accept, the tiny task otherwise."""
    from node.app.demo import demo_run_text
    from node.config import load_config
    from node.rl.config import RLConfig
    from node.rl.tasks import load_run_tasks

    trainer, validator = (load_or_create_identity(tmp_path / n)[0].peer_id for n in ("t", "v"))
    for model, taskset in (("", "synthetic"), (str(tmp_path / "m"), "reasoning-gym")):
        path = tmp_path / "run.toml"
        path.write_text(demo_run_text(trainer, validator, model))
        run = load_config(path, {}, {"data_dir": str(tmp_path)}).run
        rl = run.section("rl", RLConfig)
        assert run.model == model and rl.taskset == taskset and run.trainers == [trainer]
        assert load_run_tasks(rl).draw(bytes(32), 0).prompt  # the nodes can draw its tasks
        assert run.section("grpo").optimizer_steps == (2 if model else 8)
        assert run.section("trainer").max_step_samples == (32 if model else 1024)
        assert run.section("trainer").verify_timeout_s == (300.0 if model else 30.0)


def test_demo_model_needs_the_disk_its_checkpoints_fill(tmp_path):
    """A SmolLM2 demo filled 25 GB in 13 minutes and its nodes died of a full disk mid-save."""
    from node.app.demo import check_demo_disk
    from node.app.errors import UsageError

    check_demo_disk(540_000_000, 40_000_000_000, tmp_path)
    with pytest.raises(UsageError, match=r"demo --model: about 27 GB of disk needed under .*, 10 GB free"):
        check_demo_disk(540_000_000, 10_000_000_000, tmp_path)
