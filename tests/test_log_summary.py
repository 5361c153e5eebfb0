"""Logs (issue 19): one formatter for our loggers and the libraries', no progress bars, a summary
line every interval and a warning when the run has no live trainer."""

from __future__ import annotations

import json
import subprocess
import sys

from node.summary import SummaryClock, live_trainers, summary_fields, summary_line

T1 = "12D3KooWtrainer1"


def test_every_line_is_json_for_libp2p_transformers_warnings_and_progress_bars():
    """py-libp2p turns propagation off at import (its lines went to stderr raw); transformers adds
    its own handler and draws tqdm bars. With --log-json every stderr line must be one JSON object."""
    code = r'''
import logging, warnings
from node.log import setup_logging
setup_logging("info", True, "node1")
import libp2p  # imported after setup: its import-time logging set-up must not win
import transformers
from transformers.utils import logging as tf_logging
logging.getLogger("libp2p.transport.tcp").error("Failed to open TCP stream: refused")
tf_logging.get_logger("transformers.modeling_utils").warning("weights not initialized")
warnings.warn("a library warning")
for _ in tf_logging.tqdm(range(3), desc="Loading weights"):
    pass
import sys, tempfile
from node.engines.model import create_tiny_model, load_model, TinyModelSpec
load_model(create_tiny_model(tempfile.mkdtemp() + "/m", spec=TinyModelSpec(32, 64, 1, 2, 1)))  # the bars issue 19 saw
logging.getLogger("node.x").info("ours", extra={"peer": "p"})
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    objs = [json.loads(l) for l in lines]  # raises on any non-JSON line
    by_logger = {o["logger"]: o for o in objs}
    assert by_logger["libp2p.transport.tcp"]["msg"] == "Failed to open TCP stream: refused"
    assert by_logger["transformers.modeling_utils"]["level"] == "warning"
    assert "a library warning" in by_logger["py.warnings"]["msg"]
    assert by_logger["node.x"]["peer"] == "p" and all(o["node"] == "node1" for o in objs)
    assert not any("Loading weights" in l or "Writing model shards" in l for l in lines)


def test_py_libp2p_peer_failures_are_debug_lines_and_its_other_errors_stay():
    """A dial to a peer that is down is reported by our code (INFO, with what it cost); py-libp2p's
    own ERROR copy of it is shown only at DEBUG. Its other errors still show."""
    code = r'''
import logging, sys
from node.log import setup_logging
setup_logging(sys.argv[1], False, "n")
import libp2p
logging.getLogger("libp2p.transport.tcp.tcp").error("Failed to connect: refused")
logging.getLogger("libp2p.host.basic_host").error("Failed to open stream to peer")
logging.getLogger("libp2p.pubsub.gossipsub").error("gossipsub broke")
'''
    def lines(level: str) -> str:
        proc = subprocess.run([sys.executable, "-c", code, level], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    info, debug = lines("info"), lines("debug")
    assert "gossipsub broke" in info and "gossipsub broke" in debug
    assert "Failed to connect" not in info and "Failed to open stream" not in info
    assert "Failed to connect" in debug and "Failed to open stream" in debug


def snap(role="inference", members=(), **sections) -> dict:
    return {"role": role, "peer_id": "12D3KooWme",
            "membership": {"connections": 3, "counts": {"alive": len(members)}, "members": list(members)},
            **sections}


def member(pid, role="trainer", state="alive") -> dict:
    return {"peer_id": pid, "role": role, "state": state}


def test_live_trainers_counts_only_listed_alive_trainers():
    assert live_trainers(snap(members=[member(T1)]), [T1]) == 1
    assert live_trainers(snap(members=[member(T1, state="dead")]), [T1]) == 0
    assert live_trainers(snap(members=[member("12D3KooWstranger")]), [T1]) == 0  # not in the run's list
    assert live_trainers(snap(role="trainer") | {"peer_id": T1}, [T1]) == 1  # a trainer counts itself


def test_summary_of_each_role_has_its_figures():
    inf = snap(inference={"policy_version": 7, "steps": 40, "tokens_per_s": 812.5, "mean_reward": 0.31,
                          "batches": {"sent": 40, "accepted": 37, "refused": {"stale_policy": 2, "busy": 0},
                                      "dropped": {}}})
    fields = summary_fields(inf)
    assert fields["version"] == 7 and fields["accepted"] == 37 and fields["refused"] == "stale_policy:2"
    assert fields["tokens_per_s"] == 812.5 and fields["peers"] == 3
    tr = snap(role="trainer", trainer={"step": 12, "intake": {"accepted": 50, "stale": 3},
                                       "rejected_by_reason": {"reward_mismatch": 4}, "reward": [[11, 0.2], [12, 0.25]],
                                       "last_step": {"tokens_per_s": 90.0}})
    line = summary_line(tr)
    assert line.startswith("summary ") and "steps=12" in line and "accepted=50" in line
    assert "refused=stale:3" in line and "rejected=reward_mismatch:4" in line and "reward=0.25" in line
    val = snap(role="validator", validator={"verdicts": {"pass": 5, "fail": 1}, "reasons": {"bad_proof": 1},
                                            "queue": 2, "tokens_per_s": 3000.0})
    assert "checked=6" in summary_line(val) and "reasons=bad_proof:1" in summary_line(val)


def test_summary_every_interval_and_a_warning_while_no_trainer_lives():
    clock = SummaryClock(interval=60.0, trainers=[T1], started=100.0, grace=30.0)
    lonely = snap()
    assert clock.due(110.0, lonely) == []  # joining: not yet worth a warning
    lines = clock.due(131.0, lonely)
    assert [lvl for lvl, _ in lines] == ["warning"] and "no live trainer" in lines[0][1]
    assert clock.due(140.0, lonely) == []  # said once, then again with each summary
    lines = clock.due(160.0, lonely)
    assert [lvl for lvl, _ in lines] == ["warning", "info"] and lines[1][1].startswith("summary ")
    back = snap(members=[member(T1)])
    lines = clock.due(170.0, back)
    assert lines == [("info", "a trainer is live again (1)")]
    assert clock.due(219.0, back) == []
    assert [lvl for lvl, _ in clock.due(220.0, back)] == ["info"]  # 60 s after the last summary


def test_a_run_without_trainers_says_so_and_interval_zero_is_off():
    clock = SummaryClock(interval=60.0, trainers=[], started=0.0)
    (level, text), = clock.due(31.0, snap())
    assert level == "warning" and "run.trainers is empty" in text
    assert SummaryClock(interval=0, trainers=[], started=0.0).due(1000.0, snap()) == []


def test_a_running_node_logs_json_summaries_and_the_missing_trainer(tmp_path):
    from node.app.localswarm import LocalSwarm
    from waiting import wait_until

    env = {"SWARM_SUMMARY_INTERVAL": "1", "SWARM_LOG_JSON": "true"}
    with LocalSwarm(tmp_path, extra_env=env) as swarm:
        swarm.start("relay", "relay")

        def lines() -> list[dict]:
            return [json.loads(l) for l in swarm.procs["relay"].log_path.read_text().splitlines() if l.strip()]

        wait_until(lambda: any(o["msg"].startswith("summary peers=") for o in lines()), what="a summary line")
        warned = [o for o in lines() if o["msg"].startswith("no live trainer")]
        assert warned and warned[0]["level"] == "warning" and "run.trainers is empty" in warned[0]["msg"]
