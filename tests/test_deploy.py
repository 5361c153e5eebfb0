"""deploy/ (issue 19), proven as far as this machine allows without a Docker engine: the compose
file's structure, the Dockerfile's stages and context, the init and entry scripts run for real,
and the systemd unit's hardening scored by systemd-analyze where it is installed."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from node.config import load_config
from node.identity import KEY_FILE, load_identity

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
NODES = {"relay", "trainer", "validator", "inference-1", "inference-2"}


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_forms_a_relay_trainer_validator_and_two_inference_nodes_after_init():
    doc = compose()
    services = doc["services"]
    assert set(services) == NODES | {"init"}
    roles = {name: s["command"][s["command"].index("--role") + 1] for name, s in services.items() if name != "init"}
    assert roles == {"relay": "relay", "trainer": "trainer", "validator": "validator",
                     "inference-1": "inference", "inference-2": "inference"}
    for name in NODES:
        s = services[name]
        assert s["depends_on"] == {"init": {"condition": "service_completed_successfully"}}, name
        assert s["environment"]["SWARM_RUN"] == "/shared/run.toml", name  # the run file init writes
        if name != "relay":
            assert s["environment"]["SWARM_BOOTSTRAP_FROM"] == "relay:/shared/relay/node.json"
            assert any(v.startswith(("trainer:", "validator:", "inference-")) and v.endswith(":/data")
                       for v in s["volumes"]), name
    init = services["init"]
    assert init["entrypoint"][0] == "swarm-init-run" and init["restart"] == "no"
    mounts = dict(v.split(":", 1) for v in init["volumes"])
    assert mounts == {"shared": "/shared", "trainer": "/keys/trainer", "validator": "/keys/validator"}
    assert init["entrypoint"][1:] == ["/shared/run.toml", "/keys/trainer", "/keys/validator"]
    assert set(doc["volumes"]) == {"shared", "trainer", "validator", "inference-1", "inference-2"}
    assert services["trainer"]["ports"] == ["127.0.0.1:8080:8080"]
    for name in ("validator", "inference-1", "inference-2"):
        assert "seccomp=unconfined" in services[name]["security_opt"]


def dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def test_dockerfile_builds_fastecdsa_in_a_builder_stage_from_the_lock():
    text = dockerfile()
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?", text, re.M)
    assert len(stages) == 2 and stages[0][1] == "builder"
    builder, runtime = text.split("\nFROM ${PYTHON_IMAGE}\n")
    assert "gcc" in builder and "libgmp-dev" in builder
    assert "--require-hashes -r /tmp/requirements.lock" in builder and "pip check" in builder
    assert "gcc" not in runtime and "libgmp10" in runtime and "COPY --from=builder /opt/swarm-node" in runtime
    assert re.search(r"^USER 10001", runtime, re.M) and "chown swarm:swarm /data /shared" in runtime
    assert "HEALTHCHECK" in runtime and "/healthz" in runtime and "SWARM_HTTP_PORT=8080" in runtime


def test_every_file_the_image_copies_is_in_the_build_context_and_the_venvs_are_not():
    allowed = [l[1:].rstrip("/") for l in (ROOT / ".dockerignore").read_text().splitlines() if l.startswith("!")]
    rules = [l for l in (ROOT / ".dockerignore").read_text().splitlines() if l and not l.startswith("#")]
    assert rules[0] == "*"  # everything is excluded first, then the few paths the image needs
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile(), re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
            assert any(path == a or path.startswith(a + "/") for a in allowed), f"{path} is not in the build context"
    assert not any(a.startswith((".venv", "demo-data")) for a in allowed)


def _fake_bin(tmp: Path) -> Path:
    """swarm-node as this checkout's CLI; setpriv and id faked so the root branch of the init
    script runs here (the real setpriv would drop to uid 10001, which cannot read this venv)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    scripts = {
        "swarm-node": f'#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m node "$@"\n',
        "setpriv": f'#!/bin/sh\necho "$@" > {tmp}/setpriv.args\nwhile [ "${{1#--}}" != "$1" ]; do shift; done\n'
                   'FAKE_DROPPED=1 exec "$@"\n',
        "id": '#!/bin/sh\nif [ -n "${FAKE_DROPPED:-}" ]; then echo 10001; else /usr/bin/id "$@"; fi\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_init_script_creates_the_keys_and_a_run_file_naming_them_once(tmp_path):
    bin_dir = _fake_bin(tmp_path)
    shared, trainer, validator = (tmp_path / d for d in ("shared", "trainer", "validator"))
    for d in (shared, trainer, validator):
        d.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    run = shared / "run.toml"
    cmd = ["sh", str(DEPLOY / "init-run.sh"), str(run), str(trainer), str(validator)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cfg = load_config(run, {}, {"data_dir": str(tmp_path / "x")})
    assert cfg.run.trainers == [load_identity(trainer / KEY_FILE).peer_id]
    assert cfg.run.validators == [load_identity(validator / KEY_FILE).peer_id]
    assert cfg.run.name == "compose" and cfg.run.section("rl").group_size == 8
    if os.geteuid() == 0:  # the root branch handed the volumes to the nodes' uid, then dropped to it
        assert all(d.stat().st_uid == 10001 for d in (shared, trainer, validator))
        assert (tmp_path / "setpriv.args").read_text().split()[:3] == ["--reuid=10001", "--regid=10001", "--clear-groups"]
    before = run.read_text()
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "keeping it" in again.stdout and run.read_text() == before


def test_entrypoint_waits_for_the_relay_and_joins_it_by_name(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "swarm-node").write_text('#!/bin/sh\necho "$@"\n')
    (bin_dir / "swarm-node").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    node_json = tmp_path / "node.json"
    node_json.write_text('{"peer_id": "12D3KooWrelay", "addrs": []}')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SWARM_BOOTSTRAP_FROM": f"relay:{node_json}"}
    proc = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), "--role", "inference"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["--role", "inference", "--bootstrap", "/dns4/relay/tcp/4001/p2p/12D3KooWrelay"]


def test_scripts_are_executable():
    for name in ("entrypoint.sh", "init-run.sh"):
        assert (DEPLOY / name).stat().st_mode & stat.S_IXUSR, name


def unit() -> str:
    return (DEPLOY / "swarm-node@.service").read_text()


def test_unit_takes_a_run_file_and_creates_its_user():
    text = unit()
    assert "DynamicUser=yes" in text and "StateDirectory=swarm-node/%i" in text
    assert re.search(r"^Environment=SWARM_RUN=/etc/swarm-node/run.toml", text, re.M)
    assert not re.search(r"^User=", text, re.M)  # no user to create by hand
    assert "RestrictNamespaces=" not in text.split("# Not set")[0]  # the code sandbox needs namespaces


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed (apt-get install systemd)")
def test_unit_is_hardened_to_an_exposure_of_at_most_3(tmp_path):
    path = tmp_path / "swarm-node@relay.service"
    path.write_text(unit())
    proc = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(path)],
                          capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert found, proc.stdout + proc.stderr
    assert float(found.group(1)) <= 3.0, proc.stdout
    verify = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    # The only complaint allowed here: the program is not installed on this machine.
    problems = [l for l in (verify.stdout + verify.stderr).splitlines() if l.strip() and "is not executable" not in l]
    assert problems == [], problems
