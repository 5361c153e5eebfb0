"""Peers behind real NAT take part fully (issue 18): network namespaces, nftables masquerade.

Topology (tests/netns.py :class:`NatTopology`)::

    public bridge 10.78.0.0/24:  relay .1   trainer .2   validator .3   router r1 .101   router r2 .102
    home 1 (behind r1):          inference h1 192.168.1.2     (source NAT, no port forwarding)
    home 2 (behind r2):          inference h2 192.168.2.2

Nothing is configured for NAT: the home nodes bootstrap from the relay like anyone else. They must
find out they are private (dial-back), reserve relay slots, download the checkpoint, have rollouts
validated and trained on, replicate the ledger, and be reachable (from each other too) through the
relay; the relay must carry far fewer bytes than the checkpoint (pieces come over connections the
home nodes open themselves). Slow: five node processes that each import torch. Needs root and
``ip``/``nft`` (``make test-slow`` installs nftables); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from netns import NatTopology, missing_for_namespaces
from node.app.localswarm import LocalSwarm, Proc
from node.status import NODE_FILE

pytestmark = pytest.mark.slow

PUBLIC = ["relay", "trainer", "validator"]
HOMES = ["h1", "h2"]
PORT = 4001  # every node listens on its own namespace's address at this port
BOUND = 240.0  # a hang guard for a loaded 2-core machine, not a speed figure
RUN = """\
[run]
name = "nat-test"
trainers = ["{trainer}"]
validators = ["{validator}"]

[rl]
group_size = 4
prompts_per_batch = 2
max_new_tokens = 8

[grpo]
min_batch_samples = 8

[trainer]
init_warmup_steps = 0

[ledger]
sync_interval = 1.0

[membership]
probe_period = 0.5

[shards]
announce_interval = 1.0
progress = false
"""

PROBE = r"""
import json, sys, trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.tools.anyio_service import background_trio_service
from node.identity import Identity
from node.net.host import open_swarm_host
from node.net.host import is_relayed
from node.reach.relay import connect_addr

async def main(listen, addr, peer):
    async with open_swarm_host(Identity.generate(), [listen]) as host:
        dcutr = DCUtRProtocol(host.host)
        async with background_trio_service(dcutr):
            await dcutr.event_started.wait()
            with trio.fail_after(60):
                got = await connect_addr(host, addr)
                assert got == peer, got
                rtt = await host.ping(peer)
                punched = await dcutr.initiate_hole_punch(ID.from_base58(peer))
            conns = host.host.get_network().connections.get(ID.from_base58(peer), [])
            direct = sum(1 for c in (conns if isinstance(conns, list) else [conns]) if not is_relayed(c))
            print(json.dumps({"rtt_ms": round(rtt * 1000), "punched": punched, "direct": direct}), flush=True)

trio.run(main, *sys.argv[1:])
"""


class NatSwarm(LocalSwarm):
    """LocalSwarm whose nodes run inside the topology's namespaces, listening on their own address."""

    def __init__(self, root: Path, topo: NatTopology) -> None:
        super().__init__(root, log_level="info")
        self.topo = topo

    def start_in(self, name: str, role: str, wait: float = 120.0) -> Proc:
        data_dir = self.root / name
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / NODE_FILE).unlink(missing_ok=True)
        args = [*self.topo.exec_prefix(name), sys.executable, "-m", "node", "--role", role,
                "--listen", f"/ip4/{self.topo.ip(name)}/tcp/{PORT}", "--data-dir", str(data_dir),
                "--log-level", self.log_level, "--run", str(self.run_file)]
        if self.bootstrap_addr:
            args += ["--bootstrap", self.bootstrap_addr]
        proc = Proc(name, role, data_dir, args)
        self.procs[name] = proc
        self._spawn(proc)  # `ip netns exec` execs the node: the PID we signal is the node's
        self.wait_ready(name, wait)
        if self.bootstrap_addr is None:
            self.bootstrap_addr = self.addr(name)
        return proc

    def section(self, name: str, key: str) -> dict:
        return self.status(name).get(key) or {}

    def explain(self) -> str:
        out = []
        for name in self.procs:
            st = self.status(name)
            brief = {k: st.get(k) for k in ("reachability", "relay", "inference", "ledger")}
            out.append(f"--- {name}: {json.dumps(brief, default=str)[:1500]}\n{self.tail(name, 15)}")
        return "\n".join(out)


def tcp_connect(topo: NatTopology, src: str, ip: str, port: int) -> bool:
    code = f"import socket; socket.create_connection(({ip!r}, {port}), 3).close()"
    return subprocess.run([*topo.exec_prefix(src), sys.executable, "-c", code],
                          capture_output=True, timeout=30).returncode == 0


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.skipif(bool(missing_for_namespaces(nat=True)), reason=f"NAT test {missing_for_namespaces(nat=True)}")
def test_home_nodes_behind_nat_take_part_fully(tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    # Routers that drop unsolicited inbound connection attempts (as most home routers do) rather
    # than refuse them: with refusing routers hole punching cannot work (see docs/design.md, "Hole punching").
    with NatTopology(PUBLIC, HOMES, silent_drop=True) as topo, NatSwarm(tmp_path, topo) as swarm:
        swarm.extra_env.update(env)
        ids = {n: swarm.peer_id(n) for n in ("trainer", "validator")}
        swarm.write_run_file(RUN.format(**ids))
        swarm.start_in("relay", "relay")
        swarm.start_in("trainer", "trainer")
        swarm.start_in("validator", "validator")
        for home in HOMES:
            swarm.start_in(home, "inference")

        # A home node cannot be dialled: not at its own address, not at its router's.
        for home in HOMES:
            assert not tcp_connect(topo, "trainer", topo.ip(home), PORT)
            assert not tcp_connect(topo, "trainer", topo.router_ip(home), PORT)
        assert tcp_connect(topo, "h1", topo.ip("relay"), PORT)  # while it dials out fine

        def reach(name: str) -> str:
            return swarm.section(name, "reachability").get("reachability", "?")

        def circuits(name: str) -> list[str]:
            return [a for a in swarm.section(name, "relay").get("circuit_addrs", []) if "/p2p-circuit/" in a]

        # Found automatically: private, with a reservation on the relay, advertised in the record.
        for home in HOMES:
            swarm.wait_until(lambda h=home: reach(h) == "private" and circuits(h), BOUND, poll=1.0, explain=swarm.explain)
        swarm.wait_until(lambda: reach("trainer") == "public" and reach("validator") == "public", BOUND, poll=1.0,
                         explain=swarm.explain)
        relay_id = swarm.node_info("relay")["peer_id"]
        for home in HOMES:
            assert all(f"/p2p/{relay_id}/p2p-circuit/" in a for a in circuits(home))

        # The loop: checkpoints downloaded in full, rollouts validated and trained on.
        def step() -> int:
            return swarm.section("trainer", "trainer").get("step", 0)

        swarm.wait_until(lambda: step() >= 2, BOUND, poll=1.0, explain=swarm.explain)
        for home in HOMES:
            swarm.wait_until(lambda h=home: (swarm.section(h, "inference").get("policy_version") or 0) >= 1
                             and max(swarm.section(h, "shards").get("held") or [0]) >= 1,
                             BOUND, poll=1.0, explain=swarm.explain)
            swarm.wait_until(lambda h=home: swarm.section(h, "inference").get("batches", {}).get("accepted", 0) >= 1,
                             BOUND, poll=1.0, explain=swarm.explain)
        verdicts = swarm.section("validator", "validator").get("verdicts", {})
        assert verdicts.get("accepted", 0) >= 1, verdicts

        # The ledger replicates to the home nodes: they hold the trainer's and the validator's entries.
        authors = {ids["trainer"], ids["validator"]}
        for home in HOMES:
            swarm.wait_until(lambda h=home: swarm.section(h, "ledger").get("authors", 0) >= len(authors)
                             and swarm.section(h, "ledger").get("entries", 0) >= 4, BOUND, poll=1.0,
                             explain=swarm.explain)

        # The home nodes reach each other through the relay: a fresh host in h1's home dials h2 at
        # its circuit address and pings it; then both sides run DCUtR (hole punching) over that
        # relayed connection, which must leave a direct one. Fixed port: DCUtR predicts our outside
        # address as the router's IP with our listen port (masquerade keeps free ports).
        # Up to 3 tries: on a loaded machine one relayed dial (4 handshakes through two NATs and a
        # relay, all Python) can outlast its 20 s bound; a node would simply redial too.
        h2 = swarm.node_info("h2")["peer_id"]
        for _ in range(3):
            probe = subprocess.run([*topo.exec_prefix("h1"), sys.executable, "-c", PROBE,
                                    f"/ip4/{topo.ip('h1')}/tcp/{PORT + 1}", circuits("h2")[0], h2],
                                   capture_output=True, text=True, timeout=120, env={**os.environ, **env})
            if probe.returncode == 0 and json.loads(probe.stdout.strip().splitlines()[-1])["punched"]:
                break
        assert probe.returncode == 0, probe.stderr[-2000:]
        result = json.loads(probe.stdout.strip().splitlines()[-1])
        print(f"home-to-home: {result}; hole punching on the home nodes: "
              f"{ {h: swarm.section(h, 'relay').get('hole_punching') for h in HOMES} }")
        assert result["punched"] and result["direct"] >= 1, result

        # Bulk data never rode the circuits: the relay carried far less than one checkpoint.
        # (The circuits carry membership and gossip traffic, a few KB/s here, so the bound is
        # relative to what the home nodes downloaded, with room for a slow run.)
        downloaded = sum(dir_bytes(swarm.procs[h].data_dir / "checkpoints") for h in HOMES)
        carried = swarm.section("relay", "relay").get("circuit_bytes", 0)
        print(f"checkpoint stores on the home nodes: {downloaded} B; relay circuits carried {carried} B; "
              f"relay: {json.dumps(swarm.section('relay', 'relay'))[:300]}")
        assert downloaded > 0
        assert carried < downloaded / 5, (carried, downloaded)
