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

# One node: the core under the given config; every 0.5 s its view of itself in <data dir>/probe.json;
# publishes <data dir>/publish (a model folder) once <data dir>/publish.ready appears.
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
        published = False
        while True:
            if not published and (data / "publish.ready").exists():
                await node.shards.publish(data / "publish", 1)
                published = True
            view = {"peer_id": node.peer_id, "held": node.shards.versions_held(),
                    "direct": node.host.direct_peers(), "members": sorted(node.membership.members()),
                    "reachability": node.membership.record.reachability,
                    "receipts": [[p, n] for (p, _), n in node.shards.receipts().items()]}
            tmp = data / "probe.json.tmp"
            tmp.write_text(json.dumps(view))
            tmp.replace(data / "probe.json")
            await trio.sleep(0.5)  # the child's report period; the test waits on what the report says

trio.run(main, sys.argv[1])
"""


def probe(data_dir: Path) -> dict:
    try:
        return json.loads((data_dir / "probe.json").read_text())
    except (OSError, ValueError):
        return {}


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
    procs: list[subprocess.Popen] = []
    with NatTopology(PUBLIC, HOMES, prefix="shn", silent_drop=True) as topo:
        relay_addr = None
        try:
            for name in ["relay", "origin", "holder", "downloader"]:
                spec = {"role": roles[name], "listen": f"/ip4/{topo.ip(name)}/tcp/{PORT}",
                        "bootstrap": [relay_addr] if relay_addr else [], "data_dir": str(tmp_path / name), "run": run}
                log = open(tmp_path / f"{name}.log", "w")
                procs.append(subprocess.Popen([*topo.exec_prefix(name), sys.executable, "-c", CHILD, json.dumps(spec)],
                                              stdout=log, stderr=subprocess.STDOUT, env=env))
                view = wait_until(lambda n=name: probe(tmp_path / n), BOUND, what=f"{name} started")
                if relay_addr is None:
                    relay_addr = f"/ip4/{topo.ip('relay')}/tcp/{PORT}/p2p/{view['peer_id']}"
            ids = {name: probe(tmp_path / name)["peer_id"] for name in roles}
            wait_until(lambda: {ids["origin"], ids["holder"]} <= set(probe(tmp_path / "downloader").get("members", [])),
                       BOUND, what="the downloader knows the origin and the holder")
            assert set(probe(tmp_path / "downloader")["direct"]) == {ids["relay"]}  # nothing else dialled

            src = write_checkpoint(tmp_path / "origin" / "publish", 4 * MiB, seed=7)
            (tmp_path / "origin" / "publish.ready").touch()
            wait_until(lambda: probe(tmp_path / "downloader").get("held") == [1], BOUND, what="the download completed")
            view = probe(tmp_path / "downloader")
            received = dict(view["receipts"])
            assert received.get(ids["holder"], 0) > 0, received
            assert ids["holder"] in view["direct"]
        except BaseException:
            for name in roles:
                print(f"--- {name}: {probe(tmp_path / name)}\n{(tmp_path / f'{name}.log').read_text()[-3000:]}")
            raise
        finally:
            for p in procs:  # ours, by PID
                p.kill()
                p.wait(timeout=30)
