"""A NAT'd downloader dials out to the public holders of a version (node/shards/peering.py,
``DialBook``): real nodes behind a real NAT (tests/netns.py :class:`NatTopology`).

Topology::

    public bridge 10.78.0.0/24:  relay .1   origin .2   holder .3
    home (behind r1):            downloader 192.168.1.2   (source NAT, no port forwarding)

Each node runs the core every role runs (ledger, shards, relay side, membership, dial-back) in its
namespace, as ``swarm-node publish`` runs it (``run_node(start=start_core)``): no torch. Membership
keeps one connection (``conn_low = 1``), so each node holds only its connection to the relay it
bootstrapped from: the downloader learns of the origin and the holder through membership's records,
and its own download must dial them, from behind its NAT, to get pieces from the holder. Slow:
four node processes. Needs root and ``ip``/``nft``; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from netns import NatTopology, missing_for_namespaces
from node.identity import load_or_create_identity
from node.shards.testing import write_checkpoint
from waiting import wait_until

pytestmark = pytest.mark.slow

PUBLIC = ["relay", "origin", "holder"]
HOMES = ["downloader"]
PORT = 4001
BOUND = 240.0  # a hang guard for a loaded 2-core machine, not a speed figure
MiB = 1 << 20

# One node: the core under the given config; it answers each line on its stdin with one JSON line
# on its stdout, its view of itself, after publishing <data dir>/publish (a model folder) first when
# the line is "publish". Asked, not polled: it reports when the test wants to know.
CHILD = r"""
import json, os, sys, trio
from pathlib import Path
from node.config import NodeConfig, RunConfig
from node.roles.core import run_node, start_core

async def main(spec):
    spec = json.loads(spec)
    data = Path(spec["data_dir"])
    config = NodeConfig(role=spec["role"], listen=[spec["listen"]], bootstrap=spec["bootstrap"],
                        data_dir=str(data), log_level="warning", run=RunConfig(**spec["run"]))
    async with trio.open_nursery() as nursery:
        node = await nursery.start(lambda task_status: run_node(config, task_status=task_status, start=start_core))
        requests, pending = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())), b""
        while True:
            while b"\n" not in pending:
                chunk = await requests.receive_some()
                if not chunk:  # the test closed our stdin
                    nursery.cancel_scope.cancel()
                    return
                pending += chunk
            line, pending = pending.split(b"\n", 1)
            if line == b"publish":
                await node.shards.publish(data / "publish", 1)
            view = {"peer_id": node.peer_id, "held": node.shards.versions_held(),
                    "direct": node.host.direct_peers(), "members": sorted(node.membership.members()),
                    "reachability": node.membership.record.reachability,
                    "receipts": [[p, n] for (p, _), n in node.shards.receipts().items()]}
            sys.stdout.write(json.dumps(view) + "\n")
            sys.stdout.flush()

trio.run(main, sys.argv[1])
"""


def ask(proc: subprocess.Popen, request: str = "probe") -> dict:
    """The child's answer to one request line: its view of itself ({} if it has died)."""
    try:
        proc.stdin.write(request.encode() + b"\n")
        proc.stdin.flush()
    except OSError:
        return {}
    ready, _, _ = select.select([proc.stdout], [], [], BOUND)  # unbuffered: a ready pipe holds our line
    if not ready:
        raise AssertionError(f"no answer to {request!r} within {BOUND} s")
    line = proc.stdout.readline()
    return json.loads(line) if line else {}


@pytest.mark.skipif(bool(missing_for_namespaces(nat=True)), reason=f"NAT test {missing_for_namespaces(nat=True)}")
def test_a_nat_d_downloader_dials_out_to_a_public_holder(tmp_path):
    origin, _ = load_or_create_identity(tmp_path / "origin")
    run = {"name": "nat-shards", "trainers": [origin.peer_id], "tables": {
        "membership": {"conn_low": 1, "probe_period": 0.5},
        # The origin's uplink is the narrow one, so a downloader that reaches the holder uses it.
        "shards": {"upload_rate": MiB, "announce_interval": 1.0, "request_timeout": 2.0, "progress": False}}}
    roles = {"relay": "relay", "origin": "trainer", "holder": "relay", "downloader": "inference"}
    env = dict(os.environ, OMP_NUM_THREADS="1",  # no torch thread setup: these nodes run the core only
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    procs: dict[str, subprocess.Popen] = {}
    with NatTopology(PUBLIC, HOMES, prefix="shn", silent_drop=True) as topo:
        relay_addr = None
        try:
            for name in ["relay", "origin", "holder", "downloader"]:
                spec = {"role": roles[name], "listen": f"/ip4/{topo.ip(name)}/tcp/{PORT}",
                        "bootstrap": [relay_addr] if relay_addr else [], "data_dir": str(tmp_path / name), "run": run}
                log = open(tmp_path / f"{name}.log", "w")
                procs[name] = subprocess.Popen([*topo.exec_prefix(name), sys.executable, "-c", CHILD, json.dumps(spec)],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                               bufsize=0)
                view = ask(procs[name])  # answered once the node runs
                if relay_addr is None:
                    relay_addr = f"/ip4/{topo.ip('relay')}/tcp/{PORT}/p2p/{view['peer_id']}"
            ids = {name: ask(procs[name])["peer_id"] for name in roles}
            wait_until(lambda: {ids["origin"], ids["holder"]} <= set(ask(procs["downloader"]).get("members", [])),
                       BOUND, what="the downloader knows the origin and the holder")
            assert set(ask(procs["downloader"])["direct"]) == {ids["relay"]}  # nothing else dialled

            src = write_checkpoint(tmp_path / "origin" / "publish", 4 * MiB, seed=7)
            ask(procs["origin"], "publish")
            wait_until(lambda: ask(procs["downloader"]).get("held") == [1], BOUND, what="the download completed")
            view = ask(procs["downloader"])
            received = dict(view["receipts"])
            assert received.get(ids["holder"], 0) > 0, received
            assert ids["holder"] in view["direct"]
        except BaseException:
            for name in roles:
                view = ask(procs[name]) if name in procs and procs[name].poll() is None else {}
                print(f"--- {name}: {view}\n{(tmp_path / f'{name}.log').read_text()[-3000:]}")
            raise
        finally:
            for p in procs.values():  # ours, by PID
                p.kill()
                p.wait(timeout=30)
