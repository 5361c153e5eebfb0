"""node/app/localswarm.py's Proc, the one harness for child processes (the swarm's nodes and the
multi-process tests' talking children): JSON lines both ways, and a child always reaped."""

from __future__ import annotations

import signal
import sys

import pytest

from node.app.localswarm import Proc

# Answers each command line with {"echo": command}; ends on {"op": "quit"}; SIGTERM does not stop it.
ECHO = r"""
import json, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(json.dumps({"hello": 1}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd.get("op") == "quit":
        break
    print(json.dumps({"noise": 1}), flush=True)
    print(json.dumps({"echo": cmd}), flush=True)
print("bye", file=sys.stderr, flush=True)
"""


def start(tmp_path, code: str = ECHO) -> Proc:
    proc = Proc("echo", "", tmp_path, [sys.executable, "-c", code])
    proc.spawn(tmp_path / "echo.log", talk=True)
    return proc


def test_a_talking_child_answers_and_ends_on_request(tmp_path):
    proc = start(tmp_path)
    try:
        assert proc.read(lambda m: True, 30) == {"hello": 1}
        assert proc.next_message(0) is None  # nothing more written yet: no wait
        proc.send({"op": "ping", "n": 2})
        assert proc.read(lambda m: "echo" in m, 30) == {"echo": {"op": "ping", "n": 2}}  # the noise passed over
        proc.stop(30, request={"op": "quit"})
        assert proc.popen.returncode == 0 and proc.tail() == "bye"
    finally:
        proc.stop(0)


def test_a_child_that_ignores_sigterm_is_killed_and_reaped(tmp_path):
    proc = start(tmp_path)
    try:
        proc.read(lambda m: True, 30)  # its SIGTERM handler is set
        proc.stop(0.2)
        assert not proc.alive() and proc.popen.returncode == -signal.SIGKILL
    finally:
        proc.stop(0)


def test_a_child_that_exits_while_read_is_one_error_with_its_log(tmp_path):
    proc = start(tmp_path, "import sys; print('it broke', file=sys.stderr); sys.exit(3)")
    try:
        with pytest.raises(RuntimeError, match=r"(?s)exited \(rc=3\).*it broke"):
            proc.read(lambda m: True, 30)
    finally:
        proc.stop(0)
