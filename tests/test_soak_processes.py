"""bench/soak.py for 5 minutes (issue 45's short version): nine real nodes, the seeded faults of its
first minutes, and the goals that must hold after them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_five_minutes_of_faults_lose_no_acked_batch_and_every_node_gets_back_to_work(tmp_path):
    out = tmp_path / "soak"
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "5", "--seed", "1",
                             "--keep", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGTERM)  # the bench stops its nodes and namespaces on SIGTERM
        text, _ = proc.communicate(timeout=120)
        pytest.fail(f"the soak ran past 15 minutes:\n{text[-4000:]}")
    assert proc.returncode == 0, text[-4000:]
    r = json.loads((out / "soak.json").read_text())
    assert r["events"], text[-4000:]
    assert sum(a["lost"] for a in r["accounting"].values()) == 0, r["accounting"]
    assert sum(a["trained"] for a in r["accounting"].values()) > 0, r["accounting"]
    for e in r["events"]:
        if "back_at" in e:
            assert e["recovery_s"] is not None, e
    assert r["digests_agreed_s"] is not None, r["last_digests"]
    assert not r["findings"], r["findings"]
